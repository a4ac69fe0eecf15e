"""The bench's checks beside the speed workloads (`python -m dispatcher bench
--constrained`, `--hostile`): whether a constrained neighbour slows a plain stream more
than a plain one does, and whether requests the server refuses for their cost disturb a
stream decoding beside them."""
from __future__ import annotations

import json
import threading
import time

from dispatcher.tools.bench_targets import Level, Sample, summarize


# A schema the bench's constrained stream follows; its prompt invites prose, so the
# grammar has to reject the model's own choice now and then.
BENCH_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "languages": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "languages"]}


# Neighbours of the constrained run: a plain stream (the baseline: two streams share a
# batch), a json_schema one, and a grammar the model fights (prose, only a-c allowed: the
# sampler's pick is rejected at almost every token).
NEIGHBOURS = {
    "plain": (lambda i: f"Story {i}: once upon a time", {}),
    "json_schema": (lambda i: f"Person {i}, described as JSON:",
                    {"json_schema": BENCH_SCHEMA}),
    "[a-c]* grammar": (lambda i: f"The history of the Roman Empire, part {i}, is",
                       {"grammar": "root ::= [a-c]*", "temperature": 0.8}),
}


def run_constrained(target, prompts: list[list[str]], max_tokens: int, salt: int,
                    run: int = 0, same_work: dict | None = None) -> list[Level]:
    """A plain stream's speed alone, then with a plain, a json_schema and a fighting-
    grammar stream running beside it the whole time: grammar sampling must not slow the
    rest of the batch more than another plain stream does. The plain stream's requests
    are `prompts`' (first-seen files: one list for each of the four conditions), sent
    `same_work` (ignore_eos: each writes its max_tokens); the three neighbours go in an
    order that turns with `run` (a later condition meets a server warmer by the ones
    before it)."""
    def plain_run(name: str, mine: list[str]) -> Level:
        samples, started = [], time.perf_counter()
        for prompt in mine:
            samples.append(target.complete(prompt, max_tokens, extra=same_work))
        return summarize(name, 1, samples, time.perf_counter() - started)

    levels = [plain_run("plain alone", prompts[0])]
    names = list(NEIGHBOURS)
    turned = names[run % len(names):] + names[:run % len(names)]
    for k, name in enumerate(turned, start=1):
        prompt, extra = NEIGHBOURS[name]
        stop = threading.Event()
        beside: list[Sample] = []

        def neighbour():
            i = 0
            while not stop.is_set():
                sample = target.complete(prompt(salt + i), max_tokens, extra=extra)
                beside.append(sample)
                i += 1
                if not sample.ok:       # (refused, say a server without grammars: no
                    stop.wait(0.5)      # stream of 400s as fast as it answers)

        thread = threading.Thread(target=neighbour, daemon=True)
        started = time.perf_counter()
        thread.start()
        time.sleep(0.5)                 # the neighbour is decoding by now
        levels.append(plain_run(f"plain + {name}", prompts[k]))
        stop.set()
        thread.join(timeout=600)
        levels.append(summarize(f"{name} beside", 1, beside, time.perf_counter() - started))
    return levels


def run_hostile(target, max_tokens: int) -> list[str]:
    """A plain stream alone, then again while every costly class the server refuses
    (dispatcher.tools.soak.COSTLY_BODIES) is sent one after another: the lines say how each was
    answered and the stream's largest gap between two tokens, alone and beside them."""
    from dispatcher.tools.soak import COSTLY_BODIES
    prompt = "Once upon a time"
    alone = target.complete(prompt, max_tokens, extra={"ignore_eos": True})
    results: list[Sample] = []
    thread = threading.Thread(target=lambda: results.append(target.complete(
        prompt, max_tokens * 4, extra={"ignore_eos": True})))
    thread.start()
    time.sleep(0.5)
    lines = []
    heavy = [(b, None) for b in COSTLY_BODIES] + [   # and valid work beside the decoding
        (json.dumps({"content": "word " * 180_000}).encode(), "/tokenize")]
    for body, path in heavy:
        started = time.perf_counter()
        status, payload = target.post_raw(body, path=path)
        lines.append(f"  {body[:48]!r}... ({len(body)} bytes): HTTP {status} in "
                     f"{time.perf_counter() - started:.2f} s {payload[:60]!r}")
    thread.join(timeout=600)
    beside = results[0] if results else Sample()
    lines.append(f"  a plain stream's largest gap between tokens: alone "
                 f"{alone.max_gap * 1000:.0f} ms, beside the costly requests "
                 f"{beside.max_gap * 1000:.0f} ms ({'ok' if beside.ok else beside.error})")
    return lines


def constrained_slowdowns(rows: list[dict]) -> dict[str, dict[str, list[float]]]:
    """Per target: the plain stream's ITL beside each constrained neighbour, over its ITL
    beside a plain one (the cost of the constraint, not of sharing the batch), one ratio
    for each run (rows carry their `run`; without one, a single run)."""
    out: dict[str, dict[str, list[float]]] = {}
    for target, run in sorted({(r["target"], r.get("run", 1)) for r in rows}):
        mine = [r for r in rows if r["target"] == target and r.get("run", 1) == run]
        itl = {r["name"]: r["itl_ms"] for r in mine}
        # a neighbour that never streamed (refused: a server without grammars) was no
        # neighbour: no ratio for it
        ran = {r["name"][:-len(" beside")] for r in mine
               if r["name"].endswith(" beside") and r.get("ok")}
        base = itl.get("plain + plain")
        if not base or "plain" not in ran:
            continue
        for name in NEIGHBOURS:
            if name != "plain" and name in ran and itl.get(f"plain + {name}"):
                out.setdefault(target, {}).setdefault(name, []).append(
                    itl[f"plain + {name}"] / base)
    return out
