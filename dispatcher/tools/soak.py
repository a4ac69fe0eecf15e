"""`python -m dispatcher soak`: a bounded chaos run of the whole stack on loopback.

Starts its own server (loopback only), sends a mix of valid and invalid requests at a
fixed rate, drops some streams half-way as a leaving client would, SIGKILLs a worker
every so often, and classifies every outcome:

    completed      a well-formed answer (streams: every choice finished, then [DONE])
    clean_error    an error in OpenAI's envelope (or an error event, then [DONE])
    disconnected   streams this tool dropped on purpose
    lost           no answer, a cut-off stream, a 500, an error without the envelope
    garbled        malformed JSON or shape, bad input accepted, wrong text (fake engine)

Lost and garbled must be 0 (exit status 1 otherwise). Resident memory of the dispatcher,
the front ends and the workers is reported before and after.
"""
from __future__ import annotations

import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass

from dispatcher.common import config
from dispatcher.tools.ctl import control_request, default_dispatcher_address

INVALID_BODIES = [
    b'{"prompt": "x", "temperature": "hot"}', b'{"prompt": []}', b'{"prompt": NaN}',
    b'{"prompt": "x", "max_tokens": 1e400}', b"[" * 5000 + b"]" * 5000, b"\xff\xfe\x00",
    b'{"prompt": "x", "no_such_field": 1}', b'{"model": "no-such-model", "prompt": "x"}',
    b'{"prompt": "x", "best_of": 2, "stream": true}', b'{"prompt": [1, -1]}', b"null",
    b'{"prompt": "x", "logit_bias": {"a": 1}}', b'{"prompt": "x", "stop": 5}',
    # lone UTF-16 surrogates: valid JSON, not text (they used to kill workers)
    b'{"prompt": "a\\ud800b"}', b'{"prompt": ["fine", "\\udfff"]}',
    b'{"prompt": "x", "suffix": "\\ud800"}',
    b'{"prompt": "x", "grammar": "root ::= \\"\\ud834\\""}',
    b'{"prompt": "x", "json_schema": {"enum": ["\\udc00"]}}', b'{"prompt": [5, "\\ud800"]}',
]
def _chain(n: int) -> str:
    return "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(n)) + \
        f'r{n} ::= "x"\n'


# Valid JSON whose cost is refused before it runs (each once crashed, wedged or bloated a
# worker or stalled a loop): must be a clean 4xx every time.
COSTLY_BODIES = [json.dumps(body).encode() for body in [
    {"prompt": "x", "grammar": _chain(5_000)},
    {"prompt": "x", "grammar": 'root ::= "' + "a" * 20_000 + '"{2000}'},
    {"prompt": "x", "grammar": "root ::= r0\n" + "".join(
        f"r{i} ::= r{i + 1} | r{i + 1}\n" for i in range(40)) + 'r40 ::= "x"\n'},
    {"prompt": "x", "grammar": 'root ::= "a"{3,1}'},
    {"prompt": "x", "grammar": "root ::= [\\U0010FFFF-\\x00]"},
    {"prompt": "x", "grammar": "root ::= <[999999]>"},
    {"prompt": "x", "samplers": ["infill"], "top_k": 40},
    {"prompt": "x", "samplers": ["top_k", "infill"], "top_k": 0},
    {"prompt": "x" * 300_000, "n": 16, "max_tokens": 1},
]] + [b'{"prompt": "x", "junk": [' + b"[]," * 150_000 + b"[]]}"]
# Valid but odd content that reaches the workers: special-token text, NUL,
# noncharacters, token ids at the vocabulary's edges, windows at their largest.
ODD_TEXT = ["<bos>", "<eos>", "<start_of_turn>", "<pad>", "\x00", "\ufffe", "\uffff",
            "\U0010ffff", "\u202e", "東京", "\U0001f600", "\r\n"]


@dataclass
class Outcome:
    kind: str
    detail: str = ""          # for a clean error: its code


def _rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


