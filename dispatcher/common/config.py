"""Every setting, its default, its flag and its environment variable, in one place.

Each option `foo_bar` is the flag `--foo-bar` and the variable `COMPLETIONS_FOO_BAR`.
A flag beats the variable, the variable beats the default. Repeatable options take a
comma-separated list in their variable (`COMPLETIONS_DEVICE=cuda:0,cuda:1`).
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from dispatcher.common.devices import split_device_list

ENV_PREFIX = "COMPLETIONS_"


@dataclass(frozen=True)
class Option:
    name: str
    default: Any
    help: str
    type: Callable[[str], Any] = str
    repeat: bool = False
    choices: tuple | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


class OptionValueError(argparse.ArgumentTypeError, ValueError):
    """A bad option value: argparse shows its message; config-file readers catch it as
    a ValueError."""


def _path(text: str) -> str:
    """A file or directory's path: never empty (`--api-key-file "$KEYS"` with KEYS unset
    served with no key at all; `--config ""`, `--model ""` fell back to the defaults)."""
    if not text.strip():
        raise OptionValueError("an empty path (an unset variable?); to mean none, leave "
                               "the option out")
    return text


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise OptionValueError(f"must be a whole number, got {text!r}") from None


def _positive_int(text: str) -> int:
    value = _integer(text)
    if value < 1:
        raise OptionValueError(f"must be at least 1, got {value}")
    return value


def _host(text: str) -> str:
    if not text.strip():
        # (checked as every interface, the front ends then took it for unset: loopback)
        raise OptionValueError("must name an address (0.0.0.0 for every interface)")
    return text


def _boolean(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise OptionValueError(f"expected true or false, got {text!r}")


class ArgumentParser(argparse.ArgumentParser):
    """argparse's, saying a mistake in one line (without the usage block)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


# --step-timeout auto: a worker measures one decode of a full batch on its device at start;
# a step may take STEP_TIMEOUT_FACTOR times that (a busy host, a long cache, sampling beside
# it), plus STEP_TIMEOUT_PER_SLOT for each slot (a row's sampling under a grammar: the
# guard lets one token's stack work reach 0.4 s, and one more check, beside a pass over
# the vocabulary; workers/engine/samplers.py), and never less than the floor (a GPU's
# full batch takes milliseconds; a respawn, a load and a reconnect take seconds anyway)
STEP_TIMEOUT_FACTOR = 20.0
STEP_TIMEOUT_PER_SLOT = 1.0
STEP_TIMEOUT_FLOOR = 10.0
STEP_TIMEOUT_LEAST = 1.0    # ... and the least an operator may give it (0: never)


def derived_step_timeout(full_step_s: float, slots: int) -> float:
    """The watchdog's limit from the worker's measured full-batch step (seconds)."""
    return max(STEP_TIMEOUT_FLOOR,
               STEP_TIMEOUT_FACTOR * full_step_s + slots * STEP_TIMEOUT_PER_SLOT)


def step_timeout_value(text) -> float | str:
    """`auto`, or seconds (see non_negative_seconds)."""
    if str(text).strip().lower() == "auto":
        return "auto"
    value = non_negative_seconds(text)
    if 0 < value < STEP_TIMEOUT_LEAST:
        # (a prompt piece's step takes longer on most devices: the worker was declared
        # stuck at its first, respawned, and stuck again, for ever)
        raise OptionValueError(f"must be 0 (never), auto, or at least "
                               f"{STEP_TIMEOUT_LEAST:g} s, got {text}")
    return value


