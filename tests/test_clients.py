"""Real clients, unchanged, against the whole stack on the bundled model: the bodies
llama.vim and llama.vscode send (recorded, ../shared/notes/editor-clients.md), Continue's
own client library run by node, litellm, Mistral's SDK on the FIM API; and what an
operator sees of them (the access log, the debug line for ignored fields)."""
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from conftest import ROOT, ServerProcess, SSEStream, http_json

pytestmark = pytest.mark.integration

KEY = "sk-clients"
AUTH = {"Authorization": f"Bearer {KEY}"}
TEMPLATE = "<PRE> {prefix} <SUF>{suffix} <MID>"
CONTINUE = ROOT / "tests" / "continue"
SECRET = "zebra-quokka-7731"            # in prompts: must never reach a log


@pytest.fixture(scope="module")
def access_log():
    return Path(tempfile.mkdtemp(prefix="cs-access-")) / "access.log"


@pytest.fixture(scope="module")
def server(access_log):
    server = ServerProcess("--fim-template", TEMPLATE, "--api-key", KEY,
                           "--access-log", str(access_log), "--log-level", "debug",
                           log_name="clients").start()
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def model_id(server):
    return http_json(server.port, "GET", "/v1/models", headers=AUTH)[2]["data"][0]["id"]


def post(port, path, body, headers=None):
    return http_json(port, "POST", path, body, headers={**AUTH, **(headers or {})},
                     timeout=120)


# -- llama.vim and llama.vscode: their bodies, byte for byte ---------------------------------
RING = [{"filename": "helper.py", "time": [1796136158, 578363],
         "text": "def helper(x):\n    return x * 2\n"},
        {"filename": "main.py", "time": [1796136160, 1],
         "text": "from helper import helper\n\nprint(helper(3))\n"}]
VIM_WARM_UP = {"id_slot": 0, "input_prefix": "", "input_suffix": "", "input_extra": RING,
               "prompt": "", "n_predict": 0, "temperature": 0.0, "samplers": [],
               "stream": False, "cache_prompt": True, "t_max_prompt_ms": 1,
               "t_max_predict_ms": 1, "response_fields": [""], "model": ""}
VIM_FIELDS = ["content", "timings/prompt_n", "timings/prompt_ms",
              "timings/prompt_per_token_ms", "timings/prompt_per_second",
              "timings/predicted_n", "timings/predicted_ms", "timings/predicted_per_token_ms",
              "timings/predicted_per_second", "truncated", "tokens_cached"]


def vim_completion(typed: str) -> dict:
    return {"input_prefix": "import os\n\ndef list_files(path):\n",
            "input_suffix": "\n\nprint(list_files('.'))\n", "prompt": typed,
            "input_extra": RING, "n_predict": 128, "n_indent": 0, "top_k": 40, "top_p": 0.9,
            "samplers": ["top_k", "top_p", "infill"], "stop": [], "stream": False,
            "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 250,
            "id_slot": 0, "response_fields": VIM_FIELDS, "model": ""}


def tokens_of(server, text: str) -> int:
    return len(post(server.port, "/tokenize", {"content": text})[2]["tokens"])


def test_llama_vim_warm_up_and_keystrokes_bring_suggestions(server):
    status, _, answer = post(server.port, "/infill", VIM_WARM_UP)
    assert status == 200 and answer == {}           # response_fields [""]: as llama-server
    # the ring as the worker lays it out: a snippet separator, then each chunk's text
    ring = sum(tokens_of(server, "\n\n--- snippet ---\n\n") + tokens_of(server, c["text"])
               for c in RING)
    answers = []
    for typed in ("    ", "    r", "    re"):       # three keystrokes, as the plugin sends
        status, _, answer = post(server.port, "/infill", vim_completion(typed))
        assert status == 200, answer
        assert set(answer) == set(VIM_FIELDS)         # the flat keys the plugin reads
        assert isinstance(answer["content"], str)
        assert answer["tokens_cached"] >= ring        # the ring the warm-up filled
        answers.append(answer)
    # the plugin shows a suggestion when `content` is not empty (sampled text: one of
    # the three, not each, may end at once)
    assert any(a["content"] for a in answers), answers


