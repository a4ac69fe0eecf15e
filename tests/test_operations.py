"""The ops tool, Prometheus metrics and the config file, on the real stack."""
import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import ROOT, ServerProcess, SSEStream, http_json, two_single_cores

pytestmark = pytest.mark.integration


def ops(server, *args, check=True):
    out = subprocess.run([sys.executable, "-m", "dispatcher", *args, "--port",
                          str(server.port)], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    if check:
        assert out.returncode == 0, out.stdout + out.stderr
    return out


def workers_by_name(server) -> dict:
    return {w["name"]: w for w in server.status()["workers"]}


def complete(port, body, timeout=120):
    status, _, payload = http_json(port, "POST", "/v1/completions", body, timeout=timeout)
    assert status == 200, payload
    return payload


@pytest.fixture(scope="module")
def two():
    """Two one-thread workers, on this test process's cores (its one core twice in the
    parallel pass: they take turns), and two front ends."""
    first, second = two_single_cores()
    server = ServerProcess("--device", f"cpu:{first}", "--device", f"cpu:{second}",
                           "--frontends", "2", workers=2, log_name="ops").start()
    server.names = (f"w0-cpu{first}", f"w1-cpu{second}")
    server.first_core = first
    yield server
    assert server.stop() == 0


def test_status_shows_workers_queue_and_front_ends(two):
    made = complete(two.port, {"prompt": "Hello", "max_tokens": 4})["usage"]["completion_tokens"]
    status = json.loads(ops(two, "status", "--json").stdout)
    assert {w["name"] for w in status["workers"]} == set(two.names)
    for worker in status["workers"]:
        for key in ("device", "model", "state", "busy_slots", "slots", "tokens_per_s",
                    "uptime_s", "restarts", "completed", "pid"):
            assert key in worker, key
        # the offload llama.cpp reported: none on a CPU, of the 18 layers and the output
        assert (worker["placement"]["layers_offloaded"],
                worker["placement"]["layers_total"]) == (0, 19)
    # the host's and the device's share of a step (the heartbeat's step profile), once a
    # heartbeat after the request counts its steps (each token took one)
    def profiled():
        served = [w for w in json.loads(ops(two, "status", "--json").stdout)["workers"]
                  if w.get("step_ms")]
        return served if sum(w["step_ms"]["steps"] for w in served) >= made else None
    for worker in two.wait_for(profiled, timeout=10, what="a heartbeat with the steps"):
        assert worker["step_ms"]["device"] > 0 and worker["step_ms"]["host"] > 0
    assert len(status["frontends"]) == 2 and all(f["pid"] for f in status["frontends"])
    assert "queue" in status
    table = ops(two, "status").stdout
    for text in ("WORKER", "TOK/S", "RESTARTS", *two.names, f"cpu:{two.first_core}", "FRONT END",
                 "queue:", "OFFLOAD", " 0/19 ", "STEP MS HOST/DEV"):
        assert text in table


def test_drain_moves_new_work_elsewhere_then_resume(two, tmp_path):
    # (long enough to outlast a `drain` process's start on a loaded core: ended before
    # it, the worker is "drained" already and its count taken after its stream)
    stream = SSEStream(two.port, {"prompt": "Once upon a time", "max_tokens": 200,
                                  "ignore_eos": True, "stream": True})
    stream.next_data()
    busy = next(n for n, w in workers_by_name(two).items() if w["running"])
    other = (set(two.names) - {busy}).pop()
    assert "drain" in ops(two, "drain", busy).stdout
    assert workers_by_name(two)[busy]["state"] == "draining"
    done = {n: w["completed"] for n, w in workers_by_name(two).items()}
    for i in range(3):
        complete(two.port, {"prompt": f"drained {i}", "max_tokens": 2})
    events = list(stream.events())                     # the running stream finishes
    assert events[-1] == "[DONE]" and "error" not in json.loads(events[-2])
    two.wait_for(lambda: workers_by_name(two)[busy]["state"] == "drained", timeout=10,
                 what="drained")
    assert http_json(two.port, "GET", "/health")[0] == 200     # (one worker still takes work)
    two.wait_for(lambda: workers_by_name(two)[other]["completed"] >= done[other] + 3,
                 timeout=30, what="the other worker's count (its DONEs may trail)")
    after = workers_by_name(two)
    assert after[busy]["completed"] == done[busy] + 1   # only the stream it had
    ops(two, "resume", busy)
    assert workers_by_name(two)[busy]["state"] == "idle"
    # every worker drained: /health says so (a balancer kept sending work that waited
    # 30 s for a 503), and is ok again once one takes work
    for name in two.names:
        ops(two, "drain", name)
    two.wait_for(lambda: http_json(two.port, "GET", "/health")[0] == 503, timeout=10,
                 what="/health's 503")
    assert http_json(two.port, "GET", "/health")[2]["reason"] == "every worker is drained"
    ops(two, "resume", busy)
    two.wait_for(lambda: http_json(two.port, "GET", "/health")[0] == 200, timeout=10,
                 what="/health's 200")
    ops(two, "resume", other)
    # the ops commands find the dispatcher by the config file too, as documented
    config = tmp_path / "ops.toml"
    config.write_text(f"[server]\nport = {two.port}\n")
    for command in (["status"], ["drain", "no-such-worker"]):
        out = subprocess.run([sys.executable, "-m", "dispatcher", *command, "--config",
                              str(config)], cwd=ROOT, capture_output=True, text=True,
                             timeout=60)
        assert "unrecognized" not in out.stderr and "no answer" not in out.stderr, out.stderr
    assert out.returncode == 1 and "no ready worker" in out.stderr
    out = ops(two, "drain", "no-such-worker", check=False)
    assert out.returncode == 1 and "no ready worker" in out.stderr and not out.stdout


def test_restart_and_reload_keep_other_workers_serving(two, tmp_path):
    from tiny_gguf import write_tiny_fim_model
    tiny = write_tiny_fim_model(tmp_path / "tiny-fim.gguf")
    before = workers_by_name(two)
    target, other = two.names
    results = []

    def keep_asking():
        for i in range(6):
            results.append(http_json(two.port, "POST", "/v1/completions",
                                     {"prompt": f"still here {i}", "max_tokens": 3,
                                      "model": "gemma-3-270m-q4_k_m"})[0])

    thread = threading.Thread(target=keep_asking)
    thread.start()
    ops(two, "restart", target)
    thread.join(timeout=120)
    assert results == [200] * 6
    two.wait_for(lambda: workers_by_name(two).get(target, {}).get("pid") not in
                 (None, before[target]["pid"]) and workers_by_name(two)[target]["state"]
                 == "idle", timeout=60, what="the restarted worker")
    assert workers_by_name(two)[target]["restarts"] == before[target]["restarts"] + 1
    assert workers_by_name(two)[other]["pid"] == before[other]["pid"]
    # reload onto another model: both are served, each by its worker
    ops(two, "reload", target, "--model", str(tiny), "--model-id", "tiny-fim")
    two.wait_for(lambda: workers_by_name(two).get(target, {}).get("model") == "tiny-fim"
                 and workers_by_name(two)[target]["state"] == "idle", timeout=60,
                 what="the reloaded worker")
    status, _, models = http_json(two.port, "GET", "/v1/models")
    assert {m["id"] for m in models["data"]} == {"gemma-3-270m-q4_k_m", "tiny-fim"}
    body = complete(two.port, {"model": "tiny-fim", "prompt": "def", "suffix": "x",
                               "max_tokens": 2})
    assert body["model"] == "tiny-fim"
    # the worker's DONE reaches the dispatcher by another path than the tokens the answer
    # was made of: it may arrive just after the answer
    two.wait_for(lambda: workers_by_name(two)[target]["completed"] >= 1, timeout=30,
                 what="the reloaded worker's count")
    ops(two, "reload", target, "--model", str(ROOT / "no-such.gguf"), check=False)
    empty = ops(two, "reload", target, "--model-id", "", check=False)   # (a plain restart)
    assert empty.returncode == 2 and "--model-id" in empty.stderr
    # a file that looks like a GGUF and is not: the worker gives up, and status says why
    # (it said `failed` with no reason, or the restart's loss before it)
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes([3, 0, 0, 0]) + b"\xff" * 64)
    ops(two, "reload", target, "--model", str(broken), "--model-id", "broken")
    two.wait_for(lambda: workers_by_name(two).get(target, {}).get("state") == "failed",
                 timeout=60, what="the worker giving up")
    lost = workers_by_name(two)[target]["last_lost"]
    assert lost["reason"].startswith("cannot serve: ") and "broken.gguf" in lost["reason"], lost
    ops(two, "reload", target, "--model",
        str(__import__("dispatcher.common.models", fromlist=["x"]).bundled_model_path()))
    two.wait_for(lambda: workers_by_name(two).get(target, {}).get("model")
                 == "gemma-3-270m-q4_k_m" and workers_by_name(two)[target]["state"] == "idle",
                 timeout=60, what="back on the bundled model")