class Soak:
    def __init__(self, args):
        self.args = args
        self.rng = random.Random(args.seed)
        self.outcomes: Counter = Counter()
        self.error_codes: Counter = Counter()
        self.details: list[str] = []
        self.lock = threading.Lock()
        self.kills = 0
        self.last_kill = float("-inf")         # time.monotonic() of the last kill
        self.server: subprocess.Popen | None = None
        self.port = 0
        # the server it starts inherits the environment: its heartbeat, read once here
        self.heartbeat = config.Heartbeat(config.env_value(config.OPTIONS["heartbeat_interval"]))

    # -- server --------------------------------------------------------------------------
    def start_server(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        argv = [sys.executable, "-m", "dispatcher", "serve", "--host", "127.0.0.1",
                "--port", str(self.port), "--engine", self.args.engine,
                "--log-level", "warning", "--stop-grace", "5"]
        for device in self.args.devices:
            argv += ["--device", device]
        if self.args.slots:
            argv += ["--slots", str(self.args.slots)]
        self.log = tempfile.NamedTemporaryFile(prefix="soak-", suffix=".log", delete=False)
        self.server = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        self.wait_healthy(120)

    def health(self) -> dict | None:
        try:
            status, body = self.request("GET", "/health", None, timeout=5)
            return json.loads(body) if status == 200 else None
        except (OSError, ValueError, http.client.HTTPException):
            return None

    def wait_healthy(self, timeout: float, workers: int | None = None) -> bool:
        want = workers or len(self.args.devices)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.server.poll() is not None:
                raise SystemExit(f"the server exited; log: {self.log.name}")
            body = self.health()
            if body and body.get("workers_ready") == want:
                return True
            time.sleep(0.2)
        return False

    def status(self) -> dict:
        return control_request(default_dispatcher_address(self.port), {"cmd": "status"})

    def rss(self) -> dict:
        status = self.status()
        dispatcher = _rss_kb(self.server.pid)
        workers = sum(_rss_kb(w["pid"]) for w in status["workers"] if w.get("pid"))
        worker_pids = {w.get("pid") for w in status["workers"]}
        frontends = 0
        for child in _children(self.server.pid):
            if child not in worker_pids:                     # gunicorn master
                frontends += _rss_kb(child) + sum(_rss_kb(c) for c in _children(child))
        return {"dispatcher_kb": dispatcher, "frontends_kb": frontends,
                "workers_kb": workers}

    def stop_server(self) -> int:
        self.server.send_signal(signal.SIGTERM)
        try:
            return self.server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.server.pid, signal.SIGKILL)
            return -9

    # -- requests ------------------------------------------------------------------------
    def request(self, method: str, path: str, body: bytes | None, timeout: float = 120):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, body=body,
                         headers={"Content-Type": "application/json"} if body else {})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def record(self, outcome: Outcome) -> None:
        with self.lock:
            self.outcomes[outcome.kind] += 1
            if outcome.kind == "clean_error":
                self.error_codes[outcome.detail] += 1
            if outcome.kind in ("lost", "garbled") and len(self.details) < 20:
                self.details.append(outcome.detail)

    def one(self) -> None:
        kind = self.rng.choices(["plain", "stream", "drop", "invalid", "batch", "odd",
                                 "costly"], weights=[3, 3, 2, 3, 1, 2, 1])[0]
        max_tokens = self.rng.randint(4, 24)
        try:
            if kind == "invalid":
                outcome = self.invalid(self.rng.choice(INVALID_BODIES))
            elif kind == "costly":
                outcome = self.invalid(self.rng.choice(COSTLY_BODIES))
            elif kind == "plain":
                outcome = self.plain({"prompt": self.prompt(), "max_tokens": max_tokens,
                                      "temperature": 0}, 1, max_tokens)
            elif kind == "odd":
                outcome = self.plain(self.odd_body(max_tokens), 1, max_tokens)
            elif kind == "batch":
                outcome = self.plain({"prompt": [self.prompt(), self.prompt()], "n": 2,
                                      "max_tokens": max_tokens, "logprobs": 1}, 4, max_tokens)
            else:
                outcome = self.stream({"prompt": self.prompt(), "max_tokens": max_tokens,
                                       "stream": True, "temperature": 0},
                                      max_tokens, drop_after=self.rng.randint(1, 3)
                                      if kind == "drop" else None)
        except (OSError, http.client.HTTPException) as exc:
            outcome = Outcome("lost", f"{kind}: {type(exc).__name__}: {exc}")
        self.record(outcome)

    def odd_body(self, max_tokens: int) -> dict:
        text = "".join(self.rng.choice(ODD_TEXT) for _ in range(self.rng.randint(1, 8)))
        body = {"prompt": text, "max_tokens": max_tokens, "temperature": 0}
        choice = self.rng.randrange(3)
        if choice == 0:
            body["prompt"] = [self.rng.choice([0, 1, 2, 262143, 262144]), 5, text]
        elif choice == 1:
            body.update(repeat_last_n=2 ** 31 - 1, repetition_penalty=1.5,
                        top_k=2 ** 31 - 1, min_tokens=2 ** 31 - 1)
        return body

    def prompt(self) -> str:
        words = ["def", "return", "class", "import", "for", "value", "self", "data"]
        return " ".join(self.rng.choice(words) for _ in range(self.rng.randint(3, 30)))

    def invalid(self, body: bytes) -> Outcome:
        status, raw = self.request("POST", "/v1/completions", body)
        if status == 200:
            return Outcome("garbled", f"bad input accepted: {body[:60]!r}")
        return self.error_outcome(status, raw)

    def error_outcome(self, status: int, raw: bytes) -> Outcome:
        if status >= 500 and status not in (502, 503, 504):
            return Outcome("lost", f"HTTP {status}: {raw[:200]!r}")
        try:
            error = json.loads(raw)["error"]
            assert {"message", "type", "param", "code"} <= set(error)
        except (ValueError, KeyError, TypeError, AssertionError):
            return Outcome("lost", f"HTTP {status} without the envelope: {raw[:200]!r}")
        return Outcome("clean_error", f"{status} {error['code']}")

    def expected_text_ok(self, text: str) -> bool:
        if self.args.engine != "fake":
            return True
        from dispatcher.common.fakescript import SCRIPT
        return SCRIPT.decode().startswith(text) or text in SCRIPT.decode() * 2

    def plain(self, body: dict, choices: int, max_tokens: int) -> Outcome:
        status, raw = self.request("POST", "/v1/completions", json.dumps(body).encode())
        if status != 200:
            return self.error_outcome(status, raw)
        try:
            data = json.loads(raw)
            assert data["object"] == "text_completion" and len(data["choices"]) == choices
            assert sorted(c["index"] for c in data["choices"]) == list(range(choices))
            assert all(c["finish_reason"] in ("stop", "length") for c in data["choices"])
            assert data["usage"]["completion_tokens"] <= max_tokens * choices
            assert all(self.expected_text_ok(c["text"]) for c in data["choices"])
        except (ValueError, KeyError, TypeError, AssertionError) as exc:
            return Outcome("garbled", f"plain: {exc!r} {raw[:200]!r}")
        return Outcome("completed")

    def stream(self, body: dict, max_tokens: int, drop_after: int | None) -> Outcome:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        try:
            conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                return self.error_outcome(resp.status, resp.read())
            text, chunks, finished, errored, code = "", 0, False, False, None
            for raw in resp:
                line = raw.strip()
                if not line:
                    continue
                if not line.startswith(b"data: "):
                    return Outcome("garbled", f"stream line {line[:80]!r}")
                data = line[6:]
                if data == b"[DONE]":
                    if not (finished or errored):
                        return Outcome("lost", "[DONE] before the choice finished")
                    if errored:
                        return Outcome("clean_error", f"stream {code}")
                    if not self.expected_text_ok(text):
                        return Outcome("garbled", f"text {text!r}")
                    return Outcome("completed")
                try:
                    event = json.loads(data)
                except ValueError:
                    return Outcome("garbled", f"chunk {data[:80]!r}")
                if "error" in event:
                    errored = True
                    code = event["error"].get("code")
                    continue
                choice = event["choices"][0]
                text += choice["text"]
                chunks += 1
                finished = finished or choice["finish_reason"] is not None
                if drop_after is not None and chunks >= drop_after:
                    conn.sock.shutdown(socket.SHUT_RDWR)
                    return Outcome("disconnected")
            return Outcome("lost", f"stream ended without [DONE] after {chunks} chunks")
        finally:
            conn.close()

    # -- chaos ---------------------------------------------------------------------------
    def killer(self, stop: threading.Event) -> None:
        while not stop.wait(self.args.kill_every):
            try:
                workers = [w for w in self.status()["workers"] if w.get("pid")
                           and w["state"] in ("idle", "busy")]
            except SystemExit:                # a busy dispatcher: not this time
                continue
            if workers:
                victim = self.rng.choice(workers)
                try:
                    os.kill(victim["pid"], signal.SIGKILL)
                    self.kills += 1
                    self.last_kill = time.monotonic()
                except ProcessLookupError:
                    pass

    def run(self) -> dict:
        try:
            self.start_server()
            return self._soak()
        except BaseException:           # (Ctrl-C, a dispatcher answering late: the server
            if getattr(self, "server", None) is not None:   # it started in a session of
                self.stop_server()                          # its own was left running)
            raise

    def _soak(self) -> dict:
        for _ in range(3):                                   # warm up before measuring
            self.plain({"prompt": "warm up", "max_tokens": 4}, 1, 4)
        before = self.rss()
        stop = threading.Event()
        killer = threading.Thread(target=self.killer, args=(stop,), daemon=True)
        if self.args.kill_every > 0:
            killer.start()
        threads: list[threading.Thread] = []
        started = time.monotonic()
        sent = 0
        # A kill is skipped when no worker is up, or the dispatcher answers late (a loaded
        # machine): the run goes on until it has made the kills its duration promised.
        kills_due = int(self.args.duration // self.args.kill_every) \
            if self.args.kill_every > 0 else 0
        cap = started + self.args.duration * 3 + 60
        while (time.monotonic() - started < self.args.duration or self.kills < kills_due) \
                and time.monotonic() < cap:
            due = int((time.monotonic() - started) * self.args.rate) + 1
            while sent < due:
                thread = threading.Thread(target=self.one, daemon=True)
                thread.start()
                threads.append(thread)
                sent += 1
            threads = [t for t in threads if t.is_alive()]
            time.sleep(0.02)
        stop.set()
        if killer.is_alive():
            killer.join()
        for thread in threads:
            thread.join(timeout=180)
        hung = sum(1 for t in threads if t.is_alive())
        self.outcomes["lost"] += hung
        # long enough for a kill just before the end to be noticed, then respawned
        time.sleep(max(0.0, self.last_kill + self.heartbeat.expiry - time.monotonic()))
        recovered = self.wait_healthy(60)
        after = self.rss()
        restarts = sum(w.get("restarts", 0) for w in self.status()["workers"])
        code = self.stop_server()
        report = {"seconds": round(time.monotonic() - started, 1), "requests": sent,
                  "completed": self.outcomes["completed"],
                  "clean_errors": self.outcomes["clean_error"],
                  "error_codes": dict(self.error_codes.most_common()),
                  "disconnected": self.outcomes["disconnected"],
                  "lost": self.outcomes["lost"], "garbled": self.outcomes["garbled"],
                  "worker_kills": self.kills, "worker_restarts": restarts,
                  "unexpected_restarts": max(0, restarts - self.kills),
                  "recovered": recovered,
                  "server_exit": code, "rss_before": before, "rss_after": after,
                  "problems": self.details, "log": self.log.name}
        return report


def add_arguments(parser) -> None:
    parser.add_argument("--duration", type=config.non_negative_seconds, default=60.0, help="seconds (≤ 3600)")
    parser.add_argument("--rate", type=config.non_negative_seconds, default=4.0,
                        help="requests per second (≤ 50)")
    parser.add_argument("--kill-every", type=config.non_negative_seconds, default=15.0,
                        help="SIGKILL a random worker this often, in seconds (0: never); "
                        "the run lasts until duration / kill-every kills were made")
    # (its own name: `device`, the server's option, was filled with serve's default, one
    # cpu, before this default could apply)
    parser.add_argument("--device", dest="devices", action="append", default=None,
                        help="worker devices of the soaked server (default: cpu, cpu)")
    parser.add_argument("--engine", default="llama", choices=("llama", "fake"))
    parser.add_argument("--slots", type=int, default=0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true")


def run(args) -> int:
    if not 0 < args.duration <= 3600 or not 0 < args.rate <= 50:
        raise SystemExit("--duration must be in (0, 3600] and --rate in (0, 50]")
    args.devices = args.devices or ["cpu", "cpu"]
    report = Soak(args).run()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for key in ("seconds", "requests", "completed", "clean_errors", "disconnected",
                    "lost", "garbled", "worker_kills", "worker_restarts",
                    "unexpected_restarts", "recovered", "server_exit"):
            print(f"{key:>14}: {report[key]}")
        print(f"{'error codes':>14}: " + ", ".join(f"{k} ×{v}" for k, v in
                                                   report["error_codes"].items()))
        for when in ("rss_before", "rss_after"):
            print(f"{when:>14}: " + ", ".join(f"{k} {v / 1024:.0f} MiB"
                                              for k, v in report[when].items()))
        for problem in report["problems"]:
            print(f"  problem: {problem}")
    return 0 if report["lost"] == 0 and report["garbled"] == 0 and \
        report["unexpected_restarts"] == 0 and report["recovered"] and \
        report["server_exit"] == 0 else 1
