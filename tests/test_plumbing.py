"""The real processes (launcher, dispatcher, gunicorn, workers) around FakeEngine.

FakeEngine is a test double (workers/fake_engine.py), not a model: it makes timing and
faults controllable, so these tests check the plumbing precisely. The same behaviours
are checked against the real model in test_integration.py.
"""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import ServerProcess, SSEStream, http_json
from workers.fake_engine import SCRIPT

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def fake_server():
    server = ServerProcess("--engine", "fake", "--slots", "1", log_name="fake").start()
    yield server
    assert server.stop() == 0


def collect_text(stream: SSEStream) -> tuple[str, list[dict]]:
    chunks = [json.loads(d) for d in stream.events() if d != "[DONE]"]
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"]), chunks


def test_plain_completion_returns_the_generated_text(fake_server):
    status, headers, body = http_json(fake_server.port, "POST", "/v1/completions",
                                      {"prompt": "x", "max_tokens": 9})
    assert status == 200
    assert body["choices"][0]["text"] == SCRIPT[:9].decode()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 9, "total_tokens": 11,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert headers["X-Request-Id"] == body["id"]


def test_stream_never_splits_a_utf8_character(fake_server):
    # the script's "é", "ï" and "東京" are 2- and 3-byte characters sent one byte per token
    stream = SSEStream(fake_server.port, {"prompt": "x", "max_tokens": len(SCRIPT),
                                          "stream": True})
    text, chunks = collect_text(stream)
    assert text == SCRIPT.decode()
    assert "\ufffd" not in text
    assert any(c["choices"][0]["text"] == "東" for c in chunks)


def test_stop_string_spanning_tokens_is_cut_in_stream_and_plain(fake_server):
    body = {"prompt": "x", "max_tokens": 40, "stop": ["brown fox"]}
    _, _, plain = http_json(fake_server.port, "POST", "/v1/completions", body)
    stream = SSEStream(fake_server.port, {**body, "stream": True})
    text, chunks = collect_text(stream)
    assert plain["choices"][0]["text"] == text == "The quick "
    assert plain["choices"][0]["finish_reason"] == chunks[-1]["choices"][0]["finish_reason"] \
        == "stop"
    assert not any("b" in c["choices"][0]["text"] for c in chunks)   # never leaked


def test_eos_finishes_with_stop_and_is_not_counted(fake_server):
    _, _, body = http_json(fake_server.port, "POST", "/v1/completions",
                           {"prompt": "[eos=4]", "max_tokens": 50})
    assert body["choices"][0] == {"text": "The ", "index": 0, "logprobs": None,
                                  "finish_reason": "stop"}
    assert body["usage"]["completion_tokens"] == 4


def test_disconnect_cancels_generation_within_one_token(fake_server):
    # 2 s per token: a late cancel would show up as extra tokens (a loaded machine may
    # take a second from the client's close to the worker's next step)
    stream = SSEStream(fake_server.port, {"prompt": "[slow=2]", "max_tokens": 500,
                                          "stream": True})
    read = 0
    for data in stream.events():
        read += 1
        if read == 3:
            break
    stream.close()
    worker = fake_server.wait_for(
        lambda: (w := fake_server.worker()) and w["state"] == "idle" and w["last_done"]
        and w["last_done"]["id"] != "" and w["last_done"].get("cancelled") and w,
        timeout=10, what="the worker to go idle")
    # tokens generated = those read + at most the one in flight when the client left
    assert worker["last_done"]["usage"]["completion_tokens"] <= read + 1
    status, _, _ = http_json(fake_server.port, "POST", "/v1/completions",
                             {"prompt": "x", "max_tokens": 2})
    assert status == 200


