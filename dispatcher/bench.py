"""`python -m dispatcher bench`: a load generator for any OpenAI-compatible server.

Streams completions at several concurrency levels and replays an editor's
fill-in-the-middle keystrokes (a prompt growing a few characters per request, each
superseding the last), then prints TTFT p50/p95, inter-token latency, per-stream decode
rate, aggregate rate, errors and truncated streams. `--in-process` measures
llama-cpp-python in this process on the same workloads: the library's own speed, the
ceiling for any server built on it.
"""
from __future__ import annotations

import http.client
import json
import statistics
import threading
import time
import urllib.parse
from dataclasses import asdict, dataclass, field

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


@dataclass
class Sample:
    ok: bool = False
    truncated: bool = False
    superseded: bool = False
    error: str | None = None
    ttft: float | None = None       # seconds to the first text
    tokens: int = 0
    decode_s: float = 0.0           # first text to last text
    finish_reason: str | None = None


@dataclass
class Level:
    name: str
    concurrency: int
    requests: int = 0
    ok: int = 0
    errors: int = 0
    truncated: int = 0
    superseded: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    ttft_p50_ms: float | None = None
    ttft_p95_ms: float | None = None
    itl_ms: float | None = None
    stream_tok_s: float | None = None
    aggregate_tok_s: float | None = None
    error_samples: list[str] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    index = min(len(values) - 1, max(0, round(q * (len(values) - 1))))
    return values[index]


def summarize(name: str, concurrency: int, samples: list[Sample], wall: float) -> Level:
    level = Level(name, concurrency, requests=len(samples), wall_s=round(wall, 3))
    good = [s for s in samples if s.ok]
    level.ok = len(good)
    level.errors = sum(1 for s in samples if s.error and not s.superseded)
    level.truncated = sum(1 for s in samples if s.truncated)
    level.superseded = sum(1 for s in samples if s.superseded)
    level.tokens = sum(s.tokens for s in good)
    level.error_samples = sorted({s.error for s in samples if s.error})[:3]
    ttfts = [s.ttft * 1000 for s in good if s.ttft is not None]
    level.ttft_p50_ms, level.ttft_p95_ms = percentile(ttfts, 0.5), percentile(ttfts, 0.95)
    decoding = [s for s in good if s.tokens > 1 and s.decode_s > 0]
    if decoding:
        level.itl_ms = statistics.median(s.decode_s / (s.tokens - 1) * 1000 for s in decoding)
        level.stream_tok_s = statistics.median((s.tokens - 1) / s.decode_s for s in decoding)
    if wall > 0:
        level.aggregate_tok_s = level.tokens / wall
    return level


class HttpTarget:
    """An OpenAI-compatible server, driven with raw streaming HTTP."""

    def __init__(self, url: str, model: str | None, api_key: str | None = None):
        parsed = urllib.parse.urlparse(url)
        self.host, self.port = parsed.hostname, parsed.port or 80
        self.base = parsed.path.rstrip("/")
        if not self.base.endswith("/v1"):
            self.base += "/v1"
        self.api_key = api_key
        self.name = url
        self.model = model or self._first_model()

    def _headers(self, extra: dict | None = None) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        headers.update(extra or {})
        return headers

    def _first_model(self) -> str | None:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        try:
            conn.request("GET", self.base + "/models", headers=self._headers())
            data = json.loads(conn.getresponse().read())["data"]
            return data[0]["id"] if data else None
        except (OSError, ValueError, KeyError, IndexError):
            return None
        finally:
            conn.close()

    def complete(self, prompt: str, max_tokens: int, suffix: str | None = None,
                 session: str | None = None, timeout: float = 600,
                 extra: dict | None = None) -> Sample:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
        if self.model:
            body["model"] = self.model
        if suffix is not None:
            body["suffix"] = suffix
        headers = self._headers({"X-Session-Id": session} if session else None)
        sample = Sample()
        started = time.perf_counter()
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            conn.request("POST", self.base + "/completions", json.dumps(body), headers)
            resp = conn.getresponse()
            if resp.status != 200:
                payload = resp.read()[:300].decode(errors="replace")
                sample.superseded = resp.status == 409
                sample.error = f"HTTP {resp.status}: {payload}"
                return sample
            self._read_stream(resp, sample, started)
        except (OSError, http.client.HTTPException) as exc:
            sample.error = f"{type(exc).__name__}: {exc}"
            sample.truncated = sample.ttft is not None
        finally:
            conn.close()
        return sample

    @staticmethod
    def _read_stream(resp, sample: Sample, started: float) -> None:
        chunks = last_text = 0
        usage_tokens = None
        done = False
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                sample.error = str(event["error"].get("message"))[:200]
                sample.superseded = event["error"].get("code") == "superseded"
                return
            if event.get("usage"):
                usage_tokens = event["usage"].get("completion_tokens")
            for choice in event.get("choices") or []:
                now = time.perf_counter()
                if choice.get("text"):
                    chunks += 1
                    if sample.ttft is None:
                        sample.ttft = now - started
                    last_text = now
                if choice.get("finish_reason"):
                    sample.finish_reason = choice["finish_reason"]
        sample.tokens = usage_tokens if usage_tokens is not None else chunks
        if sample.ttft is not None:
            sample.decode_s = last_text - started - sample.ttft
        sample.truncated = not done or sample.finish_reason is None
        sample.ok = not sample.truncated and sample.error is None


