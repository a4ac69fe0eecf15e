"""The HTTP front end in-process, flaskr style: `create_app(test_config)` with a fake
dispatcher client standing in for the dispatcher and the workers. Routes, validation and
response assembly; the real stack is tested elsewhere."""
import io
import json
import math
import os

import msgspec
import pytest

from app import create_app
from dispatcher.common import protocol as P
from dispatcher.common.latency import LatencyRecorder

MODEL = "tiny"
STATE = msgspec.convert({"workers_ready": 1, "expected_workers": 1, "queued": 0, "draining": False,
         "models": {MODEL: {"ready": 1, "n_ctx": 4096, "slots": 8, "fim": False,
                            "created": 0}},
         "workers": [{"model": MODEL, "n_ctx": 4096, "compute": "cpu", "n_gpu_layers": 0,
                      "profile": None, "fim": False}]}, P.State)
GENERATION = set(P.Generation.__struct_fields__)


def flat(job: P.WorkerJob) -> dict:
    """A job as it goes on the wire, its generation's fields beside the envelope's."""
    wire = msgspec.to_builtins(job)
    return {**wire, **wire.pop("generation")}


def as_job(fields: dict) -> P.WorkerJob:
    """The inverse: envelope and generation fields, as one job."""
    generation = {k: v for k, v in fields.items() if k in GENERATION}
    envelope = {k: v for k, v in fields.items() if k not in GENERATION}
    return msgspec.convert({**envelope, "generation": generation}, P.WorkerJob)


class FakeStream:
    """One job's scripted events."""

    def __init__(self, events: list):
        self.events = [e if isinstance(e, P.Event) else msgspec.convert(e, P.AnyEvent)
                       for e in events]
        self.closed = False
        self.last_size = 0               # (RequestStream's: wire bytes of the last event)

    def next_event(self) -> dict:
        event = self.events.pop(0)
        self.last_size = len(msgspec.json.encode(event))
        return event

    def close(self) -> None:
        self.closed = True


class FakeDispatcherClient:
    """Answers every job with `script(job)`'s events; remembers the jobs."""

    def __init__(self, script):
        self.pid = os.getpid()
        self.script = script
        self.jobs: list[dict] = []
        self.recorder = LatencyRecorder()
        self.served = 0

    def wait_state(self, timeout: float = 2.0) -> P.State:
        return STATE

    def submit(self, job: P.WorkerJob) -> FakeStream:
        self.jobs.append(flat(job))
        return FakeStream(self.script(self.jobs[-1]))

    def client_gone(self, request_id: str) -> None:
        pass

    def metrics_snapshot(self, timeout: float = 3.0):
        return None


def completion(text: str, reason: str = "length", score: float = 0.0) -> list[dict]:
    events = [{"e": P.EV_START, "s": 0, "prompt_tokens": 3, "cached_tokens": 1,
               "fingerprint": "fp_test", "worker": "w0", "device": "cpu"}]
    events += [{"e": P.EV_TEXT, "s": 1 + i, "text": ch} for i, ch in enumerate(text)]
    events.append({"e": P.EV_END, "s": 1 + len(text), "finish_reason": reason,
                   "score": score,
                   "usage": {"prompt_tokens": 3, "completion_tokens": len(text)}})
    return events


@pytest.fixture
def client_of():
    def make(script):
        app = create_app({"TESTING": True, "DISPATCHER": "ipc:///nonexistent"})
        fake = FakeDispatcherClient(script)
        app.extensions["dispatcher_client"] = fake
        return app.test_client(), fake
    return make


@pytest.fixture
def client(client_of):
    return client_of(lambda job: completion("Hello"))


def test_a_completion_is_assembled_from_the_job_events(client):
    http, fake = client
    response = http.post("/v1/completions", json={"prompt": "Say hi", "max_tokens": 5,
                                                  "temperature": 0})
    body = response.get_json()
    assert response.status_code == 200 and response.headers["X-Request-Id"]
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert body["choices"] == [{"text": "Hello", "index": 0, "logprobs": None,
                                "finish_reason": "length"}]
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 5
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 1}
    assert body["system_fingerprint"] == "fp_test"
    job = fake.jobs[0]
    assert job["model"] == MODEL and job["prompt"] == "Say hi" and job["max_tokens"] == 5
    assert job["sampling"]["temperature"] == 0 and job.get("fanout", 1) == 1


def test_ollama_and_vllm_fields_other_clients_send_are_folded_in_or_named(client):
    """twinny's "openai-compatible" provider sends Ollama's `options` and `keep_alive`
    (src/extension/provider-options.ts): a 400 here, dropped unread by vLLM and
    llama-server (the answer's length lost). vLLM's extra fields (the openai SDK's
    `extra_body`): accepted where they ask for what this server does, guided_json and
    guided_choice made a schema and a grammar, any other value refused by name."""
    http, fake = client
    twinny = {"model": MODEL, "prompt": "<|fim_prefix|>def f():<|fim_suffix|>\n"
              "<|fim_middle|>", "stream": True, "keep_alive": "5m",
              "options": {"temperature": 0.2, "num_predict": 512}}
    answer = http.post("/v1/completions", json=twinny)
    assert answer.status_code == 200 and b"data: [DONE]" in answer.data
    assert fake.jobs[-1]["max_tokens"] == 512
    assert fake.jobs[-1]["sampling"]["temperature"] == pytest.approx(0.2)
    vllm = {"model": MODEL, "prompt": "x", "max_tokens": 4, "skip_special_tokens": True,
            "include_stop_str_in_output": False, "use_beam_search": False,
            "length_penalty": 1.0, "stop_token_ids": [], "priority": 0,
            "guided_choice": ["yes", "no"]}
    assert http.post("/v1/completions", json=vllm).status_code == 200
    assert fake.jobs[-1]["sampling"]["grammar"] == 'root ::= "yes" | "no"'
    for field, value in (("skip_special_tokens", False), ("stop_token_ids", [7]),
                         ("include_stop_str_in_output", True), ("use_beam_search", True)):
        refused = http.post("/v1/completions", json={"prompt": "x", field: value})
        error = refused.get_json()["error"]
        assert refused.status_code == 400 and error["param"] == field, error
    refused = http.post("/v1/completions", json={"prompt": "x", "options": {"gpu": 1}})
    assert refused.status_code == 400 and refused.get_json()["error"]["param"] == "options"
    refused = http.post("/v1/completions", json={"prompt": "x", "made_up": 1})
    assert refused.status_code == 400        # (an unknown field is still named: OpenAI's)
    jobs = len(fake.jobs)                    # llama.cpp's own route ignores them, as ever
    assert http.post("/completion", json={"prompt": "x", "n_predict": 2,
                                          "options": {"weird": 1}}).status_code == 200
    assert len(fake.jobs) == jobs + 1


@pytest.mark.parametrize("order", [("fine", "refused"), ("refused", "fine")])
def test_a_stream_whose_later_prompt_is_refused_is_a_400_whatever_its_place(client_of, order):
    """The worker refuses a prompt (over the context, ids outside the vocabulary): a
    stream of several prompts is a 400 wherever that prompt is, as a whole answer is. It
    was a 200, the first prompt's text and an error event, when the refused one came
    second (the openai client raised a bare APIError, no BadRequestError)."""
    refusal = [{"e": P.EV_ERROR, "s": 0, "status": 400, "type": "invalid_request_error",
                "code": "context_length_exceeded", "param": "prompt",
                "message": "This prompt has 9000 tokens; the context holds 4096."}]
    http, fake = client_of(lambda job: refusal if job.get("prompt") == "refused"
                           else completion("Hi"))
    for stream in (True, False):
        answer = http.post("/v1/completions", json={"prompt": list(order), "n": 2,
                                                    "stream": stream})
        assert answer.status_code == 400, answer.get_data(as_text=True)
        assert answer.get_json()["error"]["code"] == "context_length_exceeded"
    fine = http.post("/v1/completions", json={"prompt": ["fine", "fine"], "n": 2,
                                              "stream": True}).get_data(as_text=True)
    assert fine.replace(' ', '').count('"finish_reason":"length"') == 4 and fine.endswith("data: [DONE]\n\n")


def test_a_stream_holds_a_bounded_answer_while_a_later_prompt_waits(client_of, monkeypatch):
    """While a later prompt waits for its checks (for a slot, behind the earlier ones),
    the earlier prompts' events are held at most HOLD_BYTES; past that the stream starts,
    and a refusal still to come is an error event in it (they piled up unbounded)."""
    from app import completions
    monkeypatch.setattr(completions, "HOLD_BYTES", 4096)
    refusal = [{"e": P.EV_ERROR, "s": 0, "status": 400, "type": "invalid_request_error",
                "code": "context_length_exceeded", "param": "prompt", "message": "too long"}]
    long = completion("x" * 200)                       # (well over 4 KiB of events)
    http, _ = client_of(lambda job: refusal if job.get("prompt") == "refused" else long)
    answer = http.post("/v1/completions", json={"prompt": ["fine", "refused"],
                                                "stream": True})
    body = answer.get_data(as_text=True)
    assert answer.status_code == 200 and '"context_length_exceeded"' in body.replace(" ", "")
    assert body.endswith("data: [DONE]\n\n")


