"""Hypothesis fuzzing of /v1/completions on the real stack: thousands of bad requests,
each answered with a 4xx in OpenAI's envelope (never a 500, never a hang), while a valid
stream runs alongside undisturbed."""
import http.client
import json
import threading

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from app.openapi import build_openapi
from conftest import ServerProcess, SSEStream

pytestmark = pytest.mark.integration

PROPS = build_openapi()["components"]["schemas"]["CompletionRequest"]["properties"]
BASE = {"prompt": "def f(x):", "max_tokens": 4, "temperature": 0}
FUZZ = settings(max_examples=1500, deadline=None, derandomize=True,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def server():
    server = ServerProcess("--nctx", "256", "--max-body", "200000", log_name="fuzz").start()
    stream = {}

    def alongside():
        s = SSEStream(server.port, {"prompt": "Once upon a time", "max_tokens": 120,
                                    "ignore_eos": True, "temperature": 0, "stream": True,
                                    "speculative.n_max": 0},
                      timeout=600)
        stream["events"] = list(s.events())

    # the alongside stream's text must begin as greedy text does: its first 20 characters
    reference = json.loads(http_post(server.port, json.dumps(
        {"prompt": "Once upon a time", "max_tokens": 16, "ignore_eos": True,
         "temperature": 0, "cache_prompt": False,
         "speculative.n_max": 0}).encode())[1])["choices"][0]["text"]
    assert len(reference) >= 20
    thread = threading.Thread(target=alongside)
    thread.start()
    yield server
    thread.join(timeout=600)
    events = stream["events"]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "error" not in chunks[-1] and chunks[-1]["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert len(text) > 100 and text[:20] == reference[:20]
    assert server.stop() == 0


def http_post(port, body: bytes, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", body=body,
                     headers=headers if headers is not None
                     else {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def assert_clean_4xx(status: int, raw: bytes) -> None:
    assert 400 <= status < 500, (status, raw[:300])
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["code"], error            # every refusal here names its cause by code


# -- strategies: every example is invalid by construction -----------------------------------
def _json_of_other_type(kind: str):
    others = {"string": st.integers() | st.booleans() | st.lists(st.integers(), max_size=3),
              "integer": st.text(max_size=5) | st.booleans() | st.floats(0.1, 0.9)
              | st.lists(st.integers(), max_size=2) | st.dictionaries(st.text(max_size=3),
                                                                      st.integers()),
              "number": st.text(max_size=5) | st.booleans() | st.lists(st.floats(
                  allow_nan=False), max_size=2),
              "boolean": st.integers() | st.text(max_size=5) | st.none().map(lambda _: "true"),
              "object": st.integers() | st.text(max_size=5) | st.lists(st.integers())}
    return others[kind]


def _type_of(prop: dict) -> str | None:
    kind = prop.get("type")
    if isinstance(kind, list):
        kind = kind[0]
    return kind if kind in ("string", "integer", "number", "boolean", "object") else None


WRONG_TYPE = st.sampled_from(sorted(n for n, p in PROPS.items() if _type_of(p))).flatmap(
    lambda name: _json_of_other_type(_type_of(PROPS[name])).map(lambda v: {name: v}))


def _outside(prop: dict):
    step = 1 if _type_of(prop) == "integer" else 0.5
    options = []
    if "minimum" in prop:
        options.append(st.integers(1, 10 ** 6).map(lambda d: prop["minimum"] - d * step))
    if "exclusiveMinimum" in prop:
        options.append(st.integers(0, 10 ** 6).map(lambda d: prop["exclusiveMinimum"] - d
                                                   * step))
    if "maximum" in prop:
        options.append(st.integers(1, 10 ** 6).map(lambda d: prop["maximum"] + d * step))
    return st.one_of(options)


RANGED = sorted(n for n, p in PROPS.items() if {"minimum", "maximum", "exclusiveMinimum"}
                & set(p) and n != "stream_options")
OUT_OF_RANGE = st.sampled_from(RANGED).flatmap(
    lambda name: _outside(PROPS[name]).map(lambda v: {name: v}))
UNKNOWN = st.text(min_size=1, max_size=12).filter(lambda k: k not in PROPS).map(
    lambda k: {k: 1})
BAD_PROMPT = st.sampled_from([None, [], [[]], [1, -5], [True], {"a": 1}, [[1], [2.5]],
                              [["x", None]], 3.5]).map(lambda p: {"prompt": p})
BAD_ENUM = st.sampled_from([{"compute": "tpu"}, {"mirostat": 3}, {"logprobs": 9},
                            {"logit_bias": {"x": 5}}, {"logit_bias": [[1, 200]]}])
BAD_COMBINATION = st.sampled_from([
    {"best_of": 1, "n": 2}, {"best_of": 3, "stream": True},
    {"stream_options": {"include_usage": True}, "stream": False},
    {"grammar": "root ::= \"a\"", "json_schema": {"type": "string"}},
    {"n_predict": 3, "max_tokens": 4}, {"n": 100, "prompt": ["a"] * 10},
])
MUTATIONS = st.lists(WRONG_TYPE | OUT_OF_RANGE | UNKNOWN | BAD_PROMPT | BAD_ENUM
                     | BAD_COMBINATION, min_size=1, max_size=3)


@FUZZ
@given(mutations=MUTATIONS, stream=st.booleans())
def test_bad_fields_are_always_a_clean_4xx(server, mutations, stream):
    body = dict(BASE, stream=stream)
    for mutation in mutations:
        body.update(mutation)
    if body.get("prompt") is None and "prompt" in body:
        del body["prompt"]
    status, raw = http_post(server.port, json.dumps(body).encode())
    assert_clean_4xx(status, raw)


RAW_BODIES = st.one_of(
    st.binary(max_size=200).filter(lambda b: not b.strip().startswith(b"{")),
    st.sampled_from([b"NaN", b"Infinity", b"-Infinity"]).map(
        lambda c: b'{"prompt": "x", "temperature": ' + c + b"}"),
    st.integers(1, 20000).map(lambda d: b"[" * d + b"]" * d),
    st.integers(1, len(json.dumps(BASE)) - 1).map(lambda n: json.dumps(BASE).encode()[:n]),
    st.binary(min_size=1, max_size=20).map(lambda b: b'{"prompt": "' + b + b'\xff"}'),
)


@settings(FUZZ, max_examples=500)
@given(raw=RAW_BODIES)
def test_malformed_bodies_are_always_a_clean_4xx(server, raw):
    status, payload = http_post(server.port, raw)
    assert_clean_4xx(status, payload)


BAD_HEADERS = st.one_of(
    st.sampled_from(["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                     "application/xml"]).map(lambda t: {"Content-Type": t}),
    st.sampled_from(["-1", "0", "abc", "nan", "inf", "1e9"]).map(
        lambda v: {"Content-Type": "application/json", "X-Request-Timeout": v}),
    st.text(alphabet="abcdefgh", min_size=1, max_size=8).map(
        lambda v: {"Content-Type": "application/json", "X-SIE-MACHINE-PROFILE": "no-" + v}),
    st.sampled_from(["-1", "1.5", "x", "", " ", "9" * 19 + "0"]).map(
        lambda v: {"Content-Type": "application/json", "X-Session-Id": "s",
                   "X-Session-Seq": v}),
    st.sampled_from(["gzip", "deflate", "br", "gzip, identity"]).map(
        lambda v: {"Content-Type": "application/json", "Content-Encoding": v}),
)


@settings(FUZZ, max_examples=300)
@given(headers=BAD_HEADERS)
def test_bad_headers_are_always_a_clean_4xx(server, headers):
    status, payload = http_post(server.port, json.dumps(BASE).encode(), headers)
    assert_clean_4xx(status, payload)
