"""llama.cpp's log lines (workers/engine/llamalog.py): request text a line may carry is
cut, and a burst of error lines is bounded, unless --log-content (unit)."""
import io

from workers.engine.llamalog import BURST, GGML_LOG_ERROR, LINE_LIMIT, LlamaLog

INFO = 2


def log_of(**kwargs):
    clock = [0.0]
    out = io.StringIO()
    return LlamaLog(stream=out, clock=lambda: clock[0], **kwargs), out, clock


def test_an_error_line_is_cut_and_a_burst_is_bounded():
    log, out, clock = log_of()
    grammar = "root ::= " + "x" * (4 << 20)             # a 4 MB grammar in an error line
    for _ in range(100):
        log.write(GGML_LOG_ERROR, f"parse: error parsing grammar: {grammar}\n")
    written = out.getvalue().splitlines()
    assert len(written) == BURST
    assert all(len(line) < LINE_LIMIT + 40 for line in written)
    clock[0] = 11.0
    log.write(GGML_LOG_ERROR, "later\n")
    assert out.getvalue().splitlines()[-2:] == [
        "llama.cpp: 80 more error lines in 10s not logged", "later"]


def test_info_lines_only_when_verbose_and_whole_only_with_log_content():
    log, out, _ = log_of()
    log.write(INFO, "prompt text\n")
    assert out.getvalue() == ""
    log, out, _ = log_of(verbose=True)
    log.write(INFO, "p" * 1000 + "\n")
    assert len(out.getvalue()) < LINE_LIMIT + 40
    log, out, _ = log_of(verbose=True, content=True)
    log.write(INFO, "p" * 1000 + "\n")
    assert out.getvalue() == "p" * 1000 + "\n"


def test_llama_cpp_lines_are_json_objects_with_log_format_json(monkeypatch, capsys):
    """--log-format json: the worker sets llamalog.LINE, and llama.cpp's own lines become
    objects like every other part's (its level named, the worker's name on them)."""
    import json
    import logging

    from dispatcher.common import logs
    from workers import worker
    from workers.engine import llamalog
    monkeypatch.setattr(llamalog, "LINE", worker.json_llama_line)
    root = logging.getLogger()
    handler = logging.StreamHandler()
    handler.setFormatter(logs.JsonFormatter("worker", "w0-cuda0"))
    monkeypatch.setattr(root, "handlers", [handler])
    LlamaLog().write(GGML_LOG_ERROR, "llama_model_load: error loading model\n")
    line = json.loads(capsys.readouterr().err)
    assert line["part"] == "llama.cpp" and line["level"] == "error"
    assert line["worker"] == "w0-cuda0" and line["message"].endswith("error loading model")
    assert line["time"].endswith("Z")


def test_every_part_logs_json_objects_with_log_format_json():
    """A whole server (fake engine) with --log-format json: every line of the dispatcher,
    the worker, the front end (gunicorn's own lines too) and the access log is one JSON
    object with time, level and part; the worker's lines name it; the access line has
    the route, status, tokens, TTFT and duration, and the request id; no request content
    anywhere."""
    import json

    from conftest import ServerProcess, http_json
    server = ServerProcess("--engine", "fake", "--log-format", "json",
                           log_name="json-logs").start()
    try:
        assert http_json(server.port, "POST", "/v1/completions",
                         {"prompt": "SECRET-PROMPT-TEXT", "max_tokens": 3})[0] == 200
        assert http_json(server.port, "POST", "/v1/completions",
                         {"prompt": "SECRET-PROMPT-TEXT", "temperature": 9})[0] == 400
        server.wait_for(lambda: server.output().count('"error": "invalid_value"') >= 1,
                        what="the access lines")
    finally:
        assert server.stop() == 0
    output = server.output()
    lines = [json.loads(line) for line in output.splitlines() if line.strip()]
    assert all({"time", "level", "part"} <= set(line) for line in lines)
    assert {"dispatcher", "worker", "frontend", "access"} <= {line["part"] for line in lines}
    assert all(line.get("worker") for line in lines if line["part"] == "worker")
    assert any(line.get("logger") == "gunicorn.error" for line in lines)
    served = next(line for line in lines if line["part"] == "access" and
                  line["route"] == "/v1/completions" and line["status"] == 200)
    assert served["route"] == "/v1/completions" and served["completion_tokens"] == 3
    assert served["request_id"].startswith("cmpl-") and "duration_ms" in served
    assert "ttft_ms" in served
    refused = next(line for line in lines if line["part"] == "access" and
                   line["status"] == 400)
    assert refused["error"] == "invalid_value"
    assert "SECRET-PROMPT-TEXT" not in output


def test_a_json_log_line_stays_one_line_for_every_reader():
    """json.dumps without ASCII escapes leaves NEL, U+2028 and U+2029 raw, where Python's
    splitlines and some log viewers break a line: a client's User-Agent or path carrying
    one cut an access-log record in two. They are escaped; other text stays as it is."""
    import json
    import logging

    from dispatcher.common.logs import JsonFormatter, json_line, one_line_json
    value = {"user_agent": "a\x85b\u2028c\u2029d é"}
    line = one_line_json(value)
    assert len(line.splitlines()) == 1 and "é" in line and json.loads(line) == value
    assert len(json_line("worker", "info", "x\u2028y").splitlines()) == 1
    record = logging.LogRecord("t", logging.INFO, __file__, 1, "p\u2029q", None, None)
    assert len(JsonFormatter("worker").format(record).splitlines()) == 1
