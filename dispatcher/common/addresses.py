"""Where the dispatcher's five sockets live: all derived from one base address."""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass


# Bytes of a Unix socket's path (sun_path: 108 with its NUL on Linux): past it ZeroMQ's
# bind fails with "File name too long", after the directory was made.
MAX_SOCKET_PATH = 107


@dataclass(frozen=True)
class Endpoints:
    """The dispatcher's five addresses, all derived from one base address.

    `ipc:///some/dir` puts five sockets in that directory; `tcp://host:port` uses
    port .. port+4. Workers and front ends on other hosts need only the base address.
    """
    frontend: str
    worker: str
    tokens_in: str
    tokens_out: str
    control: str

    NAMES = ("frontend", "worker", "tokens_in", "tokens_out", "control")

    @classmethod
    def from_base(cls, base: str) -> "Endpoints":
        if base.startswith("ipc://"):
            if not base[len("ipc://"):].strip("/"):
                raise ValueError(f"an ipc address names a directory: ipc:///dir, not {base!r}")
            directory = base[len("ipc://"):].rstrip("/") or "/"
            made = cls(*(f"ipc://{os.path.join(directory, name)}.sock" for name in cls.NAMES))
            longest = max(len(os.fsencode(p)) for p in made.ipc_paths())
            if longest > MAX_SOCKET_PATH:
                raise ValueError(f"an ipc directory's socket paths must fit in "
                                 f"{MAX_SOCKET_PATH} bytes (a Unix socket's limit); "
                                 f"{directory!r} makes {longest}: choose a shorter one")
            return made
        if base.startswith("tcp://"):
            host, sep, port = base[len("tcp://"):].rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65531:
                raise ValueError(f"tcp address needs host:port with port <= 65531: {base!r}")
            return cls(*(f"tcp://{host}:{int(port) + i}" for i in range(len(cls.NAMES))))
        raise ValueError(f"dispatcher address must start with ipc:// or tcp://: {base!r}")

    def ipc_paths(self) -> list[str]:
        return [a[len("ipc://"):] for a in (getattr(self, n) for n in self.NAMES)
                if a.startswith("ipc://")]


def directory_problem(path: str) -> str | None:
    """What `private_directory` would say of `path`, changing nothing (check-config): an
    existing directory checked as it would be, where it is this user's or open to
    others; a missing one is `serve`'s to make (systemd makes /run/completions for the
    service only when it starts; check-config runs before, as another user or root)."""
    if not os.path.lexists(path):
        return None
    info = os.lstat(path)
    if stat.S_ISDIR(info.st_mode) and info.st_uid != os.geteuid() and \
            not info.st_mode & 0o022:
        return None         # (the service user's own, checked by it when it starts)
    return _checked_directory(path)


def private_directory(path: str) -> str | None:
    """Make the ipc directory `path` if it is not there (mode 0700), and check it: None,
    or the one line saying why it cannot be used. Whoever can write into it can move a
    socket aside and bind their own (a worker respawned then registers with them), so it
    must be a real directory, ours, that no group or other user may write into; one that
    another local user made first (in /tmp, say) is refused, never taken over."""
    try:
        os.makedirs(os.path.dirname(path.rstrip("/")) or "/", exist_ok=True)
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        return f"cannot create the ipc directory {path}: {exc.strerror}"
    return _checked_directory(path)


def _checked_directory(path: str) -> str | None:
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        return f"refusing the ipc directory {path}: it is not a directory (a link?)"
    if info.st_uid != os.geteuid():
        return (f"refusing the ipc directory {path}: it belongs to uid {info.st_uid}, not "
                f"to this user ({os.geteuid()}); remove it or choose another --dispatcher")
    if info.st_mode & 0o022:
        return (f"refusing the ipc directory {path}: group or others may write into it "
                f"(mode {stat.S_IMODE(info.st_mode):04o}); chmod go-w it or remove it")
    return None
