"""What editor plugins and browser clients need to connect unchanged: model aliases,
`GET /v1/models/{id}`, CORS. The whole stack on the bundled model."""
import http.client

import openai
import pytest

from conftest import ServerProcess, http_json

ORIGIN = "https://editor.example"


@pytest.fixture(scope="module")
def editor_server():
    server = ServerProcess("--model-alias", "gpt-3.5-turbo", "--model-alias", "codellama",
                           "--cors-origin", ORIGIN, "--api-key", "sk-editor",
                           log_name="editors").start()
    yield server
    assert server.stop() == 0


def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-editor", max_retries=0)


def test_hard_coded_model_names_resolve_through_aliases(editor_server):
    api = client(editor_server)
    for name in ("gpt-3.5-turbo", "codellama"):
        answer = api.completions.create(model=name, prompt="def add(a, b):", max_tokens=3,
                                        temperature=0)
        assert answer.choices[0].finish_reason == "length"
        assert answer.usage.completion_tokens == 3
    with pytest.raises(openai.NotFoundError) as caught:
        api.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert caught.value.body["code"] == "model_not_found"


def test_models_can_be_retrieved_by_id_or_alias(editor_server):
    api = client(editor_server)
    listed = api.models.list().data
    assert len(listed) == 1
    model_id = listed[0].id
    assert sorted(listed[0].aliases) == ["codellama", "gpt-3.5-turbo"]
    assert api.models.retrieve(model_id).id == model_id
    assert api.models.retrieve("codellama").id == model_id
    with pytest.raises(openai.NotFoundError):
        api.models.retrieve("no-such-model")


def preflight(port, origin, method="POST", headers="authorization, content-type"):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("OPTIONS", "/v1/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": method,
        "Access-Control-Request-Headers": headers})
    response = conn.getresponse()
    response.read()
    conn.close()
    return response.status, {k.lower(): v for k, v in response.getheaders()}


def test_cors_preflights_are_answered_for_allowed_origins_only(editor_server):
    status, headers = preflight(editor_server.port, ORIGIN)
    assert status == 204                                  # no API key needed for it
    assert headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in headers["access-control-allow-methods"]
    assert "authorization" in headers["access-control-allow-headers"]
    assert "Origin" in headers["vary"]
    status, headers = preflight(editor_server.port, "https://evil.example")
    assert status == 204 and "access-control-allow-origin" not in headers


def test_cors_answers_echo_allowed_origins_only(editor_server):
    auth = {"Authorization": "Bearer sk-editor"}
    status, headers, _ = http_json(editor_server.port, "POST", "/v1/completions",
                                   {"prompt": "x", "max_tokens": 1},
                                   headers={**auth, "Origin": ORIGIN})
    assert status == 200 and headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "X-Request-Id" in headers["Access-Control-Expose-Headers"]
    status, headers, _ = http_json(editor_server.port, "POST", "/v1/completions",
                                   {"prompt": "x", "max_tokens": 1},
                                   headers={**auth, "Origin": "https://evil.example"})
    assert status == 200 and "Access-Control-Allow-Origin" not in headers
    status, headers, _ = http_json(editor_server.port, "POST", "/v1/completions",
                                   {"prompt": "x"}, headers={"Origin": ORIGIN})
    assert status == 401 and headers["Access-Control-Allow-Origin"] == ORIGIN  # readable


def test_no_cors_headers_without_configured_origins(real_server):
    status, headers = preflight(real_server.port, ORIGIN)
    assert "access-control-allow-origin" not in headers
    status, headers, _ = http_json(real_server.port, "GET", "/v1/models",
                                   headers={"Origin": ORIGIN})
    assert status == 200 and "Access-Control-Allow-Origin" not in headers


def test_aliases_come_from_the_config_file_too(tmp_path):
    from conftest import ROOT
    import subprocess
    import sys
    config = tmp_path / "c.toml"
    config.write_text('[[models]]\nid = "m"\naliases = ["starcoder", "m"]\n')
    result = subprocess.run([sys.executable, "-m", "dispatcher", "check-config", "--config",
                             str(config)], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode != 0 and "alias 'm'" in result.stdout
    config.write_text('[[models]]\nid = "m"\naliases = ["starcoder"]\n')
    result = subprocess.run([sys.executable, "-m", "dispatcher", "check-config", "--config",
                             str(config)], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
