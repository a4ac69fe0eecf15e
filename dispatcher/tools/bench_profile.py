"""`bench --profile`: where a target's decode steps spent a part's time.

This server's workers count their steps (protocol.StepTotals: rows by kind, llama.cpp's
sub-batches, sequences sitting a step out, draft tokens confirmed, seconds planning,
decoding and sampling) and `/metrics` exports the counters as of each worker's last
heartbeat, and counts the heartbeats. The bench reads them before a part and after it
(once every worker has sent two heartbeats since the part ended, so its last steps are
in) and prints the difference per step. A target that does not export
them (llama-server) has no profile row.
"""
from __future__ import annotations

import time

from prometheus_client.parser import text_string_to_metric_families

SETTLE = 1.5            # s after a part for the workers' next heartbeat (interval 1 s),
                        # where the target does not count heartbeats
POLL = 0.1              # s between reads while waiting for the heartbeats
HEARTBEATS = 2          # heartbeats after a part: the first may have left during its last step
FIELDS = {              # metric sample name (and label) -> StepTotals field
    ("completions_worker_steps_total", None): "steps",
    ("completions_worker_step_rows_total", "token"): "token_rows",
    ("completions_worker_step_rows_total", "draft"): "draft_rows",
    ("completions_worker_step_rows_total", "prompt"): "prompt_rows",
    ("completions_worker_step_rows_total", "filler"): "filler_rows",
    ("completions_worker_step_batches_total", None): "batches",
    ("completions_worker_step_sat_out_total", None): "sat_out",
    ("completions_worker_draft_accepted_tokens_total", None): "accepted",
    ("completions_worker_step_seconds_total", "plan"): "plan_seconds",
    ("completions_worker_step_seconds_total", "decode"): "decode_seconds",
    ("completions_worker_step_seconds_total", "sample"): "sample_seconds",
    ("completions_worker_step_seconds_total", "draft"): "draft_seconds",
    ("completions_worker_heartbeats_total", None): "heartbeats",
}


def read_totals(target) -> dict[tuple, dict[str, float]] | None:
    """The target's step counters by worker ({} where none are exported yet); None
    where it has no /metrics in Prometheus' text format."""
    try:
        status, body = target.get_root("/metrics")
    except OSError:
        return None
    return parse_totals(body.decode("utf-8", "replace")) if status == 200 else None