def test_prompts_times_choices_become_numbered_jobs(client):
    http, fake = client
    body = http.post("/v1/completions", json={"prompt": ["a", "b"], "n": 2}).get_json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    # each prompt is sent once: a prompt's later choices name the job that carried it
    a, a2, b, b2 = fake.jobs
    assert (a["prompt"], b["prompt"]) == ("a", "b") and {j["fanout"] for j in fake.jobs} == {4}
    assert "prompt" not in a2 and a2["same_as"] == a["id"]
    assert "prompt" not in b2 and b2["same_as"] == b["id"]
    assert len({j["id"] for j in fake.jobs}) == 4
    assert body["usage"]["prompt_tokens"] == 6           # each prompt counted once


def test_best_of_keeps_the_candidates_with_the_best_mean_logprob(client_of):
    scores = iter([-3.0, -0.5, -2.0])
    texts = iter(["bad", "best", "mid"])
    http, fake = client_of(lambda job: completion(next(texts), score=next(scores)))
    body = http.post("/v1/completions", json={"prompt": "p", "best_of": 3,
                                              "n": 1}).get_json()
    assert [c["text"] for c in body["choices"]] == ["best"]
    assert all(j["score"] for j in fake.jobs)
    assert body["usage"]["completion_tokens"] == 3 + 4 + 3      # discarded ones count


def test_best_of_equal_to_n_streams_every_candidate_as_a_choice(client_of):
    texts = iter(["one", "two"])
    http, fake = client_of(lambda job: completion(next(texts)))
    response = http.post("/v1/completions", json={"prompt": "p", "n": 2, "best_of": 2,
                                                  "stream": True})
    frames = [f for f in response.get_data(as_text=True).split("\n\n") if f]
    assert response.status_code == 200 and frames[-1] == "data: [DONE]"
    chunks = [json.loads(f[len("data: "):]) for f in frames[:-1]]
    by_index = {0: "", 1: ""}
    for chunk in chunks:
        by_index[chunk["choices"][0]["index"]] += chunk["choices"][0]["text"]
    assert sorted(by_index.values()) == ["one", "two"] and len(fake.jobs) == 2
    assert not any(j.get("score") for j in fake.jobs)          # (nothing to choose)


def test_a_stream_is_sse_chunks_then_done(client):
    http, _ = client
    response = http.post("/v1/completions", json={
        "prompt": "p", "stream": True, "stream_options": {"include_usage": True}})
    assert response.status_code == 200 and response.mimetype == "text/event-stream"
    frames = [f for f in response.get_data(as_text=True).split("\n\n") if f]
    assert frames[-1] == "data: [DONE]"
    chunks = [json.loads(f[len("data: "):]) for f in frames[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "Hello"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5


def test_a_worker_error_before_any_text_is_the_status_it_carries(client_of):
    error = P.WireError(status=400, code="context_length_exceeded", message="too long",
                        param="prompt").event()
    http, _ = client_of(lambda job: [error])
    response = http.post("/v1/completions", json={"prompt": "p"})
    assert response.status_code == 400
    assert response.get_json()["error"] == {"message": "too long",
                                            "type": "invalid_request_error",
                                            "param": "prompt",
                                            "code": "context_length_exceeded"}


def test_every_error_names_its_request_and_a_superseded_one_is_not_retried(client_of):
    """The openai packages read X-Request-Id into the error they raise (it was missing on
    every error) and retry a 409 unless X-Should-Retry says no: a superseded request's
    retry superseded the newer one."""
    superseded = P.WireError(status=409, code="superseded", message="newer one").event()
    http, _ = client_of(lambda job: [superseded])
    response = http.post("/v1/completions", json={"prompt": "p"})
    assert response.status_code == 409
    assert response.headers["X-Should-Retry"] == "false"
    assert response.headers["X-Request-Id"].startswith(P.new_request_id()[:4])
    refused = http.post("/v1/completions", json={"prompt": "p", "max_tokens": "x"})
    assert refused.status_code == 400 and refused.headers["X-Request-Id"]
    assert "X-Should-Retry" not in refused.headers
    assert http.get("/nope").headers["X-Request-Id"]
    ids = {http.post("/v1/completions", json={}).headers["X-Request-Id"] for _ in range(3)}
    assert len(ids) == 3


def test_an_error_after_the_stream_started_is_an_error_event(client_of):
    failed = P.WireError(status=500, code="generation_failed",
                         message="generation failed: x").event()
    http, _ = client_of(lambda job: completion("Hi")[:2] + [failed])
    response = http.post("/v1/completions", json={"prompt": "p", "stream": True})
    frames = [f for f in response.get_data(as_text=True).split("\n\n") if f]
    assert frames[-1] == "data: [DONE]"
    assert json.loads(frames[-2][len("data: "):])["error"]["code"] == "generation_failed"


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": "p", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "p", "unknown": 1}, 400, "unknown"),
    ({"prompt": "a\ud800"}, 400, "prompt"),
    ({"prompt": "p", "model": "other"}, 404, "model"),
    ({"prompt": "p", "compute": "gpu"}, 400, "compute"),
])
def test_bad_requests_never_reach_the_dispatcher(client, body, status, param):
    http, fake = client
    response = http.post("/v1/completions", data=json.dumps(body),
                         content_type="application/json")
    assert response.status_code == status
    assert response.get_json()["error"]["param"] == param
    assert fake.jobs == []


def test_a_route_is_refused_here_unless_a_worker_that_may_meet_it_is_coming(client,
                                                                           monkeypatch):
    """Two workers run, one registered: while the other starts it may meet the route, so
    the dispatcher answers (a 503 to retry); once it gave up (it cannot load its model,
    never respawned) the front end refuses at once, naming what is there."""
    http, fake = client
    body = {"prompt": "p", "compute": "gpu"}
    starting = msgspec.structs.replace(STATE, expected_workers=2, coming_workers=2)
    monkeypatch.setattr(fake, "wait_state", lambda timeout=2.0: starting)
    http.post("/v1/completions", json=body)
    assert len(fake.jobs) == 1                             # (the dispatcher decides)
    gave_up = msgspec.structs.replace(STATE, expected_workers=2, coming_workers=1)
    monkeypatch.setattr(fake, "wait_state", lambda timeout=2.0: gave_up)
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 400 and len(fake.jobs) == 1
    assert response.get_json()["error"]["param"] == "compute"


def test_a_wrong_method_is_405_with_allow(client):
    http, _ = client
    response = http.get("/v1/completions")
    assert response.status_code == 405 and response.headers["Allow"] == "OPTIONS, POST"
    assert response.get_json()["error"]["code"] == "method_not_allowed"


def test_the_model_a_request_without_one_gets_is_listed_first(client_of, monkeypatch):
    """Clients take the list's first model for the server's default: the config's first
    (alphabetical order put `alpha` before the default `zeta`)."""
    state = msgspec.structs.replace(STATE, models={
        name: STATE.models[MODEL] for name in ("zeta", "alpha", "mid")},
        default_model="zeta")
    http, fake = client_of(lambda job: completion("Hi"))
    monkeypatch.setattr(fake, "wait_state", lambda timeout=2.0: state)
    assert [m["id"] for m in http.get("/v1/models").get_json()["data"]] == \
        ["zeta", "alpha", "mid"]
    from app.requests import resolve_model
    assert resolve_model(None, state) == "zeta"


def test_an_empty_suffix_on_a_model_without_fim_is_a_plain_completion(client_of,
                                                                     monkeypatch):
    """Nothing after the cursor: on a model with no fill-in-the-middle tokens the request
    completes the prompt (it was a 400 fim_unsupported at the end of every file for a
    client that always sends `suffix`); a model with them reads the FIM layout."""
    http, fake = client_of(lambda job: completion("Hi"))
    answer = http.post("/v1/completions", json={"prompt": "def f(", "suffix": "",
                                                "max_tokens": 2})
    assert answer.status_code == 200, answer.get_json()
    assert fake.jobs[-1].get("suffix") is None and not fake.jobs[-1]["route"].get("fim")
    fim = msgspec.structs.replace(STATE, models={
        MODEL: msgspec.structs.replace(STATE.models[MODEL], fim=True)}, workers=[
        msgspec.structs.replace(STATE.workers[0], fim=True)])
    monkeypatch.setattr(fake, "wait_state", lambda timeout=2.0: fim)
    http.post("/v1/completions", json={"prompt": "def f(", "suffix": "", "max_tokens": 2})
    assert fake.jobs[-1]["suffix"] == "" and fake.jobs[-1]["route"]["fim"] is True


def test_models_and_health_come_from_the_dispatcher_state(client):
    http, _ = client
    assert [m["id"] for m in http.get("/v1/models").get_json()["data"]] == [MODEL]
    health = http.get("/health")
    assert health.status_code == 200 and health.get_json()["workers_ready"] == 1
    # (llama-server's other names for both)
    assert http.get("/v1/health").get_json() == health.get_json()
    assert http.get("/models").get_json() == http.get("/v1/models").get_json()


