"""Fixtures that start the real stack (`python -m dispatcher serve`) as a separate process."""
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
import time
from pathlib import Path

import cores
import pytest

from dispatcher.tools.ctl import control_request, default_dispatcher_address

ROOT = Path(__file__).resolve().parent.parent

# The suite starts Python a few hundred times (servers, workers, the CLI): where the
# environment says not to write bytecode (PYTHONDONTWRITEBYTECODE), each start would
# compile this project's modules again (~0.25 s of a core a server), and each pass
# rewrite every test module's asserts again. Write it, as Python does by default.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one test process per core, at most 4 (each starts its own servers)."""
    return max(1, min(len(os.sched_getaffinity(0)), 4))


def pytest_configure(config):
    if cores.WORKER:
        cores.start()
    else:
        # the controller, before any test process starts: what they would otherwise race
        # to create on a fresh machine (the assembled model, the repacking probe's answer)
        from dispatcher.common.models import bundled_model_path
        from dispatcher.common.repacking import extra_buffers_work
        bundled_model_path()
        extra_buffers_work()


def pytest_collection_modifyitems(config, items):
    """In the parallel pass (an xdist worker), `serial` tests are left out: they need every
    core, and run in the second pass, `pytest -m serial -n 0` (see tests/cores.py)."""
    if not cores.WORKER:
        return
    serial = [item for item in items if item.get_closest_marker("serial")]
    if serial:
        config.hook.pytest_deselected(items=serial)
        items[:] = [item for item in items if not item.get_closest_marker("serial")]


def two_single_cores() -> tuple[int, int]:
    """Cores for two one-thread workers within this test process's share: two of its
    own, or its one core twice (the workers then take turns on it)."""
    cores = sorted(os.sched_getaffinity(0))
    return cores[0], cores[1 % len(cores)]


@pytest.fixture
def all_cores():
    """Every core, for a `serial` test (it pins workers to the first two)."""
    if cores.WORKER:
        pytest.fail("a test that needs every core is marked serial (it runs without xdist)")
    return sorted(cores.ALL_CORES)


_next_port: int | None = None


def free_port(count: int = 1) -> int:
    """A port p such that p..p+count-1 are free right now, from this test process's own
    range (parallel test processes never pick the same one)."""
    global _next_port
    low, high = cores.port_range()
    if _next_port is None:
        _next_port = random.randrange(low, high)
    for _ in range(500):
        if _next_port + count > high:
            _next_port = low
        port, _next_port = _next_port, _next_port + count        # never handed out twice
        socks = []
        try:
            for p in range(port, port + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


def http_json(port: int, method: str, path: str, body=None, headers=None, timeout=60):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json"} if data is not None else {}
    hdrs.update(headers or {})
    conn.request(method, path, body=data, headers=hdrs)
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    try:
        payload = json.loads(raw) if raw else None
    except ValueError:
        payload = raw
    return resp.status, dict(resp.getheaders()), payload


class ServerProcess:
    """`python -m dispatcher serve ...` on a free port, in its own process group."""

    def __init__(self, *args: str, env: dict | None = None, workers: int = 1,
                 log_name: str = "server"):
        self.port = free_port()
        self.args = list(args)
        self.workers = workers
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.log_path = Path(tempfile.mkdtemp(prefix="cs-test-")) / f"{log_name}.log"
        self.proc: subprocess.Popen | None = None
        self.dispatcher = default_dispatcher_address(self.port)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, wait: bool = True) -> "ServerProcess":
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dispatcher", "serve", "--port", str(self.port),
             *self.args], cwd=ROOT, env=self.env, stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True)
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Until every worker is ready: a hang guard, not a speed check (a worker without
        kept step costs measures them at start-up, a minute on a busy machine)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n"
                                   f"{self.output()[-6000:]}")
            try:
                status, _, body = http_json(self.port, "GET", "/health", timeout=5)
                # ... and as the dispatcher says: a front end's /health may show the
                # state from before a worker was lost for a moment after the loss
                if status == 200 and body.get("workers_ready") == self.workers and \
                        self._all_ready():
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"server not ready in {timeout}s:\n{self.output()[-6000:]}")

    def status(self, timeout: float = 10.0) -> dict:
        return control_request(self.dispatcher, {"cmd": "status"}, timeout=timeout)

    def _all_ready(self) -> bool:
        """Whether the dispatcher's status has every worker ready (True where it does
        not answer this client: a keyed control socket, /health is all there is)."""
        try:
            answer = self.status(timeout=1.0)
        except SystemExit:
            return True
        workers = answer.get("workers")
        if workers is None:
            return True
        return len(workers) >= self.workers and all(
            w["state"] not in ("starting", "restarting", "failed") for w in workers)

    def worker(self, name_prefix: str = "w0") -> dict:
        return next(w for w in self.status()["workers"] if w["name"].startswith(name_prefix))

    def wait_for(self, predicate, timeout: float = 30.0, what: str = "condition"):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}")

    def wait_generating(self, count: int = 1, timeout: float = 30.0) -> dict:
        """The first worker, once `count` of its requests have their first token (the
        dispatcher's status: a request running, not only sent)."""
        return self.wait_for(lambda: len((w := self.worker())["generating"]) >= count and w,
                             timeout=timeout, what=f"{count} request(s) generating")

    def wait_idle(self, timeout: float = 30.0) -> dict:
        """The first worker, once nothing runs on it."""
        return self.wait_for(lambda: (w := self.worker())["state"] == "idle" and w,
                             timeout=timeout, what="the worker to go idle")

    def wait_cancelled(self, timeout: float = 15.0) -> dict:
        """The first worker, once idle with a cancelled request as its last."""
        return self.wait_for(
            lambda: (w := self.worker()) and w["state"] == "idle"
            and (w["last_done"] or {}).get("cancelled") and w, timeout=timeout,
            what="the worker to go idle after a cancel")

    def output(self) -> str:
        """Everything the server has logged (its access log too: a line looked for must
        not scroll out of a tail)."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def children(self) -> list[int]:
        """The processes serve started, however deep (each of its children runs in a
        session of its own): they and theirs carry COMPLETIONS_PARENT_PID=serve's pid."""
        mark = f"COMPLETIONS_PARENT_PID={self.proc.pid}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if mark in (entry / "environ").read_bytes().split(b"\0"):
                        found.append(int(entry.name))
                except OSError:
                    pass
        return found

    def group_alive(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)
            return True
        except ProcessLookupError:
            return bool(self.children())

    def _kill_all(self) -> None:
        for pid in [self.proc.pid] + self.children():
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Stop the server and wait for every process it started to be gone."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._kill_all()
            self.proc.wait()
            raise
        deadline = time.monotonic() + 10
        while self.group_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        orphans = self.group_alive()
        if orphans:
            self._kill_all()
        self.log.close()
        assert not orphans, "processes of the server outlived it"
        return code


