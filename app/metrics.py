"""GET /metrics in Prometheus' text format: the whole system, from the dispatcher.

This front end records what only it sees (HTTP statuses, time to first token and
inter-token latency by worker and device) into a LatencyRecorder whose increments ride
on the heartbeats; the dispatcher sums every front end's and answers a METRICS request
with the system's snapshot, rendered here with prometheus_client.
"""
from __future__ import annotations

from flask import Blueprint, Response, current_app, request
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from app.client import get_client
from app.errors import ServiceUnavailable

bp = Blueprint("metrics", __name__)
HISTOGRAM_NAMES = {
    "ttft": ("completions_time_to_first_token_seconds",
             "Time from the request's arrival to its first text, per worker and device."),
    "itl": ("completions_inter_token_latency_seconds",
            "Time between two texts of one stream, per worker and device."),
}


class SnapshotCollector:
    """Turns the dispatcher's snapshot into metric families."""

    def __init__(self, snapshot: dict):
        self.snapshot = snapshot

    def collect(self):
        snap = self.snapshot
        requests = CounterMetricFamily("completions_requests", "HTTP requests answered by "
                                       "the front ends, by route and status.",
                                       labels=["route", "status"])
        for route, status, n in snap.get("requests", []):
            requests.add_metric([route, status], n)
        yield requests
        for kind, (name, doc) in HISTOGRAM_NAMES.items():
            family = HistogramMetricFamily(name, doc, labels=["worker", "device"])
            for k, worker, device, h in snap.get("histograms", []):
                if k != kind:
                    continue
                cumulative, buckets = 0, []
                for bound, count in zip(list(h["buckets"]) + ["+Inf"], h["counts"]):
                    cumulative += count
                    buckets.append((str(bound), cumulative))
                family.add_metric([worker, device], buckets, h["sum"])
            yield family
        tokens = {kind: CounterMetricFamily(f"completions_{kind}_tokens", doc,
                                            labels=["worker", "device"])
                  for kind, doc in (("prompt", "Prompt tokens processed."),
                                    ("generated", "Tokens generated."),
                                    ("cached", "Prompt tokens reused from a KV cache."))}
        for kind, worker, device, n in snap.get("tokens", []):
            tokens[kind].add_metric([worker, device], n)
        yield from tokens.values()
        outcomes = CounterMetricFamily("completions_worker_requests", "Requests a worker "
                                       "ended, by outcome.", labels=["worker", "device",
                                                                      "outcome"])
        for outcome, worker, device, n in snap.get("outcomes", []):
            outcomes.add_metric([worker, device, outcome], n)
        yield outcomes
        gauges = {key: GaugeMetricFamily(f"completions_worker_{key}", doc,
                                         labels=["worker", "device", "model"])
                  for key, doc in (("up", "1 if the worker is ready."),
                                   ("slots", "Sequences the worker decodes at once."),
                                   ("busy", "Busy slots."),
                                   ("layers_offloaded", "Model layers on the accelerator, "
                                    "as llama.cpp's load reported (0: all on the CPU)."))}
        restarts = CounterMetricFamily("completions_worker_restarts", "Times the worker's "
                                       "process was restarted.", labels=["worker", "device"])
        for w in snap.get("workers", []):
            labels = [w["worker"], str(w["device"]), str(w["model"])]
            for key, family in gauges.items():
                family.add_metric(labels, w.get(key, 0))
            restarts.add_metric(labels[:2], w["restarts"])
        yield from gauges.values()
        yield restarts
        yield from step_profile(snap.get("workers", []))
        queue = GaugeMetricFamily("completions_queue_depth", "Requests waiting, by model.",
                                  labels=["model"])
        for model, depth in snap.get("queue", {}).items():
            queue.add_metric([model], depth)
        yield queue
        dispatcher = CounterMetricFamily("completions_dispatcher_requests", "Jobs seen by "
                                         "the dispatcher, by outcome.", labels=["outcome"])
        for outcome, n in snap.get("dispatcher", {}).items():
            dispatcher.add_metric([outcome], n)
        yield dispatcher
        frontends = GaugeMetricFamily("completions_frontends", "Front-end processes "
                                      "connected to the dispatcher.")
        frontends.add_metric([], snap.get("frontends", 0))
        yield frontends
        yield from usage_by_key(snap.get("usage", []))


