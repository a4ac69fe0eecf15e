"""`python -m dispatcher bench`: a load generator for any OpenAI-compatible server.

Streams completions at several concurrency levels and replays an editor's
fill-in-the-middle keystrokes (a prompt growing a few characters per request, each
superseding the last), then prints TTFT p50/p95, inter-token latency, per-stream decode
rate, aggregate rate, errors and truncated streams. `--in-process` measures
llama-cpp-python in this process on the same workloads: the library's own speed, the
ceiling for any server built on it.
"""
from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from dataclasses import asdict, replace

from dispatcher.common.config import non_negative_int, non_negative_seconds
from dispatcher.tools.bench_checks import (NEIGHBOURS, constrained_slowdowns, run_constrained,
                                           run_hostile)
from dispatcher.tools.bench_corpus import Corpus, CorpusError, edit, function_start, opening
from dispatcher.tools.bench_editors import run_fim_replay, run_typing
from dispatcher.tools import bench_profile
from dispatcher.tools.bench_targets import HttpTarget, InProcessTarget, Level, Sample, summarize

COLD_CHARS = 12_000     # `cold`: a file's first characters, about 3,000 tokens of code
# What every throughput request is sent, so that no server stops earlier (an end token)
# or samples from another distribution (servers' defaults for top_k, top_p and min_p
# differ: llama.cpp's 40, 0.95, 0.05; OpenAI's none): each writes its max_tokens, from
# the whole distribution where it samples at all.
SAME_WORK = {"ignore_eos": True, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
# The parts whose prompts are first-seen; on a target that did not start each of them
# cold (no key of its own, or a server that ignores keys) their rows say so
FIRST_SEEN_PARTS = ("edit", "fresh", "fresh1", "sampled", "cold", "typing", "fim")
WARM_STATE = " (warm state)"


def run_level(target, concurrency: int, prompts: list[str], max_tokens: int) -> Level:
    """A stream for each prompt, `concurrency` at a time (see `level_rounds`)."""
    return drain(level_rounds(target, concurrency, prompts, max_tokens))


def level_rounds(target, concurrency: int, prompts: list[str], max_tokens: int):
    """A stream for each prompt (first-seen: a file of its own), in rounds of
    `concurrency` started at once, each round waiting for its last stream: a generator
    that yields after each round (`run` runs the other targets' rounds in between) and
    returns the Level, timed over its own rounds."""
    requests = len(prompts)
    samples: list[Sample] = []
    wall = 0.0
    for first in range(0, requests, concurrency):
        batch = range(first, min(requests, first + concurrency))
        results: dict[int, Sample] = {}

        def stream(i: int) -> None:
            results[i] = target.complete(prompts[i], max_tokens, extra=SAME_WORK)

        batched = isinstance(target, InProcessTarget) and concurrency > 1
        if batched:
            target.make_room(concurrency)
        started = time.perf_counter()
        if batched:
            results.update(zip(batch, target.complete_round([prompts[i] for i in batch],
                                                            max_tokens, ignore_eos=True)))
        else:
            threads = [threading.Thread(target=stream, args=(i,)) for i in batch]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        wall += time.perf_counter() - started
        samples += [results.get(i) or Sample(error="the stream's thread failed")
                    for i in batch]
        yield
    return summarize(f"stream x{concurrency}", concurrency, samples, wall)


def drain(rounds):
    """A part's rounds run to the end, one after the other: its result."""
    while True:
        try:
            next(rounds)
        except StopIteration as done:
            return done.value


def at_once(run_part):
    """A part that runs whole, as one round (`run_part()` is its result)."""
    result = run_part()
    yield
    return result


def run_extension(target, base: str, max_tokens: int, steps: int = 5) -> Level:
    """TTFT of a prompt that extends the previous one by a few characters (warm on
    purpose: the cache holds all but the last few)."""
    target.complete(base, 1)                              # warm the cache
    started = time.perf_counter()
    samples = [target.complete(base + "x" * (3 * (i + 1)), max_tokens, extra=SAME_WORK)
               for i in range(steps)]
    return summarize("extend prompt (warm)", 1, samples, time.perf_counter() - started)


COLUMNS = [("target", "target", "{}"), ("workload", "name", "{}"),
           ("reqs", "requests", "{}"), ("ok", "ok", "{}"), ("err", "errors", "{}"),
           ("trunc", "truncated", "{}"), ("supers", "superseded", "{}"),
           ("TTFT p50 ms", "ttft_p50_ms", "{:.1f}"), ("TTFT p95 ms", "ttft_p95_ms", "{:.1f}"),
           ("ITL ms", "itl_ms", "{:.1f}"), ("stream tok/s", "stream_tok_s", "{:.1f}"),
           ("aggregate tok/s", "aggregate_tok_s", "{:.1f}"),
           ("1st line p50 ms", "first_line_p50_ms", "{:.1f}"),
           ("1st line p95 ms", "first_line_p95_ms", "{:.1f}"),
           ("unanswered", "unanswered", "{}"), ("empty", "empty", "{}"),
           ("closed", "closed", "{}")]


def table(rows: list[dict], runs: bool = False) -> str:
    """The rows as a Markdown table (`runs`: with each row's run)."""
    columns = [("run", "run", "{}")] + COLUMNS if runs else COLUMNS
    return bench_profile.markdown_table([
        {title: "-" if row.get(key) is None else fmt.format(row[key])
         for title, key, fmt in columns} for row in rows], [title for title, _, _ in columns])


def run_single(target, name: str, prompts: list[str], repeats: int,
               max_tokens: int, temperature: float) -> Level:
    """One stream at a time (see `single_rounds`)."""
    return drain(single_rounds(target, name, prompts, repeats, max_tokens, temperature))


def single_rounds(target, name: str, prompts: list[str], repeats: int,
                  max_tokens: int, temperature: float):
    """One stream at a time: `edit` (a function rewritten: the output copies much of
    the prompt), `fresh` (a function's body to write), `sampled` (temperature 1: drafts
    rarely survive), each prompt a file of its own, sent once; `repeat` sends one
    prompt `repeats` times in a row (warm on purpose). A generator that yields after
    each request (`run` runs the other targets' requests in between, so a drift of the
    machine's speed over seconds reaches every target's figure alike) and returns the
    Level, timed over its own requests."""
    samples, wall = [], 0.0
    for prompt in prompts:
        for _ in range(repeats):
            started = time.perf_counter()
            samples.append(target.complete(prompt, max_tokens,
                                           extra={**SAME_WORK, "temperature": temperature}))
            wall += time.perf_counter() - started
            yield
    return summarize(name, 1, samples, wall)


def add_arguments(parser) -> None:
    parser.add_argument("--url", action="append", default=[],
                        help="an OpenAI-compatible base URL; repeatable (default: this "
                             "server, http://127.0.0.1:PORT)")
    parser.add_argument("--model", default=None, help="model name to send (default: the "
                                                     "first of /v1/models)")
    parser.add_argument("--api-key", action="append", default=[],
                        help="the key to send; repeatable: then each part of each run "
                             "sends the next one (wrapping round), the same on every "
                             "target, so a server that keeps what it learns per key "
                             "(this one with API keys: a key's recent answers, its "
                             "recycled table, its prompt cache) starts every part cold")
    parser.add_argument("--in-process", metavar="GGUF", default=None,
                        help="also measure llama-cpp-python in this process on this model "
                             "('bundled' for the bundled one)")
    parser.add_argument("--concurrency", default="1,8",
                        help="comma-separated concurrency levels")
    parser.add_argument("--requests", type=non_negative_int, default=0,
                        help="requests per level (default: 2 × concurrency, at least 4)")
    parser.add_argument("--prompt-chars", type=int, default=400)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--fim-keystrokes", type=int, default=12,
                        help="keystrokes in the FIM replay (0: skip it)")
    parser.add_argument("--keystroke-interval", type=non_negative_seconds, default=0.15)
    parser.add_argument("--no-fim", action="store_true",
                        help="skip the FIM replay (for servers without FIM support)")
    parser.add_argument("--workloads", default="",
                        help="also: comma-separated editor workloads, one stream at a time, "
                             "--max-tokens each, every prompt a file of its own: edit (a "
                             "function rewritten), fresh (a function's body to write), "
                             "fresh1 (one such request), sampled (fresh at temperature 1), "
                             "cold (a file's first 12,000 characters, about 3,000 tokens: "
                             "a cold prefill's TTFT; --requests of each, default 6), "
                             "repeat (one edit prompt --requests times, default 3: warm on purpose), typing (see "
                             "--sessions)")
    parser.add_argument("--corpus", default=None, metavar="DIR",
                        help="Python source files to make the prompts of (default: this "
                             "interpreter's standard library); no file serves two requests")
    parser.add_argument("--seed", type=int, default=None,
                        help="shuffle the corpus this way (default: a new order each run, "
                             "printed)")
    parser.add_argument("--sessions", type=int, default=8, help="typing: users")
    parser.add_argument("--bursts", type=int, default=3, help="typing: bursts per user")
    parser.add_argument("--burst-len", type=int, default=4,
                        help="typing: keystrokes per burst")
    parser.add_argument("--keystroke-gap", type=non_negative_seconds, default=0.1,
                        help="typing: seconds between keystrokes")
    parser.add_argument("--session-header", action="store_true",
                        help="typing: send X-Session-Id (the plugins send none)")
    parser.add_argument("--session-seq", action="store_true",
                        help="typing: number each user's requests (X-Session-Seq; implies "
                             "--session-header)")
    parser.add_argument("--keep-stale", action="store_true",
                        help="typing: leave a stale keystroke's connection open instead of "
                             "closing it at once as the plugins do")
    parser.add_argument("--session-name", default=None,
                        help="typing: session ids NAME-0, NAME-1, ... (default: new ones "
                             "each run; the same NAME again is an editor restarted)")
    parser.add_argument("--typing-fim", action="store_true",
                        help="typing: send the text after the cursor as suffix (FIM)")
    parser.add_argument("--constrained", action="store_true",
                        help="also: a plain stream alone and beside a json_schema stream "
                             "(prints the slowdown; targets that take json_schema only)")
    parser.add_argument("--hostile", action="store_true",
                        help="also: a plain stream beside every costly request class the "
                             "server refuses; prints each answer and the largest gap")
    parser.add_argument("--runs", type=int, default=1,
                        help="run everything this many times, each run on files of its "
                        "own, and print each figure's median and range (machines drift "
                        "by tens of percent: compare medians)")
    parser.add_argument("--profile", action="store_true",
                        help="also: where each part's decode steps spent their time on "
                        "targets that export step counters (this server's /metrics): "
                        "rows by kind, sub-batches, sit-outs, drafts confirmed, ms "
                        "planning, decoding and sampling per step (with --json: "
                        "{\"rows\": [...], \"profiles\": [...]})")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def parts(args, target, levels: list[int], workloads: list[str], single: dict,
          salt: int, corpus: Corpus, run: int = 0) -> list[tuple[str, object]]:
    """What `run` measures on one target, in order, as (part, start) pairs: the part
    names what is measured (the same part on every target that has it: an in-process
    target has fewer); `start()` returns the part's rounds (a generator that yields
    after each round and returns its Levels, or printed lines for "hostile"). The
    streams at one concurrency and the single-stream workloads come in rounds of one
    round of streams or one request; the rest runs whole, as one round. Every prompt is
    the corpus's (bench_corpus.py): each part's files its own, the same on every
    target."""
    in_process = isinstance(target, InProcessTarget)
    out: list[tuple[str, object]] = []

    def whole(run_part):
        return lambda: at_once(run_part)

    def listed(rounds):
        return [(yield from rounds)]

    for level in levels:
        count = args.requests or max(4, 2 * level)
        prompts = corpus.prompts(f"x{level}", count,
                                 lambda text: opening(text, args.prompt_chars))
        out.append((f"x{level}", lambda level=level, prompts=prompts: listed(
            level_rounds(target, level, prompts, args.max_tokens))))
    base = corpus.prompts("extension", 1, lambda text: opening(text, args.prompt_chars))[0]
    out.append(("extension", whole(lambda: [run_extension(target, base, args.max_tokens)])))
    if args.fim_keystrokes and not args.no_fim and not in_process:
        text = corpus.files_for("fim", 1)[0]
        out.append(("fim", whole(lambda salt=salt: [run_fim_replay(
            target, args.fim_keystrokes, args.max_tokens, salt + 1,
            args.keystroke_interval, text)])))
    for workload in workloads:
        if workload in single:
            make, temperature, repeated = single[workload]
            count = 1 if repeated or workload == "fresh1" else args.requests or 6
            prompts = corpus.prompts(workload, count, make,
                                     COLD_CHARS if workload == "cold" else 0)
            repeats = (args.requests or 3) if repeated else 1
            name = f"{workload} (warm)" if repeated else workload
            out.append((workload, lambda name=name, prompts=prompts, t=temperature,
                        repeats=repeats: listed(single_rounds(
                            target, name, prompts, repeats, args.max_tokens, t))))
        elif not in_process:                   # typing
            files = corpus.files_for("typing", args.sessions)
            out.append(("typing", whole(lambda salt=salt: [run_typing(
                target, args.sessions, args.bursts, args.burst_len, args.keystroke_gap,
                args.max_tokens, salt + 3, args.session_seq, args.session_name,
                args.session_header, args.keep_stale, args.typing_fim, files)])))
    if args.hostile and not in_process:
        out.append(("hostile", whole(lambda: run_hostile(target, args.max_tokens))))
    if args.constrained and not in_process:
        plain = [corpus.prompts(f"constrained-{k}", args.requests or 4,
                                lambda text: opening(text, args.prompt_chars),
                                args.prompt_chars)
                 for k in range(1 + len(NEIGHBOURS))]
        out.append(("constrained", whole(lambda salt=salt: run_constrained(
            target, plain, args.max_tokens, salt + 2 + args.fim_keystrokes, run,
            SAME_WORK))))
    return out


