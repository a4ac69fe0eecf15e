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
import threading
import time
from dataclasses import asdict

from dispatcher.common.config import non_negative_seconds
from dispatcher.tools.bench_targets import (Abort, HttpTarget, InProcessTarget, Level, Sample,
                                      percentile, summarize)

CODE = '''import json
import os


class Inventory:
    """Items in stock, persisted as JSON."""

    def __init__(self, path):
        self.path = path
        self.items = {}
        if os.path.exists(path):
            with open(path) as f:
                self.items = json.load(f)

    def add(self, name, count=1):
        self.items[name] = self.items.get(name, 0) + count
        self.save()

    def remove(self, name, count=1):
        left = self.items.get(name, 0) - count
        if left <= 0:
            self.items.pop(name, None)
        else:
            self.items[name] = left
        self.save()

    def save(self):
        with open(self.path, "w") as f:
            json.dump(self.items, f, indent=2)

    def total(self):
'''


def prompt_of(chars: int, salt: int = 0) -> str:
    """A code prompt of about `chars` characters; `salt` makes prompts differ at the start
    so that no request reuses another's cached prefix unless the workload wants it."""
    text = f"# file {salt}\n" + CODE
    while len(text) < chars:
        text += CODE
    return text[:chars]


def run_level(target, concurrency: int, requests: int, prompt_chars: int, max_tokens: int,
              salt: int) -> Level:
    samples: list[Sample] = []
    lock = threading.Lock()
    counter = iter(range(requests))

    def worker():
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            sample = target.complete(prompt_of(prompt_chars, salt + i), max_tokens)
            with lock:
                samples.append(sample)

    started = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return summarize(f"stream x{concurrency}", concurrency, samples,
                     time.perf_counter() - started)


def run_extension(target, prompt_chars: int, max_tokens: int, salt: int, steps: int = 5
                  ) -> Level:
    """TTFT of a prompt that extends the previous one by a few characters (warm cache)."""
    base = prompt_of(prompt_chars, salt)
    target.complete(base, 1)                              # warm the cache
    started = time.perf_counter()
    samples = [target.complete(base + "x" * (3 * (i + 1)), max_tokens) for i in range(steps)]
    return summarize("extend prompt", 1, samples, time.perf_counter() - started)


def run_fim_replay(target, keystrokes: int, max_tokens: int, salt: int,
                   interval: float) -> Level:
    """An editor session: the prefix grows a few characters per keystroke, a request per
    keystroke, each one superseding the last (X-Session-Id)."""
    text = prompt_of(2000, salt)
    cut = len(text) // 2
    suffix = "\n        return sum(self.items.values())\n"
    probe = target.complete(text[:cut], 1, suffix=suffix)
    if probe.error and "fim_unsupported" in probe.error or \
            probe.error and "suffix" in probe.error:
        suffix = None              # a model without FIM tokens: the prefix alone grows
    session = f"bench-{salt}"
    samples: list[Sample] = []
    threads = []
    lock = threading.Lock()

    def fire(prefix):
        sample = target.complete(prefix, max_tokens, suffix=suffix, session=session)
        with lock:
            samples.append(sample)

    started = time.perf_counter()
    for i in range(keystrokes):
        t = threading.Thread(target=fire, args=(text[:cut + 3 * i],))
        t.start()
        threads.append(t)
        time.sleep(interval)
    for t in threads:
        t.join()
    return summarize("FIM keystrokes", 1, samples, time.perf_counter() - started)


COLUMNS = [("target", "target", "{}"), ("workload", "name", "{}"),
           ("reqs", "requests", "{}"), ("ok", "ok", "{}"), ("err", "errors", "{}"),
           ("trunc", "truncated", "{}"), ("supers", "superseded", "{}"),
           ("TTFT p50 ms", "ttft_p50_ms", "{:.1f}"), ("TTFT p95 ms", "ttft_p95_ms", "{:.1f}"),
           ("ITL ms", "itl_ms", "{:.1f}"), ("stream tok/s", "stream_tok_s", "{:.1f}"),
           ("aggregate tok/s", "aggregate_tok_s", "{:.1f}"),
           ("1st line p50 ms", "first_line_p50_ms", "{:.1f}"),
           ("1st line p95 ms", "first_line_p95_ms", "{:.1f}"),
           ("unanswered", "unanswered", "{}"), ("closed", "closed", "{}")]


