"""The front ends' gunicorn worker (app/gunicorn_worker.py): a stop ends idle keep-alive
connections at once and lets requests in flight finish."""
import http.client
import os
import signal
import socket
import subprocess
import sys
import time

from gunicorn.config import Config

from app.gunicorn_worker import FRESH_GRACE, FrontendWorker
from conftest import ROOT, free_port


def worker() -> FrontendWorker:
    return FrontendWorker(age=1, ppid=os.getppid(), sockets=[], app=None, timeout=30,
                          cfg=Config(), log=None)


def ended(sock: socket.socket, wait: float = 0.0) -> bool:
    """Whether the other end has closed (reading gives end of file), waiting up to `wait`
    seconds for it. Peeks: what was sent stays to be read."""
    sock.settimeout(wait or None)
    try:
        flags = socket.MSG_PEEK | (0 if wait else socket.MSG_DONTWAIT)
        return sock.recv(1, flags) == b""
    except (BlockingIOError, socket.timeout, ConnectionResetError):
        return False


def test_only_quiet_connections_are_closed_and_new_ones_get_time_to_ask(monkeypatch):
    from app import gunicorn_worker
    # (a grace no pause of a loaded machine between `now` and the look below comes near)
    monkeypatch.setattr(gunicorn_worker, "FRESH_GRACE", 60 * FRESH_GRACE)
    grace = gunicorn_worker.FRESH_GRACE
    w = worker()
    pairs = {name: socket.socketpair() for name in ("idle", "arriving", "fresh", "old")}
    try:
        ours = {name: pair[0] for name, pair in pairs.items()}
        w._idle.update({ours["idle"]: 0.0, ours["arriving"]: 0.0})
        pairs["arriving"][1].sendall(b"GET / HTTP/1.1\r\n")       # its next request
        now = time.monotonic()
        w._fresh = {ours["fresh"]: now, ours["old"]: now - 2 * grace}
        w._stopped_at = now - 2 * grace           # stopped a while ago
        w._close_idle()
        assert ended(pairs["idle"][1])
        assert ended(pairs["old"][1])                    # asked nothing for long enough
        assert not ended(pairs["arriving"][1])           # bytes waiting: left to be served
        assert not ended(pairs["fresh"][1])              # just made: time to ask
        assert ours["arriving"].recv(100) == b"GET / HTTP/1.1\r\n"    # nothing lost
        w._stopped_at = time.monotonic()                 # just stopped: the old one waits
        old = socket.socketpair()
        w._fresh = {old[0]: now - 10 * grace}
        w._close_idle()
        assert not ended(old[1])
        old[0].close(), old[1].close()
    finally:
        for a, b in pairs.values():
            a.close()
            b.close()
        w.tmp.close()


def test_a_stop_ends_idle_connections_at_once_and_finishes_requests_in_flight(tmp_path):
    port = free_port()
    log = open(tmp_path / "gunicorn.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gunicorn", "--worker-class",
         "app.gunicorn_worker.FrontendWorker", "--bind", f"127.0.0.1:{port}",
         "--graceful-timeout", "60", "--keep-alive", "300", "--chdir",
         str(ROOT / "tests"), "slow_wsgi:app"], cwd=ROOT, stdout=log,
        stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                idle = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                idle.request("GET", "/")
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.05)
        assert idle.getresponse().read() == b"ok"           # kept alive, now idle
        busy = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        busy.request("GET", "/slow")
        response = busy.getresponse()
        assert response.readline() == b"chunk 0\n"           # in flight
        stopped = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert response.read() == b"".join(b"chunk %d\n" % i for i in range(1, 10))
        assert ended(idle.sock, wait=10)
        proc.wait(timeout=60)
        # gunicorn's own worker would hold the idle connection until the graceful timeout
        assert time.monotonic() - stopped < 30
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    text = (tmp_path / "gunicorn.log").read_text()
    assert "Traceback" not in text and "[ERROR]" not in text, text
