"""The dispatcher's process shell: sockets, the token proxy, the poll loop, the control
channel, the launcher's children. Every decision is `dispatcher.core.DispatcherCore`'s;
this module only carries its messages.

Front ends SUBMIT jobs; the core queues them and picks a worker; workers announce READY
and heartbeat. Token events bypass this loop: workers publish them into an XSUB/XPUB
proxy run by a thread of this process, and front ends subscribe there.

The loop, as in the ZeroMQ guide's brokers, is a list of named steps: poll, read the
workers, read the front ends, read the control socket, reap exited children, tick.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import socket
import threading
import time
from collections import deque

import msgspec
import zmq

from dispatcher.common.addresses import Endpoints
from dispatcher.common import config, protocol as P
from dispatcher import refusals
from dispatcher.core import DispatcherCore, Send
from dispatcher.operations import Operations
from dispatcher.common.curve import DispatcherKeys, bind_name
from dispatcher.common.process import StopFlag

log = logging.getLogger(__name__)

LAST_WORDS_MS = 1000    # ms the front-end and worker sockets may take to send at close
LOAD_GUESS = 600.0      # s a worker's first load may take before the queue stops waiting
READ_BUDGET = 0.25      # s one socket's messages may take before the loop goes on
# a request's end from the dispatcher: never dropped (FINISHED too: the worker's last event
# may be lost on the token path by the same slow front end, and without FINISHED's grace
# nothing ended the stream)
ENDINGS = (P.FAILED, P.REJECTED, P.FINISHED)
MAX_UNSENT = 10_000     # ... while fewer than this wait for a full pipe (then counted lost);
# FINISHED (one for every job, cancelled ones too) only while half as many wait: a front
# end cancelling much filled the room, and the errors that end streams were lost
UNSENT_ROOM = {P.FAILED: MAX_UNSENT, P.REJECTED: MAX_UNSENT, P.FINISHED: MAX_UNSENT // 2}
UNSENT_FOR = 60.0       # ... nor for longer than this (s; a front end stalled that long is
                        # past its heartbeats' expiry many times over)
TEND_FAULTS = 50        # turns in a row whose tick failed before the loop gives up
LOAD_TRIES = 2          # loads in a row that may die (one OOM kill) and still be waited for


class SupervisedFleet:
    """The core's view of the processes `serve` started."""

    def __init__(self, supervisor):
        self.supervisor = supervisor

    def workers(self):
        return [c for c in self.supervisor.children.values() if c.kind == "worker"]

    def expected_workers(self, coming: bool = False) -> int:
        """The workers `serve` runs (/health's `workers_expected`: one that failed shows
        as missing); `coming`: those that are or will be ready, for admission: one that
        gave up (it cannot load its model, exit 78: never respawned) is not coming, so a
        route none of the others meets is a 400 saying why, not a 503 to retry for ever."""
        return sum(1 for c in self.workers() if not (coming and c.gave_up))

    def configured_models(self) -> set[str] | None:
        return {c.extra.get("model") for c in self.workers()}

    def loading_models(self) -> set[str]:
        """The models a worker process is loading now (started, not READY yet, not given
        up), for no longer than its load can take: three times its last measured load,
        or LOAD_GUESS for a first one. The queue waits for them (a large model's load
        takes minutes on a GPU: a reload cut its queued requests off at 30 s)."""
        now = time.monotonic()
        return {c.extra.get("model") for c in self.workers()
                if c.process is not None and c.ready_at is None and not c.gave_up
                and c.died_loading < LOAD_TRIES
                and now - c.started_at < 3 * (c.load_seconds or LOAD_GUESS / 3)}