def test_props_answers_as_llama_server_from_the_dispatcher_state(client):
    """GET /props (llama.cpp's web UI and client libraries read it first): the model's
    context and slots, and the defaults a /completion without them gets."""
    http, _ = client
    props = http.get("/props").get_json()
    assert props["model_alias"] == MODEL and props["total_slots"] >= 1
    settings = props["default_generation_settings"]
    assert settings["n_ctx"] > 0 and settings["params"]["temperature"] == 0.8
    assert settings["params"]["top_k"] == 40 and settings["params"]["n_predict"] == -1
    assert http.get("/props?model=" + MODEL).get_json() == props
    # (one model served: any name is it, as llama-server ignores the name)
    assert http.get("/props?model=nope").get_json() == props


def test_native_completion_ignores_openais_best_of_as_llama_server_does(client):
    """llama.cpp does not know best_of: one job, one answer object (it was three jobs and
    a list of three unselected summaries)."""
    http, fake = client
    body = http.post("/completion", json={"prompt": "x", "best_of": 3}).get_json()
    assert isinstance(body, dict) and body["content"] == "Hello", body
    assert len(fake.jobs) == 1


def test_a_native_stream_asks_for_its_tokens_ids_as_llama_server_sends_them(client):
    """llama-server puts each streamed token's id in its chunk (`tokens`), asked or not:
    a native stream's job asks for them, and may still take over a running generation
    (type-along adoption carries the ids); OpenAI's stream and a whole answer do not."""
    http, fake = client
    http.post("/completion", json={"prompt": "x", "stream": True},
              headers={"X-Session-Id": "s"}).get_data()
    http.post("/completion", json={"prompt": "x"}, headers={"X-Session-Id": "s"})
    http.post("/v1/completions", json={"prompt": "x", "stream": True},
              headers={"X-Session-Id": "s"}).get_data()
    stream, whole, openai = fake.jobs
    assert stream["return_tokens"] is True and stream["adopt_key"]
    assert not whole["return_tokens"] and not openai["return_tokens"]


def test_a_negative_temperature_is_greedy_on_llama_cpps_routes(client):
    """llama-server takes a temperature of 0 or below as greedy (clients send -1); the
    native route refused it; OpenAI's route keeps OpenAI's 0-2."""
    http, fake = client
    assert http.post("/completion", json={"prompt": "x", "temperature": -1}).status_code == 200
    assert fake.jobs[-1]["sampling"]["temperature"] == -1
    answer = http.post("/v1/completions", json={"prompt": "x", "temperature": -1})
    assert answer.status_code == 400 and answer.get_json()["error"]["param"] == "temperature"


def test_tokenize_is_a_job_for_a_worker(client_of):
    http, fake = client_of(lambda job: [{"e": P.EV_END, "s": 0, "result": {"tokens": [7]}}])
    body = http.post("/tokenize", json={"content": "hi"}).get_json()
    assert body == {"tokens": [7]} and fake.jobs[0]["op"] == "tokenize"


def test_adopt_key_is_the_request_less_its_prompt_and_limits():
    from app.jobs import adopt_key
    job = {"id": "r", "model": "m", "prompt": "def f(", "suffix": "\n", "max_tokens": 16,
           "stop": [], "echo": False, "logprobs": None, "score": False,
           "sampling": {"temperature": 0}, "session": "s", "session_order": 1,
           "parent": "r", "fanout": 1, "timeout": None}
    key = adopt_key(as_job(job))
    assert key and key == adopt_key(as_job({**job, "id": "r2", "parent": "r2",
                                            "prompt": "def f(x", "max_tokens": 64,
                                            "session_order": 2}))
    assert adopt_key(as_job({**job, "suffix": "\nreturn"})) != key
    assert adopt_key(as_job({**job, "sampling": {"temperature": 0.5}})) != key
    for never in ({"session": None}, {"fanout": 2}, {"prompt": [1, 2]}, {"echo": True},
                  {"logprobs": 0}, {"n_probs": 3}, {"score": True}):
        assert adopt_key(as_job({**job, **never})) is None


def test_a_longer_prompt_of_the_same_session_keeps_its_adoption_key(client):
    """What the front end adds to a job from its prompt (its estimated prefill) must not
    tell a keystroke's request from the one it would adopt: it did, and type-along
    adoption stopped."""
    http, fake = client
    for prompt in ("def fibonacci(n):\n", "def fibonacci(n):\n    if n <= 1:" * 20):
        assert http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8},
                         headers={"X-Session-Id": "s"}).status_code == 200
    first, second = fake.jobs
    assert first["prompt_work"] != second["prompt_work"]
    assert first["adopt_key"] and first["adopt_key"] == second["adopt_key"]


def test_a_keystroke_asking_another_max_tokens_keeps_its_adoption_key(client):
    """max_tokens may differ between a request and the one that adopts its generation
    (the worker holds the new one to its own limit); the job's copy of it for the queue
    (`tokens`) was in the key, so a client varying it never adopted."""
    http, fake = client
    for max_tokens in (16, 32):
        assert http.post("/v1/completions", json={"prompt": "def f(", "max_tokens":
                                                  max_tokens},
                         headers={"X-Session-Id": "s"}).status_code == 200
    first, second = fake.jobs
    assert first["tokens"] != second["tokens"]
    assert first["adopt_key"] and first["adopt_key"] == second["adopt_key"]


def test_brackets_inside_strings_do_not_count_as_arrays(client):
    from app.bodies import MAX_JSON_CONTAINERS
    http, fake = client
    code = "[" * (MAX_JSON_CONTAINERS + 10) + '"\\"{'    # inside the string, escapes too
    response = http.post("/v1/completions", json={"prompt": code, "max_tokens": 1})
    assert response.status_code == 200, response.get_json()
    many = b'{"prompt": "x", "junk": [' + b"[]," * (MAX_JSON_CONTAINERS + 10) + b"[]]}"
    response = http.post("/v1/completions", data=many, content_type="application/json")
    assert response.status_code == 400
    assert "arrays and objects" in response.get_json()["error"]["message"]


def test_a_json_schema_nested_near_the_parsers_limit_is_a_400(client):
    """An `enum` nested about 930-990 deep (where depends on the stack) passed the JSON
    parse and then broke the schema's own text (a 500). Every depth from 900 to 1,000 is
    a 400 now, by the parse or the schema's bound."""
    http, fake = client
    for depth in range(900, 1001):
        body = '{"prompt": "a", "json_schema": {"enum": ' + "[" * depth + "]" * depth + "}}"
        response = http.post("/v1/completions", data=body, content_type="application/json")
        assert response.status_code == 400, (depth, response.get_json())
        assert response.get_json()["error"]["code"] == "invalid_json" or \
            response.get_json()["error"]["param"] == "json_schema"
    assert fake.jobs == []


def test_a_quote_never_closed_before_many_escaped_quotes_is_read_once(client):
    """Past 100,000 brackets the body's strings are taken out before counting. A string
    had to end with a quote, so one never closed, before 70,000 escaped quotes (300 KB),
    was scanned again from each of them: 40 s of a front end's CPU, past the heartbeat
    gunicorn kills it for, every stream of it lost. Now read once (a millisecond; the
    bound below is thousands of times that)."""
    import time
    from app.bodies import MAX_JSON_CONTAINERS, check_shape
    http, fake = client
    raw = b"[" * (MAX_JSON_CONTAINERS + 1) + b'"' + b'\\"' * 70_000
    started = time.monotonic()
    with pytest.raises(Exception, match="arrays and objects"):
        check_shape(raw)
    assert time.monotonic() - started < 5
    response = http.post("/completion", data=raw, content_type="application/json")
    assert response.status_code == 400 and fake.jobs == []


def test_a_number_too_long_in_a_grammar_is_a_400(client):
    http, _ = client
    for grammar in ('root ::= "a"{' + "9" * 5000 + "}", "root ::= <[" + "1" * 5000 + "]>"):
        response = http.post("/v1/completions", json={"prompt": "x", "grammar": grammar})
        assert response.status_code == 400, response.get_json()
        assert response.get_json()["error"]["param"] == "grammar"


def test_the_client_a_session_is_inferred_for_is_its_key_and_address():
    """app.requests.client_of: keys and addresses tell clients apart; X-Forwarded-For
    counts only from a proxy on this host (its last entry, the address nginx saw); a
    request that names its session has no inferred one."""
    from app.requests import client_of as fingerprint
    app = create_app({"TESTING": True, "DISPATCHER": "ipc:///nonexistent",
                      "API_KEY": "ka,kb"})

    def who(addr="10.0.0.5", key="ka", **headers):
        headers.setdefault("Authorization", f"Bearer {key}")
        with app.test_request_context("/", headers=headers,
                                      environ_base={"REMOTE_ADDR": addr}):
            from flask import request
            return fingerprint(request)

    assert who() == who() and who() != who(key="kb") and who() != who(addr="10.0.0.6")
    assert who(addr="127.0.0.1", **{"X-Forwarded-For": "1.2.3.4, 10.0.0.5"}) == who()
    assert who(**{"X-Forwarded-For": "10.0.0.6"}) == who()      # not from a local proxy
    assert who(**{"X-Session-Id": "mine"}) is None