def table(rows: list[dict]) -> str:
    cells = [[title for title, _, _ in COLUMNS]]
    for row in rows:
        cells.append([("-" if row.get(key) is None else fmt.format(row[key]))
                      for _, key, fmt in COLUMNS])
    widths = [max(len(r[i]) for r in cells) for i in range(len(COLUMNS))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


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


def run_constrained(target, requests: int, prompt_chars: int, max_tokens: int,
                    salt: int) -> list[Level]:
    """A plain stream's speed alone, then with a plain, a json_schema and a fighting-
    grammar stream running beside it the whole time: grammar sampling must not slow the
    rest of the batch more than another plain stream does."""
    def plain_run(name: str, offset: int) -> Level:
        samples, started = [], time.perf_counter()
        for i in range(requests):
            samples.append(target.complete(prompt_of(prompt_chars, salt + offset + i),
                                           max_tokens))
        return summarize(name, 1, samples, time.perf_counter() - started)

    levels = [plain_run("plain alone", 0)]
    for k, (name, (prompt, extra)) in enumerate(NEIGHBOURS.items(), start=1):
        stop = threading.Event()
        beside: list[Sample] = []

        def neighbour():
            i = 0
            while not stop.is_set():
                beside.append(target.complete(prompt(salt + i), max_tokens, extra=extra))
                i += 1

        thread = threading.Thread(target=neighbour, daemon=True)
        started = time.perf_counter()
        thread.start()
        time.sleep(0.5)                 # the neighbour is decoding by now
        levels.append(plain_run(f"plain + {name}", requests * k))
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


EDIT_SOURCE = "".join(
    f"def handler_{i}(request):\n    value = request.get('field_{i}')\n"
    f"    if value is None:\n        return error('missing field_{i}')\n"
    f"    return respond(value * {i})\n\n\n" for i in range(12))


# `fresh`: new code, each prompt asked `requests` times in a row (an editor asks for
# nearly the same completion again and again). Several prompts, because whether a
# repeat drafts the earlier answer whole turns on near-ties in the greedy text that a
# draft's batched rows flip one way or the other: one prompt measures one coin.
FRESH_PROMPTS = ("def merge_sorted(left, right):\n", "class LRUCache:\n",
                 "def parse_args(argv):\n", "import os\n\ndef walk_files(root):\n",
                 "function debounce(fn, ms) {\n", "def fibonacci(n):\n")


def run_single(target, name: str, prompts: tuple[str, ...], requests: int,
               max_tokens: int, temperature: float) -> Level:
    """One stream at a time: `edit` (the output copies much of the prompt), `fresh`
    (new code), `sampled` (temperature 1: drafts rarely survive); each prompt
    `requests` times in a row."""
    samples, started = [], time.perf_counter()
    for prompt in prompts:
        for _ in range(requests):
            samples.append(target.complete(prompt, max_tokens,
                                           extra={"temperature": temperature,
                                                  "ignore_eos": True}))
    return summarize(name, 1, samples, time.perf_counter() - started)


def run_typing(target, sessions: int, bursts: int, burst_len: int, gap: float,
               max_tokens: int, salt: int, session_seq: bool = False,
               session_name: str | None = None, header: bool = False,
               keep_stale: bool = False, fim: bool = False) -> Level:
    """Editors typing: `sessions` users, each typing bursts of `burst_len` keystrokes
    `gap` s apart into its own ~400-token file, one request per keystroke, a pause after
    each burst. As the plugins do (../shared/notes/editor-clients.md), each keystroke
    closes the previous keystroke's connection at once and no session header is sent;
    `keep_stale` leaves it open instead (a client that has not read anything yet), and
    `header` sends X-Session-Id (`session_seq`: and X-Session-Seq, the user's count);
    `fim` sends the text after the cursor as `suffix` (servers with FIM only).

    Reports, for the request the user waits for (the last of each burst): TTFT, time to
    the end of the first line (p50 and p95), and how many never showed a suggestion
    (`unanswered`); `closed` counts the stale requests closed."""
    waited: list[Sample] = []
    closed = 0
    lock = threading.Lock()
    name = session_name or f"typing-{salt}"
    header = header or session_seq

    def user(u: int) -> None:
        nonlocal closed
        text = prompt_of(1600, salt + u)
        cursor = len(text) // 2
        count = 0
        for b in range(bursts):
            threads, results, aborts = [], {}, []
            for k in range(burst_len):
                cursor += 2
                count += 1
                prefix = text[:cursor] + "\n    "
                if aborts and not keep_stale:
                    aborts[-1].close()            # the plugin drops the stale request
                abort = Abort()
                aborts.append(abort)

                def fire(key=k, prefix=prefix, seq=count if session_seq else None,
                         abort=abort, suffix=text[cursor:cursor + 200] if fim else None):
                    results[key] = target.complete(
                        prefix, max_tokens, suffix=suffix,
                        session=f"{name}-{u}" if header else None, seq=seq, abort=abort)
                thread = threading.Thread(target=fire)
                thread.start()
                threads.append(thread)
                time.sleep(gap)
            for thread in threads:
                thread.join()
            with lock:
                waited.append(results[burst_len - 1])
                closed += sum(1 for r in results.values() if r.closed)
            time.sleep(gap * 3)

    started = time.perf_counter()
    users = [threading.Thread(target=user, args=(u,)) for u in range(sessions)]
    for thread in users:
        thread.start()
    for thread in users:
        thread.join()
    mode = ("stale kept open" if keep_stale else "plugin-like") + \
        (", FIM" if fim else "") + \
        (", X-Session-Seq" if session_seq else ", X-Session-Id" if header else "")
    level = summarize(f"typing ({mode})", sessions, waited, time.perf_counter() - started)
    lines = [s.first_line * 1000 for s in waited if s.ok and s.first_line is not None]
    level.first_line_p50_ms = percentile(lines, 0.5)
    level.first_line_p95_ms = percentile(lines, 0.95)
    level.unanswered = sum(1 for s in waited if not s.ok)
    level.closed = closed
    return level


def add_arguments(parser) -> None:
    parser.add_argument("--url", action="append", default=[],
                        help="an OpenAI-compatible base URL; repeatable (default: this "
                             "server, http://127.0.0.1:PORT)")
    parser.add_argument("--model", default=None, help="model name to send (default: the "
                                                     "first of /v1/models)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--in-process", metavar="GGUF", default=None,
                        help="also measure llama-cpp-python in this process on this model "
                             "('bundled' for the bundled one)")
    parser.add_argument("--concurrency", default="1,8",
                        help="comma-separated concurrency levels")
    parser.add_argument("--requests", type=int, default=0,
                        help="requests per level (default: 2 × concurrency, at least 4)")
    parser.add_argument("--prompt-chars", type=int, default=400)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--fim-keystrokes", type=int, default=12,
                        help="keystrokes in the FIM replay (0: skip it)")
    parser.add_argument("--keystroke-interval", type=non_negative_seconds, default=0.15)
    parser.add_argument("--no-fim", action="store_true",
                        help="skip the FIM replay (for servers without FIM support)")
    parser.add_argument("--workloads", default="",
                        help="also: comma-separated editor workloads: edit, fresh (six prompts), "
                             "fresh1 (the first of them only), sampled (one stream, "
                             "--max-tokens each, each prompt --requests times, default "
                             "3), typing (see --sessions)")
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
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def constrained_slowdowns(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Per target: the plain stream's ITL beside each constrained neighbour, over its ITL
    beside a plain one (the cost of the constraint, not of sharing the batch)."""
    out = {}
    for target in {r["target"] for r in rows}:
        itl = {r["name"]: r["itl_ms"] for r in rows if r["target"] == target}
        base = itl.get("plain + plain")
        if base:
            out[target] = {name: itl[f"plain + {name}"] / base for name in NEIGHBOURS
                           if name != "plain" and itl.get(f"plain + {name}")}
    return out


def parts(args, target, levels: list[int], workloads: list[str], single: dict,
          salt: int) -> list[tuple[str, object]]:
    """What `run` measures on one target, in order, as (part, callable) pairs: the part
    names what is measured (the same part on every target that has it: an in-process
    target has fewer); each callable returns its Levels, or printed lines for
    "hostile"."""
    in_process = isinstance(target, InProcessTarget)
    out: list[tuple[str, object]] = []
    for level in levels:
        if in_process and level > 1:
            continue                           # one Llama runs one request at a time
        count = args.requests or max(4, 2 * level)
        out.append((f"x{level}", lambda level=level, count=count, salt=salt: [run_level(
            target, level, count, args.prompt_chars, args.max_tokens, salt)]))
        salt += count + 1
    out.append(("extension", lambda salt=salt: [run_extension(
        target, args.prompt_chars, args.max_tokens, salt)]))
    if args.fim_keystrokes and not args.no_fim and not in_process:
        out.append(("fim", lambda salt=salt: [run_fim_replay(
            target, args.fim_keystrokes, args.max_tokens, salt + 1,
            args.keystroke_interval)]))
    for workload in workloads:
        if workload in single:
            prompts, temperature = single[workload]
            out.append((workload, lambda w=workload, prompts=prompts, t=temperature: [
                run_single(target, w, prompts, args.requests or 3, args.max_tokens, t)]))
        elif not in_process:                   # typing
            out.append(("typing", lambda salt=salt: [run_typing(
                target, args.sessions, args.bursts, args.burst_len, args.keystroke_gap,
                args.max_tokens, salt + 3, args.session_seq, args.session_name,
                args.session_header, args.keep_stale, args.typing_fim)]))
    if args.hostile and not in_process:
        out.append(("hostile", lambda: run_hostile(target, args.max_tokens)))
    if args.constrained and not in_process:
        out.append(("constrained", lambda salt=salt: run_constrained(
            target, args.requests or 4, args.prompt_chars, args.max_tokens,
            salt + 2 + args.fim_keystrokes)))
    return out


def run(args) -> int:
    targets = []
    for url in args.url or [f"http://127.0.0.1:{args.port}"]:
        targets.append(HttpTarget(url, args.model, args.api_key))
    if args.in_process:
        from dispatcher.common.models import resolve_model_path
        path = None if args.in_process == "bundled" else args.in_process
        targets.append(InProcessTarget(str(resolve_model_path(path)), 4096, None))
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    extra_workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    single = {"edit": ((EDIT_SOURCE + "def handler_12(request):\n",), 0.0),
              "fresh": (FRESH_PROMPTS, 0.0),
              "fresh1": (FRESH_PROMPTS[:1], 0.0),
              "sampled": (FRESH_PROMPTS[:1], 1.0)}
    for workload in extra_workloads:
        if workload not in single and workload != "typing":
            raise SystemExit(f"unknown workload {workload!r}: edit, fresh, fresh1, "
                             "sampled, typing")
    # Each target's parts, in order; run part by part across the targets (the first part
    # on every target, then the second...), so a machine whose speed drifts over minutes
    # (a shared host) shifts every target's figure of a part alike, not one target's.
    plans = [parts(args, target, levels, extra_workloads, single,
                   1000 * (t_index + 1) + int(time.time()) % 1000 * 10_000)
             for t_index, target in enumerate(targets)]
    order: list[str] = []                 # every part, in the order the targets run them
    for plan in plans:
        for name, _ in plan:
            if name not in order:
                order.append(name)
    results: list[list] = [[] for _ in targets]
    hostile: list[list[str]] = [[] for _ in targets]
    for name in order:
        for t_index, (target, plan) in enumerate(zip(targets, plans)):
            for part_name, part in plan:
                if part_name != name:
                    continue
                if name == "hostile":
                    hostile[t_index] = [f"{target.name}:"] + part()
                else:
                    results[t_index] += part()
    rows = [{"target": target.name, **asdict(result)}
            for target, done in zip(targets, results) for result in done]
    hostile_lines = [line for lines in hostile for line in lines]
    slowdowns = constrained_slowdowns(rows)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(table(rows))
        for target, ratios in slowdowns.items():
            for name, ratio in ratios.items():
                print(f"  {target}: a plain stream's time per token beside a {name} "
                      f"stream = {ratio:.2f}x beside a plain one")
        for row in rows:
            for message in row["error_samples"]:
                print(f"  {row['target']} / {row['name']}: {message}")
        for line in hostile_lines:
            print(line)
    return 0
