"""Where the dispatcher's five sockets live: all derived from one base address."""
from __future__ import annotations

import os
from dataclasses import dataclass


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
            return cls(*(f"ipc://{os.path.join(directory, name)}.sock" for name in cls.NAMES))
        if base.startswith("tcp://"):
            host, sep, port = base[len("tcp://"):].rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65531:
                raise ValueError(f"tcp address needs host:port with port <= 65531: {base!r}")
            return cls(*(f"tcp://{host}:{int(port) + i}" for i in range(len(cls.NAMES))))
        raise ValueError(f"dispatcher address must start with ipc:// or tcp://: {base!r}")

    def ipc_paths(self) -> list[str]:
        return [a[len("ipc://"):] for a in (getattr(self, n) for n in self.NAMES)
                if a.startswith("ipc://")]
