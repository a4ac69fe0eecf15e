"""SSE framing and text_completion objects (unit)."""
import json

from app import sse


def test_event_is_one_data_line_and_a_blank_line():
    raw = sse.event({"text": "a\nb", "x": "é"})
    assert raw.startswith(b"data: ") and raw.endswith(b"\n\n")
    assert raw.count(b"\n") == 2               # the newline in the text is escaped
    assert json.loads(raw[len(b"data: "):]) == {"text": "a\nb", "x": "é"}


def test_done_sentinel():
    assert sse.DONE == b"data: [DONE]\n\n"


def test_completion_object_shape():
    obj = sse.completion("cmpl-1", 123, "m", [sse.choice("hi", "stop")], sse.usage(3, 2))
    assert obj == {
        "id": "cmpl-1", "object": "text_completion", "created": 123, "model": "m",
        "choices": [{"text": "hi", "index": 0, "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }


def test_streaming_headers_disable_proxy_buffering():
    assert sse.SSE_HEADERS["X-Accel-Buffering"] == "no"
    assert sse.SSE_HEADERS["Cache-Control"] == "no-cache"