class InProcessTarget:
    """llama-cpp-python's `Llama` in this process, one request at a time."""

    def __init__(self, model_path: str, n_ctx: int, n_threads: int | None):
        from llama_cpp import Llama
        import os
        self.name = "llama-cpp-python in-process"
        from workers.engine import llama_loads_like_workers
        with llama_loads_like_workers():
            self.llm = Llama(model_path, n_ctx=n_ctx, n_batch=512, flash_attn=True,
                             n_threads=n_threads or len(os.sched_getaffinity(0)),
                             verbose=False)
        self.lock = threading.Lock()

    def complete(self, prompt: str, max_tokens: int, suffix: str | None = None,
                 session: str | None = None, timeout: float = 600) -> Sample:
        sample = Sample()
        with self.lock:
            started = time.perf_counter()
            last = started
            for chunk in self.llm.create_completion(prompt, max_tokens=max_tokens,
                                                    temperature=0, stream=True):
                choice = chunk["choices"][0]
                now = time.perf_counter()
                if choice["text"]:
                    if sample.ttft is None:
                        sample.ttft = now - started
                    last = now
                    sample.tokens += 1
                sample.finish_reason = choice.get("finish_reason") or sample.finish_reason
        if sample.ttft is not None:
            sample.decode_s = last - started - sample.ttft
        sample.ok = True
        return sample


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
           ("aggregate tok/s", "aggregate_tok_s", "{:.1f}")]


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


def run_constrained(target, requests: int, prompt_chars: int, max_tokens: int,
                    salt: int) -> list[Level]:
    """A plain stream's speed alone, then with one json_schema stream running beside it
    the whole time: grammar sampling must not slow the rest of the batch."""
    def plain_run(name: str, offset: int) -> Level:
        samples, started = [], time.perf_counter()
        for i in range(requests):
            samples.append(target.complete(prompt_of(prompt_chars, salt + offset + i),
                                           max_tokens))
        return summarize(name, 1, samples, time.perf_counter() - started)

    alone = plain_run("plain alone", 0)
    stop = threading.Event()
    constrained: list[Sample] = []

    def beside():
        i = 0
        while not stop.is_set():
            constrained.append(target.complete(
                f"Person {salt + i}, described as JSON:", max_tokens,
                extra={"json_schema": BENCH_SCHEMA}))
            i += 1

    thread = threading.Thread(target=beside, daemon=True)
    started = time.perf_counter()
    thread.start()
    time.sleep(0.5)                     # the constrained stream is decoding by now
    with_grammar = plain_run("plain + json_schema", requests)
    stop.set()
    thread.join(timeout=600)
    return [alone, with_grammar, summarize("json_schema beside", 1, constrained,
                                           time.perf_counter() - started)]


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
    parser.add_argument("--keystroke-interval", type=float, default=0.15)
    parser.add_argument("--no-fim", action="store_true",
                        help="skip the FIM replay (for servers without FIM support)")
    parser.add_argument("--constrained", action="store_true",
                        help="also: a plain stream alone and beside a json_schema stream "
                             "(prints the slowdown; targets that take json_schema only)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def constrained_slowdowns(rows: list[dict]) -> dict[str, float]:
    """Per target: ITL of the plain stream beside the json_schema one / alone."""
    out = {}
    for target in {r["target"] for r in rows}:
        itl = {r["name"]: r["itl_ms"] for r in rows if r["target"] == target}
        if itl.get("plain alone") and itl.get("plain + json_schema"):
            out[target] = itl["plain + json_schema"] / itl["plain alone"]
    return out


def run(args) -> int:
    targets = []
    for url in args.url or [f"http://127.0.0.1:{args.port}"]:
        targets.append(HttpTarget(url, args.model, args.api_key))
    if args.in_process:
        from dispatcher.models import resolve_model_path
        path = None if args.in_process == "bundled" else args.in_process
        targets.append(InProcessTarget(str(resolve_model_path(path)), 4096, None))
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    rows = []
    for t_index, target in enumerate(targets):
        salt = 1000 * (t_index + 1) + int(time.time()) % 1000 * 10_000
        in_process = isinstance(target, InProcessTarget)
        results = []
        for level in levels:
            if in_process and level > 1:
                continue                       # one Llama runs one request at a time
            count = args.requests or max(4, 2 * level)
            results.append(run_level(target, level, count, args.prompt_chars,
                                     args.max_tokens, salt))
            salt += count + 1
        results.append(run_extension(target, args.prompt_chars, args.max_tokens, salt))
        if args.fim_keystrokes and not args.no_fim and not in_process:
            results.append(run_fim_replay(target, args.fim_keystrokes, args.max_tokens,
                                          salt + 1, args.keystroke_interval))
        if args.constrained and not in_process:
            results += run_constrained(target, args.requests or 4, args.prompt_chars,
                                       args.max_tokens, salt + 2 + args.fim_keystrokes)
        for result in results:
            rows.append({"target": target.name, **asdict(result)})
    slowdowns = constrained_slowdowns(rows)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(table(rows))
        for target, ratio in slowdowns.items():
            print(f"  {target}: a plain stream's time per token beside a json_schema "
                  f"stream = {ratio:.2f}x alone")
        for row in rows:
            for message in row["error_samples"]:
                print(f"  {row['target']} / {row['name']}: {message}")
    return 0