def usage_by_key(rows: list) -> list:
    """Requests, prompt and completion tokens and failed requests per API key, labelled
    by the key's name (its fingerprint where it has none), never the key."""
    families = [CounterMetricFamily(f"completions_key_{kind}", doc, labels=["key"])
                for kind, doc in (("requests", "Requests answered, by API key."),
                                  ("prompt_tokens", "Prompt tokens, by API key."),
                                  ("completion_tokens", "Completion tokens, by API key."),
                                  ("errors", "Requests answered with an error, by API key."))]
    for key, *counts in rows:
        for family, n in zip(families, counts):
            family.add_metric([key], n)
    return families


def step_profile(workers: list[dict]):
    """The workers' step counters (protocol.StepTotals, as of each one's last heartbeat):
    where a decode step's time goes (`bench --profile` reads them)."""
    steps = CounterMetricFamily("completions_worker_steps", "Decode steps.",
                                labels=["worker", "device"])
    rows = CounterMetricFamily("completions_worker_step_rows", "Rows decoded, by kind: a "
                               "generating sequence's token, a draft token verified, a "
                               "prompt token, a filler (a free sequence's row joining "
                               "runs of sequence ids into one batch).",
                               labels=["worker", "device", "kind"])
    batches = CounterMetricFamily("completions_worker_step_batches", "llama.cpp's "
                                  "sub-batches: runs of consecutive sequence ids in a step.",
                                  labels=["worker", "device"])
    sat_out = CounterMetricFamily("completions_worker_step_sat_out", "Sequences that sat "
                                  "a step out for others' first lines.",
                                  labels=["worker", "device"])
    accepted = CounterMetricFamily("completions_worker_draft_accepted_tokens", "Draft "
                                   "tokens the model confirmed.", labels=["worker", "device"])
    by_source = CounterMetricFamily("completions_worker_draft_tokens", "Draft tokens by "
                                    "source (copy, resume, long, short, history, recycled, model, "
                                    "guess) "
                                    "and outcome (drafted, accepted).",
                                    labels=["worker", "device", "source", "outcome"])
    seconds = CounterMetricFamily("completions_worker_step_seconds", "Step time by phase: "
                                  "plan (rows, drafts, the batch), decode (to the device's "
                                  "end), sample (sampling and verifying), draft (the draft "
                                  "model's decodes, --draft-model).",
                                  labels=["worker", "device", "phase"])
    beats = CounterMetricFamily("completions_worker_heartbeats", "Heartbeats the dispatcher "
                                "received from the worker (the step counters above are as "
                                "of its last one).", labels=["worker", "device"])
    for w in workers:
        labels = [w["worker"], str(w["device"])]
        if w.get("heartbeats") is not None:
            beats.add_metric(labels, w["heartbeats"])
        totals = w.get("steps")
        if not totals:
            continue
        steps.add_metric(labels, totals["steps"])
        for kind in ("token", "draft", "prompt", "filler"):
            rows.add_metric(labels + [kind], totals.get(f"{kind}_rows", 0))
        batches.add_metric(labels, totals["batches"])
        sat_out.add_metric(labels, totals["sat_out"])
        accepted.add_metric(labels, totals["accepted"])
        for source, (drafted, kept) in sorted((totals.get("sources") or {}).items()):
            by_source.add_metric(labels + [source, "drafted"], drafted)
            by_source.add_metric(labels + [source, "accepted"], kept)
        for phase in ("plan", "decode", "sample", "draft"):
            seconds.add_metric(labels + [phase], totals.get(f"{phase}_seconds", 0.0))
    yield from (steps, rows, batches, sat_out, accepted, by_source, seconds, beats)


@bp.get("/metrics")
def metrics():
    snapshot = get_client(current_app).metrics_snapshot()
    if snapshot is None:
        raise ServiceUnavailable("the dispatcher is unreachable")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(snapshot))
    return Response(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)


# read by machines every second or so (probes, scrapers, the status page): not counted
QUIET_PATHS = ("/metrics", "/health", "/v1/health", "/v1/status")


def init_app(app) -> None:
    """Count every answered request (by route pattern, so ids do not explode labels)."""

    @app.after_request
    def count(response):
        client = app.extensions.get("dispatcher_client")   # made at worker start
        if client is not None and request.path not in QUIET_PATHS:
            route = request.url_rule.rule if request.url_rule else "unmatched"
            client.recorder.requests[(route, str(response.status_code))] += 1
            client.served += 1
        return response
