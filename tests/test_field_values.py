"""Every field of every route that takes a body, given generated values of every JSON type
and size (integers of hundreds of digits, Unicode digits, deep and wide containers, odd
keys): the answer is a 2xx or a 4xx in OpenAI's envelope, never a 500, and whatever is
accepted encodes onto the wire. In-process, with the fake dispatcher client of
test_app.py standing in for the dispatcher (the real stack's fuzzing is test_fuzz.py)."""
import json

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from app.native import _completion_schema, _infill_schema
from app.openapi import build_openapi
from app.tokens import DetokenizeRequestSchema, TokenizeRequestSchema
from test_app import MODEL, STATE, FakeDispatcherClient, completion

PROPS = build_openapi()["components"]["schemas"]["CompletionRequest"]["properties"]
ROUTES = {
    "/v1/completions": sorted(PROPS),
    "/completion": sorted(_completion_schema.fields),
    "/infill": sorted(_infill_schema.fields),
    "/tokenize": sorted(TokenizeRequestSchema().fields),
    "/detokenize": sorted(DetokenizeRequestSchema().fields),
}
BASE = {"/v1/completions": {"prompt": "def f(x):", "max_tokens": 4},
        "/completion": {"prompt": "def f(x):", "n_predict": 4},
        "/infill": {"input_prefix": "def f(", "input_suffix": "):", "n_predict": 4},
        "/tokenize": {"content": "hi"}, "/detokenize": {"tokens": [1, 2]}}

# integers far past any 64-bit range, at both signs, and the edges around it
BIG_INTS = st.sampled_from([2 ** 63, 2 ** 64, -(2 ** 63) - 1, 10 ** 30, -(10 ** 30),
                            10 ** 309, -(10 ** 309), int("9" * 400), 2 ** 31, -1, 0])
ODD_STRINGS = st.sampled_from(["²", "١٢", "¹²³", "-²", " 7", "7 ", "+1", "0x10", "1e3",
                               "½", "", "\u0000", "𝟙", "1" * 5000, "-" + "9" * 400,
                               "null", "true", "[]"])
SCALARS = (st.none() | st.booleans() | st.integers() | BIG_INTS
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20)
           | ODD_STRINGS)
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=6) | ODD_STRINGS, inner,
                                        max_size=4), max_leaves=12)
WIDE = st.sampled_from([list(range(3000)), ["x"] * 3000, {str(i): i for i in range(3000)},
                        {"k" * 100_000: 1}, [[[[[[[[[[1]]]]]]]]]], "y" * 100_000])
FIELD_VALUES = settings(max_examples=1500, deadline=None, derandomize=True,
                        suppress_health_check=list(HealthCheck))


FIM_STATE = msgspec.structs.replace(STATE, models={MODEL: msgspec.structs.replace(
    STATE.models[MODEL], fim=True)}, workers=[msgspec.structs.replace(STATE.workers[0],
                                                                     fim=True)])


class EncodingClient(FakeDispatcherClient):
    """The fake client, encoding each job as the real one puts it on the wire, for a model
    that has fill-in-the-middle tokens (so /infill runs too)."""

    def wait_state(self, timeout: float = 2.0):
        return FIM_STATE

    def submit(self, job):
        msgspec.json.encode(job)
        return super().submit(job)


@pytest.fixture(scope="module")
def http():
    from app import create_app
    app = create_app({"TESTING": True, "DISPATCHER": "ipc:///nonexistent"})
    app.extensions["dispatcher_client"] = EncodingClient(lambda job: (
        [{"e": "end", "s": 0, "result": {"tokens": [1]}}] if job.get("op")
        else completion("Hello")))
    return app.test_client()


def assert_answered(response) -> None:
    assert response.status_code < 500, (response.status_code, response.data[:300])
    if response.status_code >= 400:
        error = json.loads(response.data)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]


@FIELD_VALUES
@given(route=st.sampled_from(sorted(ROUTES)), data=st.data(),
       value=VALUES | WIDE, stream=st.booleans())
def test_every_field_with_any_json_value_is_answered_without_a_500(http, route, data,
                                                                  value, stream):
    field = data.draw(st.sampled_from(ROUTES[route]))
    body = dict(BASE[route], **{field: value})
    if route not in ("/tokenize", "/detokenize") and "stream" not in (field,):
        body["stream"] = stream
    assert_answered(http.post(route, data=json.dumps(body),
                              content_type="application/json"))


@pytest.mark.parametrize("key", ["²", "١٢", "-²", "𝟙", "1" * 5000, "-" + "9" * 400, " 5 ",
                                 "5", str(2 ** 70)], ids=lambda key: ascii(key)[:16])
def test_logit_bias_keys_that_only_look_like_numbers_are_a_400(http, key):
    response = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1,
                                                  "logit_bias": {key: 1}})
    assert_answered(response)
    if key.strip() == "5":
        assert response.status_code == 200
    else:
        assert response.status_code == 400
        assert response.get_json()["error"]["param"] == "logit_bias"


@pytest.mark.parametrize("field", sorted(n for n, p in PROPS.items()
                                         if "number" in str(p.get("type"))))
def test_a_float_field_given_a_310_digit_integer_is_a_400(http, field):
    response = http.post("/v1/completions", data='{"prompt": "x", "max_tokens": 1, "'
                         + field + '": ' + "9" * 310 + "}", content_type="application/json")
    assert_answered(response)
    assert response.status_code == 400