def test_with_keys_only_the_health_routes_are_open():
    app = create_app({"TESTING": True, "DISPATCHER": "ipc:///nonexistent",
                      "API_KEY": "ka"})
    app.extensions["dispatcher_client"] = FakeDispatcherClient(lambda job: completion("Hi"))
    http = app.test_client()
    for path in ("/health", "/v1/health"):
        assert http.get(path).status_code == 200, path
    for path in ("/models", "/v1/models", "/props"):
        assert http.get(path).status_code == 401, path
        assert http.get(path, headers={"Authorization": "Bearer ka"}).status_code == 200


def test_llama_cpps_predicted_count_takes_the_end_token_it_sampled(client_of):
    """llama-server counts the end-of-generation token among `tokens_predicted` and
    `timings.predicted_n` (its n_decoded is counted before the end is seen); OpenAI's
    usage and `tokens_cached` (the cache never holds it) do not."""
    def ended(job):
        events = completion("Hi", reason="stop")
        events[-1]["stop_type"] = "eos"
        return events
    http, _ = client_of(ended)
    answer = http.post("/completion", json={"prompt": "x"}).get_json()
    assert answer["stop_type"] == "eos" and answer["tokens_predicted"] == 3
    assert answer["timings"]["predicted_n"] == 3 and answer["tokens_cached"] == 3 + 2
    usage = http.post("/v1/completions", json={"prompt": "x"}).get_json()["usage"]
    assert usage["completion_tokens"] == 2
    http, _ = client_of(lambda job: completion("Hi"))           # (a limit: no end token)
    assert http.post("/completion", json={"prompt": "x"}).get_json()["tokens_predicted"] == 2


def test_a_tokenize_job_carries_its_keys_tenant():
    """A worker keeps long texts' tokenizations per tenant (--cache-scope key): /tokenize
    and /detokenize jobs went without a tenant, so one key's text tokenized came back
    sooner to another key asking for the same (a timing oracle), and the dispatcher
    could not count them to a key."""
    app = create_app({"TESTING": True, "DISPATCHER": "ipc:///nonexistent",
                      "API_KEY": "ka,kb", "CACHE_SCOPE": "key"})
    fake = FakeDispatcherClient(lambda job: [{"e": P.EV_END, "s": 0,
                                              "result": {"tokens": [7]}}])
    app.extensions["dispatcher_client"] = fake
    http = app.test_client()
    for key in ("ka", "kb"):
        assert http.post("/tokenize", json={"content": "hi"},
                         headers={"Authorization": f"Bearer {key}"}).status_code == 200
    first, second = fake.jobs
    assert first["tenant"] and second["tenant"] and first["tenant"] != second["tenant"]
    assert first["api_key"] and first["api_key"] != second["api_key"]


def test_a_refused_status_read_is_in_the_access_log(tmp_path):
    """/v1/status is left out of the access log (the status page reads it every 1.5 s),
    but a refusal there is logged: a key guessed against it was seen nowhere."""
    log = tmp_path / "access.log"
    app = create_app({"TESTING": True, "DISPATCHER": "ipc:///nonexistent",
                      "API_KEY": "ka", "STATUS_ACCESS": "key", "ACCESS_LOG": str(log)})
    app.extensions["dispatcher_client"] = FakeDispatcherClient(lambda job: completion("x"))
    http = app.test_client()
    for _ in range(2):
        response = http.get("/v1/status", headers={"Authorization": "Bearer kz"})
        response.close()                        # (the line is written as it ends)
        assert response.status_code == 401
    lines = [line for line in log.read_text().splitlines() if "/v1/status" in line]
    assert len(lines) == 2 and all("401" in line for line in lines), lines


def test_any_model_name_serves_the_one_model_when_switched_on(client_of):
    from app import create_app
    app = create_app({"TESTING": True, "DISPATCHER": "ipc:///nonexistent",
                      "ANY_MODEL_NAME": True})
    fake = FakeDispatcherClient(lambda job: completion("Hi"))
    app.extensions["dispatcher_client"] = fake
    answer = app.test_client().post("/v1/completions", json={"model": "PLACEHOLDER",
                                                             "prompt": "x"})
    assert answer.status_code == 200 and answer.get_json()["model"] == MODEL
    http, _ = client_of(lambda job: completion("Hi"))           # off: a 404 naming it
    answer = http.post("/v1/completions", json={"model": "PLACEHOLDER", "prompt": "x"})
    assert answer.status_code == 404 and answer.get_json()["error"]["code"] == \
        "model_not_found"


def test_an_unknown_route_says_what_this_server_serves(client):
    http, _ = client
    answer = http.post("/v1/chat/completions", json={"messages": []})
    error = answer.get_json()["error"]
    assert answer.status_code == 404 and error["code"] == "not_found"
    assert "not chat" in error["message"] and "POST /v1/completions" in error["message"]
    message = http.get("/nope").get_json()["error"]["message"]
    assert "no route /nope" in message
    # every route served is named (a list written by hand left out /props, /models and
    # /v1/health), and none that is not
    for served in ("GET /props", "GET /models", "GET /v1/health", "POST /infill",
                   "GET /v1/models/{model}", "POST /v1/fim/completions", "GET /metrics"):
        assert served in message
    assert "static" not in message and "<" not in message


def test_tokenize_ignores_fields_it_does_not_know_as_llama_server_does(client_of):
    http, fake = client_of(lambda job: [{"e": "end", "s": 0, "result": {"tokens": [7]}}])
    answer = http.post("/tokenize", json={"content": "hi", "parse_special": False,
                                          "with_pieces": False, "from_vscode": 1})
    assert answer.status_code == 200 and answer.get_json() == {"tokens": [7]}
    assert fake.jobs[0]["parse_special"] is False
    assert http.post("/detokenize", json={"tokens": [7], "x": 1}).status_code == 200
    # curl -d sends a form's content type: llama-server reads the JSON anyway
    for path, data in (("/tokenize", b'{"content": "hi"}'), ("/detokenize", b'{"tokens": [7]}')):
        assert http.post(path, data=data, content_type="application/x-www-form-urlencoded"
                         ).status_code == 200


def test_long_lists_are_refused_by_their_length_before_their_items_are_read(client_of):
    """An 8 MB body holds millions of list items, each costing microseconds to validate:
    a list's length is checked first (a refusal names the bound, not four million bad
    items), and token ids are checked in one pass; a long model name is not echoed
    whole."""
    http, fake = client_of(lambda job: completion("Hi"))
    cases = [("/completion", {"prompt": "x", "response_fields": ["a"] * 65},
              "response_fields", "At most 64 items."),
             ("/completion", {"prompt": "x", "response_fields": ["a" * 257]},
              "response_fields", "256"),
             ("/infill", {"input_extra": [None] * 257}, "input_extra",
              "At most 256 items."),
             ("/infill", {"input_prefix": "a", "input_extra": [{"filename": "n" * 4097}]},
              "input_extra", "4096"),                # (a path: a megabyte was tokenized)
             ("/detokenize", {"tokens": [1, True]}, "tokens", "token ids"),
             ("/detokenize", {"tokens": [1, -1]}, "tokens", "token ids"),
             ("/detokenize", {"tokens": [2 ** 31]}, "tokens", "token ids")]
    for path, body, param, says in cases:
        answer = http.post(path, json=body)
        error = answer.get_json()["error"]
        assert answer.status_code == 400 and error["param"].startswith(param), (path, body)
        assert says in error["message"] and len(error["message"]) < 300, error
    answer = http.post("/v1/completions", json={"model": "m" * 100_000, "prompt": "x"})
    assert answer.status_code == 404 and len(answer.get_json()["error"]["message"]) < 400
    answer = http.get("/v1/models/" + "m" * 10_000)
    assert answer.status_code == 404 and len(answer.get_json()["error"]["message"]) < 400
    assert not fake.jobs
    http, fake = client_of(lambda job: [{"e": "end", "s": 0, "result": {"content": "x"}}])
    ids = list(range(100_000))
    answer = http.post("/detokenize", json={"tokens": ids})
    assert answer.status_code == 200 and fake.jobs[0]["tokens"] == ids
    answer = http.post("/detokenize", json={"tokens": [5.0, 7]})     # whole numbers, as
    assert answer.status_code == 200 and fake.jobs[1]["tokens"] == [5, 7]   # elsewhere


def test_a_client_session_id_can_never_name_an_inferred_session(client_of):
    """Without API keys, an X-Session-Id written like the dispatcher's name for an
    inferred session (`~client:1`) is still the client's own: it reaches the dispatcher
    in the clients' name space, apart from every inferred one."""
    http, fake = client_of(lambda job: completion("Hi"))
    answer = http.post("/v1/completions", json={"prompt": "x"},
                       headers={"X-Session-Id": "~0123456789abcdef:1"})
    assert answer.status_code == 200
    assert fake.jobs[0]["session"] == "h:~0123456789abcdef:1"
    assert not fake.jobs[0]["session"].startswith("~")


