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
