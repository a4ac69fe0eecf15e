"""Type-along adoption on the real stack: a session's new request whose prompt is the
running request's prompt plus part of what it generated takes over that generation."""
import json

import pytest

from conftest import SSEStream, http_json

pytestmark = pytest.mark.integration
PROMPT = "def fibonacci(n):\n"
# no drafts: verifying one changes the arithmetic, and a near-tie may then flip the greedy
# text the comparison below expects to be the same as the reference's
PARAMS = {"max_tokens": 40, "temperature": 0, "cache_prompt": False, "speculative.n_max": 0}


def complete(port, body, headers=None):
    status, _, payload = http_json(port, "POST", "/v1/completions", body, headers=headers)
    return status, payload


def stats(server) -> dict:
    return server.status()["stats"]


def start_typing(port, session: str, chars: int) -> tuple[SSEStream, str]:
    """A session's stream, read until it has sent at least `chars` characters."""
    # (its max_tokens may differ from its successor's: long, so it is still running when
    # the next keystroke comes on a loaded machine; it ends superseded in every test)
    stream = SSEStream(port, {**PARAMS, "max_tokens": 400, "prompt": PROMPT, "stream": True},
                       headers={"X-Session-Id": session})
    assert stream.status == 200
    text = ""
    while len(text) < chars:
        text += json.loads(stream.next_data())["choices"][0]["text"]
    return stream, text


def superseded_error(stream: SSEStream) -> dict:
    rest = list(stream.events())
    assert rest[-1] == "[DONE]"
    return json.loads(rest[-2])["error"]


def test_typing_what_was_suggested_takes_over_the_running_generation(real_server):
    port = real_server.port
    before = stats(real_server)
    stream, shown = start_typing(port, "typealong-1", 12)
    typed = shown[:7]                          # the user typed 7 of the suggested chars
    status, body = complete(port, {**PARAMS, "prompt": PROMPT + typed},
                            headers={"X-Session-Id": "typealong-1"})
    assert status == 200, body
    text = body["choices"][0]["text"]
    # one generation, nothing lost: what was typed plus the new answer goes on from what
    # the stream had shown (a new generation from the prompt ending "    if " writes
    # "0 <= n", the running one had shown " n == ")
    assert text and len(typed + text) > len(shown) and (typed + text).startswith(shown)
    usage = body["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"]
    assert superseded_error(stream)["code"] == "superseded"     # the old one was told
    after = stats(real_server)
    assert after["adopted"] == before["adopted"] + 1
    assert after["superseded"] == before["superseded"] + 1


def test_typing_something_else_supersedes_as_before(real_server):
    port = real_server.port
    before = stats(real_server)
    stream, _ = start_typing(port, "typealong-2", 4)
    status, body = complete(port, {**PARAMS, "prompt": PROMPT + "    # zzz"},
                            headers={"X-Session-Id": "typealong-2"})
    assert status == 200 and body["choices"][0]["text"]
    assert superseded_error(stream)["code"] == "superseded"
    after = stats(real_server)
    assert after["adopted"] == before["adopted"]
    assert after["superseded"] == before["superseded"] + 1


def test_other_parameters_are_never_adopted(real_server):
    port = real_server.port
    before = stats(real_server)
    stream, shown = start_typing(port, "typealong-3", 8)
    status, body = complete(port, {**PARAMS, "prompt": PROMPT + shown[:4], "top_k": 5},
                            headers={"X-Session-Id": "typealong-3"})
    assert status == 200
    assert superseded_error(stream)["code"] == "superseded"
    assert stats(real_server)["adopted"] == before["adopted"]
