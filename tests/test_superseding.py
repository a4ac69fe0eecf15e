"""Superseding on the real stack (FakeEngine): a session's order is the client's, taken as
close to the client as the server sees it (the connection's acceptance), and a client
whose X-Session-Seq starts again is a new epoch, not locked out."""
import json
import socket

import pytest

from conftest import ServerProcess, http_json, wait_read_by_server

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server():
    server = ServerProcess("--engine", "fake", "--slots", "2", log_name="superseding").start()
    yield server
    assert server.stop() == 0


def raw_request(port: int, body: dict, headers: dict) -> tuple[socket.socket, bytes]:
    data = json.dumps(body).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    return sock, (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  f"application/json\r\nContent-Length: {len(data)}\r\n{head}"
                  f"Connection: close\r\n\r\n").encode() + data


def status_of(sock: socket.socket) -> int:
    reply = b""
    while b"\r\n" not in reply:
        chunk = sock.recv(4096)
        if not chunk:
            break
        reply += chunk
    sock.close()
    return int(reply.split(b" ")[1])


def test_the_order_is_the_connections_not_when_its_request_was_read(server):
    """The older request's head and body come late (a slow client, or a busy front end
    that reads it late): it is still the older one, so the newer one is answered."""
    session = {"X-Session-Id": "slow-body"}
    old, old_bytes = raw_request(server.port, {"prompt": "[slow=0.05] a", "max_tokens": 20},
                                 session)
    old.sendall(old_bytes[:30])                       # its request line, part of its head
    wait_read_by_server(old, server.port)
    status, _, body = http_json(server.port, "POST", "/v1/completions",
                                {"prompt": "[slow=0.05] ab", "max_tokens": 3},
                                headers=session)
    old.sendall(old_bytes[30:])
    assert status == 200, body                        # the newer one: answered
    assert status_of(old) == 409                      # the older: superseded on arrival


def test_a_client_whose_seq_starts_again_is_not_locked_out(server):
    session = {"X-Session-Id": "restarted-editor"}
    for seq in (40, 41):
        status, _, _ = http_json(server.port, "POST", "/v1/completions",
                                 {"prompt": "x", "max_tokens": 1},
                                 headers={**session, "X-Session-Seq": str(seq)})
        assert status == 200
    status, _, body = http_json(server.port, "POST", "/v1/completions",
                                {"prompt": "x", "max_tokens": 1},
                                headers={**session, "X-Session-Seq": "0"})
    assert status == 200, body                        # a new epoch, not a 409
    status, _, body = http_json(server.port, "POST", "/v1/completions",
                                {"prompt": "x", "max_tokens": 1},
                                headers={**session, "X-Session-Seq": "1"})
    assert status == 200, body


def test_the_openai_client_does_not_retry_a_superseded_request(server):
    """The openai package retries a 409 (a lock timeout to it) unless the answer says
    X-Should-Retry: false; its retry of a superseded request arrived newest and
    superseded the request that had replaced it."""
    import threading
    import openai
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=2)
    session = {"X-Session-Id": "real-client"}
    outcome = {}
    model = client.models.list().data[0].id

    def older():
        try:
            client.completions.create(model=model, prompt="[slow=0.05] a", max_tokens=400,
                                      extra_headers=session)
            outcome["older"] = "answered"
        except openai.ConflictError as exc:
            outcome["older"] = exc.response.headers.get("x-should-retry")
        except Exception as exc:                       # (said in the assertion)
            outcome["older"] = repr(exc)
    thread = threading.Thread(target=older)
    thread.start()
    server.wait_generating()
    status, _, body = http_json(server.port, "POST", "/v1/completions",
                                {"prompt": "[slow=0.05] ab", "max_tokens": 30},
                                headers=session)
    thread.join(timeout=60)
    assert outcome == {"older": "false"}               # raised at once, not retried
    assert status == 200, body                         # the newer one kept its answer


TEMPLATE = "<PRE> {prefix} <SUF>{suffix} <MID>"
KEYS = ("sk-infer-a", "sk-infer-b")