def metric_samples(port) -> dict:
    status, headers, _ = http_json(port, "GET", "/metrics")
    assert status == 200
    import urllib.request
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def total(samples, name, **labels) -> float:
    return sum(v for lab, v in samples.get(name, [])
               if all(lab.get(k) == x for k, x in labels.items()))


def generated_after_first(samples) -> float:
    """Tokens the workers generated after each request's first (which its prefill gives):
    one a token row, and each draft token a row's verification kept."""
    return total(samples, "completions_worker_step_rows_total", kind="token") + \
        total(samples, "completions_worker_draft_accepted_tokens_total")


def test_metrics_show_the_whole_system_from_any_front_end(two):
    before = metric_samples(two.port)
    for i in range(6):
        # five tokens each: a sampled end of text sooner left the counts below short
        list(SSEStream(two.port, {"prompt": f"metrics {i}", "max_tokens": 5,
                                  "ignore_eos": True, "stream": True}).events())
    http_json(two.port, "POST", "/v1/completions", {"prompt": []})          # a 400
    want = total(before, "completions_requests_total", route="/v1/completions",
                 status="200") + 6

    def settled():
        samples = metric_samples(two.port)
        settled = total(samples, "completions_requests_total", route="/v1/completions",
                        status="200") >= want and \
            total(samples, "completions_requests_total", status="400") >= 1 and \
            generated_after_first(samples) >= generated_after_first(before) + 6 * 4
        return samples if settled else None

    # front ends report every second; whichever answers /metrics shows every request
    samples = two.wait_for(settled, timeout=10, what="metrics from both front ends")
    samples_again = two.wait_for(settled, timeout=10, what="metrics again")
    assert total(samples, "completions_requests_total", status="400") >= 1
    assert total(samples_again, "completions_requests_total", route="/v1/completions",
                 status="200") >= want
    ttft = total(samples, "completions_time_to_first_token_seconds_count")
    assert ttft >= 6
    assert total(samples, "completions_worker_requests_total", outcome="completed") >= 6
    workers = {lab["worker"] for lab, _ in
               samples["completions_time_to_first_token_seconds_count"]}
    assert workers <= set(two.names) and workers
    assert total(samples, "completions_inter_token_latency_seconds_count") >= 6 * 3
    assert total(samples, "completions_generated_tokens_total") >= 30
    assert total(samples, "completions_prompt_tokens_total") > 0
    assert {lab["worker"] for lab, _ in samples["completions_worker_busy"]} == set(two.names)
    assert "completions_worker_restarts_total" in samples
    assert [value for _, value in samples["completions_worker_layers_offloaded"]] == [0, 0]
    assert total(samples, "completions_frontends") == 2
    # the step profile (heartbeats): each stream's tokens after its first came from a
    # generating row; its prompt, from prompt rows; the decodes took time
    assert total(samples, "completions_worker_steps_total") >= 6 * 4
    assert total(samples, "completions_worker_step_rows_total", kind="prompt") > 0
    assert total(samples, "completions_worker_step_seconds_total", phase="decode") > 0
    assert total(samples, "completions_worker_step_batches_total") >= \
        total(samples, "completions_worker_steps_total")
    assert {lab["worker"] for lab, value in samples["completions_worker_heartbeats_total"]
            if value >= 1} == set(two.names)


