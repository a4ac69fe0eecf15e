"""The dispatcher: one poll loop over the front-end, worker and control sockets.

Front ends SUBMIT jobs; the broker queues them (FIFO per model) and hands each to a ready
worker with a free slot. Workers announce READY and heartbeat; one that stops answering,
or whose process exits, is dropped, and its requests are requeued once (no text sent yet)
or failed (text already sent). Token events bypass this loop: workers publish them into
an XSUB/XPUB proxy run by a thread of this process, and front ends subscribe there.
"""
from __future__ import annotations

import json
import logging
import threading
import time

import zmq

from dispatcher import config, protocol as P
from dispatcher.metrics import SystemMetrics
from dispatcher.operations import Operations, tokens_per_second
from dispatcher.queues import Job, RequestQueue, WorkerRecord, WorkerRegistry
from dispatcher.routing import explain_unfit, fits

log = logging.getLogger(__name__)
TOKEN_HWM = 100_000
# A queued job whose model has had no ready worker for this long is turned away.
NO_WORKER_TIMEOUT = 30.0
# A job that never started is requeued when its worker is lost, up to this many attempts.
MAX_ATTEMPTS = 3
# How long the rest of an admitted request's jobs may take to arrive.
UNIT_TIMEOUT = 60.0


class Broker:
    def __init__(self, endpoints: P.Endpoints, supervisor=None,
                 known_models: dict[str, dict] | None = None, max_queue: int = 64,
                 queue_timeout: float = 0.0):
        self.endpoints = endpoints
        self.max_queue = max_queue
        self.queue_timeout = queue_timeout
        self.draining_until: float | None = None
        self.supervisor = supervisor
        self.known_models = dict(known_models or {})
        self.started = time.time()
        self.context = zmq.Context()
        self.frontend = self._router(endpoints.frontend)
        self.backend = self._router(endpoints.worker)
        self.control = self.context.socket(zmq.ROUTER)
        self.control.setsockopt(zmq.LINGER, 0)
        self.control.bind(endpoints.control)
        self.queue = RequestQueue()
        self.registry = WorkerRegistry()
        self.frontends: dict[bytes, dict] = {}     # id -> {"seen": t, "pid": ...}
        self.sessions: dict[str, dict[str, Job]] = {}   # X-Session-Id -> its open jobs
        # requests being admitted job by job: parent id -> [jobs still to come, since]
        self.units: dict[str, list] = {}
        self.stats = {"submitted": 0, "rejected": 0, "requeued": 0, "failed": 0,
                      "completed": 0, "cancelled": 0, "superseded": 0, "queue_full": 0,
                      "timed_out": 0}
        self.metrics = SystemMetrics()
        self.ops = Operations(self)
        self._stop = threading.Event()
        self.exit_code = 0
        self._next_heartbeat = 0.0
        self._proxy_thread = self._start_proxy()

    # -- sockets -----------------------------------------------------------------------
    def _router(self, address: str) -> zmq.Socket:
        sock = self.context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)   # a send to a vanished peer raises
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)    # a reconnecting peer takes its name back
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(address)
        return sock

    def _start_proxy(self) -> threading.Thread:
        xsub = self.context.socket(zmq.XSUB)
        xpub = self.context.socket(zmq.XPUB)
        for sock in (xsub, xpub):
            sock.setsockopt(zmq.SNDHWM, TOKEN_HWM)
            sock.setsockopt(zmq.RCVHWM, TOKEN_HWM)
            sock.setsockopt(zmq.LINGER, 0)
        xsub.bind(self.endpoints.tokens_in)
        xpub.bind(self.endpoints.tokens_out)
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

    @staticmethod
    def _send(sock: zmq.Socket, peer: bytes, cmd: bytes, request_id: str = "",
              body: dict | None = None) -> bool:
        """Send to one peer of a ROUTER; False if it is gone or not keeping up."""
        try:
            sock.send_multipart([peer] + P.encode(cmd, request_id, body), zmq.NOBLOCK)
            return True
        except zmq.ZMQError:          # EHOSTUNREACH (ROUTER_MANDATORY) or EAGAIN
            return False

    def _send_frontend(self, frontend: bytes, *args, **kwargs) -> bool:
        return self._send(self.frontend, frontend, *args, **kwargs)

    def _send_worker(self, worker: bytes, *args, **kwargs) -> bool:
        return self._send(self.backend, worker, *args, **kwargs)

    # -- the loop ----------------------------------------------------------------------
    def stop(self) -> None:
        self._stop.set()

    def drain(self, grace: float) -> None:
        """Stop admitting work (503) and stop once in-flight work is done or `grace`
        seconds have passed."""
        if self.draining_until is None:
            self.draining_until = time.monotonic() + grace
            log.info("draining: no new requests; waiting up to %.0fs for %d running and "
                     "%d queued", grace, self.in_flight(), len(self.queue))
            self.broadcast_state()

    def in_flight(self) -> int:
        return sum(len(w.running) + len(w.ops) for w in self.registry.workers.values())

    def run(self) -> None:
        poller = zmq.Poller()
        for sock in (self.frontend, self.backend, self.control):
            poller.register(sock, zmq.POLLIN)
        log.info("dispatcher listening: %s", ", ".join(
            f"{n}={getattr(self.endpoints, n)}" for n in P.Endpoints.NAMES))
        while not self._stop.is_set():
            ready = dict(poller.poll(100))
            if self.backend in ready:
                self._drain(self.backend, self.process_worker)
            if self.frontend in ready:
                self._drain(self.frontend, self.process_frontend)
            if self.control in ready:
                self._drain(self.control, self.process_control)
            self.tick(time.monotonic())

    def _drain(self, sock: zmq.Socket, handler) -> None:
        for _ in range(1000):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            handler(frames)

    def tick(self, now: float) -> None:
        if self.supervisor is not None:
            for child, pid in self.supervisor.poll():
                record = self.registry.get(child.name.encode())
                if record is not None and record.info.get("pid") == pid:
                    self.worker_lost(record, f"process exited ({child.last_exit})")
                if child.gave_up:
                    self._check_models_loadable()
        for record in self.registry.expired(now):
            self.worker_lost(record, "stopped answering heartbeats")
            self._send_worker(record.identity, P.DISCONNECT)
        for fe_id, info in list(self.frontends.items()):
            if info["seen"] < now - config.HEARTBEAT_INTERVAL * config.HEARTBEAT_LIVENESS:
                self.frontend_lost(fe_id)
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + config.HEARTBEAT_INTERVAL
            for identity in list(self.registry.workers):
                self._send_worker(identity, P.HEARTBEAT)
        self._expire_unservable(now)
        self._expire_deadlines(now)
        for parent, (_, since) in list(self.units.items()):
            if since < now - UNIT_TIMEOUT:         # its front end never sent the rest
                del self.units[parent]
        self.ops.tick(now)
        self.dispatch()
        if self.draining_until is not None and (
                now >= self.draining_until or not (len(self.queue) or self.in_flight())):
            if now < self.draining_until:
                log.info("drained")
            else:
                log.info("grace period over with %d requests in flight", self.in_flight())
            self.stop()

    def _check_models_loadable(self) -> None:
        """Stop, with a non-zero exit, when every worker of some model has given up on
        loading it: `serve` must not pretend to serve a model nothing can load."""
        workers = [c for c in self.supervisor.children.values() if c.kind == "worker"]
        for model in {c.extra.get("model") for c in workers}:
            mine = [c for c in workers if c.extra.get("model") == model]
            if mine and all(c.gave_up for c in mine):
                log.error("no worker can load the model '%s': stopping", model)
                self.exit_code = 1
                self.stop()

    # -- front ends --------------------------------------------------------------------
    def process_frontend(self, frames: list[bytes]) -> None:
        fe_id, frames = frames[0], frames[1:]
        try:
            msg = P.decode(frames)
        except P.ProtocolError as exc:
            log.warning("bad message from front end %r: %s", fe_id, exc)
            return
        info = self.frontends.setdefault(fe_id, {"since": time.time()})
        info["seen"] = time.monotonic()
        if msg.cmd == P.PING:
            body = dict(msg.body)
            delta = body.pop("metrics", None)
            if isinstance(delta, dict):
                self.metrics.absorb(delta)
            info.update(body)
            self._send_frontend(fe_id, P.STATE, body=self.state())
        elif msg.cmd == P.METRICS:
            self._send_frontend(fe_id, P.METRICS, msg.request_id, self.ops.metrics_snapshot())
        elif msg.cmd == P.SUBMIT:
            self.submit(fe_id, msg.request_id, msg.body)
        elif msg.cmd == P.CANCEL:
            self.cancel(msg.request_id)
        else:
            log.warning("unknown command %r from front end %r", msg.cmd, fe_id)

    def submit(self, fe_id: bytes, request_id: str, body: dict) -> None:
        model = body.get("model")
        models = self.models()
        if not request_id or not isinstance(model, str):
            return self._reject(fe_id, request_id, 400, "invalid_request_error", "bad_job",
                                "the job lacks an id or a model")
        if self.draining_until is not None:
            return self._reject(fe_id, request_id, 503, "server_error", "shutting_down",
                                "the server is shutting down",
                                retry_after=config.RETRY_AFTER_SECONDS)
        if not models:
            return self._reject(fe_id, request_id, 503, "server_error", "no_worker_ready",
                                "no worker is ready", retry_after=config.RETRY_AFTER_SECONDS)
        if model not in models:
            return self._reject(fe_id, request_id, 404, "invalid_request_error",
                                "model_not_found", f"The model '{model}' does not exist")
        infos = self.registry.infos()
        if not any(fits(body, info) for info in infos):
            if not models[model]["ready"] or len(self.registry) < self.expected_workers():
                return self._reject(fe_id, request_id, 503, "server_error", "no_worker_ready",
                                    f"no worker for '{model}' that can run this is ready",
                                    retry_after=config.RETRY_AFTER_SECONDS)
            param, code, message = explain_unfit(body, infos)
            return self._reject(fe_id, request_id, 400, "invalid_request_error", code,
                                message, param=param)
        self.stats["submitted"] += 1
        job = Job(request_id, fe_id, body)
        if body.get("op"):
            return self._run_op(job)
        if body.get("session"):
            self._supersede(job)
        key = self.queue.key(job)
        if not self._admit_unit(job) and self.queue.depth(key) >= self.max_queue:
            self.stats["queue_full"] += 1
            return self._reject(fe_id, request_id, 429, "rate_limit_error", "queue_full",
                                f"{self.max_queue} requests are already waiting for "
                                f"'{key[0]}'" + (f" (profile '{key[1]}')" if key[1] else ""),
                                retry_after=1)
        timeout = body.get("timeout") or self.queue_timeout
        if timeout:
            job.deadline = job.enqueued_at + float(timeout)
        fanout = int(body.get("fanout") or 1)
        if fanout > 1 and job.parent not in self.units:
            self.units[job.parent] = [fanout - 1, time.monotonic()]
        self.queue.push(job)
        self._send_frontend(fe_id, P.ACCEPTED, request_id)
        self.dispatch()

    def _admit_unit(self, job: Job) -> bool:
        """True for a later job of a request whose first job was admitted: a request's
        prompts × choices are admitted (or refused) as one unit, never half of them."""
        unit = self.units.get(job.parent)
        if unit is None:
            return False
        unit[0] -= 1
        if unit[0] <= 0:
            del self.units[job.parent]
        return True

    def _supersede(self, job: Job) -> None:
        """A new request of a session (X-Session-Id) ends the session's older ones,
        queued or running: an editor sends one per keystroke and wants only the last."""
        session, parent = job.body["session"], job.body.get("parent")
        older = self.sessions.setdefault(session, {})
        for request_id, old in list(older.items()):
            if old.body.get("parent") == parent:
                continue                     # a sibling (n > 1, batch): same request
            del older[request_id]
            self.stats["superseded"] += 1
            self._send_frontend(old.frontend, P.FAILED, request_id, {
                "status": 409, "type": "invalid_request_error", "code": "superseded",
                "message": "superseded by a newer request of the same session"})
            if self.queue.remove(request_id) is None and old.worker is not None:
                self._send_worker(old.worker, P.CANCEL, request_id)
        older[job.request_id] = job

    def _forget(self, job: Job) -> None:
        session = job.body.get("session")
        if session and session in self.sessions:
            self.sessions[session].pop(job.request_id, None)
            if not self.sessions[session]:
                del self.sessions[session]

    def _run_op(self, job: Job) -> None:
        """Tokenize/detokenize: no queue, no slot; the least busy fitting worker."""
        worker = self.registry.pick(job.body)
        self._send_frontend(job.frontend, P.ACCEPTED, job.request_id)
        body = {**job.body, "topic": job.frontend.decode(), "attempt": job.attempt}
        if worker is None or not self._send_worker(worker.identity, P.REQUEST,
                                                   job.request_id, body):
            self._send_frontend(job.frontend, P.FAILED, job.request_id, {
                "status": 503, "type": "server_error", "code": "no_worker_ready",
                "message": "no worker could take the request"})
            return
        job.worker = worker.identity
        worker.ops[job.request_id] = job

    def expected_workers(self) -> int:
        children = self.supervisor.children.values() if self.supervisor else []
        return sum(1 for child in children if child.kind == "worker")

    def _reject(self, fe_id: bytes, request_id: str, status: int, type_: str, code: str,
                message: str, retry_after: int | None = None, param: str | None = None
                ) -> None:
        self.stats["rejected"] += 1
        body = {"status": status, "type": type_, "code": code, "message": message,
                "param": param}
        if retry_after:
            body["retry_after"] = retry_after
        self._send_frontend(fe_id, P.REJECTED, request_id, body)

    def cancel(self, request_id: str) -> None:
        job = self.queue.remove(request_id)
        if job is not None:
            self.stats["cancelled"] += 1
            self._forget(job)
            return
        for record in self.registry.workers.values():
            if request_id in record.running or request_id in record.ops:
                self._send_worker(record.identity, P.CANCEL, request_id)
                return

    def frontend_lost(self, fe_id: bytes) -> None:
        """A front end stopped heartbeating: its clients are gone with it."""
        self.frontends.pop(fe_id, None)
        for job in list(self.queue):
            if job.frontend == fe_id:
                self.cancel(job.request_id)
        for record in self.registry.workers.values():
            for job in list(record.running.values()):
                if job.frontend == fe_id:
                    self._send_worker(record.identity, P.CANCEL, job.request_id)
        log.warning("front end %s stopped heartbeating", fe_id.decode(errors="replace"))

    # -- workers -----------------------------------------------------------------------
    def process_worker(self, frames: list[bytes]) -> None:
        identity, frames = frames[0], frames[1:]
        try:
            msg = P.decode(frames)
        except P.ProtocolError as exc:
            log.warning("bad message from worker %r: %s", identity, exc)
            return
        now = time.monotonic()
        record = self.registry.get(identity)
        if msg.cmd == P.READY:
            if record is not None:
                self.worker_lost(record, "re-registered")
            if not isinstance(msg.body.get("model"), str):
                log.warning("worker %r sent READY without a model", identity)
                return
            record = self.registry.add(identity, msg.body, now)
            if self.supervisor is not None:
                self.supervisor.mark_healthy(record.name)
            log.info("worker %s ready: %s on %s, pid %s, n_ctx %s, %s slot(s)", record.name,
                     record.model, msg.body.get("device"), msg.body.get("pid"),
                     msg.body.get("n_ctx"), record.slots)
            self.broadcast_state()
            return
        if record is None:
            # A worker we do not know (we restarted, or expired it): make it register again.
            self._send_worker(identity, P.DISCONNECT)
            return
        record.refresh(now)
        if msg.cmd == P.HEARTBEAT:
            pass
        elif msg.cmd == P.STARTED:
            job = record.running.get(msg.request_id)
            if job is not None and int(msg.body.get("attempt", 1)) == job.attempt:
                job.started = True
        elif msg.cmd == P.FIRST:
            job = record.running.get(msg.request_id)
            if job is not None:
                job.started = job.first_token = True
        elif msg.cmd == P.DONE:
            self.job_done(record, msg.request_id, msg.body)
        elif msg.cmd == P.DISCONNECT:
            self.worker_lost(record, "disconnected")
        else:
            log.warning("unknown command %r from worker %s", msg.cmd, record.name)

    def job_done(self, record: WorkerRecord, request_id: str, body: dict) -> None:
        job = record.running.get(request_id) or record.ops.get(request_id)
        if job is None or int(body.get("attempt", 1)) != job.attempt:
            return
        record.running.pop(request_id, None)
        record.ops.pop(request_id, None)
        if body.get("released"):          # a stopping worker handed it back unstarted
            self._requeue(job)
            return
        self._forget(job)
        usage = body.get("usage") or {}
        record.tokens += int(usage.get("completion_tokens", 0))
        if body.get("cancelled"):
            record.cancelled += 1
            self.stats["cancelled"] += 1
        else:
            record.completed += 1
            self.stats["completed"] += 1
        record.last_done = {"id": request_id, **body}
        record.history.append((time.monotonic(), int(usage.get("completion_tokens", 0))))
        self.metrics.job_done(record.name, str(record.info.get("device")), body)
        self._send_frontend(job.frontend, P.FINISHED, request_id,
                            {"attempt": job.attempt, "last_seq": body.get("last_seq")})

    def _requeue(self, job: Job) -> None:
        job.worker, job.started, job.first_token = None, False, False
        job.attempt += 1
        self.stats["requeued"] += 1
        self.queue.push(job, front=True)

    def worker_lost(self, record: WorkerRecord, reason: str) -> None:
        """Drop a worker; requeue its jobs that had not started (they cannot be what
        killed it), fail the others: a request that was being prefilled or generated when
        its worker died is never handed to a second worker to kill."""
        self.registry.remove(record.identity)
        log.error("worker %s lost (%s) with %d request(s)", record.name, reason,
                  len(record.running))
        self.metrics.worker_lost(record.name, str(record.info.get("device")),
                                 len(record.running) + len(record.ops))
        for job in record.running.values():
            job.worker = None
            if not job.started and job.attempt < MAX_ATTEMPTS:
                self._requeue(job)
            else:
                self.stats["failed"] += 1
                self._forget(job)
                self._send_frontend(job.frontend, P.FAILED, job.request_id, {
                    "status": 503, "type": "server_error", "code": "worker_lost",
                    "message": f"the worker serving this request was lost ({reason})"})
        for job in record.ops.values():
            self._send_frontend(job.frontend, P.FAILED, job.request_id, {
                "status": 503, "type": "server_error", "code": "worker_lost",
                "message": f"the worker serving this request was lost ({reason})"})
        record.running.clear()
        record.ops.clear()
        self.broadcast_state()

    def dispatch(self) -> None:
        """Hand queued jobs, oldest first, to the worker the registry chooses for each
        (cache affinity, then load); a job no free worker fits waits without blocking
        the jobs behind it."""
        if not len(self.queue) or not self.registry.with_free_slots():
            return
        running: dict[str, int] = {}
        for record in self.registry.workers.values():
            for job in record.running.values():
                running[job.parent] = running.get(job.parent, 0) + 1
        for job in self.queue.in_fair_order(running):
            worker = self.registry.choose(job)
            if worker is None:
                continue
            self.queue.take(job)
            body = {**job.body, "topic": job.frontend.decode(), "attempt": job.attempt}
            if not self._send_worker(worker.identity, P.REQUEST, job.request_id, body):
                self.queue.push(job, front=True)
                self.worker_lost(worker, "unreachable")
                continue
            job.worker = worker.identity
            worker.running[job.request_id] = job
            worker.last_assigned = time.monotonic()
            worker.remember(job)
            if not self.registry.with_free_slots():
                return

    def _expire_deadlines(self, now: float) -> None:
        """Queued requests past their deadline get a 504 before they take a slot."""
        for job in self.queue.past_deadline(now):
            self.stats["timed_out"] += 1
            self._forget(job)
            waited = now - job.enqueued_at
            self._reject(job.frontend, job.request_id, 504, "server_error", "queue_timeout",
                         f"waited {waited:.1f}s in the queue, past the request's deadline")

    def _expire_unservable(self, now: float) -> None:
        for job in self.queue.expire(now - NO_WORKER_TIMEOUT, self.registry.infos()):
            self._forget(job)
            self._reject(job.frontend, job.request_id, 503, "server_error", "no_worker_ready",
                         f"no worker for '{job.model}' became ready in {NO_WORKER_TIMEOUT:.0f}s",
                         retry_after=config.RETRY_AFTER_SECONDS)

    # -- state -------------------------------------------------------------------------
    def models(self) -> dict[str, dict]:
        configured = None
        if self.supervisor is not None:          # what the workers are set to load now
            configured = {c.extra.get("model") for c in self.supervisor.children.values()
                          if c.kind == "worker"}
        models = {m: {"ready": 0, "n_ctx": info.get("n_ctx", 0), "slots": 0, "fim": False}
                  for m, info in self.known_models.items()
                  if configured is None or m in configured}
        models.update(self.registry.models())
        for info in models.values():
            info["created"] = int(self.started)
        return models

    def state(self) -> dict:
        capabilities = ("model", "n_ctx", "compute", "n_gpu_layers", "profile", "fim")
        return {"workers_ready": len(self.registry), "models": self.models(),
                "queued": len(self.queue), "expected_workers": self.expected_workers(),
                "draining": self.draining_until is not None,
                "workers": [{k: info.get(k) for k in capabilities}
                            for info in self.registry.infos()]}

    def broadcast_state(self) -> None:
        state = self.state()
        for fe_id in list(self.frontends):
            self._send_frontend(fe_id, P.STATE, body=state)

    def status(self) -> dict:
        now = time.monotonic()
        children = self.supervisor.children if self.supervisor else {}
        workers = []
        for name, child in children.items():
            if child.kind == "worker" and name.encode() not in self.registry:
                state = "failed" if child.gave_up else \
                    "starting" if child.process else "restarting"
                workers.append({"name": name, "state": state, "restarts": child.restarts,
                                "pid": child.pid, "device": child.extra.get("device"),
                                "model": child.extra.get("model")})
        for record in self.registry.workers.values():
            child = children.get(record.name)
            state = ("draining" if record.running else "drained") if record.draining \
                else "busy" if record.running else "idle"
            workers.append({
                "name": record.name, "state": state,
                "tokens_per_s": tokens_per_second(record.history, now),
                "device": record.info.get("device"), "model": record.model,
                "pid": record.info.get("pid"), "n_ctx": record.info.get("n_ctx"),
                "slots": record.slots, "busy_slots": len(record.running),
                "running": sorted(record.running),
                "started": sorted(i for i, j in record.running.items() if j.started),
                "generating": sorted(i for i, j in record.running.items() if j.first_token),
                "completed": record.completed,
                "cancelled": record.cancelled, "tokens": record.tokens,
                "uptime_s": round(now - record.ready_at, 1),
                "restarts": child.restarts if child else 0,
                "placement": record.info.get("placement"), "last_done": record.last_done})
        return {"workers": sorted(workers, key=lambda w: w["name"]),
                "queue": self.queue.depth_by_model(), "stats": dict(self.stats),
                "frontends": [{"id": k.decode(errors="replace"), "open": v.get("open"),
                               "served": v.get("served"), "pid": v.get("pid")}
                              for k, v in self.frontends.items()]}

    def process_control(self, frames: list[bytes]) -> None:
        identity, request = frames[0], frames[-1]
        try:
            body = json.loads(request)
            reply = self.ops.handle(body) if isinstance(body, dict) else \
                {"error": "a request is a JSON object"}
        except ValueError:
            reply = {"error": "a request is a JSON object"}
        self.control.send_multipart([identity, b"", P.encode_json(reply)])

    def close(self) -> None:
        try:
            self._proxy_control.send(b"TERMINATE")
        except zmq.ZMQError:
            pass
        self._proxy_thread.join(timeout=2)
        for sock in (self.frontend, self.backend, self.control, self._proxy_control):
            sock.close(0)
        self.context.term()