@pytest.fixture(scope="module")
def fim_server():
    server = ServerProcess("--engine", "fake", "--slots", "4", "--fim-template", TEMPLATE,
                           "--api-key", KEYS[0], "--api-key", KEYS[1],
                           log_name="inferred-sessions").start()
    yield server
    assert server.stop() == 0


def keystroke(port: int, text: str, key: str = KEYS[0], path: str = "/v1/completions",
              extra: dict | None = None):
    """An editor's FIM request as the plugins send it: no session header."""
    body = {"prompt": text, "suffix": "\n    return total\n", "max_tokens": 20,
            "temperature": 0} if path == "/v1/completions" else \
        {"input_prefix": text, "input_suffix": "\n    return total\n", "prompt": "",
         "n_predict": 20}
    return raw_request(port, {**body, **(extra or {})}, {"Authorization": f"Bearer {key}"}) \
        if path == "/v1/completions" else _raw_infill(port, {**body, **(extra or {})}, key)


def _raw_infill(port, body, key):
    sock, data = raw_request(port, body, {"Authorization": f"Bearer {key}"})
    return sock, data.replace(b"/v1/completions", b"/infill", 1)


CODE = "[slow=0.05] def total(items):\n    total = 0\n    for item in items:\n        tot"


@pytest.mark.parametrize("path", ["/v1/completions", "/infill"])
def test_a_keystroke_without_a_header_supersedes_the_open_one_before_it(fim_server, path):
    """A client that leaves its previous keystroke's request open (it has not read
    anything yet) and sends no X-Session-Id: the newer keystroke of the same key and
    address replaces it, so the older one is answered 409 and the newer one 200."""
    # (5 s each: the old one outlasts a loaded machine's pause; one kind of request, as a
    # keystroke's are: other limits are another kind, app/jobs.py inference_client)
    long = {"max_tokens": 100} if path == "/v1/completions" else {"n_predict": 100}
    old, data = keystroke(fim_server.port, CODE, path=path, extra=long)
    old.sendall(data)
    fim_server.wait_generating()                       # it is running
    new, data = keystroke(fim_server.port, CODE + "a", path=path, extra=long)
    new.sendall(data)
    assert status_of(new) == 200
    assert status_of(old) == 409


def test_another_keys_keystroke_never_supersedes(fim_server):
    old, data = keystroke(fim_server.port, CODE, key=KEYS[0])
    old.sendall(data)
    fim_server.wait_generating()
    new, data = keystroke(fim_server.port, CODE + "a", key=KEYS[1])
    new.sendall(data)
    assert status_of(new) == 200 and status_of(old) == 200


def test_requests_elsewhere_in_the_file_are_both_answered(fim_server):
    old, data = keystroke(fim_server.port, CODE)
    old.sendall(data)
    fim_server.wait_generating()
    new, data = keystroke(fim_server.port, "[slow=0.05] class Basket:\n    def __init__(se")
    new.sendall(data)
    assert status_of(new) == 200 and status_of(old) == 200


def test_a_request_on_a_connection_opened_long_before_is_still_the_newest(server):
    """A client that keeps connections open ahead of time (a pool) sends its newest
    keystroke on one opened before the previous keystroke's: it is the newest by when it
    was sent, so it is answered and the previous one superseded (stamped at the
    connection's accept, it looked the older and was lost)."""
    session = {"X-Session-Id": "pooled"}
    spare, newer_bytes = raw_request(server.port, {"prompt": "[slow=0.05] ab",
                                                   "max_tokens": 3}, session)
    wait_read_by_server(spare, server.port)           # accepted, left silent
    old, old_bytes = raw_request(server.port, {"prompt": "[slow=0.05] a", "max_tokens": 400},
                                 session)
    old.sendall(old_bytes)
    server.wait_generating()                          # running
    spare.sendall(newer_bytes)
    assert status_of(spare) == 200                    # the newest: answered
    assert status_of(old) == 409                      # the one sent before it
