"""/openapi.json: a valid OpenAPI 3.1 document that says exactly what the schemas accept."""
import pytest
from marshmallow import fields
from openapi_spec_validator import validate as validate_spec

from app import create_app
from app.requests import validate
from app.errors import InvalidRequest
from app.openapi import build_openapi
from app.schemas import CompletionRequestSchema

DOC = build_openapi()
REQUEST = DOC["components"]["schemas"]["CompletionRequest"]


def test_document_is_valid_openapi():
    validate_spec(DOC)


def test_served_document_is_the_built_one():
    app = create_app({"DISPATCHER": "ipc:///nonexistent"})
    response = app.test_client().get("/openapi.json")
    assert response.status_code == 200 and response.get_json() == DOC


def test_every_schema_field_is_documented_and_nothing_else():
    schema = CompletionRequestSchema()
    keys = {name: field.data_key or name for name, field in schema.fields.items()}
    assert set(REQUEST["properties"]) == set(keys.values())
    assert REQUEST["required"] == [keys[n] for n, f in schema.fields.items() if f.required]
    assert REQUEST["additionalProperties"] is False
    for name, field in schema.fields.items():
        documented = REQUEST["properties"][keys[name]]
        assert documented.get("description"), f"{name} has no description"
        if field.allow_none:
            types = documented.get("type", [])
            assert "null" in types or {"type": "null"} in documented.get("oneOf", []), name


def _numeric_fields():
    for name, prop in REQUEST["properties"].items():
        for key in ("minimum", "maximum", "exclusiveMinimum"):
            if key in prop:
                yield name, key, prop[key], prop


@pytest.mark.parametrize("name, key, bound, prop", list(_numeric_fields()),
                         ids=lambda v: str(v) if not isinstance(v, dict) else "")
def test_documented_bounds_are_the_validators_bounds(name, key, bound, prop):
    types = prop["type"] if isinstance(prop["type"], list) else [prop["type"]]
    step = 1 if "integer" in types else 0.001
    outside = {"minimum": bound - step, "maximum": bound + step,
               "exclusiveMinimum": bound}[key]
    inside = {"minimum": bound, "maximum": bound, "exclusiveMinimum": bound + step}[key]
    extra = {"stream": True} if name == "stream_options" else {}
    validate({"prompt": "p", name: inside, **extra})
    with pytest.raises(InvalidRequest) as info:
        validate({"prompt": "p", name: outside, **extra})
    assert info.value.param == name


@pytest.mark.parametrize("name", [n for n, p in REQUEST["properties"].items() if "enum" in p])
def test_documented_enums_are_accepted_and_others_rejected(name):
    for value in REQUEST["properties"][name]["enum"]:
        validate({"prompt": "p", name: value})
    with pytest.raises(InvalidRequest):
        validate({"prompt": "p", name: "not-in-enum" if isinstance(
            REQUEST["properties"][name]["enum"][0], str) else 99})


def test_documented_types_match_the_field_classes():
    kinds = {"StrictFloat": "number", "StrictInteger": "integer", "StrictBoolean": "boolean",
             "StrictString": "string", "JSONObject": "object"}
    for name, field in CompletionRequestSchema().fields.items():
        name = field.data_key or name
        kind = kinds.get(type(field).__name__)
        if kind:
            documented = REQUEST["properties"][name]["type"]
            assert kind == (documented[0] if isinstance(documented, list) else documented)
        elif isinstance(field, fields.Nested):
            assert REQUEST["properties"][name]["type"][0] == "object"


def test_native_endpoints_are_documented():
    for path in ("/completion", "/completions", "/infill", "/v1/models/{model}"):
        assert path in DOC["paths"], path
    infill = DOC["components"]["schemas"]["NativeInfillRequest"]["properties"]
    assert {"input_prefix", "input_suffix", "input_extra", "prompt", "n_indent",
            "t_max_prompt_ms", "t_max_predict_ms", "samplers"} <= set(infill)
    assert "501" in DOC["paths"]["/infill"]["post"]["responses"]


def test_list_limits_are_documented_as_the_fields_enforce_them():
    """The bounds checked before a list's items are read (app/fields.py BoundedList,
    TokenIdsField) are in the document too."""
    from app.native import MAX_EXTRA_CHUNKS, MAX_FIELD_PATH, MAX_RESPONSE_FIELDS
    from dispatcher.common.fields import INT_MAX
    schemas = DOC["components"]["schemas"]
    fields_ = schemas["NativeCompletionRequest"]["properties"]["response_fields"]
    assert fields_["maxItems"] == MAX_RESPONSE_FIELDS
    assert fields_["items"]["maxLength"] == MAX_FIELD_PATH
    extra = schemas["NativeInfillRequest"]["properties"]["input_extra"]
    assert extra["maxItems"] == MAX_EXTRA_CHUNKS
    tokens = schemas["DetokenizeRequest"]["properties"]["tokens"]
    assert tokens["items"]["maximum"] == INT_MAX


def test_every_route_served_is_documented_with_what_it_answers():
    """Each route the app serves is in the document (the status page's files and static
    files aside): /metrics was not; a native answer may be a list (several prompts or
    n_cmpl); /infill streams; a generating route may be superseded (409) or time out in
    the queue (504); any route but /health needs a key once keys are configured (401);
    a vocabulary request's other fields are ignored, as llama-server ignores them."""
    app = create_app({"DISPATCHER": "ipc:///nonexistent"})
    served = {rule.rule.replace("<path:model>", "{model}") for rule in app.url_map.iter_rules()
              if rule.endpoint not in ("static", "status.status_page_file")
              and rule.rule != "/ui/"}
    assert served <= set(DOC["paths"]), served - set(DOC["paths"])
    answer = DOC["components"]["schemas"]["NativeAnswer"]["oneOf"]
    assert {"type": "array", "items": {"$ref": "#/components/schemas/NativeCompletion"}} \
        in answer
    infill = DOC["paths"]["/infill"]["post"]["responses"]
    assert "text/event-stream" in infill["200"]["content"]
    for path in ("/v1/completions", "/v1/fim/completions", "/completion", "/infill"):
        assert {"401", "409", "504"} <= set(DOC["paths"][path]["post"]["responses"]), path
    assert "401" not in DOC["paths"]["/health"]["get"]["responses"]
    for name in ("TokenizeRequest", "DetokenizeRequest"):
        assert DOC["components"]["schemas"][name]["additionalProperties"] is True
    model = DOC["components"]["schemas"]["ModelList"]["properties"]["data"]["items"]
    assert {"aliases", "meta"} <= set(model["properties"])
