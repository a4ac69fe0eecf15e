"""What `python -m dispatcher bench` measures: an OpenAI-compatible server over raw
streaming HTTP, or llama-cpp-python's `Llama` in this process; one `Sample` a request,
summed up per workload in a `Level`."""
from __future__ import annotations

import http.client
import json
import socket
import statistics
import threading
import time
import urllib.parse
from dataclasses import dataclass, field


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
    first_line: float | None = None  # seconds to the end of the first line (a newline)
    max_gap: float = 0.0            # the longest wait between two texts, seconds
    closed: bool = False            # the client closed it (a newer keystroke came)


class Abort:
    """Lets another thread close a request's connection at once, as an editor plugin
    does with the previous keystroke's request (llama.vim's jobstop, Continue's abort)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.conn: http.client.HTTPConnection | None = None
        self.closed = False

    def attach(self, conn: http.client.HTTPConnection) -> None:
        with self.lock:
            self.conn = conn
            if self.closed:
                self._shut()

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self._shut()

    def _shut(self) -> None:
        sock = self.conn.sock if self.conn is not None else None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


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
    first_line_p50_ms: float | None = None
    first_line_p95_ms: float | None = None
    unanswered: int | None = None   # typing: requests the user waited for and never saw
    empty: int | None = None        # typing: ... answered with no text (nothing shown)
    closed: int | None = None       # typing: stale requests the client closed at once
    error_samples: list[str] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile, linear between the two nearest ranks (numpy's default: p50 is
    the median; it was the nearest rank, rounded half to even, so p50 of an even count
    was the lower or the upper middle value by turns)."""
    if not values:
        return None
    values = sorted(values)
    position = min(len(values) - 1.0, max(0.0, q * (len(values) - 1)))
    below = int(position)
    above = min(below + 1, len(values) - 1)
    return values[below] + (values[above] - values[below]) * (position - below)


def summarize(name: str, concurrency: int, samples: list[Sample], wall: float) -> Level:
    level = Level(name, concurrency, requests=len(samples), wall_s=round(wall, 3))
    good = [s for s in samples if s.ok]
    level.ok = len(good)
    # (a stream cut short by an error counts once, as truncated)
    level.errors = sum(1 for s in samples if s.error and not s.superseded
                       and not s.truncated)
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
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise SystemExit(f"--url {url}: an http:// or https:// URL, e.g. "
                             "http://127.0.0.1:8080")
        # (https spoken as https: its key went in clear to port 80)
        self.connection = http.client.HTTPSConnection if parsed.scheme == "https" \
            else http.client.HTTPConnection
        self.host = parsed.hostname
        self.port = parsed.port or (443 if parsed.scheme == "https" else 80)
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
        conn = self.connection(self.host, self.port, timeout=30)
        try:
            conn.request("GET", self.base + "/models", headers=self._headers())
            data = json.loads(conn.getresponse().read())["data"]
            return data[0]["id"] if data else None
        except (OSError, ValueError, KeyError, IndexError):
            return None
        finally:
            conn.close()

    def keys_enforced(self) -> bool:
        """Whether the server refuses a request that sends no key (401): one that does
        keeps what it learns per key (this server with keys: its drafting history, the
        recycled table, the prompt cache), so a part under a key of its own starts cold;
        one that does not (llama-server started without keys) ignores the keys."""
        conn = self.connection(self.host, self.port, timeout=30)
        try:
            conn.request("GET", self.base + "/models")
            resp = conn.getresponse()
            resp.read()
            return resp.status == 401
        except (OSError, http.client.HTTPException):
            return False
        finally:
            conn.close()

    def get_root(self, path: str, timeout: float = 30) -> tuple[int, bytes]:
        """GET a path of the server's root (not under /v1), e.g. /metrics."""
        conn = self.connection(self.host, self.port, timeout=timeout)
        try:
            conn.request("GET", self.base[:-len("/v1")] + path, headers=self._headers())
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def post_raw(self, body: bytes, timeout: float = 120,
                 path: str | None = None) -> tuple[int, bytes]:
        """POST these bytes to the completions route (or `path`): (status, answer)."""
        conn = self.connection(self.host, self.port, timeout=timeout)
        try:
            conn.request("POST", path or self.base + "/completions", body,
                         self._headers({"Content-Type": "application/json"}))
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def complete(self, prompt: str, max_tokens: int, suffix: str | None = None,
                 session: str | None = None, timeout: float = 600,
                 extra: dict | None = None, seq: int | None = None,
                 abort: Abort | None = None) -> Sample:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
        if self.model:
            body["model"] = self.model
        if suffix is not None:
            body["suffix"] = suffix
        session_headers = {"X-Session-Id": session} if session else {}
        if session and seq is not None:
            session_headers["X-Session-Seq"] = str(seq)
        headers = self._headers(session_headers or None)
        sample = Sample()
        started = time.perf_counter()
        conn = self.connection(self.host, self.port, timeout=timeout)
        try:
            if abort is not None:
                conn.connect()
                abort.attach(conn)
            conn.request("POST", self.base + "/completions", json.dumps(body), headers)
            resp = conn.getresponse()
            if resp.status != 200:
                payload = resp.read()[:300].decode(errors="replace")
                sample.superseded = resp.status == 409
                sample.error = f"HTTP {resp.status}: {payload}"
                return sample
            self._read_stream(resp, sample, started)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            sample.error = f"{type(exc).__name__}: {exc}"
            sample.truncated = sample.ttft is not None
        finally:
            conn.close()
        if abort is not None and abort.closed and not sample.ok:
            sample.closed, sample.error, sample.truncated = True, None, False
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
                error = event["error"] if isinstance(event["error"], dict) else \
                    {"message": event["error"]}     # (a server's own shape: a string)
                sample.error = str(error.get("message"))[:200]
                sample.superseded = error.get("code") == "superseded"
                return
            if event.get("usage"):
                usage_tokens = event["usage"].get("completion_tokens")
            for choice in event.get("choices") or []:
                now = time.perf_counter()
                if choice.get("text"):
                    chunks += 1
                    if sample.ttft is None:
                        sample.ttft = now - started
                    else:
                        sample.max_gap = max(sample.max_gap, now - last_text)
                    if sample.first_line is None and "\n" in choice["text"]:
                        sample.first_line = now - started
                    last_text = now
                if choice.get("finish_reason"):
                    sample.finish_reason = choice["finish_reason"]
        sample.tokens = usage_tokens if usage_tokens is not None else chunks
        if sample.ttft is not None:
            sample.decode_s = last_text - started - sample.ttft
            if sample.first_line is None and done:   # an answer of one line: all of it
                sample.first_line = last_text - started
        sample.truncated = not done or sample.finish_reason is None
        sample.ok = not sample.truncated and sample.error is None


