"""API keys as tenants, on the real stack: a request reuses only prompt cache that its
own key filled (`--cache-scope key`, the default with keys), so `cached_tokens` tells one
key nothing of another's prompts; `--cache-scope shared` reuses across keys, as it says.
And per-client state stays bounded: oversized session headers are 400s."""
import json

import pytest

from conftest import ServerProcess, http_json

pytestmark = pytest.mark.integration

SECRET = ("def connect():\n    # internal service account, do not share\n"
          "    user = 'deploy'\n    the_password_is = 'Tr0ub4dor&3'\n"
          "    return login(user, the_password_is)\n" * 6)


def complete(port, key, prompt, headers=None):
    status, _, body = http_json(port, "POST", "/v1/completions", {
        "prompt": prompt, "max_tokens": 1, "temperature": 0},
        headers={"Authorization": f"Bearer {key}", **(headers or {})})
    assert status == 200, body
    return body


def cached(body) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def keyed():
    server = ServerProcess("--api-key", "key-a", "--api-key", "key-b", "--slots", "4",
                           log_name="tenants").start()
    yield server
    assert server.stop() == 0


def test_a_key_reuses_only_the_prompt_cache_it_filled(keyed):
    first = complete(keyed.port, "key-a", SECRET)
    assert cached(first) == 0
    assert cached(complete(keyed.port, "key-a", SECRET)) > 0      # its own: reused
    other = complete(keyed.port, "key-b", SECRET)                 # the same text, other key
    assert cached(other) == 0
    assert other["usage"]["prompt_tokens"] == first["usage"]["prompt_tokens"]


def test_probing_another_keys_prompt_learns_nothing(keyed):
    """Key b guesses, right, the text key a sent: as if key a had sent nothing."""
    secret = "# payroll export job\n" + SECRET.replace("deploy", "payroll")   # b: never
    complete(keyed.port, "key-a", secret)
    assert cached(complete(keyed.port, "key-a", secret)) > 0        # a's cache is there
    guess = secret[:secret.index("Tr0ub4dor")] + "Tr0ub4dor&3'\n"
    control = "@" + guess[1:]                    # nobody sent it; shares no text with it
    # both hit at most what b's own earlier prompts share with them (the BOS token, in
    # whichever of b's slots each lands: one that shares a tenth of it counts, none does)
    assert cached(complete(keyed.port, "key-b", control)) <= 1
    assert cached(complete(keyed.port, "key-b", guess)) <= 1


@pytest.mark.parametrize("header, value", [("X-Session-Id", "s" * 129),
                                           ("X-Session-Seq", "1" * 21)])
def test_an_oversized_session_header_is_a_400(keyed, header, value):
    status, _, body = http_json(keyed.port, "POST", "/v1/completions",
                                {"prompt": "x", "max_tokens": 1},
                                headers={"Authorization": "Bearer key-a", header: value})
    assert status == 400, body
    assert body["error"]["param"] == header and body["error"]["code"] == "header_too_long"


def test_a_shared_cache_scope_reuses_across_keys():
    server = ServerProcess("--api-key", "key-a", "--api-key", "key-b", "--cache-scope",
                           "shared", log_name="shared-cache").start()
    try:
        complete(server.port, "key-a", SECRET)
        assert cached(complete(server.port, "key-b", SECRET)) > 0   # what `shared` reveals
    finally:
        assert server.stop() == 0


