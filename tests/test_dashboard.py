"""deploy/grafana/completions.json against what /metrics really exports: every metric and
every label its PromQL names, read from a running server (fake engine, with an API key,
after plain, streamed and failed requests), so the dashboard cannot drift from the code."""
import json
import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import ROOT, ServerProcess, SSEStream, http_json

pytestmark = pytest.mark.integration

DASHBOARD = ROOT / "deploy" / "grafana" / "completions.json"
METRIC = re.compile(r"\b(completions_[a-z_]+)\b")
# label names in matchers ({a="x", b=~"y"}) and in by (...) / without (...)
MATCHERS = re.compile(r"\{([^}]*)\}")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
FUNCTIONS_LABELS = {"le"}           # histogram_quantile's bucket bound


def expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    assert exprs and all(isinstance(e, str) and e for e in exprs)
    return exprs


def exported(text: str) -> tuple[dict[str, set[str]], set[str]]:
    """Sample names -> the label names they carry; and every name a family declares
    (with its _total / _bucket / _sum / _count forms), samples or not."""
    samples: dict[str, set[str]] = {}
    declared: set[str] = set()
    for family in text_string_to_metric_families(text):
        suffixes = {"counter": ("_total", "_created"), "histogram": (
            "_bucket", "_sum", "_count", "_created")}.get(family.type, ("",))
        declared.update(family.name + s for s in suffixes)
        for sample in family.samples:
            samples.setdefault(sample.name, set()).update(sample.labels)
    return samples, declared


@pytest.fixture(scope="module")
def metrics_text():
    server = ServerProcess("--engine", "fake", "--api-key", "sk-dash",
                           log_name="dashboard").start()
    try:
        auth = {"Authorization": "Bearer sk-dash"}
        assert http_json(server.port, "POST", "/v1/completions",
                         {"prompt": "a", "max_tokens": 3}, headers=auth)[0] == 200
        assert http_json(server.port, "POST", "/v1/completions",
                         {"prompt": "a", "temperature": 9}, headers=auth)[0] == 400
        stream = SSEStream(server.port, {"prompt": "b", "max_tokens": 6, "stream": True},
                           headers=auth)
        assert list(stream.events())[-1] == "[DONE]"

        def scrape():
            text = http_json(server.port, "GET", "/metrics")[2].decode()
            return "completions_time_to_first_token_seconds_bucket" in text and \
                'completions_key_requests_total{key=' in text and text
        yield server.wait_for(scrape, what="the requests counted in /metrics")
    finally:
        assert server.stop() == 0


def test_every_metric_the_dashboard_names_is_exported(metrics_text):
    samples, declared = exported(metrics_text)
    missing = sorted({name for expr in expressions() for name in METRIC.findall(expr)
                      if name not in samples and name not in declared})
    assert missing == []


def test_every_label_the_dashboard_names_is_on_its_metric(metrics_text):
    samples, _ = exported(metrics_text)
    wrong = []
    for expr in expressions():
        names = METRIC.findall(expr)
        used = {part.split("=")[0].split("!")[0].strip()
                for group in MATCHERS.findall(expr) for part in group.split(",") if part}
        used |= {label.strip() for group in GROUPING.findall(expr)
                 for label in group.split(",") if label.strip()}
        for label in used - FUNCTIONS_LABELS:
            carriers = [n for n in names if n in samples]
            if carriers and not any(label in samples[n] for n in carriers):
                wrong.append((expr, label))
    assert wrong == []


def test_the_dashboard_panels_cover_what_operators_watch():
    text = DASHBOARD.read_text()
    for needed in ("completions_requests_total", "time_to_first_token", "inter_token_latency",
                   "completions_generated_tokens_total", "completions_queue_depth",
                   "completions_worker_busy", "completions_worker_draft_tokens_total",
                   "completions_worker_restarts_total", "completions_key_requests_total"):
        assert needed in text, needed
