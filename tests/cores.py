"""How parallel test processes (pytest-xdist) share this machine's cores and ports.

llama.cpp's CPU thread pool spins while it waits for its own threads, so two pools on
the same cores slow each other down by an order of magnitude. Each xdist worker (and
every server it starts, which inherits its affinity) therefore runs on cores of its own,
and its real-model workers size their thread pools to them.

A test that needs every core (two workers pinned to the first two cores) is marked
`serial`: the parallel pass leaves it out, and a second pass without xdist (`pytest -m
serial -n 0`, in `.ci/run`) runs those alone, with every core. Without xdist, nothing here
pins anything.
"""
from __future__ import annotations

import os
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


def start() -> None:
    """In an xdist worker: pin this process (and every server it starts) to its cores."""
    os.sched_setaffinity(0, own_cores())
