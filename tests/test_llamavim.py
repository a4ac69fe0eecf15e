"""llama.vim's real sequence of requests (ggml-org/llama.vim's autoload/llama.vim, the
bodies recorded in shared/notes/editor-clients.md), replayed on the whole stack with the
bundled model: typing, the prefetch of the suggestion after the one shown, accepting it
with Tab, a ring-buffer update after a yank (fire and forget, beside a completion) and
typing elsewhere. The plugin sends no X-Session-Id and cancels nothing it has sent, so
every request is answered 200 as llama-server answers it: none is superseded by the
sessions the dispatcher infers."""
import http.client
import json
import threading
import time

import pytest

from conftest import ServerProcess

pytestmark = pytest.mark.integration

TEMPLATE = "<PRE> {prefix} <SUF>{suffix} <MID>"
RESPONSE_FIELDS = ["content", "timings/prompt_n", "timings/prompt_ms",
                   "timings/prompt_per_token_ms", "timings/prompt_per_second",
                   "timings/predicted_n", "timings/predicted_ms",
                   "timings/predicted_per_token_ms", "timings/predicted_per_second",
                   "truncated", "tokens_cached"]
EXTRA = [{"filename": "utils.py", "time": [1769857200, 123456],
          "text": "def clamp(x, lo, hi):\n    return max(lo, min(x, hi))\n\n"}]
PREFIX = "import math\n\ndef add(a, b):\n    return a + b\n\ndef mul(a, b):\n"
SUFFIX = "\n\nprint(mul(2, 3))\n"


def fim(prompt: str, prefix: str = PREFIX, suffix: str = SUFFIX, predict_ms: int = 250,
        n_predict: int = 128) -> dict:
    """A completion request as llama.vim sends it (250 ms at the typed cursor, the
    configured 1000 ms for a prefetch)."""
    return {"id_slot": 0, "input_prefix": prefix, "input_suffix": suffix,
            "input_extra": EXTRA, "prompt": prompt, "n_predict": n_predict, "stop": [],
            "n_indent": 4, "top_k": 40, "top_p": 0.9,
            "samplers": ["top_k", "top_p", "infill"], "stream": False,
            "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": predict_ms,
            "response_fields": RESPONSE_FIELDS, "model": ""}


def ring_update(chunks: list[dict]) -> dict:
    return {"id_slot": 0, "input_prefix": "", "input_suffix": "", "input_extra": chunks,
            "prompt": "", "n_predict": 0, "temperature": 0.0, "samplers": [],
            "stream": False, "cache_prompt": True, "t_max_prompt_ms": 1,
            "t_max_predict_ms": 1, "response_fields": [""], "model": ""}


@pytest.fixture(scope="module")
def server():
    server = ServerProcess("--fim-template", TEMPLATE, log_name="llamavim").start()
    yield server
    assert server.stop() == 0


class Sent:
    """One request in flight on its own connection, as llama.vim's curl job."""

    def __init__(self, port: int, body: dict):
        self.result: tuple | None = None
        self.thread = threading.Thread(target=self._run, args=(port, body))
        self.thread.start()

    def _run(self, port: int, body: dict) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        conn.request("POST", "/infill", body=json.dumps(body),
                     headers={"Content-Type": "application/json",
                              "Authorization": "Bearer ", "User-Agent": "curl/7.88.1"})
        response = conn.getresponse()
        self.result = (response.status, json.loads(response.read()))
        conn.close()

    def answer(self) -> tuple[int, dict]:
        self.thread.join(timeout=120)
        assert self.result is not None, "no answer within 120 s"
        return self.result


def test_llama_vims_sequence_is_answered_whole(server):
    port = server.port
    answers = []
    # opening the buffer: a ring-buffer warm-up, then the first keystroke beside it
    warm = Sent(port, ring_update(EXTRA))
    time.sleep(0.05)
    typed = Sent(port, fim("    r"))
    answers += [warm.answer(), typed.answer()]
    suggestion = answers[-1][1]["content"]
    # the suggestion shown: its prefetch, as if it were accepted (the typed text plus it)
    prefetch = Sent(port, fim("    r" + suggestion, predict_ms=1000))
    # ... while the user types on at the cursor (llama.vim queues this one; a slow network
    # or a second editor of the same address sends it beside the prefetch)
    time.sleep(0.1)
    typed = Sent(port, fim("    re"))
    answers += [prefetch.answer(), typed.answer()]
    # Tab: the next prefetch, for the line after the accepted one
    accepted = PREFIX + "    return a * b\n\ndef div(a, b):\n"
    tab = Sent(port, fim("    return a / b", prefix=accepted, predict_ms=1000))
    # a yank in normal mode: the ring tick sends its update beside the completion
    time.sleep(0.1)
    ring = Sent(port, ring_update(EXTRA + [{"filename": "calc.py", "time": [1769857204, 5120],
                                            "text": "def add(a, b):\n    return a + b\n\n"}]))
    # typing on another line while the update still runs
    time.sleep(0.05)
    elsewhere = Sent(port, fim("    p", prefix=PREFIX + "    return a * b\n"))
    answers += [tab.answer(), ring.answer(), elsewhere.answer()]
    statuses = [status for status, _ in answers]
    assert statuses == [200] * len(answers), [a for a in answers if a[0] != 200]
    for _, body in answers[1:5] + answers[6:]:          # the fields asked for, flat
        assert "content" in body and body["timings/predicted_n"] >= 0
        assert set(body) <= set(RESPONSE_FIELDS)
    for _, body in (answers[0], answers[5]):                        # warm-ups: nothing asked
        assert body.get("content", "") == ""
    assert server.status()["stats"]["superseded"] == 0
