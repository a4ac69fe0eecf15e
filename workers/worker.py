"""One worker process: pinned to one device, one model loaded, serving the dispatcher.

Two threads. The IO thread owns the DEALER to the dispatcher: READY, heartbeats (which
keep flowing while the other thread is inside a long decode, since llama.cpp releases
the GIL), jobs and cancels in, FIRST/DONE out. The main thread runs the generation loop
and owns the engine and the XPUB socket that streams tokens to the front ends.
"""
from __future__ import annotations

import argparse
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, NoReturn
import signal
import threading
import time

import msgspec
import zmq

from dispatcher.common.addresses import Endpoints
from dispatcher.common import config, configfile, curve, logs, protocol as P
from dispatcher.common.curve import PartKeys
from dispatcher.common.devices import DeviceSpec, parse_device
from dispatcher.common.models import default_model_id, model_file_digest, resolve_model_path
from dispatcher.common.process import StopFlag, die_with_parent
from workers import inbox
from workers.engine.contextshape import ContextShape
from workers.errors import EngineError
from workers.faults import FaultInjection
from workers.generation import GenerationLoop
from workers.preparation import PREPARE_STUCK_SECONDS
from workers.publisher import Publisher
from workers.sdnotify import SystemdNotify
from workers.prompts import FimTemplate
from workers.pinning import Placement, pin

log = logging.getLogger("workers")
RECONNECT_MAX = 4.0
EXIT_CANNOT_LOAD = config.EXIT_CANNOT_LOAD


