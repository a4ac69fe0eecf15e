"""Process helpers every part uses: dying with the parent, a signal-safe stop flag,
the argv of a fresh interpreter running a module."""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Linux: get SIGTERM when the parent exits; exit now if it already has."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:
        os._exit(1)


class StopFlag:
    """"Stop" as signal handlers may set it. threading.Event.set() takes a lock: a handler
    that runs while its own thread is inside set() (a second SIGTERM arriving just as the
    dispatcher stops itself after draining) waits forever for that lock. Setting an
    attribute takes none."""

    def __init__(self) -> None:
        self._set = False
        self.drain_deadline: float | None = None     # (monotonic) see drain

    def set(self) -> None:
        self._set = True

    def drain(self, grace: float) -> None:
        """A stop that lets running work finish for up to `grace` s (a worker stopped by
        systemd: nobody drained it first); asked again, stop at once."""
        if self.drain_deadline is None:
            self.drain_deadline = time.monotonic() + grace
        else:
            self._set = True

    def is_set(self) -> bool:
        return self._set


def python_module_argv(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value a command line gives `flag`, as `--flag value` or `--flag=value` (None:
    not given)."""
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg[len(flag) + 1:]
    return None


def with_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """The command line with `flag` set to `value`, as `--flag=value` (a value beginning
    with `-` is not taken for a flag of its own)."""
    argv = list(argv)
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            argv[i:i + 2] = [f"{flag}={value}"]
            return argv
        if arg.startswith(flag + "="):
            argv[i] = f"{flag}={value}"
            return argv
    return argv + [f"{flag}={value}"]