class RunFiles:
    """A later run's view of the corpus: every part takes files no earlier run had."""

    def __init__(self, corpus: Corpus, run: int):
        self.corpus, self.run = corpus, run

    def files_for(self, part: str, n: int, min_chars: int = 0) -> list[str]:
        return self.corpus.files_for(f"{part}#{self.run}", n, min_chars)

    def prompts(self, part: str, n: int, make, min_chars: int = 0) -> list[str]:
        return self.corpus.prompts(f"{part}#{self.run}", n, make, min_chars)


def run_parts(args, targets, plans, profiles: list[dict], run: int,
              reused: set | None = None) -> list[dict]:
    """One run: each target's parts, part by part across the targets (the first part on
    every target, then the second...) and within a part round by round (a request, or a
    round of concurrent streams, on each target in turn, the first target rotating), so
    a machine whose speed drifts (a shared host) shifts every target's figure of a part
    alike, not one target's. Returns each target's {part: result}; with --profile,
    appends each part's step profile to `profiles`; adds to `reused` the parts that
    met a key an earlier part had sent (more parts than --api-key keys)."""
    order: list[str] = []                 # every part, in the order the targets run them
    for plan in plans:
        for name, _ in plan:
            if name not in order:
                order.append(name)
    done: list[dict] = [{} for _ in targets]
    in_process = [isinstance(t, InProcessTarget) for t in targets]
    for p_index, name in enumerate(order):
        running = [(t_index, start()) for t_index, plan in enumerate(plans)
                   for part_name, start in plan if part_name == name]
        before = {t: bench_profile.read_totals(targets[t]) for t, _ in running
                  if args.profile and not in_process[t]}
        # the first target of a part's first round rotates by part and by run: a part
        # that runs whole (typing, the FIM replay) goes first on each target in turn
        turn = run - 1 + p_index
        if len(args.api_key) > 1:         # each part of each run under a key of its own
            used = (run - 1) * len(order) + p_index
            key = args.api_key[used % len(args.api_key)]
            if used >= len(args.api_key) and reused is not None:
                reused.add(name)
            for t, _ in running:
                if not in_process[t]:
                    targets[t].api_key = key
        while running:
            first = turn % len(running)
            others = running[first + 1:] + running[:first]
            if turn // len(running) % 2:     # every other pass the others go the other
                others.reverse()             # way round: nobody always follows the same
            for t_index, rounds in [running[first]] + others:
                try:
                    next(rounds)
                except StopIteration as finished:
                    done[t_index][name] = finished.value
            running = [(t, r) for t, r in running if name not in done[t]]
            turn += 1
        for t, totals in before.items():
            if totals is not None:
                row = bench_profile.profile_row(
                    targets[t].name, name, totals, bench_profile.settled(targets[t]))
                if row is not None:
                    profiles.append({"run": run, **row} if args.runs > 1 else row)
    return done