class DispatcherLink(threading.Thread):
    """The IO thread: the DEALER socket and the heartbeat protocol (Paranoid Pirate)."""

    def __init__(self, context: zmq.Context, endpoints: Endpoints, identity: bytes,
                 info: P.WorkerInfo, loop: GenerationLoop, notify_address: str,
                 step_timeout: float = 0.0, heartbeat: config.Heartbeat = config.Heartbeat(),
                 keys: PartKeys | None = None, on_refused=lambda: None):
        super().__init__(name="dispatcher-link", daemon=True)
        self.refused: str | None = None  # why the dispatcher will not take this worker
        self.on_refused = on_refused     # ... told to the main thread (it stops)
        self.heartbeat = heartbeat
        self.keys = keys                 # CURVE: this worker's key and the dispatcher's
        self.context = context
        self.endpoints = endpoints
        self.identity = identity
        self.info = info
        self.loop = loop
        self.notify_address = notify_address
        self.stopping = threading.Event()
        self.leaving: list[str] = []
        self.connects = 0
        self.step_timeout = step_timeout
        self.shared: OrderedDict[str, dict] = OrderedDict()   # protocol.SHARED_FIELDS
        self.systemd = SystemdNotify()   # (its unit's watchdog: a worker frozen whole)

    def _connect(self) -> zmq.Socket:
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.identity)
        sock.setsockopt(zmq.LINGER, 0)
        if self.keys is not None:
            self.keys.apply(sock)
        sock.connect(self.endpoints.worker)
        sock.send_multipart(P.encode(P.READY, body=self.info))
        self.connects += 1
        return sock

    def run(self) -> None:
        notify = self.context.socket(zmq.PAIR)
        notify.connect(self.notify_address)
        dealer = self._connect()
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(notify, zmq.POLLIN)
        interval = self.heartbeat.interval
        expires = time.monotonic() + self.heartbeat.expiry
        next_beat = time.monotonic() + interval
        reconnect_delay = interval
        self.systemd.send(b"READY=1")
        while not self.stopping.is_set():
            ready = dict(poller.poll(100))
            now = time.monotonic()
            self.systemd.ping(now)
            if dealer in ready:
                while dealer.poll(0, zmq.POLLIN):
                    self.systemd.ping()
                    expires = now + self.heartbeat.expiry
                    reconnect_delay = interval
                    if not self._handle(dealer):
                        expires = 0.0           # told to reconnect
            if notify in ready:
                while notify.poll(0, zmq.POLLIN):
                    dealer.send_multipart(notify.recv_multipart())
            if now >= next_beat:
                dealer.send_multipart(P.encode(P.HEARTBEAT, body=P.WorkerBeat(
                    steps=self.loop.engine.totals, leaving=self.loop.leaving_by is not None)))
                next_beat = now + interval
            stuck = self.loop.stuck_for(now)
            if self.step_timeout and stuck > self.step_timeout:
                self._give_up(dealer, stuck)
            preparing = self.loop.watch.longest(now)
            if self.step_timeout and preparing > max(self.step_timeout,
                                                     PREPARE_STUCK_SECONDS):
                self._give_up(dealer, preparing, "one job's preparation (its tokens, its "
                              "sampler chain) or /tokenize ran", PREPARE_STUCK_SECONDS)
            if now > expires:
                log.warning("dispatcher silent: reconnecting in %.1fs", reconnect_delay)
                self.loop.inbox.put(inbox.Reset(self.loop.preparer.being_prepared()))
                poller.unregister(dealer)
                dealer.close(0)
                self._pause(reconnect_delay)
                reconnect_delay = min(reconnect_delay * 2, RECONNECT_MAX)
                dealer = self._connect()
                poller.register(dealer, zmq.POLLIN)
                expires = time.monotonic() + self.heartbeat.expiry
        while notify.poll(0, zmq.POLLIN):
            dealer.send_multipart(notify.recv_multipart())
        dealer.send_multipart(P.encode(P.DISCONNECT, body=P.Disconnect(
            reason="stopped", code=P.STOPPED)))      # (a planned stop, not a loss)
        self.systemd.send(b"STOPPING=1")
        self.systemd.close()
        time.sleep(0.05)
        dealer.close(linger=500)
        notify.close(0)

    def _pause(self, seconds: float) -> None:
        """Sleep, its unit's watchdog told meanwhile (a reconnect waits up to the
        heartbeat interval: 60 s at most, past the unit's 30)."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0 and not self.stopping.is_set():
            time.sleep(min(left, 0.5))
            self.systemd.ping()

    def _with_shared(self, body: P.WorkerJob) -> P.WorkerJob | None:
        """A job's prompt fields: kept for `share_as`, filled in for `same_as` (the
        dispatcher sends each prompt of a request once; protocol.SHARED_FIELDS)."""
        if body.share_as:
            self.shared[body.share_as] = P.prompt_fields(body)
            self.shared.move_to_end(body.share_as)
            while len(self.shared) > P.WORKER_SHARED:
                self.shared.popitem(last=False)
        elif body.same_as:
            fields = self.shared.get(body.same_as)
            if fields is None:
                return None
            # (named `share_as` from here on, only here: the prompt's id, by which the
            # preparing thread keeps what its choices share, preparation.FITTED_KEPT)
            body = msgspec.structs.replace(P.with_prompt(body, fields),
                                           share_as=body.same_as)
        return body

    def _refuse(self, frames: list[bytes], exc: P.ProtocolError) -> None:
        """A REQUEST whose generation is not one (the dispatcher forwards it unread): its
        request fails with a 400, through the loop that owns the token socket."""
        request_id = P.malformed_request(frames, P.REQUEST)
        if request_id is None:
            return
        try:
            envelope = msgspec.json.decode(frames[3], type=P.SubmittedJob)
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
            return                       # not even its envelope: nobody to answer
        if envelope.topic:
            self.loop.inbox.put(inbox.Invalid(request_id, envelope.topic, envelope.attempt,
                                              f"the job is malformed: {exc}"))

    def _give_up(self, dealer: zmq.Socket, stuck: float,
                 what: str = "one step of its generation loop ran",
                 floor: float = 0.0) -> None:
        """The watchdog: the generation thread has been inside one step (or a preparing
        thread in one job) for longer than any legitimate one takes (a wedged sampler, a
        hung device, a tokenizer call that never returns). Tell the dispatcher, which
        fails its requests with worker_stuck, and end the process at once (the stuck
        thread may never return, nor see a signal); the supervisor replaces it."""
        limit = f"--step-timeout {self.step_timeout:g}s" if self.step_timeout >= floor \
            else f"{floor:g}s"
        reason = f"stuck: {what} {stuck:.0f}s, past {limit}"
        dealer.send_multipart(P.encode(P.DISCONNECT, body=P.Disconnect(
            reason=reason, code="worker_stuck")))
        # straight to the file descriptor: the stuck thread may hold a logging lock
        os.write(2, f"worker {self.identity.decode()} {reason}; exiting to be "
                    "replaced\n".encode())
        time.sleep(0.2)                  # let the message leave
        os._exit(config.EXIT_STUCK)

    def _handle(self, dealer: zmq.Socket) -> bool:
        frames = dealer.recv_multipart()
        try:
            msg = P.decode(frames)
        except P.ProtocolError as exc:
            log.warning("bad message from the dispatcher: %s", exc)
            self._refuse(frames, exc)
            return True
        if msg.cmd == P.REQUEST:
            body = self._with_shared(msg.body)
            if body is None:
                # its prompt was sent to this worker's earlier connection: hand it back
                # unstarted, the dispatcher sends it again whole
                log.warning("%s: same_as names a prompt this worker does not have",
                            msg.request_id)
                dealer.send_multipart(P.encode(P.DONE, msg.request_id, P.Done(
                    attempt=msg.body.attempt, unshared=True)))
                return True
            if self.loop.preparer.submit(msg.request_id, body):
                # being worked on from now (workers/preparation.py): if that kills this
                # process, the dispatcher fails the job, never hands it to another worker
                dealer.send_multipart(P.encode(P.STARTED, msg.request_id,
                                               P.Attempt(attempt=body.attempt)))
            else:
                self.loop.inbox.put(inbox.NewJob(msg.request_id, body))
        elif msg.cmd == P.CANCEL:
            self.loop.inbox.put(inbox.Cancel(msg.request_id, msg.body.attempt))
        elif msg.cmd == P.DISCONNECT and msg.body is not None and msg.body.code == P.REFUSED:
            self.refused = msg.body.reason or "refused by the dispatcher"
            log.error("the dispatcher refused this worker: %s", self.refused)
            self.stopping.set()
            self.on_refused()
        elif msg.cmd == P.DISCONNECT:
            log.warning("the dispatcher does not know us: registering again")
            return False
        return True


def worker_name(given: str | None, slug: str, key_name: str | None) -> str:
    """The name a worker registers under: `given` (--name, or its config entry's), else
    its device's slug and pid; a keyed worker's (`key_name`: its CURVE key's, not
    `local`) always starts with its key's name, which the dispatcher binds it to (an
    entry's default name, w0-cuda0, was refused on a second host)."""
    name = given or f"{slug}-{os.getpid()}"
    if key_name and key_name != "local" and not (
            name == key_name or name.startswith(f"{key_name}-")):
        name = f"{key_name}-{name}"
    return name


def _from_config_file(args, spec, file_data: dict):
    """This device's [[workers]] entry: its model, profile, name and sizes, unless a flag
    or variable gave them."""
    data = configfile.worker_entry(file_data, str(spec))
    args.explicit.discard("device")        # the entry's device is this one, as given
    worker = configfile.plan(data, args, resolve_model_path, default_model_id).workers[0]
    if "model" not in args.explicit:
        args.model = str(worker.model.path)
        args.model_id = args.model_id if "model_id" in args.given else worker.model.id
        if "deterministic" not in args.given:
            args.deterministic = worker.model.deterministic
        args.fim_template = args.fim_template or worker.model.fim_template
    args.name = args.name or worker.name
    # the worker's own flags override its entry; variables (an env file all the units
    # share) do not: as under `serve`, an entry's sizes are its own
    for name in ("nctx", "ngl", "slots", "kv_type", "batch", "ubatch"):
        if name not in args.given:
            setattr(args, name, getattr(worker, name))
    return worker.device, args


def compute_kind(device_compute: str, n_gpu_layers: int, n_layer: int) -> str:
    """cpu, gpu or npu; `hybrid` for an accelerator holding only some of the layers
    (llama.cpp counts the output layer after the `n_layer` blocks: --ngl N_LAYER leaves
    it on the CPU)."""
    if device_compute == "cpu" or n_gpu_layers == 0:
        return "cpu"
    return device_compute if n_gpu_layers > n_layer else "hybrid"


def load_engine(kind: str, model_path: str, n_ctx: int, slots: int, n_threads: int,
                n_gpu_layers: int, verbose: bool, deterministic: bool = False,
                prefill_chunk: int = 0, draft_max: int = 0, cache_reuse: int = 0,
                log_content: bool = False, shape: ContextShape = ContextShape(),
                draft_model: str | None = None, measure_costs: bool = True):
    if kind == "fake":
        from workers.fake_engine import FakeEngine
        return FakeEngine(model_path, n_ctx, slots, n_threads, n_gpu_layers, verbose,
                          deterministic)
    if kind == "llama":
        from workers.engine.llama import LlamaEngine      # imported only after pinning
        return LlamaEngine(model_path, n_ctx, slots, n_threads, n_gpu_layers, verbose,
                           deterministic, prefill_chunk, draft_max, cache_reuse,
                           log_content, shape=shape, draft_model=draft_model,
                           measure_costs=measure_costs)
    raise ValueError(f"unknown engine {kind!r}: use llama or fake")


def worker_info(engine, spec, placement: Placement, model_id: str, model_path,
                deterministic: bool, fim: bool) -> P.WorkerInfo:
    """What the worker registers as (READY): its model, device, offload and sizes."""
    return P.WorkerInfo(
        model=model_id, model_path=str(model_path), device=str(spec),
        compute=compute_kind(spec.compute, placement.n_gpu_layers, engine.n_layer),
        n_gpu_layers=placement.n_gpu_layers, profile=spec.profile, pid=os.getpid(),
        n_ctx=engine.n_ctx, slots=engine.n_slots, fim=fim,
        fingerprint=engine.fingerprint, deterministic=deterministic,
        model_digest=model_file_digest(model_path),
        rates=engine.step_costs.rates(engine.n_slots) if engine.step_costs else [],
        engine=engine.name, placement={**placement.to_dict(),
                                       "layers_offloaded": engine.layers_offloaded,
                                       "layers_total": engine.layers_total})


def checked_placement(spec, placement: Placement, model_path: str, nctx: int, slots: int,
                      shape: ContextShape) -> tuple[Placement, str | None]:
    """Before loading: whether the build drives the device, the device is visible and
    the model fits at nctx × slots (backends.check_placement), and the threads for the
    layers the model leaves on the CPU."""
    from workers.engine.backends import check_placement
    found = check_placement(spec, placement, model_path, nctx, slots, shape)
    if found.n_layer is not None:
        placement = placement.for_layers(found.n_layer)
    return placement, found.refusal


def step_timeout(given: float | str, engine) -> float:
    """--step-timeout: the seconds given, or (auto) derived from one full-batch decode
    timed on this device now (config.derived_step_timeout)."""
    if given != "auto":
        return float(given)
    full = engine.full_step_seconds()
    limit = config.derived_step_timeout(full, engine.n_slots)
    log.info("watchdog: a step may take %.1fs (--step-timeout auto: a full batch took "
             "%.0f ms on this device)", limit, 1000 * full)
    return limit


class CannotServe(Exception):
    """This worker cannot serve (its model, its device, its memory): one line, and an exit
    status that tells the supervisor not to try again (EXIT_CANNOT_LOAD)."""


@dataclass
class Launch:
    """A worker's settings, parsed and checked before anything is pinned or loaded."""
    args: argparse.Namespace
    spec: DeviceSpec
    endpoints: Endpoints
    keys: PartKeys | None
    shape: ContextShape
    template: FimTemplate | None
    usage_error: Callable[[str], NoReturn]      # argparse's: the usage line, status 2


@dataclass
class Loaded:
    """The engine, loaded where it was pinned, and what the worker registers with."""
    engine: object
    placement: Placement
    model_path: object
    model_id: str
    name: str
    faults: FaultInjection


def json_llama_line(level: int, text: str) -> str:
    """One line of llama.cpp's log in the json format, with this worker's name."""
    worker = next((h.formatter.worker for h in logging.getLogger().handlers
                   if isinstance(h.formatter, logs.JsonFormatter)), None)
    return logs.json_line("llama.cpp", LLAMA_LEVELS.get(level, "info"), text.rstrip("\n"),
                          worker)


LLAMA_LEVELS = {1: "debug", 2: "info", 3: "warning", 4: "error"}   # ggml_log_level


def parse_launch(argv: list[str] | None) -> Launch:
    """Flags, variables and the config file's [[workers]] entry (argparse's usage error,
    status 2, for anything wrong)."""
    try:
        file_data = configfile.read_for(argv)      # the config file, read once
    except configfile.ConfigError as exc:
        raise SystemExit(exc.report())
    parser = config.ArgumentParser(
        prog="python -m workers",
        description="Run one worker: pin it to a device, load the model, serve the "
                    "dispatcher. With --config, the file's [[workers]] entry for the device "
                    "supplies its model, profile and sizes; flags override them.")
    config.add_options(parser, ["config", "dispatcher", "device", "model", "model_id", "nctx",
                                "ngl", "slots", "kv_type", "batch", "ubatch", "deterministic",
                                "engine", "name", "fim_template", "prefill_chunk", "draft_max",
                                "draft_model", "cache_reuse", "step_timeout",
                                "heartbeat_interval", "log_level", "log_format", "log_content",
                                "curve_keys", "curve_name", "insecure_transport",
                                "stop_grace"],
                       configfile.server_defaults(file_data))
    args = config.resolve(parser.parse_args(argv), file_data)
    logs.setup(args.log_level, args.log_format, "worker", args.name)
    if args.log_format == "json":           # llama.cpp's own lines too (engine/llamalog.py)
        from workers.engine import llamalog
        llamalog.LINE = json_llama_line
    if not args.dispatcher:
        parser.error(f"--dispatcher (or {config.OPTIONS['dispatcher'].env}) is required")
    if len(args.device) != 1:
        parser.error(f"a worker serves exactly one device, got {args.device}")
    try:
        spec = parse_device(args.device[0])
        endpoints = Endpoints.from_base(args.dispatcher)
        problem = curve.transport_problem(args.dispatcher, args.curve_keys,
                                          args.insecure_transport)
        if problem:
            raise ValueError(problem)
        keys = curve.PartKeys.load(args.curve_keys, args.curve_name) if args.curve_keys \
            else None
        if args.config:
            spec, args = _from_config_file(args, spec, file_data)
        template = FimTemplate.parse(args.fim_template) if args.fim_template else None
        return Launch(args, spec, endpoints, keys, ContextShape.of(args), template,
                      parser.error)
    except (ValueError, configfile.ConfigError) as exc:
        parser.error(str(exc))


def load(launch: Launch, placement: Placement) -> Loaded:
    """The model (and draft model) found, checked against the pinned device and loaded;
    CannotServe where it cannot be."""
    args, spec = launch.args, launch.spec
    name = args.name or spec.slug
    try:
        model_path = resolve_model_path(args.model)
    except SystemExit as exc:          # not there, not readable, not GGUF: never respawn
        raise CannotServe(f"worker {name} cannot serve: {exc}") from None
    slots = args.slots or config.DEFAULT_SLOTS[spec.compute]
    if args.engine == "llama":
        placement, refusal = checked_placement(spec, placement, str(model_path), args.nctx,
                                               slots, launch.shape)
        if refusal:
            raise CannotServe(f"worker {name} cannot serve {model_path} on {spec}: {refusal}")
    try:
        draft_model = str(resolve_model_path(args.draft_model)) if args.draft_model else None
    except SystemExit as exc:
        raise CannotServe(f"worker {name} cannot serve: the draft model: {exc}") from None
    model_id = args.model_id or default_model_id(model_path)
    name = worker_name(args.name, spec.slug,
                       args.curve_name if launch.keys is not None else None)
    started = time.monotonic()
    faults = FaultInjection.from_env()
    faults.at_load()
    try:
        engine = load_engine(args.engine, str(model_path), args.nctx, slots,
                             placement.n_threads, placement.n_gpu_layers,
                             args.log_level.lower() == "debug", args.deterministic,
                             args.prefill_chunk, args.draft_max, args.cache_reuse,
                             args.log_content, launch.shape, draft_model)
    except EngineError as exc:
        raise CannotServe(f"worker {name} cannot serve {model_path} on {spec}: {exc}") \
            from None
    logs.name_worker(name)
    log.info("worker %s: %s loaded on %s in %.1fs (%d threads, cores %s, %s)", name,
             model_id, spec, time.monotonic() - started, placement.n_threads,
             list(placement.cores), placement.visible_devices or "no accelerator variables")
    return Loaded(engine, placement, model_path, model_id, name, faults)


def serve(launch: Launch, loaded: Loaded, stopping: StopFlag) -> int:
    """Connect to the dispatcher and run the generation loop until told to stop."""
    args, engine, name = launch.args, loaded.engine, loaded.name
    context = zmq.Context()
    xpub = context.socket(zmq.XPUB)
    xpub.setsockopt(zmq.SNDHWM, config.TOKEN_HWM)
    xpub.setsockopt(zmq.LINGER, 2000)
    if launch.keys is not None:
        launch.keys.apply(xpub)
    xpub.connect(launch.endpoints.tokens_in)
    notify_address = f"inproc://notify-{os.getpid()}"
    notify = context.socket(zmq.PAIR)
    notify.bind(notify_address)

    def send_notice(cmd: bytes, request_id: str, body=None) -> None:
        notify.send_multipart(P.encode(cmd, request_id, body))

    loop = GenerationLoop(engine, Publisher(xpub), send_notice,
                          identity={"worker": name, "device": str(launch.spec)},
                          fim_template=launch.template, faults=loaded.faults)
    info = worker_info(engine, launch.spec, loaded.placement, loaded.model_id,
                       loaded.model_path, args.deterministic,
                       fim=engine.fim_tokens is not None or launch.template is not None)
    watchdog = step_timeout(args.step_timeout, engine)     # (timed before what follows)
    engine.after_load()
    link = DispatcherLink(context, launch.endpoints, name.encode(), info, loop,
                          notify_address, watchdog, config.Heartbeat.of(args), launch.keys,
                          on_refused=stopping.set)
    link.start()
    try:
        loop.run(stopping)
    finally:
        loop.abort_all("the worker is shutting down")
        loop.vocabulary_thread.shutdown(wait=True, cancel_futures=True)   # before the engine
        loop.preparer.shutdown()                                          # (both use it)
        loop.release_unread()
        loop.publisher.flush()
        link.stopping.set()
        link.join(timeout=5)
        xpub.close()
        notify.close(0)
        engine.close()
        context.term()
    if link.refused:                   # one line said why; never started again
        return gave_up(f"the dispatcher refused it: {link.refused}")
    log.info("worker %s stopped", name)
    return 0


def main(argv: list[str] | None = None) -> int:
    launch = parse_launch(argv)
    if os.environ.get("COMPLETIONS_PARENT_PID"):
        die_with_parent(int(os.environ["COMPLETIONS_PARENT_PID"]))
    stopping = StopFlag()
    if os.environ.get("COMPLETIONS_PARENT_PID"):
        # `serve`'s launcher drains the dispatcher before it stops a worker (SIGTERM), so
        # it stops at once; Ctrl-C in a terminal signals the launcher's whole process
        # group, and is the launcher's to act on
        signal.signal(signal.SIGTERM, lambda *_: stopping.set())
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    else:
        # on its own (systemd, a terminal) nobody drains it first: the requests it runs
        # finish, for up to --stop-grace s, the rest go back to the dispatcher; a second
        # signal stops it at once
        grace = launch.args.stop_grace
        signal.signal(signal.SIGTERM, lambda *_: stopping.drain(grace))
        signal.signal(signal.SIGINT, lambda *_: stopping.drain(grace))
    try:
        placement = pin(launch.spec, launch.args.ngl)   # before the inference library
    except ValueError as exc:                          # is imported
        launch.usage_error(str(exc))
    try:
        loaded = load(launch, placement)
    except CannotServe as exc:
        log.error("%s", exc)
        return gave_up(str(exc))
    return serve(launch, loaded, stopping)


def gave_up(why: str) -> int:
    """EXIT_CANNOT_LOAD, its line written where the launcher reads it for `status`
    (config.EXIT_NOTE_ENV: `serve` sets it; a worker on its own has only its log)."""
    path = os.environ.get(config.EXIT_NOTE_ENV)
    if path:
        try:
            with open(path, "w", encoding="utf-8") as f:
                f.write(why[:1000])
        except OSError as exc:
            log.warning("could not write why it stops to %s: %s", path, exc)
    return EXIT_CANNOT_LOAD
