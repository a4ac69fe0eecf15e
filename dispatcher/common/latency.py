"""What a front end measures between two heartbeats, in the shape the dispatcher adds up
(dispatcher.metrics): latency histograms, answers by route and status, and usage per API
key (by its name)."""
from __future__ import annotations

from collections import Counter

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)
HISTOGRAMS = {"ttft": TTFT_BUCKETS, "itl": ITL_BUCKETS}


class Histogram:
    """Counts per bucket (not cumulative; the last one is +Inf), sum and count."""

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        index = next((i for i, bound in enumerate(self.buckets) if value <= bound),
                     len(self.buckets))
        self.counts[index] += 1
        self.sum += value

    def merge(self, counts: list[int], total: float) -> None:
        if len(counts) == len(self.counts):
            self.counts = [a + b for a, b in zip(self.counts, counts)]
            self.sum += total

    def to_wire(self) -> dict:
        return {"counts": self.counts, "sum": self.sum}

    @property
    def empty(self) -> bool:
        return not any(self.counts)


class LatencyRecorder:
    """What a front end accumulates between two heartbeats."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.requests: Counter = Counter()            # (route, status) -> n
        self.histograms: dict[tuple[str, str, str], Histogram] = {}
        # key name -> [requests, prompt tokens, completion tokens, errors]
        self.usage: dict[str, list[int]] = {}

    def used(self, key: str, prompt: int, completion: int, error: bool) -> None:
        counts = self.usage.setdefault(key, [0, 0, 0, 0])
        for i, n in enumerate((1, prompt, completion, int(error))):
            counts[i] += n

    def observe(self, kind: str, worker: str, device: str, seconds: float) -> None:
        key = (kind, worker, device)
        if key not in self.histograms:
            self.histograms[key] = Histogram(HISTOGRAMS[kind])
        self.histograms[key].observe(seconds)

    def take(self) -> dict | None:
        """The increments since the last call, for the heartbeat; None if nothing."""
        if not self.requests and not self.histograms and not self.usage:
            return None
        delta = {"requests": [[r, s, n] for (r, s), n in self.requests.items()],
                 "histograms": [[k, w, d, h.to_wire()] for (k, w, d), h in
                                self.histograms.items()],
                 "usage": [[key, *counts] for key, counts in self.usage.items()]}
        self.reset()
        return delta

    def restore(self, delta: dict) -> None:
        """Put back increments that could not be sent."""
        for route, status, n in delta["requests"]:
            self.requests[(route, status)] += n
        for key, requests, prompt, completion, errors in delta.get("usage", []):
            counts = self.usage.setdefault(key, [0, 0, 0, 0])
            for i, n in enumerate((requests, prompt, completion, errors)):
                counts[i] += n
        for kind, worker, device, wire in delta["histograms"]:
            key = (kind, worker, device)
            if key not in self.histograms:
                self.histograms[key] = Histogram(HISTOGRAMS[kind])
            self.histograms[key].merge(wire["counts"], wire["sum"])