def test_llama_vim_without_a_key_sends_an_empty_bearer(real_server):
    # llama.vim always sends `Authorization: Bearer ` (empty when no api_key is set)
    status, _, answer = http_json(real_server.port, "POST", "/completion",
                                  {"prompt": "def f(", "n_predict": 2, "model": ""},
                                  headers={"Authorization": "Bearer "})
    assert status == 200 and answer["tokens_predicted"] <= 2


def test_llama_vscode_body_with_its_default_model_and_three_completions(server, model_id):
    body = {"id_slot": 0, "input_prefix": "import os\n\ndef list_py(path):\n    ",
            "input_suffix": "\n", "input_extra": [{"text": "x = 1\n", "time": 1718000000000,
                                                   "filename": "/src/a.py"}],
            "prompt": "return [", "n_predict": 12, "n_cmpl": 3, "top_k": 40, "top_p": 0.99,
            "stream": False, "samplers": ["top_k", "top_p", "infill"],
            "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 500,
            "model": "google/gemini-2.5-flash"}           # its `ai_model` default
    status, _, answer = post(server.port, "/infill", body)
    assert status == 200, answer
    assert isinstance(answer, list) and len(answer) == 3      # llama.cpp's n_cmpl answer
    for one in answer:
        assert isinstance(one["content"], str) and one["model"] == model_id
        assert one["tokens_predicted"] <= 12 and \
            one["timings"]["predicted_n"] == one["tokens_predicted"]
        assert one["tokens_predicted"] >= 1 or not one["content"]     # (an EOS at once)
    status, _, answer = post(server.port, "/infill", {**body, "n_cmpl": 0})
    assert status == 400 and answer["error"]["param"] == "n_cmpl"


def test_an_unknown_model_on_v1_is_still_404(server):
    status, _, answer = post(server.port, "/v1/completions", {"model": "gpt-4",
                                                              "prompt": "x"})
    assert status == 404 and answer["error"]["code"] == "model_not_found"
    status, _, answer = post(server.port, "/v1/completions", {"model": "", "prompt": "x",
                                                              "max_tokens": 1})
    assert status == 200 and answer["usage"]["completion_tokens"] == 1


# -- Continue's own client library (npm), run by node ----------------------------------------
def ensure_node() -> str:
    """node and npm from Debian's packages when the machine has none (as nginx)."""
    if shutil.which("node") and shutil.which("npm"):
        return shutil.which("node")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    lock = ["-o", "DPkg::Lock::Timeout=600"]
    subprocess.run(["apt-get", *lock, "update"], env=env, check=True, capture_output=True,
                   timeout=900)
    subprocess.run(["apt-get", *lock, "install", "-y", "--no-install-recommends", "nodejs",
                    "npm"], env=env, check=True, capture_output=True, timeout=900)
    return shutil.which("node")


@pytest.fixture(scope="module")
def continue_client():
    """`node drive.mjs ...` with @continuedev/openai-adapters installed beside it."""
    node = ensure_node()
    if not (CONTINUE / "node_modules" / "@continuedev" / "openai-adapters").exists():
        # the versions of package-lock.json (made with --omit-lockfile-registry-resolved)
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"],
                       cwd=CONTINUE, check=True, capture_output=True, timeout=900)

    def run(server, model, *calls):
        result = subprocess.run([node, str(CONTINUE / "drive.mjs"), server.url, KEY, model,
                                 *calls], capture_output=True, text=True, timeout=300,
                                env={**os.environ, "NO_PROXY": "127.0.0.1"})
        lines = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
        assert len(lines) == len(calls), result.stdout + result.stderr
        return {line["call"]: line for line in lines}
    return run


def test_continue_adapters_complete_and_fill_in_the_middle(server, model_id,
                                                           continue_client):
    results = continue_client(server, model_id, "completion", "llamacpp", "fim")
    for call, result in results.items():
        assert result["ok"], (call, result)
        assert result["text"] and result["chunks"] >= 2, (call, result)
        assert result["finish"] in ("stop", "length"), (call, result)