def test_a_stray_byte_before_a_close_still_cancels_a_non_streamed_request(fake_server):
    """A client that sends its request, one more byte (a stray newline, the start of a
    pipelined request) and closes: the byte waits unread, and the close behind it is
    still noticed, so the generation does not run all its tokens for nobody."""
    import socket
    body = json.dumps({"prompt": "[slow=0.2]", "max_tokens": 3000}).encode()
    sock = socket.create_connection(("127.0.0.1", fake_server.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    fake_server.wait_for(lambda: fake_server.worker()["state"] == "busy", what="busy worker")
    sock.sendall(b"\n")
    sock.close()
    worker = fake_server.wait_for(
        lambda: (w := fake_server.worker()) and w["state"] == "idle" and w["last_done"]
        and w["last_done"].get("cancelled") and w, timeout=20, what="the cancel")
    # (a cancel that reached the worker with the job itself, before it was admitted: a
    # busy machine, ends it with no usage at all, zero tokens)
    assert worker["last_done"].get("usage", {}).get("completion_tokens", 0) < 100


def test_client_leaving_while_queued_never_runs(fake_server):
    before = fake_server.status()["stats"]
    # (5 s: still running when the second is seen queued, on a loaded machine too)
    busy = SSEStream(fake_server.port, {"prompt": "[slow=0.05]", "max_tokens": 100,
                                        "stream": True})
    fake_server.wait_for(lambda: fake_server.worker()["state"] == "busy", what="busy worker")
    queued = SSEStream(fake_server.port, {"prompt": "queued", "max_tokens": 5,
                                          "stream": True}, timeout=30, wait=False)
    fake_server.wait_for(lambda: sum(fake_server.status()["queue"].values()) == 1,
                         what="the second request to be queued")
    queued.close()
    fake_server.wait_for(lambda: sum(fake_server.status()["queue"].values()) == 0,
                         timeout=20, what="the queue to drop the request")
    text, _ = collect_text(busy)
    assert len(text.encode()) == 100                 # (one byte a token)
    # the worker's DONE may trail the stream it finished (another path)
    fake_server.wait_for(lambda: fake_server.status()["stats"]["completed"]
                         == before["completed"] + 1, timeout=30, what="the count")
    after = fake_server.status()["stats"]
    assert after["cancelled"] == before["cancelled"] + 1
    assert after["submitted"] == before["submitted"] + 2
    assert after["completed"] == before["completed"] + 1


def test_a_tokenize_whose_client_left_is_dropped_before_it_runs(fake_server):
    """/tokenize was never cancelled: a client's texts of a megabyte (17-23 s of a core
    each) ran to their end for nobody, every other /tokenize of the worker behind them.
    A client that leaves is noticed (499) and a worker drops its job if not started."""
    import socket

    def send(content):
        body = json.dumps({"content": content}).encode()
        sock = socket.create_connection(("127.0.0.1", fake_server.port))
        sock.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        return sock

    import select
    before = fake_server.status()["stats"]["cancelled"]
    running = send("[slowtok=8] the first")         # the vocabulary thread's for 8 s
    time.sleep(0.5)
    left = send("[slowtok=8] nobody reads this")
    time.sleep(0.3)
    left.close()
    fake_server.wait_for(lambda: fake_server.status()["stats"]["cancelled"] == before + 1,
                         timeout=7, what="the cancel")
    # dropped unstarted, not run after the first: counted while the first still runs
    # (one vocabulary thread: the second could only have started after it)
    assert select.select([running], [], [], 0)[0] == []
    running.settimeout(30)
    answer = b""                # (the head and the body may come in two segments)
    while b"\r\n\r\n" not in answer or len(answer.partition(b"\r\n\r\n")[2]) < int(
            re.search(rb"Content-Length: (\d+)", answer).group(1)):
        chunk = running.recv(65536)
        assert chunk, answer
        answer += chunk
    assert answer.startswith(b"HTTP/1.1 200") and b'"tokens"' in answer
    running.close()
    fake_server.wait_for(lambda: any(
        "route=/tokenize status=499" in line and "error=client_closed" in line
        for line in fake_server.output().splitlines()), timeout=10,
        what="the 499 in the access log")


def test_unknown_model_is_404_and_bad_field_is_400(fake_server):
    status, _, body = http_json(fake_server.port, "POST", "/v1/completions",
                                {"prompt": "x", "model": "nope"})
    assert status == 404 and body["error"]["code"] == "model_not_found"
    status, _, body = http_json(fake_server.port, "POST", "/v1/completions",
                                {"prompt": "x", "temperature": -1})
    assert status == 400 and body["error"]["param"] == "temperature"
    assert set(body["error"]) == {"message", "type", "param", "code"}


def test_unknown_route_and_wrong_method_use_the_envelope(fake_server):
    status, _, body = http_json(fake_server.port, "GET", "/v1/nothing")
    assert status == 404 and body["error"]["type"] == "invalid_request_error"
    status, _, body = http_json(fake_server.port, "GET", "/v1/completions")
    assert status == 405 and "error" in body


def test_body_over_the_limit_is_413():
    server = ServerProcess("--engine", "fake", "--max-body", "1000", log_name="small").start()
    try:
        status, _, body = http_json(server.port, "POST", "/v1/completions",
                                    {"prompt": "x" * 2000})
        assert status == 413 and "error" in body
        status, _, _ = http_json(server.port, "POST", "/v1/completions", {"prompt": "x"})
        assert status == 200
    finally:
        assert server.stop() == 0


def test_a_request_that_kills_its_worker_is_failed_not_handed_to_another():
    server = ServerProcess("--engine", "fake", log_name="crash").start()
    try:
        # "[crash]" kills the worker running it: it had started, so it could be a poison
        # pill; it is failed with a 503 envelope instead of killing the respawned worker
        status, _, body = http_json(server.port, "POST", "/v1/completions",
                                    {"prompt": "[crash]", "max_tokens": 5})
        assert status == 503 and body["error"]["code"] == "worker_lost"
        assert server.status()["stats"]["requeued"] == 0
        # the supervisor respawned the worker (/health alone may still show the state
        # from before the loss for a moment: the worker's own record says)
        server.wait_for(lambda: (w := server.worker()) and w["restarts"] == 1
                        and w["state"] == "idle" and w, timeout=60,
                        what="the worker respawned and ready")
        server.wait_ready()
        status, _, body = http_json(server.port, "POST", "/v1/completions",
                                    {"prompt": "x", "max_tokens": 3})
        assert status == 200 and body["choices"][0]["text"] == "The"
        assert server.worker()["restarts"] == 1  # and nothing killed it again
    finally:
        assert server.stop() == 0


def test_a_request_its_worker_had_not_started_is_requeued_when_the_worker_dies():
    server = ServerProcess("--engine", "fake", log_name="requeue").start()
    try:
        # one step of the blocker takes 5 s: a job dispatched meanwhile waits in the
        # worker's inbox, not started, until the step ends (the kill comes long before)
        blocker = SSEStream(server.port, {"prompt": "[slow=5] x", "max_tokens": 3,
                                          "stream": True})
        assert blocker.status == 200
        server.wait_for(lambda: server.worker()["busy_slots"] == 1, what="the blocker")
        results = {}
        waiter = threading.Thread(target=lambda: results.update(r=http_json(
            server.port, "POST", "/v1/completions", {"prompt": "y", "max_tokens": 3})))
        waiter.start()
        server.wait_for(lambda: server.worker()["busy_slots"] == 2, what="dispatch")
        os.kill(server.worker()["pid"], signal.SIGKILL)
        waiter.join(timeout=60)
        status, _, body = results["r"]
        assert status == 200 and body["choices"][0]["text"] == "The"   # served after all
        stats = server.status()["stats"]
        assert stats["requeued"] == 1 and stats["failed"] == 1          # the blocker
        events = list(blocker.events())
        assert json.loads(events[-2])["error"]["code"] == "worker_lost"
    finally:
        assert server.stop() == 0


def test_a_worker_with_another_model_file_under_the_same_id_is_refused(tmp_path):
    """One model id, one model: a worker that registers another file under an id a
    worker already serves is refused, exits 78 with the reason in one line, and the
    serving worker goes on answering."""
    from tiny_gguf import write_tiny_fim_model
    served = write_tiny_fim_model(tmp_path / "a.gguf", seed=1)
    other = write_tiny_fim_model(tmp_path / "b.gguf", seed=2)
    server = ServerProcess("--engine", "fake", "--model", str(served), "--model-id", "code",
                           log_name="refused").start()
    try:
        environ = {k: v for k, v in os.environ.items() if k != "COMPLETIONS_PARENT_PID"}
        joined = subprocess.run(
            [sys.executable, "-m", "workers", "--dispatcher", server.dispatcher, "--engine",
             "fake", "--model", str(other), "--model-id", "code", "--name", "intruder"],
            capture_output=True, text=True, timeout=60, cwd=ROOT, env=environ)
        assert joined.returncode == 78, joined.stderr[-2000:]
        (line,) = [line for line in joined.stderr.splitlines() if "ERROR" in line]
        assert f"refused this worker: its model file {other} differs from {served}" in line
        assert [w["name"] for w in server.status()["workers"]] == ["w0-cpu"]
        status, _, body = http_json(server.port, "POST", "/v1/completions",
                                    {"model": "code", "prompt": "hi", "max_tokens": 2})
        assert status == 200, body
    finally:
        assert server.stop() == 0


def test_workers_are_pinned_and_report_it_on_ready():
    core = min(os.sched_getaffinity(0))        # one this process may use
    server = ServerProcess("--engine", "fake", "--device", f"cpu:{core}", "--device",
                           "cuda:1", workers=2, log_name="pinned").start()
    try:
        workers = {w["name"]: w for w in server.status()["workers"]}
        cpu, gpu = workers[f"w0-cpu{core}"], workers["w1-cuda1"]
        assert cpu["device"] == f"cpu:{core}" and gpu["device"] == "cuda:1"
        assert cpu["placement"]["cores"] == [core] and cpu["placement"]["n_threads"] == 1
        assert os.sched_getaffinity(cpu["pid"]) == {core}
        environ = Path(f"/proc/{gpu['pid']}/environ").read_bytes().split(b"\0")
        assert b"CUDA_VISIBLE_DEVICES=1" in environ and b"CUDA_DEVICE_ORDER=PCI_BUS_ID" in environ
        assert gpu["placement"]["visible_devices"] == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                                                       "CUDA_VISIBLE_DEVICES": "1"}
        assert gpu["placement"]["n_gpu_layers"] == 999
        assert gpu["placement"]["n_threads"] == min(4, len(gpu["placement"]["cores"]))
        assert gpu["placement"]["layers_offloaded"] == 0          # the fake has no weights
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stop_leaves_no_processes_and_no_ipc_files(sig):
    server = ServerProcess("--engine", "fake", "--frontends", "2", log_name="stop").start()
    ipc_dir = Path(server.dispatcher[len("ipc://"):])
    assert ipc_dir.is_dir() and len(list(ipc_dir.iterdir())) == 5
    stream = SSEStream(server.port, {"prompt": "[slow=0.05]", "max_tokens": 30,
                                     "stream": True})
    stream.next_data()
    assert server.stop(sig) == 0                   # asserts the process group is empty
    assert not ipc_dir.exists()
    stream.close()


def test_two_fake_workers_run_two_streams_at_once():
    server = ServerProcess("--engine", "fake", "--device", "cpu", "--device", "cpu",
                           workers=2, log_name="two").start()
    try:
        spans = {}

        def run(i):
            stream = SSEStream(server.port, {"prompt": "[slow=0.05]", "max_tokens": 20,
                                             "stream": True})
            stream.next_data()
            first = time.monotonic()
            list(stream.events())
            spans[i] = (first, time.monotonic())

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert max(s[0] for s in spans.values()) < min(s[1] for s in spans.values())
        # (each worker's DONE reaches the dispatcher by a slower path than its tokens
        # reach the client: its count may trail the stream's end)
        server.wait_for(lambda: sorted(w["completed"] for w in server.status()["workers"])
                        == [1, 1], timeout=10, what="one stream done on each worker")
    finally:
        assert server.stop() == 0


def raw_exchange(port: int, data: bytes, sending: bool = False) -> tuple[int, dict, bytes]:
    """Send `data` as it is and read the answer to the close: (status, headers, body);
    `sending`: from a thread of its own while the answer is read (a server refusing the
    body midway answers before it has all of it, and stops reading)."""
    import socket
    import threading

    def send(sock):
        try:
            sock.sendall(data)
        except OSError:
            pass                        # (refused midway: the answer says why)
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sender = threading.Thread(target=send, args=(sock,)) if sending else None
        if sender is not None:
            sender.start()
        else:
            sock.sendall(data)
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except ConnectionResetError:
            pass                        # (after the answer, for unread data)
        if sender is not None:
            sender.join(timeout=20)
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), headers, body


