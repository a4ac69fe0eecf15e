"""deploy/ tested for real: systemd units (verified, and their commands run), nginx with
deploy/nginx.conf in front of two front ends, and a worker on another "host" (its own
network namespace) joining over TCP."""
import http.client
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import ROOT, free_port, http_json

pytestmark = pytest.mark.integration
DEPLOY = ROOT / "deploy"
UNITS = DEPLOY / "systemd"


# -- helpers ---------------------------------------------------------------------------------
def ensure_nginx() -> str:
    """nginx from Debian's packages, installed by the test when the machine lacks it
    (without letting the package start its own server)."""
    found = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists()
                                       else None)
    if found:
        return found
    policy = Path("/usr/sbin/policy-rc.d")
    created = not policy.exists()
    if created:
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
    try:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update"], env=env, check=True, capture_output=True,
                       timeout=900)
        subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", "nginx"],
                       env=env, check=True, capture_output=True, timeout=900)
    finally:
        if created:
            policy.unlink()
    return shutil.which("nginx") or "/usr/sbin/nginx"


def systemd_escape(text: str, tool: bool = False) -> str:
    """An instance name as `systemctl enable unit@TEXT` makes it (a character not valid
    in a unit name as \\xNN: `,` and `+`), or as `systemd-escape` does (`tool`: `-`
    too): what %i holds (%I would unescape `-` to `/`)."""
    keep = ":_." if tool else ":_.-"
    return "".join(c if c.isalnum() or c in keep else
                   "".join(f"\\x{b:02x}" for b in c.encode()) for c in text)