def non_negative_seconds(text: str) -> float:
    """A finite number ≥ 0 (NaN and infinities refused: a NaN deadline never passes)."""
    try:
        value = float(text)
    except ValueError:
        raise OptionValueError(f"must be a number, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise OptionValueError(f"must be a finite number of at least 0, got {text}")
    return value


def dispatcher_address(text: str) -> str:
    """ipc:///dir or tcp://host:port, checked when read (not when first used)."""
    from dispatcher.common.addresses import Endpoints
    try:
        Endpoints.from_base(text)
    except ValueError as exc:
        raise OptionValueError(str(exc)) from None
    return text


def heartbeat_seconds(text: str) -> float:
    """Seconds between 0.25 and 60: the loops poll every 0.1 s, three beats must span more."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0.25 <= seconds <= 60:
        raise OptionValueError(f"seconds between 0.25 and 60, got {text!r}")
    return seconds


def non_negative_int(text: str) -> int:
    value = _integer(text)
    if value < 0:
        raise OptionValueError(f"must be at least 0, got {value}")
    return value


def _port(text: str) -> int:
    value = _integer(text)
    if not 1 <= value <= 65535:
        raise OptionValueError(f"must be a port from 1 to 65535, got {value}")
    return value


DEFAULT_SLOTS = {"cpu": 8, "gpu": 16, "npu": 16}
# KV cache cell types a worker may use, with their bytes per cell (ggml's blocks of 32:
# q8_0 34 bytes, q4_0 18), for the memory estimate before loading
KV_TYPES = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}


def check_context_shape(kv_type: str, batch: int, ubatch: int) -> None:
    """ValueError unless the KV cache type is known and ubatch is at most batch."""
    if kv_type not in KV_TYPES:
        raise ValueError(f"kv_type must be one of {', '.join(KV_TYPES)}, got {kv_type!r}")
    if ubatch > batch:
        raise ValueError(f"ubatch {ubatch} is larger than batch {batch}")

OPTIONS: dict[str, Option] = {o.name: o for o in [
    Option("host", "127.0.0.1", "address the HTTP front ends listen on", _host),
    Option("port", 8080, "port the HTTP front ends listen on (1-65535)", _port),
    Option("frontends", 1, "number of gunicorn front-end processes (0: none)", non_negative_int),
    Option("model", None, "path of the GGUF model (default: the bundled Gemma 3 270M Q4_K_M)",
           _path),
    Option("model_id", None, "model name clients send (default: the file name without .gguf)"),
    Option("draft_max", 64, "speculative decoding: at most this many tokens drafted a step "
           "from the request's own text and its key's recent answers, verified in the same "
           "decode (0: off); each draft's length, and whether to draft at all, follows the "
           "step costs measured at start-up", non_negative_int),
    Option("draft_model", None, "path of a small GGUF model of the served model's "
           "vocabulary that drafts for it on the same device, beside the lookups (llama.cpp's "
           "-md); used where the step costs measured at start-up, its own included, say its "
           "drafts pay; a vocabulary that differs is refused at start", _path),
    Option("cache_reuse", 256, "KV chunk reuse: after the prefix a slot's cache shares with "
           "a prompt, runs of at least this many cached tokens that the prompt repeats "
           "further along (the file after an edit) are shifted into place instead of "
           "prefilled again, as llama.cpp's --cache-reuse (0: off; never in deterministic "
           "mode)", non_negative_int),
    Option("prefill_chunk", 0, "prompt tokens a worker decodes per step, all prompts "
           "together, beside the running streams' tokens (0: as many as a batch holds, "
           "512); smaller keeps streams smoother while a long prompt is prefilled",
           non_negative_int),
    Option("fim_template", None, "fill-in-the-middle prompt template with {prefix} and "
           "{suffix}, special-token text parsed (e.g. '<PRE> {prefix} <SUF>{suffix} <MID>'), "
           "for models whose GGUF has no FIM tokens, or to override them"),
    Option("model_alias", [], "another name clients may send for the model (editor plugins "
           "hard-code names such as gpt-3.5-turbo); repeatable", repeat=True),
    Option("device", ["cpu"], "device of one worker, repeatable: cpu, cpu:0-3, cuda:0, npu:0",
           repeat=True),
    Option("nctx", 4096, "context length of each sequence, in tokens", _positive_int),
    Option("ngl", 999, "layers offloaded to the accelerator (ignored for cpu devices)",
           non_negative_int),
    Option("kv_type", "f16", "KV cache cell type: f16, or q8_0 / q4_0 for about half / a "
           "quarter of the memory per token of context (slightly different numbers)",
           str.lower, choices=KV_TYPES),
    Option("batch", 512, "tokens one decode takes at most (llama.cpp's --batch-size): "
           "the largest prompt piece a step prefills", _positive_int),
    Option("ubatch", 512, "tokens the device computes at once within a decode (llama.cpp's "
           "--ubatch-size, at most --batch): the compute buffer grows with it",
           _positive_int),
    Option("slots", 0, "sequences one worker decodes at once (continuous batching); "
           f"0: {DEFAULT_SLOTS['cpu']} on cpu, {DEFAULT_SLOTS['gpu']} on accelerators",
           non_negative_int),
    Option("deterministic", False, "batch composition never changes results (slower: no "
           "CPU weight repacking, prompts prefilled alone)", _boolean),
    Option("engine", "llama", "inference engine: llama, or fake (a test double, no model)",
           str.lower, choices=("llama", "fake")),
    Option("dispatcher", None,
           "dispatcher address: ipc:///dir (sockets in dir) or tcp://host:port (port..port+4); "
           "default: ipc:///tmp/completions-PORT", dispatcher_address),
    Option("name", None, "worker name (default: derived from the device and pid)"),
    Option("curve_keys", None, "CURVE key directory (python -m dispatcher keygen DIR): the "
           "dispatcher authenticates and encrypts every socket with it; a part started on "
           "its own needs the directory's dispatcher.key and its NAME.key_secret", _path),
    Option("curve_name", "local", "the key a part presents: NAME.key_secret in "
           "--curve-keys (a worker's name must be NAME or start with NAME-)"),
    Option("insecure_transport", False, "allow a tcp:// dispatcher address reachable from "
           "other hosts without --curve-keys (anyone on the network can then read the "
           "token stream and submit work)", _boolean),
    Option("step_timeout", "auto", "seconds one step of a worker's generation loop may take "
           "(a decode of at most a batch, and the sampling); past it the worker is stuck: its "
           "requests fail with worker_stuck and it exits to be replaced (0: never; auto: "
           f"{STEP_TIMEOUT_FACTOR:g} times the full-batch step the worker measures on its "
           f"device at start, plus {STEP_TIMEOUT_PER_SLOT:g}s a slot, at least "
           f"{STEP_TIMEOUT_FLOOR:g}s)", step_timeout_value),
    Option("heartbeat_interval", 1.0, "seconds between the heartbeats of every pair of "
           "processes (dispatcher, workers, front ends); a peer silent for 3 of them is gone; "
           "parts started separately must agree", heartbeat_seconds),
    Option("config", None, "TOML config file (see deploy/workstation-4gpu.toml)", _path),
    Option("log_level", "info", "log level", str.lower,
           choices=("debug", "info", "warning", "error")),
    Option("log_format", "text", "every part's log lines (the access log's too): text, or "
           "json (one object per line: time, level, part, worker, request_id, message)",
           str.lower, choices=("text", "json")),
    Option("log_content", False, "let request content (prompts, grammars) reach the logs: "
           "llama.cpp's lines whole at --log-level debug (by default every line is cut to "
           "200 characters and its errors to 20 per 10 s); a warning says so at start",
           _boolean),
    Option("max_connections", 4096, "open connections one front-end process serves; past "
           "them a new connection takes the place of the quiet one that waited longest "
           "(between requests, or silent for 0.5 s), and with none a reserve answers "
           "/health and /metrics only (others: 503)",
           _positive_int),
    Option("header_timeout", 10.0, "seconds a new connection has to send its request "
           "line and headers (later requests on it: the keep-alive time, 75 s)",
           non_negative_seconds),
    Option("body_timeout", 60.0, "seconds a client has to send a request's whole body "
           "(408 after)", non_negative_seconds),
    Option("send_timeout", 60.0, "seconds one write of an answer may wait for the client "
           "to read it (then the connection is closed and the request ended; 0: no limit)",
           non_negative_seconds),
    Option("access_log", "-", "the front ends' access log, one logfmt line per request: "
           "- (stderr), off, or a file path"),
    Option("max_body", 8 * 1024 * 1024, "largest request body accepted, in bytes", _positive_int),
    Option("max_prompt_chars", 1 << 20, "largest prompt (all prompts of a request), in "
           "characters; 413 above", _positive_int),
    Option("max_queue", 64, "queued requests per model and profile; 429 above",
           _positive_int),
    Option("queue_timeout", 0.0, "seconds a request may wait in the queue before a 504 "
           "(0: no limit; a request's X-Request-Timeout header overrides it)",
           non_negative_seconds),
    Option("stop_grace", 30.0, "seconds in-flight requests get to finish after SIGTERM",
           non_negative_seconds),
    Option("api_key", [], "API key clients must send as 'Authorization: Bearer KEY'; "
           "repeatable", repeat=True),
    Option("api_key_file", None, "file of API keys, one per line, each optionally followed "
           "by its name (`KEY NAME`: usage is counted under the name)", _path),
    Option("operator_key", [], "key that may read /metrics and the status page's data "
           "(/v1/status) where --status-access asks for one; with any, the API keys may not "
           "(one key's usage is not another's to read); repeatable", repeat=True),
    Option("status_access", "loopback", "who may read /metrics and the status page's data "
           "(/v1/status) without an API key when keys are configured: open (anyone), "
           "loopback (a client on this host, not through a proxy), key (nobody)",
           str.lower, choices=("open", "loopback", "key")),
    Option("usage_by_key", True, "count requests, tokens and errors per API key (by its "
           "name, or its fingerprint) in /metrics and `usage`; off for one-tenant setups",
           _boolean),
    Option("max_queue_per_key", None, "queued requests one API key may have per model and "
           "profile (429 with Retry-After above, while other keys are still admitted); 0: no "
           "limit; default: max-queue divided by the number of keys when there are several",
           non_negative_int),
    Option("infer_sessions", True, "give editors' fill-in-the-middle requests that send no "
           "X-Session-Id a session: one from the same API key and address, model and route "
           "whose text before the cursor changed only near the cursor within 3 s replaces "
           "the older one (superseding, type-along adoption); false: only X-Session-Id does",
           _boolean),
    Option("cache_scope", None, "whose prompt cache a request may reuse: key (only what "
           "requests of the same API key filled, so cached_tokens and timings reveal nothing "
           "of another key's prompts) or shared (everyone's: for one trusted team); default: "
           "key when API keys are configured, else shared", str.lower,
           choices=("key", "shared")),
    Option("any_model_name", False, "while one model is served, a request naming a model "
           "that is not served gets it instead of a 404 (llama-server ignores `model`; "
           "minuet-ai.nvim's llama.cpp recipe sends \"PLACEHOLDER\"); an empty or missing "
           "model always gets the served one", _boolean),
    Option("cors_origin", [], "a browser origin allowed to call the API (CORS), e.g. "
           "https://editor.example.com, or * for any; repeatable; none by default",
           repeat=True),
]}


# Timing of the heartbeats between every pair of processes (ZeroMQ guide, Paranoid Pirate):
# each process resolves `heartbeat_interval` once at start (flag, COMPLETIONS_HEARTBEAT_
# INTERVAL, config file) and hands a `Heartbeat` to what it runs; serve's children
# inherit the variable, and parts started separately must agree.
HEARTBEAT_LIVENESS = 3


@dataclass(frozen=True)
class Heartbeat:
    """Seconds between beats; a peer silent for `liveness` of them (`expiry`) is gone."""
    interval: float = 1.0
    liveness: int = HEARTBEAT_LIVENESS

    @property
    def expiry(self) -> float:
        return self.interval * self.liveness

    @classmethod
    def of(cls, options) -> "Heartbeat":
        """From resolved options (`heartbeat_interval`), default 1 s."""
        value = getattr(options, "heartbeat_interval", None)
        return cls(value) if value is not None else cls()

# High-water mark of every socket on the token path (worker XPUB, proxy, front-end SUB).
TOKEN_HWM = 100_000
# How long a front end waits for the dispatcher to accept a job before giving up.
SUBMIT_TIMEOUT = 5.0
# How long a front end waits for stream messages after the dispatcher says a job is done.
# They travel a faster path (the proxy, in C) than that word (the dispatcher's loop):
# normally they are there first.
DONE_GRACE = 2.0
# How long a worker waits for a front end's subscription to reach its PUB socket.
SUBSCRIPTION_WAIT = 5.0
# Worker respawn backoff (seconds): doubles from the first value up to the second.
RESPAWN_BACKOFF = (0.5, 30.0)
# Grace given to children, once asked to stop, before they are killed.
STOP_GRACE = 10.0
# ... and once asked to stop for a restart, whose grace for requests is already over: a
# worker whose generation thread is stuck in C never runs its SIGTERM handler, and every
# second here is a second without that device (a healthy worker exits well within it)
RESTART_KILL_AFTER = 3.0
# A worker's exit status when its generation loop was stuck past --step-timeout
# (EX_SOFTWARE): the supervisor respawns it as after any crash.
EXIT_STUCK = 70
# A worker's exit status when its model cannot be loaded on its device (EX_CONFIG): the
# supervisor does not respawn it, and `serve` stops if no worker of a model is left.
EXIT_CANNOT_LOAD = 78
# the variable naming the file where a worker that gives up so writes its one line why,
# for `status` (its log has it too): `serve` sets it
EXIT_NOTE_ENV = "COMPLETIONS_EXIT_NOTE"
# Every process's log lines (the access log has its own, see app/access.py).
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s[%(process)d] %(message)s"
# /tokenize and /detokenize jobs one worker runs at once (between its decode steps,
# without a slot); more get 429 tokenizer_busy.
MAX_OPS_PER_WORKER = 4
# Retry-After sent with a 503 when no worker is ready.
RETRY_AFTER_SECONDS = 5


def env_value(option: Option, environ: dict | None = None) -> Any:
    """The option's value from the environment, or its default."""
    environ = os.environ if environ is None else environ
    raw = environ.get(option.env)
    if raw is None or raw == "":
        return option.default
    if option.repeat:
        parts = split_device_list(raw) if option.name == "device" else raw.split(",")
        if not any(part.strip() for part in parts):
            # (`COMPLETIONS_API_KEY=$A,$B` with both unset: no key, and an open server)
            raise OptionValueError(f"{option.env}={raw!r} names nothing between its commas")
        return [option.type(part.strip()) for part in parts if part.strip()]
    value = option.type(raw)
    if option.choices and value not in option.choices:
        raise ValueError(f"{value!r} is not one of {', '.join(option.choices)}")
    return value


def env_is_set(option: Option, environ: dict | None = None) -> bool:
    environ = os.environ if environ is None else environ
    return environ.get(option.env, "") != ""


class _Given(argparse.Action):
    """Store the value and note that the command line gave this option (`resolve`: a
    flag equal to its default still overrides the config file)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, self.const if values is None else values)
        given = getattr(namespace, "_given", None) or set()
        given.add(self.dest)
        setattr(namespace, "_given", given)


def add_options(parser: argparse.ArgumentParser, names: Iterable[str],
                file_values: dict | None = None) -> None:
    """Declare the named options on an argparse parser. Each defaults to its environment
    variable, else to the config file's value (`file_values`), else to its default."""
    file_values = file_values or {}
    for name in names:
        option = OPTIONS[name]
        try:
            default = env_value(option) if env_is_set(option) else \
                file_values.get(name, option.default)
        except (ValueError, argparse.ArgumentTypeError) as exc:
            # said by `resolve` if this parser's command is the one run (a bad variable
            # of `serve`'s is no error of `keygen`'s, nor to be named after `serve`)
            if parser.get_default("_env_problem") is None:
                parser.set_defaults(_env_problem=(parser, f"{option.env}: {exc}"))
            default = option.default
        help_text = f"{option.help} [env {option.env}; default {option.default!r}]"
        if option.repeat:
            parser.add_argument(option.flag, dest=name, action="append", type=option.type,
                                default=None, choices=option.choices, help=help_text)
            parser.set_defaults(**{f"_{name}_default": default})
        elif option.type is _boolean:        # `--flag` alone means true; `--flag false`
            parser.add_argument(option.flag, dest=name, type=option.type, default=default,
                                nargs="?", const=True, help=help_text, action=_Given)
        else:
            parser.add_argument(option.flag, dest=name, type=option.type, default=default,
                                choices=option.choices, help=help_text, action=_Given)


# With several API keys, the share of a model's slots one key may run at once: the rest
# stay for the others (the queue serves it in turn). A key whose jobs alone wait for
# the model may fill the rest with brief jobs (at most BRIEF_TOKENS to write each, an
# editor's completion, and BRIEF_WORK with their prompt's prefill): held back, eight
# users of one key found two slots idle and waited for a whole completion; another
# key's request then waits for one brief job
KEY_SLOT_SHARE = 0.75
BRIEF_TOKENS = 256
BRIEF_WORK = 2048       # ... and at most this much with its prompt's prefill (prompt_work)
# ... and of one request whose choices are long (more than LONG_REQUEST_TOKENS together, or
# one without a limit): they would hold every slot for minutes, so its choices past this
# share wait for its own, and a later request starts within a step (short ones, which
# free their slots soon, may fill them all)
REQUEST_SLOT_SHARE = 0.75
LONG_REQUEST_TOKENS = 4096


def queue_share(max_queue: int, given: int | None, keys: int) -> int:
    """Requests one API key may have queued per model (0: no limit): as given, else a fair
    share of the queue when more than one key is configured."""
    if given is not None:
        return given
    return max(1, max_queue // keys) if keys > 1 else 0


class Settings(argparse.Namespace):
    """One process's options, resolved once at start (`resolve`) and passed down: each
    option an attribute; `explicit`, the names a flag or variable set (not the config
    file, not a default); `given`, those a flag set; `file_data`, the config file as
    read."""
    explicit: set
    given: set
    file_data: dict


def refuse_env_problem(args: argparse.Namespace) -> None:
    """Exit with the first bad environment variable of the parsed command's options, in
    its parser's words (add_options keeps it for the command that is run)."""
    problem = getattr(args, "_env_problem", None)
    if problem:
        parser, message = problem
        parser.error(message)


def resolve(args: argparse.Namespace, file_data: dict | None = None) -> Settings:
    """The parsed arguments as Settings. Repeatable flags replace, not extend, the
    env/default list."""
    refuse_env_problem(args)
    parsed = vars(args)
    settings = Settings(**{k: v for k, v in parsed.items() if not k.startswith("_")})
    settings.explicit, settings.file_data = set(), dict(file_data or {})
    settings.given = set(parsed.get("_given") or ())     # on the command line itself
    for name, option in OPTIONS.items():
        if name not in parsed:
            continue
        explicit = env_is_set(option) or name in (parsed.get("_given") or ())
        if option.repeat:
            if parsed[name] is None:
                setattr(settings, name, parsed.get(f"_{name}_default", option.default))
            else:
                explicit = True
        elif option.default is None and parsed[name] is not None:
            explicit = True
        if explicit:
            settings.explicit.add(name)
    return settings