def medians(rows: list[dict]) -> list[dict]:
    """Per target and workload over the runs: the median of each figure, and the range."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["target"], row["name"]), []).append(row)
    out = []
    for (target, name), group in groups.items():
        summary = {"target": target, "workload": name, "runs": len(group),
                   "failed": sum(r["errors"] + r["truncated"] for r in group)}
        for key in ("stream_tok_s", "aggregate_tok_s", "ttft_p50_ms", "ttft_p95_ms",
                    "first_line_p50_ms"):
            values = sorted(r[key] for r in group if r.get(key) is not None)
            if values:
                summary[key] = f"{statistics.median(values):.1f} " \
                    f"({values[0]:.1f}-{values[-1]:.1f})"
        out.append(summary)
    return out


def run(args) -> int:
    targets = []
    for url in args.url or [f"http://127.0.0.1:{args.port}"]:
        targets.append(HttpTarget(url, args.model, args.api_key[0] if args.api_key else None))
    if args.in_process:
        from dispatcher.common.models import resolve_model_path
        path = None if args.in_process == "bundled" else args.in_process
        targets.append(InProcessTarget(str(resolve_model_path(path)), 4096, None))
    try:
        levels = list(dict.fromkeys(int(c) for c in args.concurrency.split(",") if c.strip()))
    except ValueError:
        levels = [0]
    if not levels or any(level < 1 for level in levels):
        raise SystemExit("--concurrency: levels of 1 or more, e.g. 1,8")
    extra_workloads = list(dict.fromkeys(w.strip() for w in args.workloads.split(",")
                                         if w.strip()))
    # (the prompt each file makes, the temperature, whether one prompt is repeated)
    single = {"edit": (edit, 0.0, False), "fresh": (function_start, 0.0, False),
              "fresh1": (function_start, 0.0, False),
              "sampled": (function_start, 1.0, False),
              "cold": (lambda text: opening(text, COLD_CHARS), 0.0, False),
              "repeat": (edit, 0.0, True)}
    for workload in extra_workloads:
        if workload not in single and workload != "typing":
            raise SystemExit(f"unknown workload {workload!r}: edit, fresh, fresh1, "
                             "sampled, cold, repeat, typing")
    try:
        corpus = Corpus(args.corpus, args.seed)
    except CorpusError as exc:
        raise SystemExit(f"--corpus: {exc}") from None
    print(f"first-seen prompts: files of {corpus.root}, shuffled by seed {corpus.seed} "
          f"(--seed {corpus.seed} repeats this run's choice)", file=sys.stderr)
    if len(args.api_key) > 1:
        print(f"{len(args.api_key)} API keys: each part of each run sends the next one",
              file=sys.stderr)
    # a target whose parts each start cold: each under a key of its own, on a server that
    # keeps what it learns per key; the others' first-seen rows are named WARM_STATE
    cold = [not isinstance(t, InProcessTarget) and len(args.api_key) > 1 and
            t.keys_enforced() for t in targets]
    for target, cold_ in zip(targets, cold):
        if not cold_ and not isinstance(target, InProcessTarget):
            print(f"{target.name}: its first-seen rows are named '{WARM_STATE.strip()}': "
                  "its parts share what it learns (a key per part to a server started "
                  "with those keys starts each part cold: --api-key once for every part "
                  "of every run)", file=sys.stderr)
    results: list[list] = [[] for _ in targets]
    hostile_lines: list[str] = []
    profiles: list[dict] = []
    for round_ in range(max(1, args.runs)):
        view = corpus if round_ == 0 else RunFiles(corpus, round_)
        try:
            plans = [parts(args, target, levels, extra_workloads, single,
                           1000 * (t_index + 1) + int(time.time()) % 1000 * 10_000
                           + round_, view, round_)
                     for t_index, target in enumerate(targets)]
        except CorpusError as exc:
            raise SystemExit(f"--corpus: {exc}") from None
        reused: set = set()
        done = run_parts(args, targets, plans, profiles, round_ + 1, reused)
        if reused:
            print(f"run {round_ + 1}: parts {', '.join(sorted(reused))} met a key sent "
                  f"before ({len(args.api_key)} keys): named '{WARM_STATE.strip()}'",
                  file=sys.stderr)
        for t_index, plan in enumerate(plans):
            for part_name, _ in plan:
                if part_name == "hostile":
                    label = f" (run {round_ + 1})" if args.runs > 1 else ""
                    hostile_lines += [f"{targets[t_index].name}{label}:",
                                      *done[t_index]["hostile"]]
                    continue
                for level in done[t_index][part_name]:
                    if part_name in FIRST_SEEN_PARTS or part_name[1:].isdigit():
                        if (not cold[t_index] or part_name in reused) and \
                                not isinstance(targets[t_index], InProcessTarget) and \
                                "(warm" not in level.name:
                            level = replace(level, name=level.name + WARM_STATE)
                    results[t_index].append((round_ + 1, level))
    rows = [{"target": target.name, "run": run_, **asdict(result)}
            for target, levels_done in zip(targets, results) for run_, result in levels_done]
    return report(args, rows, profiles, hostile_lines)


def report(args, rows: list[dict], profiles: list[dict], hostile_lines: list[str]) -> int:
    """Print a bench's figures (a table, or JSON with --json); its exit status: 1 when a
    request failed."""
    slowdowns = constrained_slowdowns(rows)
    if args.json:
        extras = {"profiles": profiles} if args.profile else {}
        if args.constrained:
            extras["constrained"] = slowdowns
        if args.hostile:
            extras["hostile"] = hostile_lines
        print(json.dumps({"rows": rows, **extras} if extras else rows, indent=2))
    else:
        print(table(rows, runs=args.runs > 1))
        if args.runs > 1:
            print(f"\nmedians over {args.runs} runs (lowest-highest), each run on files "
                  "of its own:")
            print(bench_profile.markdown_table(medians(rows)))
        if profiles:
            print("\nstep profile (per decode step, each part on each target):")
            print(bench_profile.markdown_table(profiles))
        for target, ratios in slowdowns.items():
            for name, runs in ratios.items():
                spread = f" ({min(runs):.2f}-{max(runs):.2f} over {len(runs)} runs)" \
                    if len(runs) > 1 else ""
                print(f"  {target}: a plain stream's time per token beside a {name} "
                      f"stream = {statistics.median(runs):.2f}x beside a plain one{spread}")
        for row in rows:
            for message in row["error_samples"]:
                print(f"  {row['target']} / {row['name']}: {message}")
        for line in hostile_lines:
            print(line)
    # (a bench whose requests failed measured nothing of what it was asked: scripts and
    # CI can tell; the hostile part's refusals are its point, not failures)
    # (nor a constrained neighbour a server refuses: it is no neighbour, said above)
    failed = sum(r["errors"] + r["truncated"] for r in rows
                 if not r["name"].endswith(" beside"))
    if failed:
        print(f"{failed} request(s) failed or ended early (see the errors above)",
              file=sys.stderr)
    return 1 if failed else 0