def unit_command(unit: Path, instance: str, config: Path) -> tuple[list[str], dict]:
    """A unit's ExecStart and Environment, as this machine would run them: %i filled in
    (the instance as systemctl escapes it), the install paths (/opt/completions,
    /etc/completions) pointed at this checkout."""
    text = unit.read_text().replace("%i", systemd_escape(instance))
    text = text.replace("/etc/completions/config.toml", str(config))
    # (systemd's CacheDirectory: this machine's own cache, where step costs are kept)
    text = text.replace("XDG_CACHE_HOME=/var/cache/completions", "XDG_CACHE_HOME=" + str(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"))
    env = {}
    for key, value in re.findall(r"^Environment=(\w+)=(.*)$", text, re.M):
        env[key] = value
    command = re.search(r"^ExecStart=(.*)$", text, re.M).group(1).split()
    if command[0].endswith("/python"):
        command[0] = sys.executable
    elif command[0].endswith("/gunicorn"):
        command[:1] = [sys.executable, "-m", "gunicorn"]
    command = [c.replace("/opt/completions/deploy", str(DEPLOY)) for c in command]
    return command, env


class Stack:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.log = open(tmp / "stack.log", "wb")
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, command: list[str], env: dict, netns: str | None = None):
        if netns:
            command = ["ip", "netns", "exec", netns, *command]
        self.procs[name] = subprocess.Popen(
            command, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        return self.procs[name]

    def kill(self, name: str, sig=signal.SIGKILL) -> None:
        proc = self.procs.pop(name)
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)

    def stop(self) -> None:
        for name in list(self.procs)[::-1]:
            proc = self.procs.pop(name)
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        self.log.close()

    def output(self) -> str:
        return (self.tmp / "stack.log").read_text(errors="replace")[-4000:]


def wait(predicate, timeout, what, stack=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"timed out: {what}\n" + (stack.output() if stack else ""))


def healthy(port, workers=1) -> bool:
    status, _, body = http_json(port, "GET", "/health", timeout=5)
    return status == 200 and body.get("workers_ready") == workers


def write_config(tmp: Path, base_port: int, host: str = "127.0.0.1",
                 curve_keys: Path | None = None) -> Path:
    from dispatcher.common.models import bundled_model_path
    config = tmp / "config.toml"
    keys = f'curve_keys = "{curve_keys}"\n' if curve_keys else ""
    config.write_text(f'[server]\nhost = "127.0.0.1"\ndispatcher = "tcp://{host}:{base_port}"\n'
                      f'nctx = 2048\n{keys}[[models]]\npath = "{bundled_model_path()}"\n'
                      f'[[workers]]\ndevice = "cpu"\n')
    return config


# -- systemd -------------------------------------------------------------------------------
def test_systemd_units_verify_cleanly(tmp_path):
    """systemd's own checker finds nothing wrong (and does find a planted mistake)."""
    instances = {"completions-dispatcher.service": "completions-dispatcher.service",
                 "completions-worker@.service": "completions-worker@cpu.service",
                 "completions-frontend@.service": "completions-frontend@8081.service"}
    paths = []
    for template, instance in instances.items():
        text = (UNITS / template).read_text()
        text = text.replace("/opt/completions/venv/bin/python", sys.executable)
        text = text.replace("/opt/completions/venv/bin/gunicorn", shutil.which("gunicorn")
                            or sys.executable)
        (tmp_path / instance).write_text(text)
        paths.append(str(tmp_path / instance))
    out = subprocess.run(["systemd-analyze", "verify", "--man=no", *paths],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout + out.stderr == "", out.stdout + out.stderr
    broken = tmp_path / "broken.service"
    broken.write_text((tmp_path / "completions-dispatcher.service").read_text()
                      + "[Service]\nRestartSecs=2\n")
    out = subprocess.run(["systemd-analyze", "verify", "--man=no", str(broken)],
                         capture_output=True, text=True, timeout=60)
    assert "RestartSecs" in out.stdout + out.stderr


def test_the_worker_unit_does_not_respawn_a_worker_that_cannot_serve():
    """The status a worker exits with when it cannot serve as configured (one line said
    why) is the one systemd is told not to restart, as the launcher's supervisor does."""
    from dispatcher.common.config import EXIT_CANNOT_LOAD
    unit = (UNITS / "completions-worker@.service").read_text().splitlines()
    (prevent,) = [line for line in unit if line.startswith("RestartPreventExitStatus=")]
    assert prevent.partition("=")[2].split() == ["2", str(EXIT_CANNOT_LOAD)]
    assert "Restart=always" in unit


@pytest.mark.parametrize("device", ["cuda:0,1", "cpu:0-1+4-5", "cpu:0-3",
                                    "cuda:GPU-5a8e4b0c-1d2f-4e3a-9b7c-6d5e4f3a2b1c"])
@pytest.mark.parametrize("tool", [False, True])
def test_the_worker_unit_serves_the_device_its_instance_names(device, tool, tmp_path):
    """`completions-worker@cuda:0,1` (a model split over two GPUs): systemctl writes `,`
    and `+` in the instance as \\x2c and \\x2b (systemd-escape `-` too), and %i passes
    that on: no device parsed (exit 2, never restarted). The worker reads the escapes;
    %I would have turned `-` into `/`."""
    from dispatcher.common.devices import parse_device
    command, _ = unit_command(UNITS / "completions-worker@.service", device,
                              tmp_path / "config.toml")
    given = command[command.index("--device") + 1]
    assert str(parse_device(given)) == str(parse_device(device))
    assert str(parse_device(systemd_escape(device, tool))) == str(parse_device(device))


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    """The units' commands (dispatcher, one worker, front ends on two ports) behind nginx
    configured by deploy/nginx.conf."""
    tmp = tmp_path_factory.mktemp("deploy")
    base, fe1, fe2, edge = free_port(5), free_port(), free_port(), free_port()
    config = write_config(tmp, base)
    stack = Stack(tmp)
    stack.start("dispatcher", *unit_command(UNITS / "completions-dispatcher.service", "", config))
    stack.start("worker", *unit_command(UNITS / "completions-worker@.service", "cpu", config))
    # the worker ready before the rest start: its step costs measured with the cores to
    # itself are kept, so the restart test's successor is ready within the 30 s a
    # request waits for one (measured again beside two gunicorns and nginx starting,
    # they were not kept, and the successor measured for 15-20 s more)
    from dispatcher.tools.ctl import control_request

    def worker_ready() -> bool:
        try:
            return bool(control_request(f"tcp://127.0.0.1:{base}", {"cmd": "status"},
                                        timeout=2)["workers"])
        except SystemExit:                      # (not answering yet)
            return False
    wait(worker_ready, 300, "the worker", stack)
    for name, port in (("fe1", fe1), ("fe2", fe2)):
        command, env = unit_command(UNITS / "completions-frontend@.service", str(port),
                                    config)
        # as a COMPLETIONS_PORT in /etc/completions/env would be: systemd puts an
        # EnvironmentFile's values over Environment=; each instance keeps its own port
        env["COMPLETIONS_PORT"] = str(fe1)
        stack.start(name, command, env)
    text = (DEPLOY / "nginx.conf").read_text()
    text = text.replace("127.0.0.1:8081", f"127.0.0.1:{fe1}").replace(
        "127.0.0.1:8082", f"127.0.0.1:{fe2}").replace("listen 8080;", f"listen 127.0.0.1:{edge};")
    text = re.sub(r"/var/log/nginx/", str(tmp) + "/", text)
    (tmp / "nginx.conf").write_text(text)
    nginx = ensure_nginx()
    assert "\npid " not in text             # the distribution's (its service reloads by it)
    pid = f"pid {tmp / 'nginx.pid'};"
    check = subprocess.run([nginx, "-t", "-p", str(tmp), "-c", str(tmp / "nginx.conf"),
                            "-g", pid], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    stack.start("nginx", [nginx, "-p", str(tmp), "-c", str(tmp / "nginx.conf"), "-g",
                          f"daemon off; {pid}"], {})
    try:
        for port in (fe1, fe2):
            wait(lambda: healthy(port), 120, f"front end {port}", stack)
        wait(lambda: healthy(edge), 30, "nginx", stack)
        yield {"stack": stack, "edge": edge, "fe": (fe1, fe2), "dispatcher":
               f"tcp://127.0.0.1:{base}", "config": config}
    finally:
        stack.stop()


def test_tokens_stream_through_nginx_as_they_are_made(deployed):
    conn = http.client.HTTPConnection("127.0.0.1", deployed["edge"], timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps(
        {"prompt": "Once upon a time", "max_tokens": 256, "ignore_eos": True,
         "speculative.n_max": 0, "stream": True}),
        headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    assert response.getheader("Content-Type").startswith("text/event-stream")
    times = []
    for line in response:
        if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
            times.append(time.monotonic())
    conn.close()
    assert len(times) >= 200            # (an event may hold several: a UTF-8 character's
                                        # pieces, a stop string's possible start)
    # unbuffered: the first token arrives long before the last (256 tokens take a few
    # seconds, more than a loaded machine's pause in the reader), and tokens arrive
    # spread out rather than in one burst at the end
    assert times[-1] - times[0] > 0.3
    assert times[len(times) // 2] - times[0] > 0.1


def test_a_body_over_the_limit_is_refused_in_the_api_envelope_through_nginx(deployed):
    """Just over the server's max_body the front end answers its own 413; far over it
    nginx does, in the same envelope (its error_page), never an HTML page."""
    for size in (8_500_000, 10_000_000):
        conn = http.client.HTTPConnection("127.0.0.1", deployed["edge"], timeout=60)
        body = b'{"prompt": "' + b"x" * size + b'"}'
        try:
            conn.request("POST", "/v1/completions", body=body,
                         headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            status, kind, data = response.status, response.getheader("Content-Type"), \
                response.read()
        finally:
            conn.close()
        assert status == 413, (size, data[:200])
        assert kind.startswith("application/json"), (size, kind)
        assert json.loads(data)["error"]["code"] == "request_too_large"


def test_the_operator_paths_answer_this_host_only_through_nginx(deployed):
    """/metrics and /v1/status (every key's usage, the workers) through nginx: served to
    a client on this host, refused in the API's envelope to any other (here a client
    from 127.0.0.2, which nginx does not count as this host)."""
    for path in ("/metrics", "/v1/status"):
        conn = http.client.HTTPConnection("127.0.0.1", deployed["edge"], timeout=30)
        conn.request("GET", path)
        assert conn.getresponse().status == 200
        conn.close()
        conn = http.client.HTTPConnection("127.0.0.1", deployed["edge"], timeout=30,
                                          source_address=("127.0.0.2", 0))
        conn.request("GET", path)
        response = conn.getresponse()
        assert response.status == 403
        assert response.getheader("Content-Type").startswith("application/json")
        assert json.loads(response.read())["error"]["code"] == "forbidden"
        conn.close()
    conn = http.client.HTTPConnection("127.0.0.1", deployed["edge"], timeout=30,
                                      source_address=("127.0.0.2", 0))
    conn.request("GET", "/v1/models")                   # the API itself is for everyone
    assert conn.getresponse().status == 200
    conn.close()


def test_load_spreads_over_both_front_ends(deployed):
    from dispatcher.tools.ctl import control_request
    for i in range(12):
        status, _, _ = http_json(deployed["edge"], "POST", "/v1/completions",
                                 {"prompt": f"spread {i}", "max_tokens": 2})
        assert status == 200

    def served() -> list[int]:                # front ends report with their heartbeat
        return [f["served"] or 0 for f in control_request(
            deployed["dispatcher"], {"cmd": "status"})["frontends"]]

    wait(lambda: sum(served()) >= 12, 15, "the front ends' counts")
    assert len(served()) == 2 and min(served()) >= 1


def test_a_dead_front_end_fails_no_new_request(deployed):
    # nginx holds kept-alive connections to both front ends; kill one mid-flight
    for i in range(6):
        assert http_json(deployed["edge"], "POST", "/v1/completions",
                         {"prompt": f"before {i}", "max_tokens": 2})[0] == 200
    deployed["stack"].kill("fe1")
    results = [http_json(deployed["edge"], "POST", "/v1/completions",
                         {"prompt": f"after {i}", "max_tokens": 2}) for i in range(10)]
    assert [r[0] for r in results] == [200] * 10, [r[2] for r in results if r[0] != 200]


def test_restarting_the_worker_unit_lets_its_stream_finish(deployed):
    """`systemctl restart completions-worker@cpu`: SIGTERM to a worker that nobody drained
    first. Its running stream ends whole; a request sent while it finishes waits for its
    successor (systemd's Restart=always) and is answered."""
    stack, edge = deployed["stack"], deployed["edge"]
    conn = http.client.HTTPConnection("127.0.0.1", edge, timeout=120)
    conn.request("POST", "/v1/completions", body=json.dumps(
        {"prompt": "Once upon a time", "max_tokens": 160, "ignore_eos": True,
         "stream": True}), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    lines = iter(response)
    events = []
    while len(events) < 3:
        line = next(lines)
        if line.startswith(b"data: {"):
            events.append(json.loads(line[6:]))
    worker = stack.procs["worker"]
    os.killpg(worker.pid, signal.SIGTERM)             # as systemd stops the unit
    later = {}
    meanwhile = threading.Thread(target=lambda: later.update(result=http_json(
        edge, "POST", "/v1/completions", {"prompt": "meanwhile", "max_tokens": 2},
        timeout=120)), daemon=True)
    meanwhile.start()
    try:
        done = False
        for line in lines:
            if line.strip() == b"data: [DONE]":
                done = True
                break
            if line.startswith(b"data: {"):
                events.append(json.loads(line[6:]))
        conn.close()
        assert done and "error" not in events[-1], events[-1]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert "".join(e["choices"][0]["text"] for e in events if "choices" in e)
        assert worker.wait(timeout=60) == 0, stack.output()
    finally:                                          # systemd's Restart=always
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
        stack.start("worker", *unit_command(UNITS / "completions-worker@.service", "cpu",
                                            deployed["config"]))
    meanwhile.join(timeout=150)
    assert later["result"][0] == 200, later["result"]
    wait(lambda: healthy(edge), 60, "the new worker", stack)


# -- multi-host ------------------------------------------------------------------------------
@pytest.fixture
def netns():
    """A second "host": a network namespace joined to this one by a veth pair."""
    name, host_if, ns_if = f"cs{os.getpid() % 10000}", f"csh{os.getpid() % 10000}", "csw0"
    run = lambda *a: subprocess.run(a, check=True, capture_output=True)  # noqa: E731
    run("ip", "netns", "add", name)
    try:
        run("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if, "netns", name)
        run("ip", "addr", "add", "10.231.0.1/24", "dev", host_if)
        run("ip", "link", "set", host_if, "up")
        run("ip", "netns", "exec", name, "ip", "addr", "add", "10.231.0.2/24", "dev", ns_if)
        run("ip", "netns", "exec", name, "ip", "link", "set", ns_if, "up")
        run("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")
        yield {"name": name, "host_if": host_if, "ip": "10.231.0.1"}
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_a_worker_on_another_host_joins_over_tcp_and_its_loss_is_handled(netns, tmp_path,
                                                                        monkeypatch):
    from dispatcher.common.curve import PartKeys
    from dispatcher.tools.ctl import control_request
    # every part beats as set here (they must agree): liveness 3 s, a loss seen soon,
    # and no part of a loaded machine dropped for a pause
    monkeypatch.setenv("COMPLETIONS_HEARTBEAT_INTERVAL", "1.0")
    base, http_port = free_port(5), free_port()
    # keyed (CURVE): the second host gets only the dispatcher's public key and its own
    keys, remote_keys = tmp_path / "keys", tmp_path / "remote-keys"
    subprocess.run([sys.executable, "-m", "dispatcher", "keygen", str(keys), "--worker",
                    "remote-gpu-box"], check=True, capture_output=True)
    remote_keys.mkdir()
    for name in ("dispatcher.key", "remote-gpu-box.key_secret"):
        shutil.copy(keys / name, remote_keys / name)
    config = write_config(tmp_path, base, host=netns["ip"], curve_keys=keys)
    dispatcher = f"tcp://{netns['ip']}:{base}"
    ops = PartKeys.load(str(keys), "ops")
    stack = Stack(tmp_path)
    try:
        stack.start("dispatcher", [sys.executable, "-m", "dispatcher", "broker",
                                   "--config", str(config)], {})
        stack.start("frontend", [sys.executable, "-m", "gunicorn", "-c",
                                 str(DEPLOY / "gunicorn.conf.py")],
                    {"COMPLETIONS_CONFIG": str(config), "COMPLETIONS_PORT": str(http_port)})
        # the worker knows only the dispatcher's address, and lives in the other namespace
        stack.start("worker", [sys.executable, "-m", "workers", "--dispatcher", dispatcher,
                               "--device", "cpu", "--name", "remote-gpu-box",
                               "--curve-keys", str(remote_keys),
                               "--curve-name", "remote-gpu-box"], {},
                    netns=netns["name"])
        wait(lambda: healthy(http_port), 120, "remote worker ready", stack)
        status, _, body = http_json(http_port, "POST", "/v1/completions",
                                    {"prompt": "Hello", "max_tokens": 3})
        assert status == 200 and body["usage"]["completion_tokens"] == 3
        wait(lambda: [(w["name"], w["completed"]) for w in control_request(
            dispatcher, {"cmd": "status"}, keys=ops)["workers"]] == [("remote-gpu-box", 1)],
             10, "the request to be counted against the remote worker", stack)
        assert_nothing_without_the_right_key(dispatcher, keys, http_port)
        assert [w["name"] for w in control_request(
            dispatcher, {"cmd": "status"}, keys=ops)["workers"]] == ["remote-gpu-box"]
        # the host disappears from the network: within the heartbeat liveness it
        # is dropped, and clients are told there is no worker rather than left waiting
        subprocess.run(["ip", "link", "set", netns["host_if"], "down"], check=True)
        wait(lambda: http_json(http_port, "GET", "/health", timeout=5)[0] == 503, 15,
             "the lost host to be noticed", stack)
        status, headers, body = http_json(http_port, "POST", "/v1/completions",
                                          {"prompt": "x", "max_tokens": 2})
        assert status == 503 and headers["Retry-After"]
        # it comes back: the worker registers again by itself
        subprocess.run(["ip", "link", "set", netns["host_if"], "up"], check=True)
        wait(lambda: healthy(http_port), 60, "the host to rejoin", stack)
        status, _, body = http_json(http_port, "POST", "/v1/completions",
                                    {"prompt": "Hello again", "max_tokens": 2})
        assert status == 200
    finally:
        stack.stop()


def assert_nothing_without_the_right_key(dispatcher: str, keys: Path, http_port: int):
    """An unkeyed client, and one with a key the dispatcher was not given, get nothing on
    any of its five sockets while a stream flows; an authorized worker key cannot speak
    under another worker's name."""
    import zmq

    from conftest import SSEStream
    from dispatcher.common import protocol as P
    from dispatcher.common.addresses import Endpoints
    from dispatcher.common.curve import PartKeys
    endpoints = Endpoints.from_base(dispatcher)
    server = PartKeys.load(str(keys), "ops").server
    public, secret = zmq.curve_keypair()
    strangers = {"unkeyed": None, "wrongly keyed": PartKeys(public, secret, server)}
    context = zmq.Context()
    stream = SSEStream(http_port, {"prompt": "Count slowly:", "max_tokens": 40,
                                   "stream": True})
    watched = {}                     # socket -> who and on what; all watched at once
    try:
        for who, key in strangers.items():
            socks = {}
            for name, kind in (("frontend", zmq.DEALER), ("worker", zmq.DEALER),
                               ("control", zmq.REQ), ("tokens_out", zmq.SUB),
                               ("tokens_in", zmq.XPUB)):
                sock = socks[name] = context.socket(kind)
                sock.setsockopt(zmq.LINGER, 0)
                if key is not None:
                    key.apply(sock)
                if kind == zmq.SUB:
                    sock.setsockopt(zmq.SUBSCRIBE, b"")           # everyone's tokens
                sock.connect(getattr(endpoints, name))
                watched[sock] = f"{who}: answered on {name}"
            socks["frontend"].send_multipart(P.encode(P.PING, body=P.Ping()), zmq.NOBLOCK)
            socks["worker"].send_multipart(P.encode(P.READY, body=P.WorkerInfo(model="x")),
                                           zmq.NOBLOCK)      # registered: heartbeats come
            socks["control"].send(b'{"cmd": "status"}', zmq.NOBLOCK)
            # (a publisher the proxy accepted would be sent the front ends' subscriptions)
        # an authorized worker key, another name: never registered
        impostor = context.socket(zmq.DEALER)
        impostor.setsockopt(zmq.LINGER, 0)
        impostor.setsockopt(zmq.IDENTITY, b"someone-else")
        PartKeys.load(str(keys / ".." / "remote-keys"), "remote-gpu-box").apply(impostor)
        impostor.connect(endpoints.worker)
        impostor.send_multipart(P.encode(P.READY, body=P.WorkerInfo(model="x")))
        watched[impostor] = "the impostor was answered"
        poller = zmq.Poller()
        for sock in watched:
            poller.register(sock, zmq.POLLIN)
        deadline = time.monotonic() + 1.5           # every socket watched for 1.5 s
        while (left := deadline - time.monotonic()) > 0:
            answered = [watched[sock] for sock, _ in poller.poll(1000 * left)]
            assert not answered, answered
        for sock in watched:
            sock.close(0)
        assert list(stream.events())[-1] == "[DONE]"            # the stream went on
    finally:
        context.destroy(linger=0)            # (every socket, even where an assert fired)


@pytest.mark.parametrize("how, expected", [({"COMPLETIONS_STOP_GRACE": "7.5"}, 8),
                                           ({"file": "[server]\nstop_grace = 12\n"}, 12),
                                           ({}, None)])
def test_a_front_end_run_on_its_own_gives_streams_the_stop_grace(how, expected, tmp_path):
    """deploy/gunicorn.conf.py (a front end under systemd, or by hand): gunicorn's
    graceful_timeout, what in-flight streams get after SIGTERM, is --stop-grace from the
    variable or the config file, rounded up to whole seconds (gunicorn's); by default
    the same as the dispatcher's and the workers'."""
    from dispatcher.common import config
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPLETIONS_")}
    env.update({k: v for k, v in how.items() if k != "file"})
    if "file" in how:
        (tmp_path / "config.toml").write_text(how["file"])
        env["COMPLETIONS_CONFIG"] = str(tmp_path / "config.toml")
    out = subprocess.run(
        [sys.executable, "-c", "import runpy; print(runpy.run_path("
         f"{str(DEPLOY / 'gunicorn.conf.py')!r})['graceful_timeout'])"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    default = math.ceil(config.OPTIONS["stop_grace"].default)
    assert int(out.stdout.split()[-1]) == (expected if expected is not None else default)