class Broker:
    def __init__(self, endpoints: Endpoints, supervisor=None,
                 known_models: dict[str, dict] | None = None, max_queue: int = 64,
                 queue_timeout: float = 0.0, heartbeat: config.Heartbeat = config.Heartbeat(),
                 max_queue_per_key: int = 0, keys: DispatcherKeys | None = None,
                 infer_sessions: bool = True, key_slot_share: float = 1.0):
        self.endpoints = endpoints
        self.keys = keys                          # CURVE: every socket authenticated
        self.bound_keys: dict[str, str] = {}      # worker name -> the key it registered with
        # messages of peers that are no front end (_stranger), and when last logged
        self.strangers, self._stranger_logged = 0, -60.0
        # messages whose handling raised (_handler_failed): when the last minute's first
        # was logged, and how many of that minute's were
        self._fault_logged, self._faults_logged = -60.0, 0
        self._tend_faults = 0       # turns in a row whose tick failed (TEND_FAULTS)
        # the ends of requests (FAILED, REJECTED) a front end's full pipe refused: sent
        # again each turn of the loop (resend)
        self.unsent: deque[tuple[float, Send]] = deque()    # (first refused at, send)
        self.supervisor = supervisor
        self.core = DispatcherCore(SupervisedFleet(supervisor) if supervisor else None,
                                   known_models, max_queue, queue_timeout, time.time(),
                                   heartbeat, max_queue_per_key, infer_sessions,
                                   key_slot_share)
        self.context = zmq.Context()
        self.auth = keys.authenticator(self.context) if keys else None
        self.frontend = self._router(endpoints.frontend, "frontends")
        self.backend = self._router(endpoints.worker, "workers")
        self.control = self.context.socket(zmq.ROUTER)
        self.control.setsockopt(zmq.LINGER, 0)
        if keys:
            keys.serve(self.control, "ops")
        self.control.bind(endpoints.control)
        self.ops = Operations(self.core, supervisor)
        self._stop = StopFlag()                   # set by signal handlers
        # written to by stop() and drain(), so that the loop acts on a signal at once
        # rather than at its next poll timeout
        self._wake_r, self._wake_w = socket.socketpair()
        for end in (self._wake_r, self._wake_w):
            end.setblocking(False)
        self._drain_requested: float | None = None
        self._drain_because = self._stop_because = ""
        self.exit_code = 0
        self._proxy_thread = self._start_proxy()

    # -- sockets -----------------------------------------------------------------------
    def _router(self, address: str, role: str) -> zmq.Socket:
        sock = self.context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)   # a send to a vanished peer raises
        if self.keys is None:
            sock.setsockopt(zmq.ROUTER_HANDOVER, 1)    # a reconnecting peer takes its name
        else:
            # keyed: a connection never takes over a name in use (it could be another
            # key's), and only `role`'s keys get through at all
            self.keys.serve(sock, role)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(address)
        return sock

    def _start_proxy(self) -> threading.Thread:
        xsub = self.context.socket(zmq.XSUB)
        xpub = self.context.socket(zmq.XPUB)
        for sock in (xsub, xpub):
            sock.setsockopt(zmq.SNDHWM, config.TOKEN_HWM)
            sock.setsockopt(zmq.RCVHWM, config.TOKEN_HWM)
            sock.setsockopt(zmq.LINGER, 0)
        # the beats that prove a front end's token path (see protocol): published into
        # the proxy like a worker's events (bound before CURVE applies to the socket)
        beats_address = f"inproc://token-beats-{id(self)}"
        xsub.bind(beats_address)
        if self.keys:                     # workers publish; only front ends may read
            self.keys.serve(xsub, "workers")
            self.keys.serve(xpub, "frontends")
        xsub.bind(self.endpoints.tokens_in)
        xpub.bind(self.endpoints.tokens_out)
        self.beats = self.context.socket(zmq.PUB)
        self.beats.setsockopt(zmq.LINGER, 0)
        self.beats.connect(beats_address)
        self._proxy_control = self.context.socket(zmq.PAIR)
        self._proxy_control.bind(f"inproc://proxy-control-{id(self)}")
        control_address = f"inproc://proxy-control-{id(self)}"

        def run() -> None:
            control = self.context.socket(zmq.PAIR)
            control.connect(control_address)
            try:
                zmq.proxy_steerable(xsub, xpub, None, control)
            except zmq.ContextTerminated:
                pass
            finally:
                for sock in (xsub, xpub, control):
                    sock.close(0)

        thread = threading.Thread(target=run, name="token-proxy", daemon=True)
        thread.start()
        return thread

    def deliver(self, sends: list[Send]) -> None:
        """Send the core's messages; tell it about each that could not be delivered (a
        vanished peer, or one not keeping up), and deliver what that makes it send."""
        while sends:
            failed = []
            for send in sends:
                if send.cmd == P.STATE and send.body.unheld and self.unsent:
                    send = self._spare_unsent(send)
                sock = self.frontend if send.to == "frontend" else self.backend
                try:
                    sock.send_multipart([send.peer] + P.encode(send.cmd, send.request_id,
                                                               send.body), zmq.NOBLOCK)
                except zmq.ZMQError as exc:   # EHOSTUNREACH (ROUTER_MANDATORY) or EAGAIN
                    if exc.errno == zmq.EAGAIN and send.to == "frontend" and \
                            send.cmd in ENDINGS and len(self.unsent) < UNSENT_ROOM[send.cmd]:
                        self.unsent.append((time.monotonic(), send))
                    else:
                        failed.append((send, exc.errno != zmq.EAGAIN))
            sends = [more for send, gone in failed for more in self.core.send_failed(send, gone)]

    def _spare_unsent(self, state: Send) -> Send:
        """`state` without the requests whose end waits in `unsent` for its front end:
        held still, a STATE saying otherwise would go out before that end (resent later
        in the loop), and the stream would end `stream_incomplete` in its stead."""
        waiting = {send.request_id for _, send in self.unsent if send.peer == state.peer}
        return dataclasses.replace(state, body=msgspec.structs.replace(
            state.body, unheld=[r for r in state.body.unheld if r not in waiting]))

    def resend(self) -> None:
        """Send again the ends of requests a front end's full pipe refused (`unsent`):
        a FAILED or REJECTED dropped left its stream waiting for an end that no worker
        would send (its job was over), until its client gave up; a FINISHED dropped, with
        the worker's last event lost on the token path, the same. In order for each front
        end, one still full passing over the others' turn; given up (counted as
        undelivered) once its front end has gone, or after UNSENT_FOR s of a full pipe."""
        kept, lost, full = deque(), [], set()
        now = time.monotonic()
        for since, send in self.unsent:
            if send.peer in full:
                kept.append((since, send))
                continue
            try:
                self.frontend.send_multipart([send.peer] + P.encode(
                    send.cmd, send.request_id, send.body), zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EAGAIN and now - since < UNSENT_FOR:
                    full.add(send.peer)
                    kept.append((since, send))
                else:
                    lost.append(send)
                continue
            self.core.stats["frontend_resent"] += 1
        self.unsent = kept
        self.deliver([more for send in lost for more in self.core.send_failed(send)])

    # -- the loop ----------------------------------------------------------------------
    # stop() and drain() are safe in a signal handler: they set attributes and write to a
    # socket; the loop logs and carries out the request (`because`: the signal's name)
    def stop(self, because: str = "") -> None:
        self._stop_because = because
        self._stop.set()
        self._wake()

    def drain(self, grace: float, because: str = "") -> None:
        """Ask for a graceful stop: no new requests, in-flight ones get `grace` seconds."""
        self._drain_because = because
        self._drain_requested = grace
        self._wake()

    @property
    def wakeup_fd(self) -> int:
        """Writing any byte here wakes the loop (for signal.set_wakeup_fd)."""
        return self._wake_w.fileno()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:                        # full, or closed: a wake-up is due anyway
            pass

    @property
    def draining(self) -> bool:
        return self._drain_requested is not None or self.core.draining_until is not None

    def run(self) -> None:
        poller = zmq.Poller()
        for sock in (self.frontend, self.backend, self.control):
            poller.register(sock, zmq.POLLIN)
        wake = self._wake_r.fileno()            # the poller reports plain sockets by fd
        poller.register(wake, zmq.POLLIN)
        log.info("dispatcher listening: %s", ", ".join(
            f"{n}={getattr(self.endpoints, n)}" for n in Endpoints.NAMES))
        while not self._stop.is_set():
            ready = dict(poller.poll(100))
            if wake in ready:
                try:
                    self._wake_r.recv(4096)
                except OSError:
                    pass
            if self.backend in ready:
                self._read(self.backend, self.process_worker)
            if self.frontend in ready:
                self._read(self.frontend, self.process_frontend)
            if self.control in ready:
                self._read(self.control, self.process_control)
            try:
                self._tend()
                self._tend_faults = 0
            except Exception:       # (a fault of the tick's: logged and counted, as a
                self._handler_failed(None, [])          # message's; the loop goes on)
                self._tend_faults += 1
                if self._tend_faults >= TEND_FAULTS:
                    # (one that recurs each turn: a dispatcher that dispatches nothing is
                    # worse than one that stops, to be restarted by its service)
                    log.critical("the tick failed %d turns in a row: stopping",
                                 self._tend_faults)
                    raise
            if self.core.stopped:
                self.stop()
        if self._stop_because:
            log.info("%s: stopping", self._stop_because)

    def _tend(self) -> None:
        """What the loop does after each read: resends, reaping, a drain asked for, the
        core's tick (expiries, heartbeats, dispatch), silent workers, the ops."""
        self.resend()
        now = time.monotonic()
        self.reap_children()
        if self._drain_requested is not None:
            if self._drain_because:
                log.info("%s: finishing in-flight requests (up to %.0fs; again to stop "
                         "now)", self._drain_because, self._drain_requested)
            self.deliver(self.core.drain(self._drain_requested, now))
            self._drain_requested = None
        self.deliver(self.core.tick(now))
        self.end_silent_workers()
        self.ops.tick(now)

    def _read(self, sock: zmq.Socket, handler) -> None:
        """Up to 1000 messages, for READ_BUDGET s at most: the loop then reads the
        workers' heartbeats and ticks (a long burst of costly admissions held it past
        the heartbeats' expiry: every worker dropped as silent, its requests failed)."""
        until = time.monotonic() + READ_BUDGET
        for _ in range(1000):
            if time.monotonic() > until:
                return
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=self.keys is None)
            except zmq.Again:
                return
            if self.keys is not None:
                if sock is self.backend and not self._key_holds_name(frames):
                    continue
                frames = [frame.bytes for frame in frames]
            try:
                handler(frames)
            except Exception:       # (a fault one message meets: not the end of the loop)
                self._handler_failed(sock, frames)

    def _handler_failed(self, sock: zmq.Socket | None, frames: list[bytes]) -> None:
        """A message's handling raised (or the tick's: `sock` None): logged (the first
        few a minute with the trace), counted, and a front end's job cancelled wherever
        it got to (queued, sent to a worker: it would run for nobody) and answered 500
        rather than left waiting. The loop goes on: every other stream, queue and worker
        outlives one message's fault (an escape here ended `serve`, and it stopped every
        worker with it)."""
        self.core.stats["loop_faults"] += 1
        now = time.monotonic()
        if now - self._fault_logged >= 60:
            self._fault_logged, self._faults_logged = now, 0
        if self._faults_logged < 3:
            self._faults_logged += 1
            log.exception("handling a message failed (%d so far); the dispatcher goes on",
                          self.core.stats["loop_faults"])
        if sock is self.frontend and len(frames) == 5:
            request_id = P.malformed_request(frames[1:], P.SUBMIT)
            if request_id:
                try:
                    self.deliver(self.core.abandon(request_id))
                except Exception:           # (counted once: the message's fault)
                    log.debug("abandoning %s failed too", request_id, exc_info=True)
                self.deliver([Send("frontend", frames[0], P.REJECTED, request_id,
                                   refusals.dispatcher_fault())])

    def _key_holds_name(self, frames: list) -> bool:
        """A keyed worker speaks only under a name its key holds (curve.may_register);
        the first key to register a name keeps it."""
        identity = frames[0].bytes.decode(errors="replace")
        user = frames[-1].get("User-Id") if len(frames) > 1 else None
        if not self.keys.may_register(user, identity, self.bound_keys):
            log.warning("worker message as %r from a key that does not hold that name: "
                        "dropped", identity)
            return False
        bind_name(self.bound_keys, identity, user)
        return True

    def end_silent_workers(self) -> None:
        """A worker of ours dropped for silence is still a process holding its device
        (frozen, or its IO thread stuck too): SIGKILL it, so that it is respawned."""
        while self.core.silent:
            name, pid = self.core.silent.pop()
            if self.supervisor is not None and pid:
                self.supervisor.kill(name, pid)

    def reap_children(self) -> None:
        if self.supervisor is None:
            return
        for child, pid in self.supervisor.poll(respawn=self.core.draining_until is None):
            stuck = child.last_exit == config.EXIT_STUCK
            reason = "stuck: its step ran past --step-timeout" if stuck \
                else f"process exited ({child.last_exit})"
            self.deliver(self.core.worker_exited(
                child.name, pid, reason, "worker_stuck" if stuck else None,
                crashed=not (stuck or child.exited_as_asked) and child.last_exit != 0))
            if child.gave_up and child.kind == "frontend":
                self._check_frontends_alive()
            elif child.gave_up:         # (why, as it said: status showed an older loss)
                self.core.note_loss(child.name, "cannot serve: " + (
                    child.exit_note or f"process exited ({child.last_exit})"), None)
                self._check_models_loadable()

    def _check_frontends_alive(self) -> None:
        """Stop, with a non-zero exit, once every front end has been given up (each
        exited soon after its start, again and again): nothing serves HTTP, and `serve`
        must not go on as if it did."""
        frontends = [c for c in self.supervisor.children.values() if c.kind == "frontend"]
        if frontends and all(c.gave_up for c in frontends):
            log.error("no front end stays up: stopping")
            self.exit_code = 1
            self.stop()

    def _check_models_loadable(self) -> None:
        """Stop, with a non-zero exit, when every worker of some model has given up on
        loading it at start-up: `serve` must not pretend to serve a model nothing can load.
        (A worker that served before and fails later, after a reload to a bad file, say,
        stays down as `failed` while the others serve; so does one an operator restarted
        or reloaded: the server it was asked of goes on, whatever that worker did before.)"""
        workers = [c for c in self.supervisor.children.values() if c.kind == "worker"]
        for model in {c.extra.get("model") for c in workers}:
            mine = [c for c in workers if c.extra.get("model") == model]
            if mine and all(c.gave_up and not c.ever_ready and not c.extra.get("operated")
                            for c in mine):
                log.error("no worker can load the model '%s': stopping", model)
                self.exit_code = 1
                self.stop()

    def process_frontend(self, frames: list[bytes]) -> None:
        fe_id, frames = frames[0], frames[1:]
        if not P.is_frontend_id(fe_id):
            # (its jobs' tokens would go to a topic nobody reads, and naming it as
            # text failed: the dispatcher stopped)
            self._stranger(fe_id)
            return
        try:
            msg = P.decode(frames)
        except P.ProtocolError as exc:
            log.warning("bad message from front end %r: %s", fe_id, exc)
            request_id = P.malformed_request(frames, P.SUBMIT)
            if request_id:                # a job that is not one: refused, not dropped
                self.deliver([Send("frontend", fe_id, P.REJECTED, request_id, P.WireError(
                    status=400, code="bad_job", message=f"the job is malformed: {exc}"))])
            return
        self.deliver(self.core.frontend_message(fe_id, msg, time.monotonic(), time.time()))
        if msg.cmd == P.PING and len(fe_id) == P.FRONTEND_ID_LEN:
            # dropped by the PUB while the front end's subscription has not come through
            self.beats.send_multipart(P.encode_event(
                fe_id, "", P.Beat(epoch=self.core.epoch)))
        if msg.cmd == P.METRICS:
            self.deliver([Send("frontend", fe_id, P.METRICS, msg.request_id,
                               self.ops.metrics_snapshot())])

    def _stranger(self, identity: bytes) -> None:
        """A message on the front ends' socket from a peer that is not one: dropped,
        logged once a minute at most (a peer may try many identities)."""
        self.strangers += 1
        now = time.monotonic()
        if now - self._stranger_logged >= 60:
            self._stranger_logged = now
            log.warning("%d message(s) dropped so far from peers on the front ends' "
                        "socket without a front end's identity (the last: %r)",
                        self.strangers, identity[:32])

    def process_worker(self, frames: list[bytes]) -> None:
        identity, frames = frames[0], frames[1:]
        try:
            msg = P.decode(frames)
        except P.ProtocolError as exc:
            log.warning("bad message from worker %r: %s", identity, exc)
            return
        if msg.cmd == P.READY and self.supervisor is not None:
            self.supervisor.mark_healthy(identity.decode(errors="replace"))
        self.deliver(self.core.worker_message(identity, msg, time.monotonic()))

    def process_control(self, frames: list[bytes]) -> None:
        identity, request = frames[0], frames[-1]
        try:
            body = json.loads(request)
            reply = self.ops.handle(body) if isinstance(body, dict) else \
                {"error": "a request is a JSON object"}
        except ValueError:
            reply = {"error": "a request is a JSON object"}
        except Exception as exc:          # a malformed command never stops the dispatcher
            log.warning("control request failed: %r", exc)
            reply = {"error": f"bad request: {type(exc).__name__}: {exc}"}
        self.deliver(self.core.pending())
        self.control.send_multipart([identity, b"", P.encode_json(reply)])

    def close(self) -> None:
        try:
            self._proxy_control.send(b"TERMINATE")
        except zmq.ZMQError:
            pass
        self._proxy_thread.join(timeout=2)
        for sock in (self.frontend, self.backend, self.control, self.beats,
                     self._proxy_control):
            # (the front ends' and workers' last answers, a stop's `shutting_down` and
            # CANCELs among them, get a second to leave: at 0 ZeroMQ drops them unsent)
            sock.close(LAST_WORDS_MS if sock in (self.frontend, self.backend) else 0)
        if self.auth is not None:
            self.auth.stop()
        self._wake_r.close()
        self._wake_w.close()
        self.context.term()