# -- litellm ---------------------------------------------------------------------------------
def test_litellm_text_completion_streams_with_a_suffix(server, model_id, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")     # no download at import
    import litellm
    chunks = litellm.text_completion(
        model=f"text-completion-openai/{model_id}", api_base=server.url + "/v1",
        api_key=KEY, prompt="def add(a, b):\n    return ", suffix="\n\nprint(add(1, 2))\n",
        max_tokens=8, temperature=0, stream=True)
    texts, finish = [], None
    for chunk in chunks:
        texts.append(chunk.choices[0].text or "")
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(texts) and finish == "length"
    # the suffix was laid out: the same request without it has fewer prompt tokens
    status, _, with_suffix = post(server.port, "/v1/completions", {
        "prompt": "def add(a, b):\n    return ", "suffix": "\n\nprint(add(1, 2))\n",
        "max_tokens": 1})
    status, _, without = post(server.port, "/v1/completions", {
        "prompt": "def add(a, b):\n    return ", "max_tokens": 1})
    assert with_suffix["usage"]["prompt_tokens"] > without["usage"]["prompt_tokens"]


# -- Mistral's FIM API, with Mistral's SDK ---------------------------------------------------
@pytest.fixture(scope="module")
def mistral(server):
    try:
        from mistralai import Mistral             # mistralai 1.x
    except ImportError:
        from mistralai.client import Mistral      # 2.x and later
    return Mistral(api_key=KEY, server_url=server.url)


def test_mistral_sdk_fim_complete_and_stream(server, model_id, mistral):
    prompt, suffix = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"
    answer = mistral.fim.complete(model=model_id, prompt=prompt, suffix=suffix,
                                  max_tokens=8, temperature=0)
    assert answer.object == "chat.completion" and answer.model == model_id
    choice = answer.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length" and answer.usage.completion_tokens == 8
    streamed, last = [], None
    for event in mistral.fim.stream(model="", prompt=prompt, suffix=suffix, max_tokens=8,
                                    temperature=0, random_seed=7):
        last = event.data
        streamed.append(last.choices[0].delta.content or "")
    assert "".join(streamed) and last.choices[0].finish_reason == "length"
    assert last.usage.completion_tokens == 8
    assert last.usage.prompt_tokens == answer.usage.prompt_tokens


def test_fim_lays_out_the_suffix_with_the_template(server):
    body = {"prompt": "def square(x):\n    ", "suffix": "\n\nprint(square(3))\n",
            "max_tokens": 1}
    status, _, fim = post(server.port, "/v1/fim/completions", body)
    status2, _, plain = post(server.port, "/v1/completions", body)
    assert status == status2 == 200
    assert fim["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    status, _, no_suffix = post(server.port, "/v1/fim/completions",
                                {"prompt": body["prompt"], "max_tokens": 1})
    assert status == 200     # Mistral's meaning: without a suffix, a plain completion
    assert no_suffix["usage"]["prompt_tokens"] < fim["usage"]["prompt_tokens"]
    status, _, at_start = post(server.port, "/v1/fim/completions",   # the file's start
                               {"prompt": "", "suffix": body["suffix"], "max_tokens": 1})
    assert status == 200 and at_start["choices"][0]["message"]["role"] == "assistant"
    assert at_start["usage"]["prompt_tokens"] < fim["usage"]["prompt_tokens"]


@pytest.mark.parametrize("body, headers, status, param", [
    ({"prompt": "x", "seed": 1}, AUTH, 400, "seed"),             # Mistral's is random_seed
    ({"prompt": "x", "random_seed": "1"}, AUTH, 400, "random_seed"),
    ({"prompt": ["x"]}, AUTH, 400, "prompt"),
    ({"suffix": "x"}, AUTH, 400, "prompt"),
    ({"prompt": "x", "max_tokens": 2, "max_completion_tokens": 3}, AUTH, 400,
     "max_completion_tokens"),
    ({"prompt": "x", "temperature": 3}, AUTH, 400, "temperature"),
    ({"prompt": "x", "model": "codestral-latest"}, AUTH, 404, "model"),
    ({"prompt": "x"}, {"Authorization": "Bearer wrong"}, 401, None),
])
def test_fim_errors_use_the_openai_envelope(server, body, headers, status, param):
    got, _, answer = http_json(server.port, "POST", "/v1/fim/completions", body,
                               headers=headers)
    assert got == status and set(answer["error"]) == {"message", "type", "param", "code"}
    assert answer["error"]["param"] == param


def test_fim_needs_fim_tokens_or_a_template(real_server):
    status, _, answer = http_json(real_server.port, "POST", "/v1/fim/completions",
                                  {"prompt": "def f(", "suffix": ")", "max_tokens": 1})
    assert status == 400 and answer["error"]["code"] == "fim_unsupported"


def test_fim_stream_disconnect_cancels_generation(server):
    stream = SSEStream(server.port, {"prompt": "List every number from 1 to 1000: 1, 2,",
                                     "stream": True, "max_tokens": 1500, "temperature": 0},
                       headers=AUTH, path="/v1/fim/completions")
    assert stream.status == 200
    read = sum(1 for _, _ in zip(range(5), stream.events()))
    stream.close()
    worker = server.wait_cancelled()
    # (far from 1,500: a count drafts well, several tokens a step, and a loaded machine
    # may take a second from the close to the worker)
    assert read == 5 and worker["last_done"]["usage"]["completion_tokens"] < 600


# -- what an operator sees -------------------------------------------------------------------
def parse_logfmt(line: str) -> dict:
    pairs = re.findall(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)', line)
    return {k: (json.loads(v) if v.startswith('"') else v) for k, v in pairs}


def access_lines(path: Path) -> list[dict]:
    return [parse_logfmt(line) for line in path.read_text().splitlines() if line]


def test_access_log_has_one_line_per_request_and_no_content(server, access_log):
    status, headers, answer = post(server.port, "/v1/completions",
                                   {"prompt": f"The password is {SECRET}.", "max_tokens": 3,
                                    "temperature": 0})
    assert status == 200
    request_id = headers["X-Request-Id"]
    # behind nginx on this host: the address nginx saw (it was nginx's own, 127.0.0.1)
    _, proxied, _ = http_json(server.port, "POST", "/v1/completions",
                              {"prompt": "Hi", "max_tokens": 1},
                              headers={**AUTH, "X-Forwarded-For": "198.51.100.3, 203.0.113.9"})
    http_json(server.port, "POST", "/v1/completions", {"prompt": SECRET},
              headers={"Authorization": "Bearer not-the-key"})
    post(server.port, "/v1/completions", {"prompt": SECRET, "model": "nope"})
    # (ignore_eos: it must still be running when the client leaves; an answer that ended
    # early, drafted whole from this key's earlier ones, would be logged as complete)
    stream = SSEStream(server.port, {"prompt": SECRET, "max_tokens": 1000, "stream": True,
                                     "ignore_eos": True}, headers=AUTH)
    cut_id = stream.headers["x-request-id"]
    next(stream.events())
    stream.close()                                  # the client leaves mid-stream
    server.wait_for(lambda: any(line.get("request_id") == cut_id
                                for line in access_lines(access_log)),
                    what="the cut stream's line")
    text = access_log.read_text()
    assert SECRET not in text and KEY not in text   # no prompt, no key
    lines = access_lines(access_log)
    fields = ["time", "request_id", "method", "route", "status", "duration_ms", "ttft_ms",
              "prompt_tokens", "cached_tokens", "completion_tokens", "model", "worker", "key",
              "client", "user_agent", "error"]
    assert all(list(line) == fields for line in lines)
    mine = next(line for line in lines if line["request_id"] == request_id)
    assert mine["method"] == "POST" and mine["route"] == "/v1/completions"
    assert mine["status"] == "200" and mine["error"] == "-"
    assert mine["prompt_tokens"] == str(answer["usage"]["prompt_tokens"])
    assert mine["completion_tokens"] == "3" and mine["worker"].startswith("w0")
    assert 0 < float(mine["ttft_ms"]) <= float(mine["duration_ms"])
    assert mine["key"] == hashlib.sha256(KEY.encode()).hexdigest()[:8]
    assert mine["client"] == "127.0.0.1" and mine["model"] == answer["model"]
    assert next(line for line in lines if line["request_id"] == proxied["X-Request-Id"])[
        "client"] == "203.0.113.9"
    assert any(line["status"] == "401" and line["error"] == "invalid_api_key"
               and line["key"] == hashlib.sha256(b"not-the-key").hexdigest()[:8]
               for line in lines)
    assert any(line["status"] == "404" and line["error"] == "model_not_found"
               for line in lines)
    cut = next(line for line in lines if line["request_id"] == cut_id)
    assert cut["status"] == "200" and cut["error"] == "client_closed"


def test_ignored_native_fields_are_logged_at_debug(server):
    status, _, _ = post(server.port, "/completion", {"prompt": "x", "n_predict": 1,
                                                     "lora": [], "penalty_last_n": 0})
    assert status == 200
    server.wait_for(lambda: "/completion: ignoring fields lora, penalty_last_n"
                    in server.output(), what="the debug line")
