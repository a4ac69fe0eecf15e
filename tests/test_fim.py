"""POST /v1/fim/completions (app/fim.py) in-process, with a fake dispatcher client
(tests/test_app.py's): Mistral's names mapped onto the job, Mistral's answer shape. The
real stack and Mistral's own SDK: tests/test_clients.py."""
import json

import msgspec

from app import create_app
from test_app import MODEL, STATE, FakeDispatcherClient, completion

FIM_STATE = msgspec.structs.replace(
    STATE, models={MODEL: msgspec.structs.replace(STATE.models[MODEL], fim=True)},
    workers=[msgspec.structs.replace(STATE.workers[0], fim=True)])


class FakeFimDispatcherClient(FakeDispatcherClient):
    """The fake dispatcher of tests/test_app.py, its worker able to fill in the middle."""

    def wait_state(self, timeout: float = 2.0):
        return FIM_STATE


def fim_client():
    app = create_app({"TESTING": True, "DISPATCHER": "ipc:///nonexistent"})
    fake = FakeFimDispatcherClient(lambda job: completion("Hi!", reason="stop"))
    app.extensions["dispatcher_client"] = fake
    return app.test_client(), fake


def test_mistral_fields_become_the_job_of_a_suffixed_completion():
    http, fake = fim_client()
    response = http.post("/v1/fim/completions", json={
        "model": "", "prompt": "def f(", "suffix": "):\n", "max_completion_tokens": 7,
        "random_seed": 11, "stop": "\n\n", "top_p": 0.5, "min_tokens": 1,
        "presence_penalty": 0.1, "frequency_penalty": 0.2, "metadata": {"a": 1},
        "prompt_cache_key": "k"})
    assert response.status_code == 200, response.get_json()
    job = fake.jobs[0]
    assert (job["prompt"], job["suffix"], job["max_tokens"]) == ("def f(", "):\n", 7)
    sampling = job["sampling"]
    assert sampling["seed"] == 11 and sampling["top_p"] == 0.5
    assert sampling["temperature"] == 0.7                  # this route's default
    assert job["stop"] == ["\n\n"] and job["model"] == MODEL


def test_defaults_no_limit_and_no_suffix_is_a_plain_completion():
    http, fake = fim_client()
    http.post("/v1/fim/completions", json={"prompt": "x"})
    # (on the wire, a field left at its default is left out)
    assert fake.jobs[0].get("max_tokens") is None and fake.jobs[0].get("suffix") is None


def test_a_cursor_at_the_start_of_a_file_is_an_empty_prompt_before_a_suffix():
    """The code before the cursor is empty at a file's start: with a suffix that is a
    fill-in-the-middle request (on both routes); with none, there is nothing to
    complete."""
    http, fake = fim_client()
    for path in ("/v1/fim/completions", "/v1/completions"):
        response = http.post(path, json={"prompt": "", "suffix": "import os\n"})
        assert response.status_code == 200, response.get_json()
        assert (fake.jobs[-1]["prompt"], fake.jobs[-1]["suffix"]) == ("", "import os\n")
    for body in ({"prompt": ""}, {"prompt": "", "suffix": ""}):
        error = http.post("/v1/fim/completions", json=body).get_json()["error"]
        assert error["param"] == "prompt" and "empty" in error["message"]
        # on /v1/completions "" is OpenAI's start of a document: the model writes from
        # its BOS (a model without one: the worker's 400, no token to start from)
        assert http.post("/v1/completions", json=body).status_code == 200
        assert fake.jobs[-1]["prompt"] == ""
    error = http.post("/v1/completions", json={"prompt": []}).get_json()["error"]
    assert error["param"] == "prompt" and "empty" in error["message"]


def test_the_answer_is_chat_completion_shaped():
    http, _ = fim_client()
    body = http.post("/v1/fim/completions", json={"prompt": "x", "suffix": "y"}).get_json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    assert body["id"].startswith("cmpl-") and isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "message": {
        "role": "assistant", "content": "Hi!", "tool_calls": None, "prefix": False},
        "finish_reason": "stop"}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


def test_the_stream_is_delta_chunks_then_usage_then_done():
    http, _ = fim_client()
    raw = http.post("/v1/fim/completions", json={"prompt": "x", "suffix": "y",
                                                 "stream": True}).get_data()
    events = [line[len(b"data: "):] for line in raw.split(b"\n\n") if line]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": "H"}
    assert "".join(d["content"] for d in deltas) == "Hi!"          # always a string
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 3 + ["stop"]
    assert "usage" not in chunks[0] and chunks[-1]["usage"]["completion_tokens"] == 3


def test_the_fim_routes_prompt_is_text_with_or_without_a_suffix():
    """Mistral's `prompt` is code to complete: `<eos>` in it is text, as it was with a
    suffix; without one it was parsed as the control token. OpenAI's route keeps
    llama.cpp's parsing of special-token syntax."""
    http, fake = fim_client()
    for body in ({"prompt": "s = '<eos>'"}, {"prompt": "s = '<eos>'", "suffix": "\n"}):
        assert http.post("/v1/fim/completions", json=body).status_code == 200
        assert fake.jobs[-1]["parse_special"] is False
    assert http.post("/v1/completions", json={"prompt": "s = '<eos>'"}).status_code == 200
    assert fake.jobs[-1].get("parse_special") is None