# -- config file --------------------------------------------------------------------------
def check_config(*args, env=None):
    out = subprocess.run([sys.executable, "-m", "dispatcher", "check-config", *args],
                         cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, **(env or {})})
    return out


def test_an_access_log_the_front_ends_could_not_write_is_a_problem(tmp_path):
    for bad in (str(tmp_path / "missing" / "access.log"), str(tmp_path)):
        result = check_config("--access-log", bad)
        assert result.returncode == 1 and f"--access-log {bad}:" in result.stdout
    for good in ("-", "off", str(tmp_path / "access.log")):
        assert check_config("--access-log", good).returncode == 0
    result = subprocess.run([sys.executable, "-m", "dispatcher", "serve", "--port", "1",
                             "--access-log", str(tmp_path / "missing" / "a.log")],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "not writable" in result.stderr


def test_an_empty_path_is_refused_never_taken_for_none(tmp_path):
    """`--api-key-file "$KEYS"` with KEYS unset served with no key at all; `--config ""`,
    `--model ""` and `--curve-keys ""` fell back to the defaults without a word."""
    for flag in ("--api-key-file", "--config", "--model", "--curve-keys", "--draft-model"):
        out = check_config("--engine", "fake", flag, "")
        assert out.returncode in (1, 2), (flag, out.stdout)
        assert "empty path" in out.stderr + out.stdout and "Traceback" not in out.stderr
    config = tmp_path / "c.toml"
    config.write_text('[server]\napi_key_file = ""\n')
    out = check_config("--config", str(config), "--engine", "fake")
    assert out.returncode == 1 and f"{config}: [server] api_key_file" in out.stderr
    # (the word keygen as a value is no keygen command: the broken file is still said)
    out = check_config("--config", str(config), "--engine", "fake", "--model-id", "keygen")
    assert out.returncode == 1 and "api_key_file" in out.stderr
    out = check_config(env={"COMPLETIONS_CONFIG": " "})
    assert out.returncode == 1 and "COMPLETIONS_CONFIG: an empty path" in out.stderr
    assert "Traceback" not in out.stderr
    models = tmp_path / "m.toml"
    models.write_text('[[models]]\nid = "m"\npath = ""\n')
    out = check_config("--config", str(models), "--engine", "fake")
    assert out.returncode == 1 and "models[0]: path is empty" in out.stdout


def test_operators_get_one_line_or_json_never_a_wait_or_a_traceback(tmp_path):
    """check-config --json answers JSON for a broken file too; --help and keygen work
    beside a broken file; an ops command where no dispatcher runs says so at once."""
    config = tmp_path / "w.toml"
    config.write_text("workers = [1, 2]\n")
    out = check_config("--config", str(config), "--json")
    answer = json.loads(out.stdout)
    assert out.returncode == 1 and not answer["ok"] and "workers" in answer["problems"][0]
    env = {**os.environ, "COMPLETIONS_CONFIG": str(config)}
    shown = subprocess.run([sys.executable, "-m", "dispatcher", "--help"], cwd=ROOT,
                           capture_output=True, text=True, timeout=60, env=env)
    assert shown.returncode == 0 and "check-config" in shown.stdout
    status = subprocess.run([sys.executable, "-m", "dispatcher", "status", "--dispatcher",
                             f"ipc://{tmp_path}/nothing"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert status.returncode == 1 and "is `serve` running?" in status.stderr
    assert "no control socket there" in status.stderr      # (at once, not after 3 s)
    assert "Traceback" not in status.stderr
    # check-config refuses the ipc directories serve refuses, and makes none
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    out = check_config("--engine", "fake", "--dispatcher", f"ipc://{shared}")
    assert out.returncode == 1 and "group or others may write" in out.stdout
    out = check_config("--engine", "fake", "--dispatcher", f"ipc://{tmp_path}/new")
    assert out.returncode == 0 and not (tmp_path / "new").exists()
    # (a directory systemd makes for the service when it starts: serve's to make)
    out = check_config("--engine", "fake", "--dispatcher", f"ipc://{tmp_path}/run/x/d")
    assert out.returncode == 0
    out = check_config("--engine", "fake", "--dispatcher", f"ipc://{tmp_path}/{'d' * 120}")
    assert out.returncode == 2 and "107 bytes" in out.stderr
    marked = tmp_path / "bom.toml"                  # (a byte-order mark some editors write)
    marked.write_bytes(b"\xef\xbb\xbf[server]\nport = 8099\n")
    out = check_config("--config", str(marked), "--engine", "fake")
    assert out.returncode == 0 and ":8099" in out.stdout


def test_the_example_workstation_config_is_valid(tmp_path):
    from dispatcher.common.models import bundled_model_path
    text = (ROOT / "deploy" / "workstation-4gpu.toml").read_text()
    keys = tmp_path / "keys"
    keys.write_text("k\n")
    text = text.replace("/srv/models/qwen2.5-coder-7b-q4_k_m.gguf", str(bundled_model_path()))
    text = text.replace("/etc/completions/keys", str(keys))
    config = tmp_path / "config.toml"
    config.write_text(text)
    out = check_config("--config", str(config), "--json")
    report = json.loads(out.stdout)
    assert out.returncode == 0 and report["ok"], report
    assert [w["device"] for w in report["workers"]] == [
        "cuda:0@interactive", "cuda:1@interactive", "cuda:2@interactive", "cuda:3@batch"]
    assert [w["slots"] for w in report["workers"]] == [16, 16, 16, 4]
    assert report["workers"][3]["nctx"] == 32768 and report["workers"][0]["nctx"] == 8192
    human = check_config("--config", str(config)).stdout
    assert human.startswith("config OK: 1 model(s), 4 worker(s)")


def test_check_config_reports_every_problem_with_its_place(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text(textwrap.dedent("""
        [server]
        port = "eighty"
        colour = "blue"
        [[models]]
        id = "m"
        path = "/nope/model.gguf"
        [[workers]]
        device = "gpu:0"
        [[workers]]
        device = "cuda:1"
        model = "other"
        speed = 11
    """))
    out = check_config("--config", str(config))
    assert out.returncode == 1
    assert "[server] port" in out.stderr + out.stdout
    assert "[server] colour: unknown option" in out.stderr + out.stdout
    config.write_text(textwrap.dedent("""
        [[models]]
        id = "m"
        path = "/nope/model.gguf"
        [[workers]]
        device = "gpu:0"
        [[workers]]
        device = "cuda:1"
        model = "other"
        [[workers]]
        device = "cuda:2"
        speed = 11
        [[workers]]
        device = "cuda:3"
        [[workers]]
        device = "cuda:3"
        [[workers]]
        device = "cuda:4"
        kv_type = "q5_1"
        [[workers]]
        device = "cuda:5"
        batch = 256
        ubatch = 512
        [[workers]]
        device = "cuda:6,1"
    """))
    out = check_config("--config", str(config))
    assert out.returncode == 1
    for text in ("models[0]: model file not found", "workers[0]: unknown device kind",
                 "workers[1]: model 'other'", "workers[2]: unknown keys ['speed']",
                 "cuda:3 is used by more than one worker",
                 "cuda:1 is used by more than one worker",      # (split over 6 and 1)
                 "workers[5]: kv_type must be one of f16, q8_0, q4_0, got 'q5_1'",
                 "workers[6]: ubatch 512 is larger than batch 256"):
        assert text in out.stdout, (text, out.stdout)
    out = check_config("--config", str(tmp_path / "missing.toml"))
    assert out.returncode == 1 and "missing.toml" in out.stderr


def test_core_sets_that_overlap_are_refused(tmp_path):
    """Two workers whose core sets overlap (a typo: `cpu:0-3` beside `cpu:2-5`) hold each
    other back at every barrier on the shared cores: refused by name, for flags and the
    file alike. The very same set for several workers (time-sharing, as the tests' two
    workers on one core) and bare `cpu` (unpinned) are the operator's choice."""
    out = check_config("--device", "cpu:0-3", "--device", "cpu:2-5", "--device", "cpu:8")
    assert out.returncode == 1
    assert "cores 2-3 are in more than one worker's core set (cpu:0-3, cpu:2-5)" in out.stdout
    config = tmp_path / "c.toml"
    config.write_text("[[workers]]\ndevice = \"cpu:1\"\n[[workers]]\ndevice = \"cpu:0-1\"\n")
    out = check_config("--config", str(config))
    assert out.returncode == 1 and "cores 1 are in more than one worker's" in out.stdout
    core = f"cpu:{min(os.sched_getaffinity(0))}"
    out = check_config("--device", "cpu", "--device", "cpu", "--device", core, "--device", core)
    assert out.returncode == 0, out.stdout + out.stderr


def test_flags_and_variables_override_the_file(tmp_path):
    core = f"cpu:{min(os.sched_getaffinity(0))}"      # one this process may use
    config = tmp_path / "c.toml"
    config.write_text("[server]\nnctx = 1024\nport = 9100\n[[workers]]\ndevice = \"cpu\"\n"
                      "[[workers]]\ndevice = \"cpu\"\n")
    report = json.loads(check_config("--config", str(config), "--json").stdout)
    assert [w["nctx"] for w in report["workers"]] == [1024, 1024]
    report = json.loads(check_config("--config", str(config), "--json",
                                     env={"COMPLETIONS_NCTX": "2048"}).stdout)
    assert report["workers"][0]["nctx"] == 2048
    report = json.loads(check_config("--config", str(config), "--json", "--nctx", "512",
                                     env={"COMPLETIONS_NCTX": "2048"}).stdout)
    assert report["workers"][0]["nctx"] == 512
    report = json.loads(check_config("--config", str(config), "--json", "--device",
                                     core).stdout)
    assert [w["device"] for w in report["workers"]] == [core]        # replaces the list
    # the KV cache type and batch sizes: per worker, else the flags'
    config.write_text("[[workers]]\ndevice = \"cpu\"\nkv_type = \"q8_0\"\nubatch = 128\n"
                      "[[workers]]\ndevice = \"cpu\"\n")
    report = json.loads(check_config("--config", str(config), "--json", "--kv-type", "q4_0",
                                     "--batch", "1024").stdout)
    assert [(w["kv_type"], w["batch"], w["ubatch"]) for w in report["workers"]] == \
        [("q8_0", 1024, 128), ("q4_0", 1024, 512)]


def test_a_model_id_flag_names_the_config_files_model_never_replaces_it(tmp_path):
    """--model-id (or its variable) beside a file's one model renames it; it put the
    bundled test model in its place under the production name, silently. Beside several
    it is refused: which would it name?"""
    from tiny_gguf import write_tiny_fim_model
    tiny = write_tiny_fim_model(tmp_path / "tiny.gguf")
    config = tmp_path / "one.toml"
    config.write_text(f'[[models]]\nid = "coder"\npath = "{tiny}"\nnctx = 256\n'
                      '[[workers]]\ndevice = "cpu"\nmodel = "coder"\n')   # (its worker follows)
    for args, env in ((["--model-id", "foo"], None), ([], {"COMPLETIONS_MODEL_ID": "foo"})):
        out = check_config("--config", str(config), "--json", *args, env=env)
        assert out.returncode == 0, out.stdout + out.stderr
        (model,) = json.loads(out.stdout)["models"]
        assert (model["id"], model["path"], model["nctx"]) == ("foo", str(tiny), 256)
    # an entry without an id is named after its file: its workers naming that follow too
    config.write_text(f'[[models]]\npath = "{tiny}"\n[[workers]]\ndevice = "cpu"\n'
                      'model = "tiny"\n')
    out = check_config("--config", str(config), "--json", "--model-id", "foo")
    assert out.returncode == 0, out.stdout + out.stderr
    assert [w["model"] for w in json.loads(out.stdout)["workers"]] == ["foo"]
    config.write_text(f'[[models]]\nid = "a"\npath = "{tiny}"\n[[models]]\nid = "b"\n'
                      f'path = "{tiny}"\n[[workers]]\ndevice = "cpu"\nmodel = "a"\n')
    out = check_config("--config", str(config), "--model-id", "foo")
    assert out.returncode == 1 and "--model-id" in out.stdout + out.stderr
    # a model no worker of the config serves is said (a remote worker's, or a typo)
    out = check_config("--config", str(config))
    assert out.returncode == 0 and "note: no worker here serves b" in out.stdout, out.stdout
    out = check_config("--config", str(config), "--json")
    assert json.loads(out.stdout)["unserved_models"] == ["b"]


def test_a_models_or_workers_option_under_server_says_where_it_goes(tmp_path):
    """`[server] model = ...` was "unknown option": it is one, of [[models]]."""
    config = tmp_path / "c.toml"
    config.write_text('[server]\nmodel = "m.gguf"\ndevice = "cpu"\nport = 8000\n')
    out = check_config("--config", str(config))
    said = out.stdout + out.stderr
    assert out.returncode == 1
    assert "[server] model: not a server option; in this file it is [[models]] path" in \
        said and "[server] device: not a server option; in this file it is " \
        "[[workers]] device" in said and "port" not in said


def test_serve_from_a_config_file_with_two_models(tmp_path):
    from dispatcher.common.models import bundled_model_path
    from tiny_gguf import write_tiny_fim_model
    tiny = write_tiny_fim_model(tmp_path / "tiny.gguf")
    first, second = two_single_cores()
    config = tmp_path / "two-models.toml"
    config.write_text(textwrap.dedent(f"""
        [server]
        nctx = 2048
        [[models]]
        id = "gemma"
        path = "{bundled_model_path()}"
        slots = 2
        [[models]]
        id = "tiny"
        path = "{tiny}"
        nctx = 256
        [[workers]]
        device = "cpu:{first}"
        model = "gemma"
        profile = "interactive"
        [[workers]]
        device = "cpu:{second}"
        model = "tiny"
    """))
    server = ServerProcess("--config", str(config), workers=2, log_name="config").start()
    try:
        status, _, models = http_json(server.port, "GET", "/v1/models")
        assert {m["id"]: m["meta"]["n_ctx"] for m in models["data"]} == {"gemma": 2048,
                                                                         "tiny": 256}
        assert complete(server.port, {"model": "gemma", "prompt": "Hi",
                                      "max_tokens": 2})["model"] == "gemma"
        assert complete(server.port, {"model": "tiny", "prompt": "def", "suffix": "x",
                                      "max_tokens": 2})["model"] == "tiny"
        # no model, or an empty one (llama.vim's): the config's first model
        for body in ({"prompt": "Hi", "max_tokens": 1},
                     {"model": "", "prompt": "Hi", "max_tokens": 1}):
            assert complete(server.port, body)["model"] == "gemma"
        status, _, answer = http_json(server.port, "POST", "/completion",
                                      {"model": "", "prompt": "Hi", "n_predict": 1})
        assert status == 200 and answer["model"] == "gemma"
        # with several models an unknown name cannot mean one of them, native route or not
        status, _, answer = http_json(server.port, "POST", "/completion",
                                      {"model": "other", "prompt": "Hi", "n_predict": 1})
        assert status == 404 and answer["error"]["code"] == "model_not_found"
        workers = workers_by_name(server)
        assert workers[f"w0-cpu{first}-interactive"]["slots"] == 2
        assert workers[f"w1-cpu{second}"]["model"] == "tiny"
    finally:
        assert server.stop() == 0