def test_a_key_over_its_share_of_the_queue_gets_429_while_another_key_is_served():
    """Two keys, a queue of 4: each key may have 2 waiting (FakeEngine, one slot)."""
    import time

    from conftest import SSEStream
    server = ServerProcess("--engine", "fake", "--slots", "1", "--max-queue", "4",
                           "--api-key", "key-a", "--api-key", "key-b",
                           log_name="fair-share").start()
    try:
        def stream(key, wait=True, max_tokens=50):
            return SSEStream(server.port, {"prompt": "[slow=0.02] x", "max_tokens": max_tokens,
                                           "stream": True}, timeout=60, wait=wait,
                             headers={"Authorization": f"Bearer {key}"})

        # (running until closed: its end would let a queued one in before the 429's check)
        running = stream("key-a", max_tokens=2000)
        assert running.next_data() is not None
        queued = [stream("key-a", wait=False) for _ in range(2)]    # its share, waiting
        deadline = time.monotonic() + 30
        while sum(server.status()["queue"].values()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        status, headers, body = http_json(server.port, "POST", "/v1/completions",
                                          {"prompt": "x", "max_tokens": 1},
                                          headers={"Authorization": "Bearer key-a"})
        assert status == 429 and body["error"]["code"] == "key_queue_full", body
        assert headers["Retry-After"] == "1"
        other = stream("key-b", wait=False)                 # another key: still admitted
        server.wait_for(lambda: sum(server.status()["queue"].values()) == 3,
                        what="the other key's request queued beside the full key's")
        running.close()
        other.receive()
        assert other.status == 200
        assert list(other.events())[-1] == "[DONE]"
        for s in queued:
            s.receive() if not hasattr(s, "response") else None
            assert list(s.events())[-1] == "[DONE]"
    finally:
        assert server.stop() == 0


def test_request_content_never_reaches_the_log(keyed):
    """Every class of bad request, each carrying a marker where its error message quotes
    the request (a grammar's text, a schema's property path, a field's name, a sampler's
    name, a logit bias key, a lone surrogate's path): answered with a 4xx, and the marker
    is in no log the stack writes (the dispatcher's, the workers', gunicorn's), at the
    default level. The client may see it; a log may not."""
    marker = "Zq7-private-marker"
    auth = {"Authorization": "Bearer key-a"}
    complete(keyed.port, "key-a", f"# {marker}\nprint(1)\n")
    bodies = [
        ("/v1/completions", {"prompt": "x", "max_tokens": 1,
                             "grammar": f'root ::= "a" ]{marker}'}),
        ("/v1/completions", {"prompt": "x", "max_tokens": 1, "grammar": f'root ::= {marker}'}),
        ("/v1/completions", {"prompt": "x", "max_tokens": 1, "json_schema": {
            "type": "object", "properties": {marker: {"type": "nope"}}}}),
        ("/v1/completions", {"prompt": "x", "max_tokens": 1, "json_schema": {
            "type": "object", "properties": {marker: {"description": "\ud800"}}}}),
        ("/v1/completions", {"prompt": "x", "max_tokens": 1, "json_schema": {
            "type": "string", "pattern": f"^{marker}{{99999}}$"}}),
        ("/v1/completions", {"prompt": "x", marker: 1}),
        ("/v1/completions", {"prompt": "x", marker * 12_000: 1}),          # a 200 KB name
        ("/v1/completions", {"prompt": "x", "samplers": [marker]}),
        ("/v1/completions", {"prompt": "x", "logit_bias": {marker: 1}}),
        ("/v1/completions", {"prompt": "x", "stop": {marker: 1}}),
        ("/completion", {"prompt": "x", "n_predict": 1, "grammar": f'root ::= "a" ]{marker}'}),
        ("/infill", {"input_prefix": "x", "input_extra": [{"text": 5, marker: 1}]}),
        ("/tokenize", {"content": {marker: 1}}),
    ]
    for path, body in bodies:
        status, _, answer = http_json(keyed.port, "POST", path, body, headers=auth)
        assert 400 <= status < 500, (path, status, answer)
        assert len(json.dumps(answer)) < 4096                      # bounded, quoting or not
    raw = [f"{{\"prompt\": \"x\", \"{marker}\": }}".encode(),     # not JSON
           f"{{\"prompt\": \"{marker}\\ud800\"}}".encode()]        # not text
    for body in raw:
        status, _, _ = http_json(keyed.port, "POST", "/v1/completions", body, headers=auth)
        assert status == 400
    keyed.wait_for(lambda: keyed.log_path.stat().st_size > 0, what="the log")
    log = keyed.log_path.read_text(errors="replace")
    assert marker not in log
    assert "Traceback" not in log


def test_a_dispatcher_reachable_from_other_hosts_needs_keys(tmp_path):
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "dispatcher", "serve", "--engine", "fake",
                          "--dispatcher", "tcp://0.0.0.0:5590"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1].startswith(
        "tcp://0.0.0.0:5590 is reachable from other hosts: give --curve-keys DIR")
    check = subprocess.run([sys.executable, "-m", "dispatcher", "check-config",
                            "--dispatcher", "tcp://10.1.2.3:5590"], capture_output=True,
                           text=True, timeout=60)
    assert check.returncode != 0 and "--insecure-transport" in check.stdout