def parse_totals(text: str) -> dict[tuple, dict[str, float]] | None:
    """{(worker, device): {StepTotals field, or "source:outcome": value}}; None for text
    that is not Prometheus'."""
    totals: dict[tuple, dict[str, float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "completions_worker_draft_tokens_total":
                    field = f"{sample.labels.get('source')}:{sample.labels.get('outcome')}"
                else:
                    field = FIELDS.get((sample.name, sample.labels.get("kind") or
                                        sample.labels.get("phase")))
                if field is not None:
                    worker = totals.setdefault((sample.labels.get("worker"),
                                                sample.labels.get("device")), {})
                    worker[field] = worker.get(field, 0.0) + sample.value
    except ValueError:               # not Prometheus' text format
        return None
    # {}: Prometheus text without step counters (another server, or a worker that has
    # not yet sent its first heartbeat: counted from zero)
    return {w: t for w, t in totals.items() if "steps" in t}


def difference(before: dict[tuple, dict], after: dict[tuple, dict]) -> dict[str, float]:
    """The counters' increase over a part, summed over the workers: a worker restarted
    meanwhile (its counters began again) counts from zero, one gone counts nothing."""
    out: dict[str, float] = {}
    for worker, now in after.items():
        then = before.get(worker)
        if then is None or now.get("steps", 0.0) < then.get("steps", 0.0):
            then = {}
        for key, value in now.items():
            out[key] = out.get(key, 0.0) + value - then.get(key, 0.0)
    return out


def profile_row(target_name: str, part: str, before: dict | None,
                after: dict | None) -> dict | None:
    """The part's steps, per step: rows of each kind, sub-batches, sit-outs, tokens the
    step gave (a token per generating row plus the drafts confirmed), and milliseconds
    planning, decoding (and per row decoded) and sampling."""
    if before is None or after is None:
        return None
    d = difference(before, after)
    steps = d.get("steps", 0.0)
    if steps <= 0:
        return None
    rows = d["token_rows"] + d["draft_rows"] + d["prompt_rows"] + d.get("filler_rows", 0.0)
    return {
        "target": target_name, "part": part, "steps": int(steps),
        "token rows/step": round(d["token_rows"] / steps, 2),
        "draft rows/step": round(d["draft_rows"] / steps, 2),
        "accepted %": round(100 * d["accepted"] / d["draft_rows"], 1)
        if d["draft_rows"] else "-",
        "prompt rows/step": round(d["prompt_rows"] / steps, 1),
        "filler rows/step": round(d.get("filler_rows", 0.0) / steps, 2),
        "batches/step": round(d["batches"] / steps, 2),
        "sat out/step": round(d["sat_out"] / steps, 2),
        "tokens/step": round((d["token_rows"] + d["accepted"]) / steps, 2),
        "plan ms": round(1000 * d["plan_seconds"] / steps, 2),
        "decode ms": round(1000 * d["decode_seconds"] / steps, 1),
        "decode ms/row": round(1000 * d["decode_seconds"] / rows, 2) if rows else "-",
        "sample ms": round(1000 * d["sample_seconds"] / steps, 2),
        "draft model ms": round(1000 * d.get("draft_seconds", 0.0) / steps, 2),
        "drafts by source (accepted/drafted)": " ".join(
            f"{k[:-len(':drafted')]} {int(d.get(k[:-len('drafted')] + 'accepted', 0))}"
            f"/{int(v)}" for k, v in sorted(d.items())
            if k.endswith(":drafted") and v > 0) or "-",
    }


def heartbeats_since(start: dict, now: dict) -> bool:
    """Whether each worker has sent HEARTBEATS since `start`: one restarted since (its
    count began again) counts from zero, one that came up since from zero, one gone is
    not waited for."""
    for worker, totals in now.items():
        then = start.get(worker, {}).get("heartbeats", 0.0)
        beats = totals.get("heartbeats", 0.0)
        if beats < then or totals.get("steps", 0.0) < start.get(worker, {}).get("steps", 0.0):
            then = 0.0
        if beats - then < HEARTBEATS:
            return False
    return True


def settled(target, settle: float = SETTLE, tries: int = 4, poll: float = POLL):
    """The target's counters once heartbeats have brought the part's last steps. Where
    it counts its workers' heartbeats (this server), read every `poll` s until each
    worker has sent HEARTBEATS since now (`heartbeats_since`); otherwise, or where that
    takes longer than `tries` × `settle` s, read again after `settle` s until the step
    count stops moving (a longer heartbeat interval takes more reads), `tries` times at
    most."""
    start = read_totals(target)
    if start and all("heartbeats" in t for t in start.values()):
        deadline = time.monotonic() + tries * settle
        while time.monotonic() < deadline:
            time.sleep(poll)
            now = read_totals(target)
            if now is None:
                break
            if heartbeats_since(start, now):
                return now
    time.sleep(settle)
    totals = read_totals(target)
    for _ in range(tries - 1):
        time.sleep(settle)
        again = read_totals(target)
        if again is None or totals is None or difference(totals, again).get("steps", 0) == 0:
            return again if again is not None else totals
        totals = again
    return totals


def markdown_table(rows: list[dict], columns: list[str] | None = None) -> str:
    """Rows of figures as a Markdown table: `columns`, or every key in the order they
    first come; "-" where a row has none."""
    columns = columns or list(dict.fromkeys(k for row in rows for k in row))
    cells = [columns] + [[str(row.get(k, "-")) for k in columns] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)
