"""System-wide metrics, kept by the dispatcher.

Front ends measure what only they see (HTTP statuses, time to first token, inter-token
latency, per worker and device) and send the increments with each heartbeat; the
dispatcher adds them up and adds what it knows (tokens, outcomes, slots, queue, restarts).
Any front end's /metrics asks the dispatcher for this snapshot, so every front end shows
the whole system.
"""
from __future__ import annotations

from collections import Counter, OrderedDict

from dispatcher.common import protocol as P
from dispatcher.common.latency import HISTOGRAMS, Histogram


# Workers gone whose series /metrics still shows, the longest gone forgotten first: a
# worker started on its own is named with its pid, so each restart is a new name, and
# every name kept its series for ever (as Prometheus sees a target churn: the series end)
MAX_GONE = 32
# Series a front end's increments may add to each of requests, histograms and usage: their
# labels come from another process (a front end's histogram of a worker pruned here, sent
# after a dispatcher restart, came back for good: one more set of series for each
# pid-named worker lost in each outage); past this a new series is not kept
MAX_SERIES = 4096


class SystemMetrics:
    """The dispatcher's running totals."""

    def __init__(self):
        self.requests: Counter = Counter()                    # (route, status)
        self.histograms: dict[tuple[str, str, str], Histogram] = {}
        self.tokens: Counter = Counter()                      # (kind, worker, device)
        self.outcomes: Counter = Counter()                    # (outcome, worker, device)
        # API key name -> [requests, prompt tokens, completion tokens, errors]
        self.usage: dict[str, list[int]] = {}
        self.gone: OrderedDict[str, None] = OrderedDict()      # workers, longest gone first

    def absorb(self, delta: dict) -> None:
        """Add a front end's increments (a malformed one is ignored, not fatal)."""
        try:
            for route, status, n in delta.get("requests", []):
                key = (str(route), str(status))
                if key in self.requests or len(self.requests) < MAX_SERIES:
                    self.requests[key] += int(n)
            for kind, worker, device, wire in delta.get("histograms", []):
                key = (kind, str(worker), str(device))
                if kind not in HISTOGRAMS:
                    continue
                counts, total = [int(c) for c in wire["counts"]], float(wire["sum"])
                if key not in self.histograms:
                    fresh = Histogram(HISTOGRAMS[kind])
                    if len(self.histograms) >= MAX_SERIES or \
                            len(counts) != len(fresh.counts):   # (malformed: no series)
                        continue
                    self.histograms[key] = fresh
                self.histograms[key].merge(counts, total)
            for row in delta.get("usage", []):
                if not isinstance(row, list) or len(row) != 5 or not isinstance(row[0], str):
                    continue
                counts = [int(n) for n in row[1:]]
                if min(counts) < 0:             # (counters never go down)
                    continue
                if row[0] not in self.usage and len(self.usage) >= MAX_SERIES:
                    continue
                totals = self.usage.setdefault(row[0], [0, 0, 0, 0])
                for i, n in enumerate(counts):
                    totals[i] += n
        except (TypeError, ValueError, KeyError, RecursionError):
            pass                # (RecursionError: a label nested too deep to print)

    def job_done(self, worker: str, device: str, body) -> None:
        """A worker's DONE (protocol.Done)."""
        usage = body.usage or P.Usage()
        self.tokens[("prompt", worker, device)] += usage.prompt_tokens
        self.tokens[("generated", worker, device)] += usage.completion_tokens
        self.tokens[("cached", worker, device)] += body.cached_tokens
        outcome = "cancelled" if body.cancelled else \
            "error" if body.error else "completed"
        self.outcomes[(outcome, worker, device)] += 1

    def worker_lost(self, worker: str, device: str, failed: int, outcome: str = "lost") -> None:
        """`failed` requests ended with their worker: lost, or stuck (the watchdog); its
        series are kept until MAX_GONE others have gone since."""
        if failed:
            self.outcomes[(outcome, worker, device)] += failed
        self.gone.pop(worker, None)
        self.gone[worker] = None
        while len(self.gone) > MAX_GONE:
            oldest, _ = self.gone.popitem(last=False)
            for series in (self.tokens, self.outcomes, self.histograms):
                for key in [k for k in series if k[1] == oldest]:
                    del series[key]

    def worker_ready(self, worker: str) -> None:
        """A worker (re)registered: its series stay."""
        self.gone.pop(worker, None)

    def snapshot(self) -> dict:
        return {
            "requests": [[r, s, n] for (r, s), n in sorted(self.requests.items())],
            "histograms": [[k, w, d, {"buckets": list(h.buckets), **h.to_wire()}]
                           for (k, w, d), h in sorted(self.histograms.items())],
            "tokens": [[k, w, d, n] for (k, w, d), n in sorted(self.tokens.items())],
            "outcomes": [[o, w, d, n] for (o, w, d), n in sorted(self.outcomes.items())],
            "usage": [[key, *counts] for key, counts in sorted(self.usage.items())],
        }