def wait_read_by_server(sock: socket.socket, server_port: int, timeout: float = 10.0) -> None:
    """Until the server has accepted `sock`'s connection and read everything sent on it
    so far, as the kernel tells (/proc/net/tcp: the server's side of the connection has
    an inode once accepted, and nothing left in its receive queue once read), so what
    happens next happens after it."""
    client = sock.getsockname()[1]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            fields = line.split()
            local, remote, queues = fields[1], fields[2], fields[4]
            if int(local.split(":")[1], 16) == server_port and \
                    int(remote.split(":")[1], 16) == client and \
                    int(queues.split(":")[1], 16) == 0 and fields[9] != "0":
                return
        time.sleep(0.01)
    raise AssertionError("the server did not accept the connection and read what was sent")


@pytest.fixture(scope="session")
def real_server():
    """The whole stack on the bundled model: one front end, one cpu worker whose
    machine profile is `interactive`."""
    server = ServerProcess("--device", "cpu@interactive", log_name="real").start()
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="session")
def det_server():
    """The whole stack in the deterministic configuration (--deterministic): batch
    composition and concurrency never change a result, so outputs can be compared
    exactly however requests overlap."""
    server = ServerProcess("--deterministic", "true", log_name="det").start()
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="session")
def model_id(real_server) -> str:
    _, _, body = http_json(real_server.port, "GET", "/v1/models")
    return body["data"][0]["id"]


class SSEStream:
    """A raw HTTP streaming request: headers, then events one at a time, then close."""

    def __init__(self, port: int, body: dict, timeout: float = 60,
                 headers: dict | None = None, wait: bool = True,
                 path: str = "/v1/completions"):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        self.conn.request("POST", path, body=json.dumps(body).encode(),
                          headers={"Content-Type": "application/json", **(headers or {})})
        self.raw = b""
        if wait:
            self.receive()

    def receive(self) -> "SSEStream":
        """Wait for the status and headers (the constructor does, unless wait=False:
        a request still queued has none yet)."""
        self.response = self.conn.getresponse()
        self.status = self.response.status
        self.headers = {k.lower(): v for k, v in self.response.getheaders()}
        return self

    def next_data(self) -> str | None:
        """The payload of the next `data:` event, or None at end of stream."""
        lines = []
        while True:
            line = self.response.readline()
            self.raw += line
            if not line:
                return None
            if line == b"\n":
                break
            lines.append(line)
        assert len(lines) == 1 and lines[0].startswith(b"data: "), lines
        return lines[0][len(b"data: "):-1].decode()

    def events(self):
        while True:
            data = self.next_data()
            if data is None:
                return
            yield data

    def close(self) -> None:
        """Drop the connection abruptly, as a client that goes away does."""
        try:
            self.conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.conn.close()


@pytest.fixture(scope="session")
def reference_llm():
    """llama-cpp-python in this process, with the worker's settings: the ground truth."""
    from dispatcher.common.models import bundled_model_path
    from dispatcher.tools.reference import reference_llama
    llm = reference_llama(bundled_model_path(), 512, len(os.sched_getaffinity(0)),
                          logits_all=True)
    yield FreshReference(llm)
    llm.close()


class FreshReference:
    """A Llama that decodes every prompt in full: llama-cpp-python otherwise reuses the
    prefix of its previous prompt, which changes the numbers slightly."""

    def __init__(self, llm):
        self.llm = llm

    def create_completion(self, *args, **kwargs):
        self.llm.reset()
        return self.llm.create_completion(*args, **kwargs)

    def tokenize(self, *args, **kwargs):
        return self.llm.tokenize(*args, **kwargs)

