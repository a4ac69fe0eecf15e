"""Each part on its own, joined only by TCP addresses: `python -m dispatcher broker`,
`python -m workers` and gunicorn with deploy/gunicorn.conf.py."""
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, free_port, http_json
from dispatcher.tools.ctl import control_request


def spawn(argv, env_extra, log):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **env_extra}
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def stop(proc):
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise


def wait_until(predicate, timeout=60, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def health(port):
    try:
        return http_json(port, "GET", "/health", timeout=5)
    except OSError:
        return None, None, None


@pytest.mark.parametrize("engine", [
    "fake", pytest.param("llama", marks=pytest.mark.integration)])
def test_parts_joined_by_tcp_addresses(tmp_path, engine):
    base_port, http_port = free_port(5), free_port()
    dispatcher = f"tcp://127.0.0.1:{base_port}"
    log = open(tmp_path / "parts.log", "wb")
    procs = []
    try:
        procs.append(spawn([sys.executable, "-m", "dispatcher", "broker",
                            "--dispatcher", dispatcher], {}, log))
        procs.append(spawn([sys.executable, "-m", "gunicorn", "-c",
                            str(ROOT / "deploy" / "gunicorn.conf.py")],
                           {"COMPLETIONS_DISPATCHER": dispatcher,
                            "COMPLETIONS_PORT": str(http_port)}, log))
        # no worker yet: not healthy, and completions are refused with Retry-After
        wait_until(lambda: health(http_port)[0] == 503, what="front end up")
        status, headers, body = http_json(http_port, "POST", "/v1/completions",
                                          {"prompt": "x"})
        assert status == 503 and headers["Retry-After"] and "error" in body
        worker = spawn([sys.executable, "-m", "workers", "--dispatcher", dispatcher,
                        "--device", "cpu", "--engine", engine, "--model-id", "m",
                        "--name", "remote-1"], {}, log)
        procs.append(worker)
        wait_until(lambda: health(http_port)[0] == 200, timeout=300,   # (its step costs
                   what="worker ready")                 # measured on a busy machine)
        status, _, body = http_json(http_port, "POST", "/v1/completions",
                                    {"model": "m", "prompt": "Hello", "max_tokens": 3})
        assert status == 200 and body["usage"]["completion_tokens"] == 3
        # the worker's DONE reaches the dispatcher by another path than the tokens
        wait_until(lambda: [(w["name"], w["completed"]) for w in control_request(
            dispatcher, {"cmd": "status"})["workers"]] == [("remote-1", 1)], timeout=10,
            what="the dispatcher to count the request against remote-1")
        # the worker's host disappears: the dispatcher notices and reports no capacity
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
        wait_until(lambda: health(http_port)[0] == 503, timeout=10,
                   what="health to report the lost worker")
    finally:
        codes = [stop(p) for p in reversed(procs)]
        log.close()
    assert codes[-1] == 0, (tmp_path / "parts.log").read_text()[-3000:]


def test_a_dispatcher_run_alone_takes_the_shares_and_model_names_serve_would(tmp_path):
    """`broker` (the systemd dispatcher) reads the same config file as `serve`: with two
    API keys each key gets half the queue and 3/4 of a model's slots, and the [[models]]'
    ids and aliases are known before any worker comes (their files are the workers' to
    read: here they are on no disk)."""
    keys = tmp_path / "keys"
    keys.write_text("sk-one team-a\nsk-two team-b\n")
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'[server]\ndispatcher = "ipc://{tmp_path}/d"\nmax_queue = 40\n'
                   f'api_key_file = "{keys}"\n[[models]]\nid = "coder"\n'
                   f'path = "/srv/models/elsewhere.gguf"\naliases = ["code"]\nnctx = 8192\n'
                   f'[[workers]]\ndevice = "cpu"\n')
    log = open(tmp_path / "broker.log", "wb")
    proc = spawn([sys.executable, "-m", "dispatcher", "broker"],
                 {"COMPLETIONS_CONFIG": str(cfg)}, log)
    try:
        status = {}

        def answered():
            try:
                status.update(control_request(f"ipc://{tmp_path}/d", {"cmd": "status"},
                                              timeout=1))
                return True
            except Exception:
                return proc.poll() is not None
        wait_until(answered, timeout=30, what="the dispatcher")
        assert proc.poll() is None, (tmp_path / "broker.log").read_text()
        assert status["limits"] == {"max_queue": 40, "max_queue_per_key": 20,
                                    "key_slot_share": 0.75}
        assert status["known_models"] == {"coder": {"n_ctx": 8192, "aliases": ["code"]}}
    finally:
        assert stop(proc) == 0


