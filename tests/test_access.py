"""The access log (app/access.py): its line format, and the lines an in-process app writes
for the requests it answers, with a fake dispatcher client (tests/test_app.py's)."""
import hashlib
import json
import re

from app import create_app
from app.access import FIELDS, format_line, key_fingerprint, logfmt_value
from test_app import FakeDispatcherClient, completion


def parse(line: str) -> dict:
    pairs = re.findall(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)', line)
    return {k: (json.loads(v) if v.startswith('"') else v) for k, v in pairs}


def test_values_are_bare_or_json_quoted_on_one_ascii_line():
    assert logfmt_value("curl/7.88.1") == "curl/7.88.1"
    assert logfmt_value(None) == logfmt_value("") == "-"
    assert logfmt_value(12.345) == "12.3"
    for hostile in ('a "b" c', "x=y", "new\nline", "\x1b[31mred", "é", "back\\slash"):
        text = logfmt_value(hostile)
        assert text.isascii() and "\n" not in text and json.loads(text) == hostile
    assert len(json.loads(logfmt_value("x " * 1000))) == 200          # cut


def test_a_line_has_every_field_in_order():
    line = format_line({"status": 200, "route": "/v1/completions", "user_agent": "a b"})
    assert list(parse(line)) == list(FIELDS)
    assert parse(line)["user_agent"] == "a b" and parse(line)["worker"] == "-"


def test_the_key_is_only_a_fingerprint():
    assert key_fingerprint("Bearer sk-1") == hashlib.sha256(b"sk-1").hexdigest()[:8]
    assert key_fingerprint("") == key_fingerprint("Bearer ") == key_fingerprint("Basic x") \
        == "-"


def app_with_log(tmp_path, destination):
    app = create_app({"TESTING": True, "DISPATCHER": "ipc:///nonexistent",
                      "ACCESS_LOG": destination})
    fake = FakeDispatcherClient(lambda job: completion("Hello"))
    app.extensions["dispatcher_client"] = fake
    return app.test_client()


def test_each_request_gets_one_line_once_answered(tmp_path):
    log = tmp_path / "access.log"
    http = app_with_log(tmp_path, str(log))
    response = http.post("/v1/completions", json={"prompt": "secret words", "max_tokens": 5},
                         headers={"User-Agent": "llama.vim"})
    response.close()
    response = http.post("/v1/completions", json={"prompt": "x", "stream": True})
    assert response.get_data().endswith(b"data: [DONE]\n\n")
    response.close()
    refused = http.post("/v1/completions", json={"prompt": "x", "max_tokens": "5"})
    refused.close()
    http.get("/health").close()
    lines = [parse(line) for line in log.read_text().splitlines()]
    assert "secret" not in log.read_text()
    assert [(x["method"], x["route"], x["status"]) for x in lines] == [
        ("POST", "/v1/completions", "200"), ("POST", "/v1/completions", "200"),
        ("POST", "/v1/completions", "400"), ("GET", "/health", "200")]
    first = lines[0]
    assert first["request_id"].startswith("cmpl-") and first["worker"] == "w0"
    assert (first["prompt_tokens"], first["cached_tokens"], first["completion_tokens"]) \
        == ("3", "1", "5")
    assert first["user_agent"] == "llama.vim" and first["error"] == "-"
    assert float(first["ttft_ms"]) <= float(first["duration_ms"])
    assert lines[2]["error"] == "invalid_value"        # named as its answer names it
    assert lines[2]["request_id"] == refused.headers["X-Request-Id"]


def test_off_writes_nothing(tmp_path, capsys):
    http = app_with_log(tmp_path, "off")
    http.get("/health").close()
    assert "route=" not in capsys.readouterr().err
    http = app_with_log(tmp_path, "-")
    http.get("/health").close()
    assert "route=/health" in capsys.readouterr().err