@pytest.mark.parametrize("encoding, status", [("gzip", 415), ("br", 415), ("identity", 200),
                                              ("Identity ", 200), ("", 200)])
def test_a_compressed_body_is_refused_saying_so(client, encoding, status):
    http, fake = client
    response = http.post("/v1/completions", json={"prompt": "Say hi", "max_tokens": 5},
                         headers={"Content-Encoding": encoding} if encoding else {})
    assert response.status_code == status, response.get_json()
    if status == 415:
        error = response.get_json()["error"]
        assert error["code"] == "unsupported_media_type" and "uncompressed" in \
            error["message"] and not fake.jobs


@pytest.mark.parametrize("path,body,param", [
    # n_probs 100 over a whole 4,096-token context, eight choices: 3.3 million entries
    # (named as llama.cpp's route calls them: n_predict, n_probs)
    ("/completion", {"prompt": "x", "n_cmpl": 8, "n_probs": 100}, "n_predict"),
    ("/completion", {"prompt": "x", "n_cmpl": 64, "n_probs": 100, "n_predict": 1024},
     "n_probs"),
    ("/v1/completions", {"prompt": "x", "n": 128, "logprobs": 5, "max_tokens": 2048},
     "logprobs"),
    # a negative limit writes until the context is full, as none does
    ("/completion", {"prompt": "x", "n_cmpl": 8, "n_probs": 100, "n_predict": -1},
     "n_predict"),
    ("/v1/completions", {"prompt": "x", "n": 128, "logprobs": 5, "max_tokens": -1},
     "max_tokens"),
])
def test_an_answer_with_too_many_probabilities_is_refused_before_it_runs(
        client, path, body, param):
    """A front end holds a whole answer: `n` × a context × (1 + n_probs) entries were
    gigabytes in one process (every stream on it lost with it) and hours of a worker."""
    http, fake = client
    response = http.post(path, json=body)
    assert response.status_code == 400, response.get_data(as_text=True)
    error = response.get_json()["error"]
    assert error["code"] == "answer_too_large" and error["param"] == param
    assert "at most 524,288" in error["message"]
    assert fake.jobs == []


@pytest.mark.parametrize("body,status,param", [
    ({"n": 128}, 400, "n"), ({"best_of": 20, "n": 2}, 400, "best_of"),
    ({"n": 3}, 200, None), ({"n": 128, "echo": False}, 200, None),
])
def test_an_answer_echoing_its_prompt_for_many_choices_is_bounded(client, monkeypatch,
                                                                  body, status, param):
    """Each choice's job sends the whole prompt back: `echo` with `n` 128 of an 8 MB
    prompt was a gigabyte through ZeroMQ and the front end, for one prefill. Echoed
    characters over all choices are at most MAX_ECHO_CHARS (here 1 MiB of them)."""
    import app.requests
    monkeypatch.setattr(app.requests, "MAX_ECHO_CHARS", 1 << 20)   # (20 × 100,000 over it)
    http, fake = client
    response = http.post("/v1/completions", json={
        "prompt": "x" * 100_000, "echo": True, "max_tokens": 1, **body})
    assert response.status_code == status, response.get_data(as_text=True)
    if status == 400:
        error = response.get_json()["error"]
        assert error["code"] == "answer_too_large" and error["param"] == param
        assert "echo its prompt" in error["message"] and fake.jobs == []


def test_a_requests_own_context_bounds_its_answer(client):
    """geniex's `nctx` caps the request's context (the worker stops there): an answer
    that fits in it is not refused on the model's whole context."""
    http, fake = client
    body = {"prompt": "a", "max_tokens": None, "logprobs": 5, "n": 22}
    assert http.post("/v1/completions", json=body).get_json()["error"]["code"] == \
        "answer_too_large"
    answer = http.post("/v1/completions", json={**body, "nctx": 100})
    assert answer.status_code == 200, answer.get_data(as_text=True)
    assert len(fake.jobs) == 22
    import app.completions                  # (before any worker has said its context)
    unknown = msgspec.structs.replace(STATE, models={MODEL: msgspec.structs.replace(
        STATE.models[MODEL], n_ctx=0)})
    client_type = type(app.completions.get_client(http.application))
    original = client_type.wait_state
    client_type.wait_state = lambda self, timeout=2.0: unknown
    try:
        answer = http.post("/v1/completions", json={**body, "nctx": 100})
    finally:
        client_type.wait_state = original
    assert answer.status_code == 200, answer.get_data(as_text=True)


def test_a_machine_profile_is_read_as_utf8_and_bounded(client_of, monkeypatch):
    """X-SIE-MACHINE-PROFILE: a UTF-8 name reaches the worker whose profile it is (WSGI's
    Latin-1 made `é` into `Ã©`, which no profile was); one past 128 characters is a 400
    (a 6 KB header was repeated whole in the message naming the profiles)."""
    import app.completions
    state = msgspec.structs.replace(STATE, workers=[msgspec.structs.replace(
        STATE.workers[0], profile="génial")])
    http, fake = client_of(lambda job: completion("Hi"))
    monkeypatch.setattr(type(app.completions.get_client(http.application)), "wait_state",
                        lambda self, timeout=2.0: state)
    wire = "génial".encode("utf-8").decode("latin-1")         # (as the header arrives)
    answer = http.post("/v1/completions", json={"prompt": "p"},
                       headers={"X-SIE-MACHINE-PROFILE": wire})
    assert answer.status_code == 200 and fake.jobs[-1]["route"]["profile"] == "génial"
    answer = http.post("/v1/completions", json={"prompt": "p"},
                       headers={"X-SIE-MACHINE-PROFILE": "x" * 6000})
    error = answer.get_json()["error"]
    assert answer.status_code == 400 and error["code"] == "header_too_long"
    assert len(error["message"]) < 200


def test_a_stream_counts_only_an_echoed_prompt_and_that_once():
    """A stream keeps nothing, but an echoed prompt's probabilities go out in one chunk."""
    from app.requests import answer_entries
    echo = {"prompt": [[1] * 30000], "echo": True, "logprobs": 1, "n_probs": 100,
            "max_tokens": 0, "n": 4, "stream": True}
    assert answer_entries(echo, 32768) == 30000 * 101
    assert answer_entries({**echo, "stream": False}, 32768) == 4 * 30000 * 101
    assert answer_entries({**echo, "echo": False}, 32768) == 0
    assert answer_entries({"prompt": ["x"], "logprobs": 0}, 0) == 4096     # not known yet
    mixed = {"prompt": [[1, "y" * 16_000]], "echo": True, "logprobs": 5, "n": 128,
             "max_tokens": 1}                # (its text counted, not as one item)
    assert answer_entries(mixed, 32768) == 128 * (1 + 16_001) * 6
    assert answer_entries({"prompt": ["x"], "max_tokens": 9}, 4096) == 0   # text only


@pytest.mark.parametrize("path,body", [
    ("/completion", {"prompt": "x", "n_probs": 100}),             # a context of them
    ("/completion", {"prompt": "x", "n_cmpl": 128, "n_probs": 100, "stream": True}),
    ("/v1/completions", {"prompt": "x", "n": 16, "logprobs": 5}),
    # lm-evaluation-harness: echo, logprobs 1, max_tokens 0, a long prompt
    ("/v1/completions", {"prompt": ["a" * 4000, "b" * 4000], "echo": True,
                         "logprobs": 1, "max_tokens": 0}),
])
def test_answers_with_probabilities_within_the_bound_are_served(client, path, body):
    http, fake = client
    assert http.post(path, json=body).status_code == 200
    assert fake.jobs


def test_a_stream_keeps_no_text_or_probabilities_of_what_it_sent(client_of, monkeypatch):
    """Every chunk went out as it came; the front end kept each stream's text, ids,
    n_probs and logprobs besides, for nothing (n × max_tokens × (1 + n_probs) entries)."""
    from app.native import NativeResult
    from app.responses import Result
    probs = [{"id": 1, "token": "a", "logprob": -0.1, "top_logprobs": []}]
    logprobs = {"tokens": ["a"], "token_logprobs": [-0.1], "top_logprobs": [{"a": -0.1}],
                "text_offset": [0]}
    text = [{"e": P.EV_TEXT, "s": 1 + i, "text": t, "ids": [1], "probs": probs,
             "logprobs": logprobs} for i, t in enumerate(["a", "\n", "b"])]

    def script(job):
        events = completion("")
        return events[:1] + text + [{**events[-1], "s": 4}]
    kept = []
    for cls in (NativeResult, Result):
        def spy(self, index, event, original=cls.add):
            kept.append(self)
            return original(self, index, event)
        monkeypatch.setattr(cls, "add", spy)
    http, _ = client_of(script)
    native = http.post("/completion", json={"prompt": "x", "n_probs": 1,
                                            "stream": True}).get_data(as_text=True)
    openai = http.post("/v1/completions", json={"prompt": "x", "logprobs": 1,
                                                "stream": True}).get_data(as_text=True)
    frames = [json.loads(f[len("data: "):]) for f in native.split("\n\n")
              if f.startswith("data: ")]
    assert "".join(f["content"] for f in frames) == "a\nb"
    assert [len(f["completion_probabilities"]) for f in frames[:-1]] == [1, 1, 1]
    assert frames[-1]["stop"] is True and frames[-1]["has_new_line"] is True
    chunks = [json.loads(f[len("data: "):]) for f in openai.split("\n\n")
              if f.startswith("data: {")]
    assert [c["choices"][0]["logprobs"]["tokens"] for c in chunks[:3]] == [["a"]] * 3
    native_result, openai_result = kept[0], kept[-1]
    assert native_result.texts == [[]] and native_result.probs == [[]]
    assert native_result.ids == [[]]
    assert openai_result.texts == [[]] and openai_result.logprobs == [None]