BODY = b'{"prompt": "a", "max_tokens": 2}'


@pytest.mark.parametrize("framing", [
    b"zz\r\n%s\r\n0\r\n\r\n" % BODY,                  # a size that is not hex
    b"5\r\n%s\r\n0\r\n\r\n" % BODY,                   # data past its size
    b"%x\r\n%sXX0\r\n\r\n" % (len(BODY), BODY),       # no CRLF after the data
    b"-5\r\n%s\r\n0\r\n\r\n" % BODY,                  # a negative size
], ids=["not-hex", "past-size", "no-crlf", "negative"])
def test_a_chunked_body_framed_wrong_is_a_400_in_the_envelope(fake_server, framing):
    """gunicorn's chunk reader raised inside the application: a 500."""
    for path in ("/v1/completions", "/completion", "/tokenize"):
        status, headers, body = raw_exchange(fake_server.port, (
            b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" % path.encode()) + framing)
        assert status == 400, (path, body)
        assert headers["Content-Type"] == "application/json"
        assert json.loads(body)["error"]["code"] == "invalid_body", body
        # (the rest is never read: the answer says the connection ends, not keep-alive)
        assert headers["Connection"] == "close"


def test_a_body_over_max_body_is_a_413_chunked_or_not_and_ends_the_connection(fake_server):
    """A chunked body was read to --max-body and the request ran on its first 8 MiB (or a
    400 invalid_json): a 413 now, as for a Content-Length over it, which past twice the
    limit is refused before its body is read (it was read, and thrown away, for up to
    75 s; a smaller one is read past, as a proxy sending it expects); both say the
    connection ends. A WebSocket upgrade is a 400 with a code and a reason."""
    big = b'{"prompt": "' + b"a" * (9 << 20) + b'", "max_tokens": 2}'
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(big[i:i + 65536]), big[i:i + 65536])
                       for i in range(0, len(big), 65536)) + b"0\r\n\r\n"
    status, headers, body = raw_exchange(fake_server.port, (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n") + chunked, sending=True)
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    assert headers["Connection"] == "close"
    status, headers, body = raw_exchange(fake_server.port, (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % (17 << 20)))
    error = json.loads(body)["error"]
    assert status == 413 and error["code"] == "request_too_large" and "--max-body" in \
        error["message"] and headers["Connection"] == "close"
    import http.client
    conn = http.client.HTTPConnection("127.0.0.1", fake_server.port, timeout=20)
    conn.request("GET", "/health", headers={
        "Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
        "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="})
    answer = conn.getresponse()
    error = json.loads(answer.read())["error"]
    conn.close()
    assert answer.status == 400 and error["code"] == "bad_request" and \
        "WebSocket" in error["message"]


@pytest.mark.parametrize("request_bytes,status,code", [
    (b"GARBAGE\r\n\r\n", 400, "bad_request"),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n"
     b"Transfer-Encoding: chunked\r\n\r\n%s" % (len(BODY), BODY), 400, "bad_request"),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", 400,
     "bad_request"),
    (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: %s\r\n\r\n" % (b"a" * 100_000), 431,
     "headers_too_large"),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n", 400,
     "bad_request"),
], ids=["request-line", "length-and-chunked", "negative-length", "huge-header",
        "gzip-coding"])
def test_what_gunicorn_refuses_itself_is_answered_in_the_envelope(
        fake_server, request_bytes, status, code):
    """Refused before the application runs: gunicorn's HTML page, which no OpenAI client
    reads (a 501 for a transfer coding it does not take)."""
    got, headers, body = raw_exchange(fake_server.port, request_bytes)
    assert (got, headers["Content-Type"]) == (status, "application/json"), body
    error = json.loads(body)["error"]
    assert error["code"] == code and error["type"] == "invalid_request_error"
    assert error["message"].startswith("the request could not be parsed")