def test_a_worker_its_unit_started_tells_systemd_ready_and_feeds_its_watchdog(tmp_path,
                                                                            monkeypatch):
    """Under its systemd unit (Type=notify, WatchdogSec) a worker says READY=1 once it
    serves, WATCHDOG=1 every second while its IO thread runs (with no dispatcher too:
    a worker waiting for one is alive), STOPPING=1 when it stops; frozen whole, it sends
    nothing and systemd restarts it (the dispatcher only dropped it, its GPU held)."""
    import socket
    path = str(tmp_path / "notify")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(path)
    listener.settimeout(30)
    log = open(tmp_path / "worker.log", "wb")
    for name in ("WATCHDOG_PID", "COMPLETIONS_PARENT_PID"):   # (a runner's own, if any)
        monkeypatch.delenv(name, raising=False)
    listener.settimeout(60)
    worker = spawn([sys.executable, "-m", "workers", "--dispatcher",
                    f"tcp://127.0.0.1:{free_port()}", "--device", "cpu", "--engine", "fake",
                    "--model-id", "m", "--name", "unit-1"], {"NOTIFY_SOCKET": path}, log)
    try:
        said = [listener.recv(64)]
        started = time.monotonic()
        while time.monotonic() - started < 2.5:
            said.append(listener.recv(64))
        assert said[0] == b"READY=1" and said[1:] and set(said[1:]) == {b"WATCHDOG=1"}, said
        assert 1 <= len(said) - 1 <= 5                    # (about one a second)
        os.kill(worker.pid, signal.SIGSTOP)               # frozen whole: nothing more
        listener.settimeout(2.5)
        late = 0
        with pytest.raises(socket.timeout):
            while late < 3:
                listener.recv(64)                         # (one sent as it froze)
                late += 1
        os.kill(worker.pid, signal.SIGCONT)
        listener.settimeout(30)
        assert listener.recv(64) == b"WATCHDOG=1"
        worker.send_signal(signal.SIGTERM)
        while (message := listener.recv(64)) == b"WATCHDOG=1":
            pass
        assert message == b"STOPPING=1"
    finally:
        code = stop(worker)
        listener.close()
        log.close()
    assert code == 0, (tmp_path / "worker.log").read_text()[-3000:]


def test_a_worker_not_started_by_its_own_unit_tells_systemd_nothing(monkeypatch):
    """A worker `serve` started (its launcher watches it; a `serve` run under systemd
    passes its $NOTIFY_SOCKET on) or whose watchdog is another process's says nothing."""
    from workers.sdnotify import SystemdNotify
    assert SystemdNotify({"NOTIFY_SOCKET": "/run/x"}).active
    assert SystemdNotify({"NOTIFY_SOCKET": "@abstract"}).address == "\0abstract"
    assert SystemdNotify({"NOTIFY_SOCKET": "/run/x", "WATCHDOG_PID": str(os.getpid())}).active
    for environ in ({}, {"NOTIFY_SOCKET": "/run/x", "COMPLETIONS_PARENT_PID": "1"},
                    {"NOTIFY_SOCKET": "/run/x", "WATCHDOG_PID": str(os.getpid() + 1)}):
        assert not SystemdNotify(environ).active


def test_a_front_end_short_of_open_files_says_so(tmp_path):
    """Every connection is a file: a hard limit below what --max-connections needs was
    taken silently (an older systemd's 4,096), and connections past it failed."""
    import resource
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    hard = 2048 if hard == resource.RLIM_INFINITY else min(2048, hard)
    if hard < 1024:
        pytest.skip(f"this runner's open-file hard limit is {hard}")
    log_path = tmp_path / "frontend.log"
    log = open(log_path, "wb")
    http_port = free_port()
    frontend = subprocess.Popen(
        [sys.executable, "-m", "gunicorn", "-c", str(ROOT / "deploy" / "gunicorn.conf.py")],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "COMPLETIONS_PORT": str(http_port),
             "COMPLETIONS_DISPATCHER": f"tcp://127.0.0.1:{free_port(5)}"},
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard)))
    try:
        wait_until(lambda: f"open files are limited to {hard}".encode() in log_path.read_bytes(),
                   timeout=60, what="the warning")
    finally:
        os.killpg(frontend.pid, signal.SIGKILL)     # (no dispatcher: nothing to drain)
        frontend.wait(timeout=20)
        log.close()