def test_post_sampling_probs_answers_in_llama_servers_probability_keys(client_of):
    """With `post_sampling_probs` llama-server names the entries `prob` and `top_probs`
    (probabilities, not logprobs), streamed or whole; a client reading those keys found
    none."""
    probs = [{"id": 1, "token": "a", "bytes": [97], "logprob": math.log(0.5),
              "top_logprobs": [{"id": 1, "token": "a", "bytes": [97],
                                "logprob": math.log(0.5)},
                               {"id": 2, "token": "b", "bytes": [98],
                                "logprob": math.log(0.25)}]}]

    def script(job):
        events = completion("")
        return events[:1] + [{"e": P.EV_TEXT, "s": 1, "text": "a", "probs": probs},
                             {**events[-1], "s": 2}]
    http, _ = client_of(script)
    whole = http.post("/completion", json={"prompt": "x", "n_probs": 2,
                                           "post_sampling_probs": True}).get_json()
    raw = http.post("/completion", json={"prompt": "x", "n_probs": 2, "stream": True,
                                         "post_sampling_probs": True}).get_data(as_text=True)
    streamed = json.loads(raw.split("\n\n")[0][len("data: "):])
    for entries in (whole["completion_probabilities"], streamed["completion_probabilities"]):
        (entry,) = entries
        assert "logprob" not in entry and "top_logprobs" not in entry
        assert entry["prob"] == pytest.approx(0.5) and entry["bytes"] == [97]
        assert [(t["token"], round(t["prob"], 6)) for t in entry["top_probs"]] == \
            [("a", 0.5), ("b", 0.25)]
    plain = http.post("/completion", json={"prompt": "x", "n_probs": 2}).get_json()
    assert plain["completion_probabilities"] == probs          # (the default form)


def test_token_ids_past_the_context_are_refused_before_any_worker_builds_them(client):
    """A list of ids is its tokens: one of 4,096 ids or more (the model's context) went to
    a worker, which built and counted it for each choice before refusing it."""
    http, fake = client
    for prompt in ([7] * 4096, ["text", *[7] * 5000], [[1], [7] * 9000]):
        response = http.post("/v1/completions", json={"prompt": prompt, "n": 4})
        assert response.status_code == 400, response.get_data(as_text=True)
        error = response.get_json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
        assert "maximum context length is 4096 tokens" in error["message"]
    assert fake.jobs == []
    assert http.post("/v1/completions", json={"prompt": [7] * 4095}).status_code == 200


def test_a_long_list_prompt_is_routed_by_its_first_items_only():
    """The dispatcher weighs a prompt's first 64 Ki characters: a list of a million ids
    was written out whole on its thread first (0.2 s)."""
    import json as json_module
    from dispatcher.routing import BLOCK_CHARS, MAX_PREFIX_BLOCKS, routed_text
    weighed = BLOCK_CHARS * MAX_PREFIX_BLOCKS
    for prompt in ([1] * 1_000_000, [123456] * 50_000, ["ab", *[1] * 40_000, "c" * 9]):
        text = routed_text(P.Job(id="a", model="m", prompt=prompt, generation=None))
        assert weighed <= len(text) <= 5 * weighed        # (an id writes 12 at most)
        assert json_module.dumps(prompt)[:weighed] == text[:weighed]


def test_tokenize_is_bounded_by_what_its_answer_can_be(client_of):
    """A token is a byte at least, so a megabyte of four-byte characters was four million
    ids, and with pieces four million objects: seconds of the front end's loop decoding
    them, every stream of it standing still."""
    http, fake = client_of(lambda job: [{"e": P.EV_END, "s": 0, "result": {"tokens": [7]}}])
    limit = int(http.application.config["MAX_PROMPT_CHARS"])
    emoji = "\U0001F600" * (limit // 4 + 1)                  # within the characters
    for body, says in (({"content": emoji}, "bytes"),
                       ({"content": "é" * 20_000, "with_pieces": True}, "with_pieces")):
        response = http.post("/tokenize", json=body)
        assert response.status_code == 413, response.get_data(as_text=True)
        error = response.get_json()["error"]
        assert error["param"] == "content" and says in error["message"]
    assert fake.jobs == []
    assert http.post("/tokenize", json={"content": "é" * 16_000,
                                        "with_pieces": True}).status_code == 200
    assert http.post("/tokenize", json={"content": "x" * limit}).status_code == 200

def test_a_client_that_leaves_mid_body_is_a_499_not_a_bad_body(client):
    """gunicorn's reader raises NoMoreData when the connection ends before the body is
    whole: the access log said `invalid_body` (400) of a client that had gone."""
    from gunicorn.http.errors import NoMoreData

    class Gone:
        def read(self, *args):
            raise NoMoreData(b"")
        readline = read
    http, fake = client
    response = http.post("/v1/completions", data=b"{}",
                         headers={"Content-Type": "application/json"},
                         environ_overrides={"wsgi.input": Gone(), "CONTENT_LENGTH": "100",
                                            "wsgi.input_terminated": True})   # (as gunicorn)
    assert response.status_code == 499
    assert response.get_json()["error"]["code"] == "client_closed"
    assert fake.jobs == []


def test_openai_only_fields_are_ignored_on_llama_cpp_routes(client):
    """llama-server takes no `echo` or `suffix` on its own routes: `echo` put the prompt
    into `content` (and forced prompt logprobs nobody read), `suffix` made /completion a
    fill-in-the-middle request (a 400 on a model without FIM tokens)."""
    http, fake = client
    response = http.post("/completion", json={
        "prompt": "x", "n_predict": 2, "echo": True, "logprobs": 5, "suffix": "y",
        "best_of": 3})
    assert response.status_code == 200, response.get_data(as_text=True)
    (job,) = fake.jobs
    assert not job["generation"].get("echo") and job.get("suffix") is None
    assert "x" not in json.loads(response.get_data())["content"][:1]   # (no prompt echoed)


def test_a_large_stream_event_may_take_a_second_more_for_each_64_kib(client_of):
    """--send-timeout: every write of a stream may take the timeout, and an event larger
    than SEND_RATE_FLOOR (an echoed prompt's probabilities go out in one) one second more
    for each SEND_RATE_FLOOR bytes of it; the events after it the plain timeout again."""
    from app.writes import SEND_RATE_FLOOR

    class Socket:               # gunicorn's socket, as far as the timeouts go
        def __init__(self):
            self.timeouts = []

        def settimeout(self, seconds):
            self.timeouts.append(seconds)

    big = "x" * (3 * SEND_RATE_FLOOR)
    script = completion("ab")
    script.insert(2, {"e": P.EV_TEXT, "s": 2, "text": big})
    for n, event in enumerate(script):
        event["s"] = n
    client, _ = client_of(lambda job: script)
    client.application.config["SEND_TIMEOUT"] = 2.0
    sock = Socket()
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi",
                                                    "max_tokens": 4, "stream": True},
                           environ_base={"gunicorn.socket": sock})
    body = response.get_data(as_text=True)
    assert response.status_code == 200 and big in body and body.endswith("data: [DONE]\n\n")
    assert sock.timeouts[0] == 2.0                  # (the answer's start: a stream's size 0)
    larger = [t for t in sock.timeouts if t > 2.0]
    assert len(larger) == 1 and 5.0 < larger[0] < 5.1      # (the event's JSON: a bit more)
    assert sock.timeouts[-1] == 2.0 and sock.timeouts.index(larger[0]) > 0