class InProcessTarget:
    """llama-cpp-python's `Llama` in this process, one request at a time; a round of
    concurrent streams through its batch API with no server work at all
    (`reference.BatchedGreedy`: the kernels' figure for that many streams)."""

    def __init__(self, model_path: str, n_ctx: int, n_threads: int | None):
        import os

        from dispatcher.tools.reference import reference_llama
        self.name = "llama-cpp-python in-process"
        self.n_ctx = n_ctx
        self.n_threads = n_threads or len(os.sched_getaffinity(0))
        self.llm = reference_llama(model_path, n_ctx, self.n_threads)
        self.lock = threading.Lock()
        self.batched = None
        self.end_ban = None             # `ignore_eos` (reference.end_ban), made once

    def make_room(self, streams: int) -> None:
        """A context for rounds of `streams` (made before a round is timed: llama.cpp
        clears a KV cache of every sequence's context when it makes one)."""
        from dispatcher.tools.reference import BatchedGreedy
        with self.lock:
            if self.batched is None or self.batched.sequences < streams:
                old, self.batched = self.batched, None
                if old is not None:
                    old.close()
                self.batched = BatchedGreedy(self.llm, streams, self.n_ctx, self.n_threads)

    def complete_round(self, prompts: list[str], max_tokens: int,
                       ignore_eos: bool = False) -> list[Sample]:
        """Greedy streams of `prompts` started together, decoded as one batch a step."""
        self.make_room(len(prompts))
        with self.lock:
            streams = self.batched.round(prompts, max_tokens, ignore_eos)
        return [Sample(ok=True, ttft=s.ttft, tokens=len(s.ids), decode_s=s.decode_s,
                       finish_reason=s.finish_reason) for s in streams]

    def complete(self, prompt: str, max_tokens: int, suffix: str | None = None,
                 session: str | None = None, timeout: float = 600,
                 extra: dict | None = None) -> Sample:
        extra = extra or {}
        # the samplers as the HTTP targets are sent them (the library's own defaults
        # differ: top_k 40, top_p 0.95, min_p 0.05), and `ignore_eos` as a ban
        sampling = {key: extra[key] for key in ("top_k", "top_p", "min_p") if key in extra}
        if extra.get("ignore_eos"):
            from dispatcher.tools.reference import end_ban
            if self.end_ban is None:
                self.end_ban = end_ban(self.llm)
            sampling["logits_processor"] = self.end_ban
        sample = Sample()
        with self.lock:
            started = time.perf_counter()
            last = started
            for chunk in self.llm.create_completion(
                    prompt, max_tokens=max_tokens, stream=True,
                    temperature=float(extra.get("temperature", 0)), **sampling):
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