def test_a_front_end_with_api_keys_refuses_an_unkeyed_loopback_tcp_dispatcher():
    """A front end run on its own (gunicorn with the app) checked only that its tcp
    dispatcher was on loopback: with API keys it sent every key's prompts to whatever
    local process held that port. It refuses it as the dispatcher does."""
    from app import create_app
    base = "tcp://127.0.0.1:5999"
    with pytest.raises(RuntimeError, match="open to every local user"):
        create_app({"TESTING": True, "DISPATCHER": base, "API_KEY": "ka"})
    create_app({"TESTING": True, "DISPATCHER": base})                  # no tenants
    create_app({"TESTING": True, "DISPATCHER": base, "API_KEY": "ka",
                "INSECURE_TRANSPORT": True})                           # forced


def test_with_api_keys_a_loopback_tcp_dispatcher_needs_keys_too(tmp_path):
    """API keys make tenants; any local user reaches a loopback port, and the
    dispatcher's sockets take jobs without a key and carry every key's tokens: serve,
    broker and check-config refuse it unkeyed (ipc, CURVE or --insecure-transport)."""
    import subprocess
    import sys
    from conftest import free_port
    base = f"tcp://127.0.0.1:{free_port(5)}"
    keys = tmp_path / "keys"
    keys.write_text("sk-tenant-a\n")
    for argv in (["serve", "--engine", "fake", "--api-key", "sk-x", "--port",
                  str(free_port())],
                 ["broker", "--api-key-file", str(keys)]):
        out = subprocess.run([sys.executable, "-m", "dispatcher", *argv, "--dispatcher",
                              base], capture_output=True, text=True, timeout=60)
        assert out.returncode != 0, out.stderr
        assert out.stderr.strip().splitlines()[-1].startswith(
            f"{base} is open to every local user, past the API keys"), out.stderr
    check = subprocess.run([sys.executable, "-m", "dispatcher", "check-config", "--engine",
                            "fake", "--api-key-file", str(keys), "--dispatcher", base],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode != 0 and "open to every local user" in check.stdout
    for extra in (["--insecure-transport"], []):       # forced; no keys: no tenants
        argv = ["--api-key-file", str(keys)] if extra else []
        check = subprocess.run([sys.executable, "-m", "dispatcher", "check-config",
                                "--engine", "fake", *argv, "--dispatcher", base, *extra],
                               capture_output=True, text=True, timeout=60)
        assert check.returncode == 0, check.stdout


def test_insecure_transport_reaches_the_parts_serve_starts(monkeypatch):
    """--insecure-transport (flag, variable or the file's [server]) allows the launcher a
    dispatcher other hosts can reach; the workers and front ends it starts must be told
    too (they once were not: each refused the address, exited 2 and was respawned for
    ever). Checked on what `serve` would start, without binding anything."""
    from dispatcher import cli
    from dispatcher.common import config, configfile
    from dispatcher.supervisor import Child
    from workers.worker import parse_launch
    monkeypatch.delenv("COMPLETIONS_INSECURE_TRANSPORT", raising=False)
    parser = config.ArgumentParser(prog="serve")
    config.add_options(parser, cli.SERVE_OPTIONS, {})
    args = config.resolve(parser.parse_args([
        "--engine", "fake", "--dispatcher", "tcp://0.0.0.0:5590", "--insecure-transport"]))
    plan = configfile.plan_for(args)
    worker = cli._worker_child(Child, plan.workers[0], args, "tcp://0.0.0.0:5590", False)
    launch = parse_launch(worker.argv[3:])              # (after python -m workers)
    assert launch.args.insecure_transport is True
    frontend = cli._frontend_child(Child, args, "tcp://0.0.0.0:5590", False)
    assert config._boolean(frontend.env["COMPLETIONS_INSECURE_TRANSPORT"]) is True


def test_serve_keyed_over_tcp_hands_its_own_parts_their_keys(tmp_path):
    import subprocess
    import sys

    from conftest import free_port
    keys = tmp_path / "keys"
    made = subprocess.run([sys.executable, "-m", "dispatcher", "keygen", str(keys)],
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0 and "dispatcher" in made.stdout
    assert sorted(p.name for p in (keys / "authorized" / "workers").iterdir()) == ["local.key"]
    assert (keys / "dispatcher.key_secret").stat().st_mode & 0o077 == 0
    base = free_port(5)
    server = ServerProcess("--engine", "fake", "--dispatcher", f"tcp://127.0.0.1:{base}",
                           "--curve-keys", str(keys), log_name="keyed").start()
    try:
        status, _, body = http_json(server.port, "POST", "/v1/completions",
                                    {"prompt": "x", "max_tokens": 2})
        assert status == 200 and body["usage"]["completion_tokens"] == 2
    finally:
        assert server.stop() == 0


def test_usage_is_counted_per_key_by_its_name_never_the_key(tmp_path):
    """Two keys from a key file (one named, one not) and one inline: /metrics and
    `dispatcher usage` count each one's requests, tokens and errors under its name (a
    fingerprint for an unnamed key), and no key appears anywhere in them; with
    --usage-by-key off nothing is counted per key."""
    import subprocess
    import sys

    from conftest import ROOT
    from dispatcher.common.apikeys import key_fingerprint
    keys = tmp_path / "keys"
    keys.write_text("# team keys\nsk-alice-0001 alice\nsk-anon-0002\nsk-bob-0004\tbob\n")
    server = ServerProcess("--engine", "fake", "--api-key", "sk-inline-0003",
                           "--api-key-file", str(keys), log_name="usage").start()
    try:
        def send(key, body):
            return http_json(server.port, "POST", "/v1/completions", body,
                             headers={"Authorization": f"Bearer {key}"})[0]
        assert send("sk-alice-0001", {"prompt": "a", "max_tokens": 3}) == 200
        assert send("sk-alice-0001", {"prompt": "a", "max_tokens": 2}) == 200
        assert send("sk-alice-0001", {"prompt": "a", "max_tokens": -7}) == 400
        assert send("sk-anon-0002", {"prompt": "bc", "max_tokens": 4}) == 200
        assert send("sk-bob-0004", {"prompt": "b", "max_tokens": 1}) == 200      # (a tab)
        assert send("sk-nobody", {"prompt": "a"}) == 401           # no key: not counted

        def usage():
            out = subprocess.run([sys.executable, "-m", "dispatcher", "usage", "--json",
                                  "--dispatcher", server.dispatcher], cwd=ROOT,
                                 capture_output=True, text=True, timeout=30)
            return {k["key"]: k for k in json.loads(out.stdout)["keys"]}
        rows = server.wait_for(lambda: (u := usage()).get("alice", {}).get("requests") == 3
                               and f"key-{key_fingerprint('sk-anon-0002')}" in u
                               and "bob" in u and u, what="usage of the keys")
        alice = rows["alice"]
        assert (alice["errors"], alice["completion_tokens"]) == (1, 5)
        assert alice["prompt_tokens"] > 0
        anon = rows[f"key-{key_fingerprint('sk-anon-0002')}"]
        assert (anon["requests"], anon["errors"], anon["completion_tokens"]) == (1, 0, 4)
        _, _, metrics = http_json(server.port, "GET", "/metrics")
        text = metrics.decode() if isinstance(metrics, bytes) else str(metrics)
        assert 'completions_key_requests_total{key="alice"} 3.0' in text
        assert 'completions_key_errors_total{key="alice"} 1.0' in text
        table = subprocess.run([sys.executable, "-m", "dispatcher", "usage", "--dispatcher",
                                server.dispatcher], cwd=ROOT, capture_output=True,
                               text=True, timeout=30).stdout
        assert "alice" in table and "COMPLETION TOKENS" in table
        for secret in ("sk-alice-0001", "sk-anon-0002", "sk-inline-0003", "sk-bob-0004"):
            assert secret not in text and secret not in table and secret not in str(rows)
    finally:
        assert server.stop() == 0
    quiet = ServerProcess("--engine", "fake", "--api-key", "sk-inline-0003",
                          "--usage-by-key", "off", log_name="usage-off").start()
    try:
        status, _, _ = http_json(quiet.port, "POST", "/v1/completions",
                                 {"prompt": "a", "max_tokens": 2},
                                 headers={"Authorization": "Bearer sk-inline-0003"})
        assert status == 200
        quiet.wait_for(lambda: b"completions_requests_total" in
                       http_json(quiet.port, "GET", "/metrics")[2], what="the request counted")
        assert b"completions_key_requests_total{" not in http_json(quiet.port, "GET",
                                                                  "/metrics")[2]
    finally:
        assert quiet.stop() == 0


@pytest.mark.parametrize("access, bare, proxied", [("open", 200, 200),
                                                   ("loopback", 200, 401),
                                                   (None, 200, 401),
                                                   ("key", 401, 401)])
def test_status_access_decides_who_reads_metrics_and_status_without_a_key(access, bare,
                                                                           proxied):
    """With keys configured, /metrics and /v1/status need none (open), none from this
    host straight (loopback, the default: a proxied request, as nginx sends them, needs
    one; /metrics names every key's usage), or always one (key); with the key both
    always answer; the page's files are always open (they hold no data). Loopback's
    trust also wants a loopback name in Host (DNS rebinding)."""
    flags = ("--status-access", access) if access else ()
    server = ServerProcess("--engine", "fake", "--api-key", "sk-ops", *flags,
                           log_name=f"status-{access or 'default'}").start()
    try:
        for path in ("/metrics", "/v1/status"):
            assert http_json(server.port, "GET", path)[0] == bare, path
            assert http_json(server.port, "GET", path,
                             headers={"X-Forwarded-For": "203.0.113.9"})[0] == proxied
            # a name rebound to 127.0.0.1 (a page a browser here loaded from elsewhere)
            # asks by its own name: loopback's trust is for loopback's names
            assert http_json(server.port, "GET", path, headers={
                "Host": f"rebound.example:{server.port}"})[0] == proxied, path
            assert http_json(server.port, "GET", path, headers={
                "Host": f"localhost:{server.port}"})[0] == bare, path
            assert http_json(server.port, "GET", path,
                             headers={"Authorization": "Bearer sk-ops"})[0] == 200
        for path in ("/", "/ui/", "/ui/status.js"):
            assert http_json(server.port, "GET", path)[0] == 200, path
    finally:
        assert server.stop() == 0


def test_usage_counts_from_a_front_end_are_checked_before_they_are_added():
    """A malformed or negative usage row in a heartbeat is left out whole (a counter never
    goes down, no junk label appears); the ops tool says the dispatcher's error."""
    from dispatcher.metrics import SystemMetrics
    from dispatcher.tools.ctl import format_usage
    metrics = SystemMetrics()
    metrics.absorb({"usage": [["alice", 1, 10, 5, 0], "abcde", ["eve", 1, -5, 0, 0],
                              ["x", 1, 2], [7, 1, 1, 1, 1], ["bob", "2", 3, 4, 1]]})
    assert metrics.usage == {"alice": [1, 10, 5, 0], "bob": [2, 3, 4, 1]}
    assert format_usage({"error": "unknown command 'usage'"}).startswith("error:")
    assert "no usage" in format_usage({"keys": []})


def test_the_series_of_workers_long_gone_are_forgotten():
    """A worker started on its own is named with its pid: each restart (a crash loop, a
    `systemctl restart`) is a new name. /metrics keeps the series of the last MAX_GONE
    workers gone, not of every name ever seen; one that comes back keeps its own."""
    from dispatcher import metrics as M
    from dispatcher.common import protocol as P
    kept = M.SystemMetrics()
    counts = [1] * len(M.Histogram(M.HISTOGRAMS["ttft"]).counts)
    kept.job_done("steady", "cuda:1", P.Done(attempt=1, usage=P.Usage(completion_tokens=3)))
    kept.worker_lost("steady", "cuda:1", 0)
    kept.worker_ready("steady")                       # back under its own name
    for pid in range(1000, 1000 + 3 * M.MAX_GONE):
        name = f"cuda0-{pid}"
        kept.job_done(name, "cuda:0", P.Done(attempt=1, usage=P.Usage(completion_tokens=2)))
        kept.absorb({"histograms": [["ttft", name, "cuda:0", {"counts": counts, "sum": 0.1}]]})
        kept.worker_lost(name, "cuda:0", 1)
    names = {w for _, w, _, _ in kept.snapshot()["tokens"]} | \
        {w for _, w, _, _ in kept.snapshot()["outcomes"]}
    assert len(names) == M.MAX_GONE + 1 and "steady" in names
    assert "cuda0-1000" not in names and f"cuda0-{999 + 3 * M.MAX_GONE}" in names
    assert len({w for _, w, _, _ in kept.snapshot()["histograms"]}) == M.MAX_GONE


def test_a_front_ends_increments_add_at_most_max_series_of_each_kind(monkeypatch):
    """Their labels come from another process: a histogram of a worker pruned here (sent
    after a dispatcher restart) came back for good, one more set of series for every
    pid-named worker lost in each outage. Past MAX_SERIES a new series is not kept; the
    ones kept go on counting."""
    from dispatcher import metrics as M
    monkeypatch.setattr(M, "MAX_SERIES", 8)
    metrics = M.SystemMetrics()
    counts = [1] * len(M.Histogram(M.HISTOGRAMS["ttft"]).counts)
    for i in range(20):
        metrics.absorb({"requests": [[f"/r{i}", "200", 1], ["/v1/completions", "200", 1]],
                        "histograms": [["ttft", f"w-{i}", "cpu",
                                        {"counts": counts, "sum": 0.1}]],
                        "usage": [[f"key-{i}", 1, 1, 1, 0]]})
    assert len(metrics.requests) == len(metrics.histograms) == len(metrics.usage) == 8
    assert metrics.requests[("/v1/completions", "200")] == 20
    assert ("/r19", "200") not in metrics.requests and "key-19" not in metrics.usage
    fresh = M.SystemMetrics()                   # a malformed histogram takes no place
    fresh.absorb({"histograms": [["ttft", "w", "cpu", {"counts": [1, 2, 3], "sum": 1}],
                                 ["ttft", "v", "cpu", {"counts": "x", "sum": 1}]]})
    assert fresh.histograms == {}


def test_a_name_in_use_keeps_its_key_past_thousands_of_others(monkeypatch):
    """The dispatcher remembers BOUND_NAMES names' keys, the least recently used going
    first: kept in the order first bound, a worker's name in use for weeks went first
    after that many registrations of pid-named others, and another key could take it."""
    from dispatcher.common import curve
    monkeypatch.setattr(curve, "BOUND_NAMES", 4)
    bound: dict = {}
    curve.bind_name(bound, "gpu-steady", "key-gpu")
    for pid in range(10):
        curve.bind_name(bound, f"local-{pid}", "key-local")
        curve.bind_name(bound, "gpu-steady", "key-gpu")       # its heartbeat
    assert len(bound) == 4 and bound["gpu-steady"] == "key-gpu"
    assert list(bound)[-1] == "gpu-steady" and "local-0" not in bound


def test_a_worker_key_takes_only_names_no_longer_key_name_holds(tmp_path):
    """Keys `gpu` and `gpu-2`: `gpu-2-cuda0-7` is key gpu-2's name, so key gpu may not
    register it first and lock that host out; each key keeps its own names, `local` any."""
    from dispatcher.common import curve
    curve.keygen(str(tmp_path / "k"), workers=["gpu", "gpu-2"], frontends=["gpu-3"])
    keys = curve.DispatcherKeys.load(str(tmp_path / "k"))
    by_name = {name: key for key, name in keys.names.items()}
    gpu, gpu2, local = by_name["gpu"], by_name["gpu-2"], by_name["local"]
    assert not keys.may_register(gpu, "gpu-2-cuda0-7", {})
    assert keys.may_register(gpu2, "gpu-2-cuda0-7", {})
    assert keys.may_register(gpu, "gpu-cuda0-7", {}) and keys.may_register(gpu, "gpu", {})
    assert not keys.may_register(gpu2, "gpu-cuda0-7", {})
    assert keys.may_register(local, "gpu-2-cuda0-7", {})
    assert not keys.may_register(gpu, "other-1", {})
    assert keys.may_register(gpu, "gpu-3-cuda0", {})     # a front end's key owns no worker


def test_key_files_others_could_read_or_change_are_refused(tmp_path):
    """A secret readable by others, or an authorized/ directory or public key file others
    may write (they could authorize their own key, or swap the dispatcher's), is refused
    in one line saying which."""
    import pytest as _pytest
    from dispatcher.common import curve
    root = tmp_path / "k"
    curve.keygen(str(root))
    curve.DispatcherKeys.load(str(root))
    curve.PartKeys.load(str(root))
    (root / "local.key_secret").chmod(0o640)
    with _pytest.raises(curve.CurveKeyError, match="local.key_secret: mode 0640"):
        curve.PartKeys.load(str(root))
    (root / "local.key_secret").chmod(0o600)
    (root / "authorized" / "workers").chmod(0o777)
    with _pytest.raises(curve.CurveKeyError, match="workers: mode 0777 lets others write"):
        curve.DispatcherKeys.load(str(root))
    (root / "authorized" / "workers").chmod(0o700)
    # a public key others may write is theirs to swap: an authorized one (their own key
    # let in) or the dispatcher's (a part then speaks to whoever holds the other pair)
    authorized = next((root / "authorized" / "workers").glob("*.key"))
    assert authorized.stat().st_mode & 0o777 == 0o644        # (keygen's, not the umask's)
    authorized.chmod(0o666)
    with _pytest.raises(curve.CurveKeyError, match=f"{authorized.name}: mode 0666"):
        curve.DispatcherKeys.load(str(root))
    authorized.chmod(0o644)
    (root / "dispatcher.key").chmod(0o664)
    with _pytest.raises(curve.CurveKeyError, match="dispatcher.key: mode 0664"):
        curve.PartKeys.load(str(root))


def test_keygen_never_takes_over_a_directory_or_a_reserved_name(tmp_path):
    """keygen made any directory it was given 0700 (as root, `keygen .` or `/tmp` locked
    everyone else out), took `ops` or `dispatcher` as a part's name (moving the ops key
    out of authorized/ops), and wrote keys before refusing a bad name."""
    import pytest as _pytest
    from dispatcher.common import curve
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)                                # (whatever the umask)
    (shared / "notes.txt").write_text("x")
    with _pytest.raises(curve.CurveKeyError, match="holds other files and no keys"):
        curve.keygen(str(shared))
    assert shared.stat().st_mode & 0o777 == 0o755
    for name in ("ops", "dispatcher", "local", "../evil"):
        with _pytest.raises(curve.CurveKeyError, match="plain file name"):
            curve.keygen(str(tmp_path / "new"), workers=["fine", name])
        assert not (tmp_path / "new").exists()             # nothing written first
    with _pytest.raises(curve.CurveKeyError, match="give the key directory"):
        curve.keygen("")
    assert curve.keygen(str(tmp_path / "keys")) == ["dispatcher", "local", "ops"]
    assert curve.keygen(str(tmp_path / "keys"), workers=["gpu2"]) == ["gpu2"]
    # a worker's pair is never a front end's too (its host could read every token: it
    # was copied into authorized/frontends, "nothing new"), nor the other way round
    keys = tmp_path / "keys" / "authorized"
    for workers, frontends in ((), ["gpu2"]), (["fe"], ["fe"]):
        with _pytest.raises(curve.CurveKeyError, match="must be its own"):
            curve.keygen(str(tmp_path / "keys"), workers=workers, frontends=frontends)
    assert not (keys / "frontends" / "gpu2.key").exists() and \
        not (tmp_path / "keys" / "fe.key").exists()
    assert curve.keygen(str(tmp_path / "keys"), frontends=["web1"]) == ["web1"]
    with _pytest.raises(curve.CurveKeyError, match="must be its own"):
        curve.keygen(str(tmp_path / "keys"), workers=["web1"])
    assert curve.keygen(str(tmp_path / "keys"), workers=["gpu2"]) == []   # (again: fine)
    (keys / "workers" / "gpu2.key").unlink()          # retired, as deploying.md says
    for workers, frontends in ((["gpu2"], ()), ((), ["gpu2"])):
        with _pytest.raises(curve.CurveKeyError, match="not a"):
            curve.keygen(str(tmp_path / "keys"), workers=workers, frontends=frontends)
    assert not (keys / "frontends" / "gpu2.key").exists()


def test_a_keyed_workers_name_starts_with_its_keys_name():
    """A second host's workers named by their config entries (w0-cuda0-...) did not
    carry their key's name, and the dispatcher dropped every message of theirs."""
    from workers.worker import worker_name
    assert worker_name("w0-cuda0-interactive", "cuda0", "gpu2") == "gpu2-w0-cuda0-interactive"
    assert worker_name(None, "cuda0", "gpu2").startswith("gpu2-cuda0-")
    assert worker_name("gpu2-box", "cuda0", "gpu2") == "gpu2-box"      # its own already
    assert worker_name("gpu2", "cuda0", "gpu2") == "gpu2"
    assert worker_name("gpu20-x", "cuda0", "gpu2") == "gpu2-gpu20-x"     # another key's
    for unkeyed in (None, "local"):
        assert worker_name("w0-cuda0", "cuda0", unkeyed) == "w0-cuda0"


def test_an_operator_key_reads_the_operators_routes_and_tenants_do_not():
    """With API keys alone any key read /metrics and /v1/status: every other key's
    usage, cache hits and busy slots. An --operator-key reads them, and then no tenant
    key does; an operator key is no tenant's (no completions); a client on this host
    not through a proxy still reads them under the default --status-access."""
    from app import create_app
    keyed = {"TESTING": True, "DISPATCHER": "ipc:///nonexistent", "API_KEY": "sk-a,sk-b",
             "OPERATOR_KEYS": ["op-1"], "STATUS_ACCESS": "key"}

    def status(app, path, key=None, method="get", **kw):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return getattr(app.test_client(), method)(path, headers=headers, **kw).status_code
    app = create_app(keyed)
    for path in ("/metrics", "/v1/status"):
        assert status(app, path, "sk-a") == status(app, path) == 401
        assert status(app, path, "op-1") != 401
    assert status(app, "/v1/completions", "op-1", "post", json={"prompt": "x"}) == 401
    assert status(app, "/v1/completions", "sk-b", "post", json={"prompt": "x"}) != 401
    without = create_app({**keyed, "OPERATOR_KEYS": []})         # (as before: any key)
    assert status(without, "/metrics", "sk-a") != 401
    alone = create_app({**keyed, "API_KEY": "", "STATUS_ACCESS": "loopback"})
    assert status(alone, "/metrics") != 401                       # (loopback, no proxy)
    assert status(alone, "/v1/completions", None, "post", json={"prompt": "x"}) != 401
    proxied = alone.test_client().get("/metrics", headers={"X-Forwarded-For": "203.0.113.9"})
    assert proxied.status_code == 401
