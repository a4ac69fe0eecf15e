"""How parallel test processes (pytest-xdist) share this machine's cores.

llama.cpp's CPU thread pool spins while it waits for its own threads, so two pools on
the same cores slow each other down by an order of magnitude. Each xdist worker (and
every server it starts, which inherits its affinity) therefore runs on cores of its own,
and its real-model workers size their thread pools to them.

A test that needs every core (two workers pinned to the first two cores, or a check of
which cores a worker got) takes the whole machine: it waits until no other test process
is running a test, widens its affinity to every core, and the others wait until it is
done. The lock is an flock(2) shared by every other test (readers-writer) with a
turnstile in front, so a test waiting for the whole machine is not starved by the others
taking their shares back to back. Without xdist, all of this does nothing.

In-process llama.cpp belongs in tests that do not take the whole machine: its OpenMP
threads keep the affinity they were created with.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from pathlib import Path

WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")           # "gw0", "gw1", ... or ""
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
ALL_CORES = frozenset(os.sched_getaffinity(0))                # before this process is pinned


def worker_index() -> int:
    return int(WORKER[2:]) if WORKER.startswith("gw") else 0


def own_cores() -> frozenset[int]:
    """This worker's share of the cores: an equal slice, or one core shared round-robin
    where there are more workers than cores."""
    cores = sorted(ALL_CORES)
    index = worker_index()
    if len(cores) <= WORKERS:
        return frozenset({cores[index % len(cores)]})
    return frozenset(cores[index * len(cores) // WORKERS:(index + 1) * len(cores) // WORKERS])


def port_range() -> tuple[int, int]:
    """Listening ports for this worker's servers: disjoint between workers, and below
    the kernel's ephemeral range, which outgoing connections draw from."""
    try:
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    low = 10000
    span = max(200, (ephemeral - low) // WORKERS)
    return low + worker_index() * span, low + (worker_index() + 1) * span


class MachineShare:
    def __init__(self, directory: Path):
        self.lock = open(directory / "machine.lock", "a+")
        self.turnstile = open(directory / "turnstile.lock", "a+")
        self.shares = 0          # nested shared holds by this process
        self.whole = 0           # nested whole-machine holds by this process

    def _pass_turnstile(self) -> None:
        fcntl.flock(self.turnstile, fcntl.LOCK_EX)
        fcntl.flock(self.turnstile, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def share(self):
        """Around each test: run beside other shares, never beside a whole-machine test."""
        if not self.whole and not self.shares:
            self._pass_turnstile()
            fcntl.flock(self.lock, fcntl.LOCK_SH)
        self.shares += 1
        try:
            yield
        finally:
            self.shares -= 1
            if not self.whole and not self.shares:
                fcntl.flock(self.lock, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def whole_machine(self):
        if not self.whole:
            if self.shares:
                fcntl.flock(self.lock, fcntl.LOCK_UN)       # give up the share first
            fcntl.flock(self.turnstile, fcntl.LOCK_EX)
            try:
                fcntl.flock(self.lock, fcntl.LOCK_EX)
            finally:
                fcntl.flock(self.turnstile, fcntl.LOCK_UN)
            os.sched_setaffinity(0, ALL_CORES)
        self.whole += 1
        try:
            yield
        finally:
            self.whole -= 1
            if not self.whole:
                os.sched_setaffinity(0, own_cores())
                fcntl.flock(self.lock, fcntl.LOCK_SH if self.shares else fcntl.LOCK_UN)


_share: MachineShare | None = None
LOCK_DIR = "COMPLETIONS_TEST_LOCK_DIR"


def prepare_run() -> None:
    """In the controller, before the test processes start (they inherit the variable)."""
    os.environ[LOCK_DIR] = tempfile.mkdtemp(prefix="completions-tests-")


def finish_run() -> None:
    shutil.rmtree(os.environ.pop(LOCK_DIR, ""), ignore_errors=True)


def start() -> None:
    """In an xdist worker: pin this process to its cores and join the lock."""
    global _share
    os.sched_setaffinity(0, own_cores())
    _share = MachineShare(Path(os.environ[LOCK_DIR]))


@contextlib.contextmanager
def share():
    with (_share.share() if _share else contextlib.nullcontext()):
        yield


@contextlib.contextmanager
def whole_machine():
    """Every core for this block, with no other test running meanwhile."""
    with (_share.whole_machine() if _share else contextlib.nullcontext()):
        yield