def test_big_bodies_are_decoded_a_few_at_a_time_and_their_slot_always_given_back(
        client, monkeypatch):
    """Decoded, a body is ten times its size or more, and decoded bodies waited for
    validation behind every other's decode: bodies over a MiB take one of a few slots
    from before their decode to the end of their validation (or of the request, where
    it ends first), so a burst of them holds a few decoded at once, not all."""
    import threading
    from app import bodies as R
    http, fake = client
    monkeypatch.setattr(R, "big_body_slots", R.BigBodySlots(at_once=1))
    big = "a\n" * (R.BIG_BODY // 3)           # (within the prompt's bound, over a MiB as JSON)
    bodies = [{"prompt": big, "max_tokens": 1},                      # answered
              {"prompt": big, "max_tokens": "many"},                 # invalid field
              {"prompt": big, "model": "other"},                     # after validation
              b"[" + b'"' + big.encode() + b'", ]']                  # invalid JSON
    for body in bodies:
        data = body if isinstance(body, bytes) else json.dumps(body)
        http.post("/v1/completions", data=data, content_type="application/json")
        http.post("/completion", data=data, content_type="application/json")
        assert R.big_body_slots.slots.acquire(blocking=False)      # (given back)
        R.big_body_slots.slots.release()
    jobs = len(fake.jobs)
    assert jobs == 3          # (the first body on each route; /completion takes any model)
    R.big_body_slots.slots.acquire()                 # (another big body being decoded)
    waiting = threading.Thread(target=http.post, args=("/v1/completions",), kwargs={
        "data": json.dumps(bodies[0]), "content_type": "application/json"})
    waiting.start()
    waiting.join(0.5)
    assert waiting.is_alive() and len(fake.jobs) == jobs
    R.big_body_slots.slots.release()
    waiting.join(10)
    assert not waiting.is_alive() and len(fake.jobs) == jobs + 1
    small = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert small.status_code == 200


def test_one_key_holds_at_most_half_of_the_big_bodies_bytes(monkeypatch):
    """With API keys, a key announcing large bodies and trickling them held the whole
    budget, and every other key's large body waited for a 503: a key holds at most half
    (a body larger than that is read alone of its key's)."""
    from flask import Flask

    from app import bodies as R
    from app.errors import ServiceUnavailable
    app = Flask("bodies")
    app.config["API_KEYS_ENABLED"] = True
    app.config["API_KEY_COUNT"] = 1                   # one key: all of it, as before
    budget = R.BodyBytes(budget=8 * R.BIG_BODY)

    def holding(key, size, wait=0.2):
        with app.test_request_context(headers={"Authorization": f"Bearer {key}"}):
            budget.cover(size, wait)
    for _ in range(4):
        holding("a", 2 * R.BIG_BODY)
    assert budget.held == 8 * R.BIG_BODY and not budget.by_key
    app.config["API_KEY_COUNT"] = 3
    budget = R.BodyBytes(budget=8 * R.BIG_BODY)

    holding("a", 2 * R.BIG_BODY)
    holding("a", 2 * R.BIG_BODY)                      # a holds its half now
    with pytest.raises(ServiceUnavailable):
        holding("a", 2 * R.BIG_BODY)
    holding("b", 3 * R.BIG_BODY)                      # another key's is read at once
    assert budget.held == 7 * R.BIG_BODY and len(budget.by_key) == 2
    alone = R.BodyBytes(budget=8 * R.BIG_BODY)        # larger than the share: alone
    budget = alone
    holding("c", 6 * R.BIG_BODY)
    assert alone.held == 6 * R.BIG_BODY
    with pytest.raises(ServiceUnavailable):           # (and nothing more of c's beside it)
        holding("c", R.BIG_BODY)
    with app.test_request_context(headers={"Authorization": "Bearer d"}):
        budget.cover(2 * R.BIG_BODY, 0.2)
        budget.give_back()                            # (given back: its key's share too)
    assert alone.held == 6 * R.BIG_BODY and len(alone.by_key) == 1


def test_big_bodies_hold_a_bounded_share_of_bytes_while_they_are_read(client_of,
                                                                       monkeypatch):
    """A big body read first waited for its decode slot with its bytes in hand (4,096
    connections: 32 GiB): a body's bytes past a MiB are covered by the front end's
    budget a MiB at a time as they arrive, a body with no room waits, and is a 503
    server_busy (its connection closed: the rest is not read) after BODY_BYTES_WAIT;
    its share is given back once it is validated (before its job runs), whatever the
    request's end, chunked bodies (no length) included."""
    import threading
    from app import bodies as R
    budget = R.BodyBytes(budget=3 * R.BIG_BODY)
    monkeypatch.setattr(R, "body_bytes", budget)
    held_at_submit = []
    http, fake = client_of(lambda job: held_at_submit.append(budget.held) or
                           completion("Hi"))
    covered = []
    cover = budget.cover
    monkeypatch.setattr(budget, "cover", lambda size, wait=None: covered.append(size) or
                        cover(size, wait))
    big = json.dumps({"prompt": "a\n" * (R.BIG_BODY // 3), "max_tokens": 1})
    assert R.BIG_BODY < len(big) < 2 * R.BIG_BODY
    for data in (big, big.replace('"max_tokens": 1', '"max_tokens": "many"'), "[" + big):
        http.post("/v1/completions", data=data, content_type="application/json")
        assert covered and budget.held == 0              # (given back, whatever the end)
        covered.clear()
    assert held_at_submit == [0]                         # (given back once validated)
    chunked = http.post("/v1/completions", input_stream=io.BytesIO(big.encode()),
                        content_type="application/json")      # (no Content-Length)
    assert chunked.status_code == 200 and covered and budget.held == 0
    jobs = len(fake.jobs)
    with budget.changed:
        budget.held = 3 * R.BIG_BODY                 # (other big bodies being read)
    monkeypatch.setattr(R, "BODY_BYTES_WAIT", 0.3)
    stopped = []
    monkeypatch.setattr(R, "_stop_reading", lambda: stopped.append(True))
    refused = http.post("/v1/completions", data=big, content_type="application/json")
    assert refused.status_code == 503 and refused.headers["Retry-After"]
    assert refused.get_json()["error"]["code"] == "server_busy" and len(fake.jobs) == jobs
    assert stopped == [True]                        # (its connection ends: not read on)
    monkeypatch.setattr(R, "BODY_BYTES_WAIT", 60.0)
    waiting = threading.Thread(target=http.post, args=("/v1/completions",), kwargs={
        "data": big, "content_type": "application/json"})
    waiting.start()
    waiting.join(0.3)
    assert waiting.is_alive() and len(fake.jobs) == jobs
    with budget.changed:
        budget.held = 0
        budget.changed.notify_all()
    waiting.join(30)
    assert not waiting.is_alive() and len(fake.jobs) == jobs + 1 and budget.held == 0
    small = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert small.status_code == 200


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize", "/completion", "/infill",
                                  "/v1/completions"])
def test_a_body_that_is_not_an_object_says_so_on_every_route(client, path):
    """The vocabulary routes answered `[]`, `"x"` or `null` with marshmallow's "Invalid
    input type."; every route now says what the body must be."""
    http, fake = client
    for body in ("[]", '"x"', "null", "3"):
        answer = http.post(path, data=body, content_type="application/json")
        assert answer.status_code == 400, (path, body)
        assert answer.get_json()["error"]["message"] == \
            "The request body must be a JSON object.", (path, body)
    assert not fake.jobs


def test_an_infill_context_too_large_is_named_by_its_largest_part(client, monkeypatch):
    """It was always `input_extra`, also where none was sent."""
    http, fake = client
    state = msgspec.structs.replace(STATE, workers=[
        msgspec.structs.replace(STATE.workers[0], fim=True)])
    monkeypatch.setattr(fake, "wait_state", lambda timeout=2.0: state)
    limit = 1 << 20
    for body, param in [({"input_prefix": "a" * limit, "input_suffix": "b"}, "input_prefix"),
                        ({"input_suffix": "b" * limit, "prompt": "c"}, "input_suffix"),
                        ({"input_prefix": "a", "input_extra": [{"text": "x" * limit}]},
                         "input_extra")]:
        answer = http.post("/infill", json=body)
        assert answer.status_code == 413 and answer.get_json()["error"]["param"] == param
    assert not fake.jobs


def test_llama_cpps_default_seed_draws_a_random_one_on_its_routes(client):
    """llama-server reads a seed as a uint32: -1 and 4294967295 (LLAMA_DEFAULT_SEED, the
    seed it reports as its default) both mean a random one there; on OpenAI's route it
    is a fixed seed (the worker's uint32 draws it as another: seeds are mod 2^32)."""
    http, fake = client
    for path, seed in (("/completion", -1), ("/completion", 4294967295),
                       ("/v1/completions", -1), ("/v1/completions", 4294967295),
                       ("/completion", 4294967294)):
        assert http.post(path, json={"prompt": "p", "seed": seed}).status_code == 200
    assert [job["sampling"].get("seed") for job in fake.jobs] == \
        [None, None, None, 4294967296, 4294967294]


def test_the_choices_of_one_request_never_share_a_seed(client):
    """Choice c draws with the seed plus c, passing over 4294967295 (mod 2^32), which
    the worker's uint32 draws as the seed before it: seed -2 with n 2 gave the choices
    -2 and -1, the same draws."""
    from app.jobs import choice_seed
    assert [choice_seed(-2, c) for c in range(3)] == [-2, 0, 1]
    assert [choice_seed(7, c) for c in range(3)] == [7, 8, 9]
    assert choice_seed(2 ** 33 - 1, 0) == 2 ** 33
    http, fake = client
    assert http.post("/v1/completions", json={"prompt": "p", "seed": 4294967294,
                                              "n": 2}).status_code == 200
    assert [job["sampling"]["seed"] for job in fake.jobs] == [4294967294, 4294967296]


def test_an_infill_sampler_with_top_k_null_takes_the_routes_default(client, monkeypatch):
    """null is the default: top_k 40 on llama.cpp's routes, which the infill sampler
    needs before it (it was read as 0 and refused)."""
    http, fake = client
    state = msgspec.structs.replace(STATE, workers=[
        msgspec.structs.replace(STATE.workers[0], fim=True)])
    monkeypatch.setattr(fake, "wait_state", lambda timeout=2.0: state)
    body = {"input_prefix": "a", "samplers": ["top_k", "top_p", "infill"], "top_k": None}
    assert http.post("/infill", json=body).status_code == 200
    assert fake.jobs[-1]["sampling"]["top_k"] == 40
    refused = http.post("/infill", json={**body, "top_k": 0})
    assert refused.status_code == 400 and refused.get_json()["error"]["param"] == "samplers"


def test_llama_cpp_routes_penalize_the_prompt_and_openai_routes_do_not(client):
    """llama-server's penalties count the prompt's last `repeat_last_n` tokens; OpenAI's
    count the output alone: the job says which (the worker's chain takes the prompt)."""
    http, fake = client
    http.post("/completion", json={"prompt": "p", "repeat_penalty": 1.3})
    http.post("/v1/completions", json={"prompt": "p", "presence_penalty": 1.0})
    assert [job.get("penalize_prompt", False) for job in fake.jobs] == [True, False]


def test_a_schema_that_finds_every_conversion_busy_is_a_503_to_retry(client, monkeypatch):
    from app import requests as R
    from dispatcher.common.schemagrammar import SchemaBusy

    def busy(schema, **_):
        raise SchemaBusy("Every JSON schema conversion of this front end was busy.")
    http, fake = client
    monkeypatch.setattr(R._schema_grammars, "grammar", busy)
    answer = http.post("/v1/completions", json={"prompt": "p", "json_schema": {}})
    assert answer.status_code == 503 and answer.headers["Retry-After"]
    assert answer.get_json()["error"]["code"] == "server_busy" and not fake.jobs


def _sized_events(monkeypatch, pause: float = 0.0):
    """FakeStream's events with their wire sizes, as RequestStream's (`pause`: each
    comes that long after the one before, as a worker's tokens do)."""
    import gevent

    def sized(stream):
        if pause:
            gevent.sleep(pause)
        event = stream.events.pop(0)
        stream.last_size = len(msgspec.json.encode(event))
        return event
    monkeypatch.setattr(FakeStream, "next_event", sized)


def test_a_stream_that_outruns_its_client_ends_with_an_error_event(client_of, monkeypatch):
    """Past MAX_BACKLOG_BYTES of events waiting while the handler writes (a client that
    reads slower than its answer comes), the request's jobs are cancelled. The stream
    ended there without a word: a client still reading now reads why, then [DONE]."""
    import gevent

    import app.fanout
    monkeypatch.setattr(app.fanout, "MAX_BACKLOG_BYTES", 3000)
    _sized_events(monkeypatch, pause=0.001)
    events = completion("")
    events[1:1] = [{"e": P.EV_TEXT, "s": 1 + i, "text": "x" * 1000} for i in range(8)]
    events[-1]["s"] = 9
    http, fake = client_of(lambda job: events)
    response = http.post("/v1/completions", json={"prompt": "p", "stream": True,
                                                  "max_tokens": 200}, buffered=False)
    pieces = []
    for piece in response.response:     # each write slow: the jobs' events come meanwhile
        pieces.append(piece)
        gevent.sleep(0.05)
    frames = [f for f in b"".join(pieces).decode().split("\n\n") if f]
    assert frames[-1] == "data: [DONE]"
    error = json.loads(frames[-2][len("data: "):])["error"]
    assert error["code"] == "client_too_slow" and "outran" in error["message"]


@pytest.mark.parametrize("reader", ["steady", "slow"])
def test_the_rest_of_an_ended_stream_is_written_by_a_deadline(client_of, monkeypatch, reader):
    """Once every job of a stream has ended, what is left of it must be written within
    --send-timeout and a second per SEND_RATE_FLOOR bytes of it, each chunk moving the
    deadline on by its size (app.writes.drain_deadline): each write alone was bounded,
    so a client that took an event a minute held the connection, and up to 8 MiB
    waiting for it, for days. Each write is given what is left of that time; past it
    the stream ends with `client_too_slow`, its last words given a second each. A
    client keeping up reads it all. (A fake clock: the reader's pace is the test's.)"""
    from types import SimpleNamespace

    import app.fanout
    import app.writes

    class Socket:               # gunicorn's socket, as far as the timeouts go
        def __init__(self):
            self.timeouts = []
            self.quiet, self.unused = os.pipe()  # (what the disconnect watcher waits on)

        def settimeout(self, seconds):
            self.timeouts.append(seconds)

        def fileno(self):
            return self.quiet

    clock = SimpleNamespace(now=1000.0)
    fake_time = SimpleNamespace(monotonic=lambda: clock.now)
    monkeypatch.setattr(app.writes, "time", fake_time)
    monkeypatch.setattr(app.fanout, "time", fake_time)
    _sized_events(monkeypatch)          # (every event at once: the jobs end first)
    events = completion("")
    events[1:1] = [{"e": P.EV_TEXT, "s": 1 + i, "text": "x" * 1000} for i in range(8)]
    events[-1]["s"] = 9
    http, fake = client_of(lambda job: events)
    http.application.config["SEND_TIMEOUT"] = 2.0
    sock = Socket()
    response = http.post("/v1/completions", json={"prompt": "p", "stream": True,
                                                  "max_tokens": 200}, buffered=False,
                         environ_base={"gunicorn.socket": sock})
    pieces = []
    for piece in response.response:
        pieces.append(piece)
        clock.now += 0.5 if reader == "slow" else 0.01
    os.close(sock.quiet), os.close(sock.unused)
    frames = [f for f in b"".join(pieces).decode().split("\n\n") if f]
    assert frames[-1] == "data: [DONE]"
    texts = [f for f in frames if '"xxxx' in f]
    given = [t for t in sock.timeouts[1:-1] if t != 2.0]    # (the answer's start: 2.0)
    if reader == "steady":              # (2 s and a bit: never less than a write's 2 s)
        assert len(texts) == 8 and "error" not in frames[-2] and not given
        return
    # 2 s and a bit for the ~10 KB: four or five events read at 0.5 s each, then no more
    assert 4 <= len(texts) <= 5, len(texts)
    error = json.loads(frames[-2][len("data: "):])["error"]
    assert error["code"] == "client_too_slow" and "rest of the answer" in error["message"]
    assert given == sorted(given, reverse=True) and min(given) < 0.5
    assert sock.timeouts[-1] == 1.0     # (the error event and [DONE]: LAST_WORDS each)


@pytest.mark.parametrize("stream", [False, True])
def test_events_larger_than_the_backlog_that_the_client_reads_are_answered(
        client_of, monkeypatch, stream):
    """Events that come while the handler waits for them are no backlog: one event
    larger than MAX_BACKLOG_BYTES (an echoed prompt with its logprobs: 9 MB for 3,000
    tokens of n_probs 100), or several choices' echoes in one turn of the loop, ended a
    request whose client read everything, a non-streaming one with an empty 499."""
    import app.fanout
    monkeypatch.setattr(app.fanout, "MAX_BACKLOG_BYTES", 3000)
    _sized_events(monkeypatch)
    events = completion("")
    events[1:1] = [{"e": P.EV_TEXT, "s": 1, "text": "x" * 5000},
                   {"e": P.EV_TEXT, "s": 2, "text": "y" * 5000}]
    events[-1]["s"] = 3
    http, fake = client_of(lambda job: [dict(e) for e in events])
    response = http.post("/v1/completions", json={"prompt": "p", "stream": stream,
                                                  "max_tokens": 200, "n": 3})
    assert response.status_code == 200
    if stream:
        frames = [f for f in response.get_data(as_text=True).split("\n\n") if f]
        assert frames[-1] == "data: [DONE]" and "error" not in frames[-2]
        texts = [json.loads(f[len("data: "):])["choices"][0] for f in frames[:-1]]
        assert sorted(len(c["text"]) for c in texts if c["text"]) == [5000] * 6
    else:
        choices = response.get_json()["choices"]
        assert [c["text"] for c in choices] == ["x" * 5000 + "y" * 5000] * 3


def test_every_body_the_soak_sends_as_invalid_is_refused_by_the_front_end(client):
    """The soak counts an invalid body answered 200 as garbled: its list must hold only
    bodies this server refuses (it still held `{"prompt": ""}` after the empty prompt
    became the start of a document, and the soak failed on its own list)."""
    from dispatcher.tools.soak import INVALID_BODIES
    http, fake = client
    for body in INVALID_BODIES:
        response = http.post("/v1/completions", data=body,
                             headers={"Content-Type": "application/json"})
        assert 400 <= response.status_code < 500, (body[:60], response.status_code)
        assert set(response.get_json()["error"]) == {"message", "type", "param", "code"}
    assert fake.jobs == []
