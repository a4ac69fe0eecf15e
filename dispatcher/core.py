"""The dispatcher's core: every decision, no sockets, no processes, no clock of its own.

Messages go in (`frontend_message`, `worker_message`, `worker_exited`, `send_failed`),
time goes in (`tick(now)`), and each call returns the messages to send (`Send`). The
broker (`dispatcher.broker`) owns the sockets and the poll loop and only carries these
messages; the tests drive the core directly with messages and a fake clock.

What it decides: admission (the queue's bound, counted per request; draining; unknown
models; routes no worker can meet), superseding by session, dispatch (fair order,
routing), heartbeats by expiry (workers and front ends), worker loss (requeue what had
not started, fail the rest), deadlines, and when a graceful stop is complete. What a
refused or failed request is told (status, code, message) is `dispatcher.refusals`.
"""
from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass
from typing import Protocol

import msgspec

from dispatcher.common import config, protocol as P
from dispatcher.common.fit import fits
from dispatcher import refusals
from dispatcher.admission import InferredSessions, ServedRequests, Sessions, Units
from dispatcher.dispatch_pass import DispatchPass
from dispatcher.metrics import SystemMetrics
from dispatcher.queues import QueuedJob, RequestQueue, WorkerRecord, WorkerRegistry
from dispatcher.shares import Shares

log = logging.getLogger("dispatcher.broker")
# A queued job whose model has had no ready worker for this long is turned away.
NO_WORKER_TIMEOUT = 30.0
UNSERVABLE_CHECK = 1.0      # s between looks for queued jobs no worker can run (each
                            # looks at every queued job against every worker)
# A job that never started is requeued when its worker is lost, up to this many attempts.
MAX_ATTEMPTS = 3
# A job on a worker that crashed before it said the job started is requeued, and goes
# to a worker where no other such job waits to start; when that one crashes too before
# it started, it is failed: it may be what crashed them (a job's STARTED travels behind
# its prefill's first step, and a crash there is never said), and a third worker, with
# every request running on it, is not risked on it. (Jobs unstarted beside it there
# count one crash, as it did at its first.)
MAX_CRASHES = 2
# Requests a choice of which was served are remembered this long (this many at most): a
# later choice of theirs is not timed out in the queue (a finished first choice freed
# its slot for another key's turn, and the next tick 504'd the rest)
SERVED_FOR = 3600.0
SERVED_MEMORY = 10_000


@dataclass(frozen=True)
class Send:
    """One message for the broker to send: to a front end or a worker, by identity."""
    to: str                     # "frontend" or "worker"
    peer: bytes
    cmd: bytes
    request_id: str = ""
    body: object = None         # a protocol struct (protocol.BODIES), or None

    def __repr__(self) -> str:
        return (f"Send({self.to} {self.peer.decode(errors='replace')} "
                f"{P.command_name(self.cmd)} {self.request_id})")


class Fleet(Protocol):
    """What the core needs to know of the processes a launcher started (none for a
    dispatcher run alone)."""

    def expected_workers(self, coming: bool = False) -> int: ...

    def configured_models(self) -> set[str] | None: ...

    def loading_models(self) -> set[str]: ...


class NoFleet:
    def expected_workers(self, coming: bool = False) -> int:
        return 0

    def configured_models(self) -> set[str] | None:
        return None

    def loading_models(self) -> set[str]:
        return set()


class DispatcherCore:
    def __init__(self, fleet: Fleet | None = None, known_models: dict | None = None,
                 max_queue: int = 64, queue_timeout: float = 0.0, started: float = 0.0,
                 heartbeat: config.Heartbeat = config.Heartbeat(),
                 max_queue_per_key: int = 0, infer_sessions: bool = True,
                 key_slot_share: float = 1.0):
        self.fleet = fleet or NoFleet()
        # each key's and each request's share of the slots and the queue (shares.py)
        self.shares = Shares(key_slot_share, max_queue_per_key)
        self.known_models = dict(known_models or {})
        self.max_queue = max_queue
        self.queue_timeout = queue_timeout
        self.started = started                     # wall clock, for `created`
        self.epoch = secrets.token_hex(6)          # this run: front ends see a restart
        self.queue = RequestQueue()
        self.heartbeat = heartbeat
        self.registry = WorkerRegistry(heartbeat.expiry)
        self.frontends: dict[bytes, dict] = {}     # id -> {"seen": t, "pid": ...}
        self.sessions = Sessions()                 # superseding by X-Session-Id
        # ... and by sessions inferred for FIM requests without one (None: off)
        self.inferred = InferredSessions() if infer_sessions else None
        self.units = Units()                       # requests admitted job by job
        self.stats = {"submitted": 0, "rejected": 0, "requeued": 0, "failed": 0,
                      "completed": 0, "cancelled": 0, "superseded": 0, "queue_full": 0,
                      "timed_out": 0, "adopted": 0, "frontend_undelivered": 0,
                      "frontend_resent": 0, "loop_faults": 0}
        self.metrics = SystemMetrics()
        # worker name -> {reason, code, at}: why it was last lost (status shows it)
        self.losses: dict[str, dict] = {}
        self.silent: list[tuple[str, int | None]] = []    # (name, pid) dropped as silent
        # names the operator drained (ops: drain) until resumed: a worker registering
        # again under one (respawned, reconnected) stays drained
        self.paused: set[str] = set()
        self.draining_until: float | None = None
        self.stopped = False                       # a graceful stop is complete
        self.now = 0.0
        self._next_heartbeat = 0.0
        self._next_unservable_check = 0.0
        self.served_parents = ServedRequests(SERVED_FOR, SERVED_MEMORY)
        self._undelivered_said = -60.0
        self._dispatch_fault_said = -60.0     # when a dispatch fault's trace was last logged
        self._out: list[Send] = []

    # -- plumbing ----------------------------------------------------------------------
    def pending(self) -> list[Send]:
        """What changes made outside a message (operations: resume) have to send."""
        return self._take()

    def _take(self) -> list[Send]:
        out, self._out = self._out, []
        return out

    def _to_frontend(self, fe_id: bytes, cmd: bytes, request_id: str = "",
                     body=None) -> None:
        self._out.append(Send("frontend", fe_id, cmd, request_id, body))

    def _to_worker(self, identity: bytes, cmd: bytes, request_id: str = "",
                   body=None) -> None:
        self._out.append(Send("worker", identity, cmd, request_id, body))

    def _reject(self, fe_id: bytes, request_id: str, error: P.WireError) -> None:
        self.stats["rejected"] += 1
        self._to_frontend(fe_id, P.REJECTED, request_id, error)

    def _fail(self, job: QueuedJob, error: P.WireError) -> None:
        self._to_frontend(job.frontend, P.FAILED, job.request_id, error)

    # -- time --------------------------------------------------------------------------
    def tick(self, now: float) -> list[Send]:
        """Expiry of workers, front ends, deadlines and admissions; heartbeats; dispatch;
        whether a graceful stop is complete."""
        self.now = now
        self.expire_workers(now)
        self.expire_frontends(now)
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self.heartbeat.interval
            for identity in list(self.registry.workers):
                self._to_worker(identity, P.HEARTBEAT)
        if now >= self._next_unservable_check:
            self._next_unservable_check = now + UNSERVABLE_CHECK
            self.expire_unservable(now)
        self.expire_deadlines(now)
        self.units.expire(now)
        self.sessions.expire(now)
        self.dispatch()
        if self.draining_until is not None and (
                now >= self.draining_until or not (len(self.queue) or self.in_flight())):
            if now < self.draining_until:
                log.info("drained")
            else:
                log.info("grace period over with %d requests in flight and %d queued",
                         self.in_flight(), len(self.queue))
                self._end_at_grace()
            self.stopped = True
        return self._take()

    def _end_at_grace(self) -> None:
        """--stop-grace is over: every request still queued or running gets its answer
        now, a 503 `shutting_down` (a stream that started: an error event), and the
        workers drop the running ones; left alone, they waited on a dispatcher that had
        stopped reading until the front ends lost it (a cut connection, or a late 503)."""
        for job in self.queue:
            self.queue.remove(job.request_id)
            self._forget(job)
            self._reject(job.frontend, job.request_id, refusals.shutting_down())
        for record in self.registry.workers.values():
            for jobs in (record.running, record.ops):
                for job in list(jobs.values()):
                    if not job.cancelled:        # (a superseded one was told already)
                        self._fail(job, refusals.shutting_down(running=True))
                    job.cancelled = True         # (nor requeued, if its worker is lost)
                    self._to_worker(record.identity, P.CANCEL, job.request_id)

    def expire_workers(self, now: float) -> None:
        for record in self.registry.expired(now):
            self.worker_lost(record, "stopped answering heartbeats", silent=True)
            self._to_worker(record.identity, P.DISCONNECT)
            # a process frozen whole (its IO thread too): the launcher ends it, if its own
            self.silent.append((record.name, record.info.pid))

    def expire_frontends(self, now: float) -> None:
        for fe_id, info in list(self.frontends.items()):
            if info["seen"] < now - self.heartbeat.expiry:
                self.frontend_lost(fe_id)

    def expire_deadlines(self, now: float) -> None:
        """Queued requests past their deadline get a 504 before they take a slot (a
        request with a choice running has started: its other choices wait their turn)."""
        started = {job.parent for record in self.registry.workers.values()
                   for job in record.running.values()}
        started |= {job.parent for job in self.queue if job.parent in self.served_parents}
        for job in self.queue.past_deadline(now, started):
            self.stats["timed_out"] += 1
            self._forget(job)
            waited = now - job.enqueued_at
            self._reject(job.frontend, job.request_id, refusals.queue_timeout(waited))

    def expire_unservable(self, now: float) -> None:
        """Queued jobs no worker could take for NO_WORKER_TIMEOUT s: none registered that
        meets them, or only ones the operator drained (else they waited for a `resume`
        that may never come, and the queue filled). Not while a worker of their model is
        loading it (a restart, a reload, a respawn: the fleet says for how long that can
        take, from the load it measured)."""
        takers, held = self.registry.infos_by_pause(self.paused)
        loading = self.fleet.loading_models()
        for job in self.queue.expire(now, NO_WORKER_TIMEOUT, takers, loading):
            self._forget(job)
            paused = any(fits(job.model, job.body.route, info) for info in held)
            self._reject(job.frontend, job.request_id, refusals.no_worker_became_ready(
                job.model, NO_WORKER_TIMEOUT, paused))

    def drain(self, grace: float, now: float) -> list[Send]:
        """Stop admitting work (503) and stop once in-flight work is done or `grace`
        seconds have passed."""
        if self.draining_until is None:
            self.draining_until = now + grace
            log.info("draining: no new requests; waiting up to %.0fs for %d running and "
                     "%d queued", grace, self.in_flight(), len(self.queue))
            self.broadcast_state()
        return self._take()

    def in_flight(self) -> int:
        return sum(len(w.running) + len(w.ops) for w in self.registry.workers.values())

    # -- front ends: admission, superseding, cancel ----------------------------------
    def submit(self, fe_id: bytes, request_id: str, body: P.SubmittedJob) -> None:
        # the id its prompt fields go by: the first job of its prompt (fan-outs only)
        share_key = body.same_as or (request_id if body.fanout > 1 else None)
        body = self.units.fill(request_id, body)
        refusal = refusals.admission(
            request_id, body, self.models(), self.registry.infos(),
            draining=self.draining_until is not None,
            short_of_workers=len(self.registry) < self.fleet.expected_workers(coming=True))
        if refusal is not None:
            return self._reject(fe_id, request_id, refusal)
        self.stats["submitted"] += 1
        job = QueuedJob(request_id, fe_id, body, enqueued_at=self.now, share_key=share_key)
        if body.op:
            return self._run_op(job)
        lane = self.queue.lane(job)
        later = self.units.later_job(job.parent)
        # (refused before it supersedes anything; the places of the queued requests it
        # would end count as free: an editor's newest keystroke is never refused for the
        # one it replaces, which would then run in its stead)
        inferred = self.inferred.peek(body, self.now) \
            if body.session is None and self.inferred is not None else None
        preview = job if inferred is None else QueuedJob(
            request_id, fe_id, msgspec.structs.replace(body, session=inferred))
        ending = {old.body.parent: old.body.api_key for old in (
            self.sessions.would_end(preview, self.now) if preview.body.session else ())
            if old.worker is None and self.queue.lane(old) == lane}
        if not later and body.api_key is not None and self.shares.key_queue_full(
                self.queue.depth_of_api_key(lane, body.api_key) -
                sum(key == body.api_key for key in ending.values())):
            self.stats["queue_full"] += 1           # this key's share; others still admitted
            return self._reject(fe_id, request_id, refusals.key_queue_full(
                self.shares.max_queue_per_key, self.max_queue, lane))
        if not later and self.queue.depth(lane) - len(ending) >= self.max_queue:
            self.stats["queue_full"] += 1
            return self._reject(fe_id, request_id, refusals.queue_full(self.max_queue, lane))
        if body.session is None and self.inferred is not None:
            session = self.inferred.session_for(body, self.now)   # an editor's keystroke
            if session is not None:
                body = job.body = msgspec.structs.replace(body, session=session)
        if body.session and not self._supersede(job):
            return self._reject(fe_id, request_id, refusals.superseded(by_newer_first=True))
        timeout = body.timeout or self.queue_timeout
        if timeout:         # (a hand-over's too: queued again if its worker is lost first)
            job.deadline = job.enqueued_at + float(timeout)
        if job.adopt_from is not None:
            return self._hand_over(job)
        self.units.admitted(job, self.now, later)
        self.queue.push(job)
        self._to_frontend(fe_id, P.ACCEPTED, request_id)
        self.dispatch()

    def _supersede(self, job: QueuedJob) -> bool:
        """A request of a session (X-Session-Id) ends the session's requests the client
        sent before it, queued or running: an editor sends one per keystroke and wants
        only the last (admission.Sessions keeps the order). False: the client sent a newer
        one first, so this one is superseded itself, whether that newer one is still open
        or already done."""
        accepted, older = self.sessions.arrives(job, self.now)
        if not accepted:
            self.stats["superseded"] += 1
            return False
        for old in older:
            self.stats["superseded"] += 1
            self._fail(old, refusals.superseded(by_newer_first=False))
            if self.queue.remove(old.request_id) is None and old.worker is not None \
                    and not old.cancelled:        # (a cancelled one's worker has it gone)
                old.cancelled = True
                key, record = job.body.adopt_key, self.registry.get(old.worker)
                if key and job.adopt_from is None and old.body.adopt_key == key \
                        and record is not None and not record.draining:
                    job.adopt_from = old     # its worker decides: adopt, or cancel it
                else:
                    self._to_worker(old.worker, P.CANCEL, old.request_id)
        return True

    def _hand_over(self, job: QueuedJob) -> None:
        """Type-along adoption: the new request goes straight to the worker running the
        one it supersedes, marked `adopt`. If the user typed what that generation had
        produced, the worker hands the running generation to the new request (no
        prefill, no lost tokens); otherwise it cancels the old one and runs the new one
        in the freed slot, its prompt mostly cached."""
        old, job.adopt_from = job.adopt_from, None
        self._to_frontend(job.frontend, P.ACCEPTED, job.request_id)
        self._assign(job, self.registry.get(old.worker), adopt=old.request_id)

    def _forget(self, job: QueuedJob) -> None:
        self.sessions.forget(job)

    def _run_op(self, job: QueuedJob) -> None:
        """Tokenize/detokenize: no queue, no slot; the least busy fitting worker."""
        # (with several keys, one key's at most half of a worker's: another key's
        # /tokenize was refused, or waited behind four 1 MiB texts of the first's)
        key_ops = config.MAX_OPS_PER_WORKER // 2 if self.shares.key_slot_share < 1.0 \
            and job.body.api_key is not None else None
        worker = self.registry.pick(job.body, config.MAX_OPS_PER_WORKER, key_ops)
        if worker is None and self.registry.pick(job.body) is not None:
            return self._reject(job.frontend, job.request_id, refusals.tokenizer_busy(
                self.registry.pick(job.body, config.MAX_OPS_PER_WORKER) is not None))
        self._to_frontend(job.frontend, P.ACCEPTED, job.request_id)
        if worker is None:
            return self._fail(job, refusals.no_worker_took())
        self._to_worker(worker.identity, P.REQUEST, job.request_id, job.for_worker())
        job.worker = worker.identity
        worker.ops[job.request_id] = job

    def cancel(self, request_id: str) -> None:
        job = self.queue.remove(request_id)
        if job is not None:
            self.stats["cancelled"] += 1
            self._forget(job)
            return
        for record in self.registry.workers.values():
            if request_id in record.running or request_id in record.ops:
                job = record.running.get(request_id) or record.ops.get(request_id)
                job.cancelled = True
                self._to_worker(record.identity, P.CANCEL, request_id)
                self.dispatch()             # its slot is as good as free (WorkerRecord.busy)
                return

    def unheld(self, request_ids: list[str]) -> list[str]:
        """Of a front end's quiet requests, those neither queued nor on a worker here:
        over (or never known), so their end was lost on the way (a FINISHED or FAILED
        dropped with the worker's last event, for a front end far behind), and their
        streams waited, kept open by the front end's heartbeats, until their clients
        left."""
        held = {job.request_id for job in self.queue}
        for record in self.registry.workers.values():
            held.update(record.running)
            held.update(record.ops)
        return [r for r in request_ids[:P.MAX_QUIET] if r not in held]

    def abandon(self, request_id: str) -> list[Send]:
        """A job whose handling failed midway (the broker's `_handler_failed`): whatever
        of it was queued or sent to a worker is cancelled, so it runs for nobody."""
        self.cancel(request_id)
        return self._take()

    def frontend_lost(self, fe_id: bytes) -> None:
        """A front end stopped heartbeating: its clients are gone with it."""
        self.frontends.pop(fe_id, None)
        for job in list(self.queue):
            if job.frontend == fe_id:
                self.cancel(job.request_id)     # (told: a front end that only stalled
                self._reject(fe_id, job.request_id, refusals.frontend_silent())  # waits)
        for record in self.registry.workers.values():
            for job in list(record.running.values()):
                if job.frontend == fe_id:
                    if not job.cancelled:      # (one superseded or cancelled was told)
                        self._fail(job, refusals.frontend_silent(running=True))
                    job.cancelled = True
                    self._to_worker(record.identity, P.CANCEL, job.request_id)
        self.dispatch()
        log.warning("front end %s stopped heartbeating", fe_id.decode(errors="replace"))

    def frontend_message(self, fe_id: bytes, msg: P.Message, now: float,
                         wall: float = 0.0) -> list[Send]:
        self.now = now
        info = self.frontends.setdefault(fe_id, {"since": wall})
        info["seen"] = now
        if msg.cmd == P.PING:
            if msg.body.metrics:
                self.metrics.absorb(msg.body.metrics)
            info.update(open=msg.body.open, pid=msg.body.pid, served=msg.body.served)
            state = self.state()
            if msg.body.quiet:
                state.unheld = self.unheld(msg.body.quiet)
            self._to_frontend(fe_id, P.STATE, body=state)
        elif msg.cmd == P.SUBMIT:
            self.submit(fe_id, msg.request_id, msg.body)
        elif msg.cmd == P.CANCEL:
            self.cancel(msg.request_id)
        elif msg.cmd != P.METRICS:                 # METRICS: answered by the broker
            log.warning("unknown command %s from front end %r", P.command_name(msg.cmd),
                        fe_id)
        return self._take()

    # -- workers -----------------------------------------------------------------------
    def worker_message(self, identity: bytes, msg: P.Message, now: float) -> list[Send]:
        self.now = now
        record = self.registry.get(identity)
        if msg.cmd == P.READY:
            if record is not None:
                self._reregistered(record)
            refusal = self.registry.refusal(identity, msg.body)
            if refusal:
                log.error("worker %s refused: %s", identity.decode(errors="replace"), refusal)
                self._to_worker(identity, P.DISCONNECT,
                                body=P.Disconnect(reason=refusal, code=P.REFUSED))
                return self._take()
            record = self.registry.add(identity, msg.body, now)
            if record.name in self.paused:
                record.draining = True
            self.metrics.worker_ready(record.name)
            log.info("worker %s ready: %s on %s, pid %s, n_ctx %s, %s slot(s)", record.name,
                     record.model, msg.body.device, msg.body.pid, msg.body.n_ctx,
                     record.slots)
            self.broadcast_state()
            self.dispatch()
            return self._take()
        if record is None:
            # A worker we do not know (we restarted, or expired it): make it register again.
            self._to_worker(identity, P.DISCONNECT)
            return self._take()
        record.refresh(now, self.heartbeat.expiry)
        if msg.cmd == P.STARTED:
            job = record.running.get(msg.request_id)
            if job is not None and msg.body.attempt == job.attempt:
                job.started = True
        elif msg.cmd == P.FIRST:
            job = record.running.get(msg.request_id)
            if job is not None and msg.body.attempt == job.attempt:
                job.started = job.first_token = True
                if job.share_key is not None:
                    self.dispatch()          # its prompt's other choices may spread now
        elif msg.cmd == P.DONE:
            self.job_done(record, msg.request_id, msg.body)
        elif msg.cmd == P.DISCONNECT and msg.body.code == P.STOPPED and not record.running \
                and not record.ops:
            self.registry.remove(record.identity)      # it stopped as asked, nothing lost
            self.metrics.worker_lost(record.name, record.info.device, 0)
            log.info("worker %s stopped", record.name)
            self.broadcast_state()
        elif msg.cmd == P.DISCONNECT:
            # (stuck: a step that never returned, maybe an unstarted job's first prefill
            # step, which its STARTED travels behind: counted as a crash, MAX_CRASHES)
            self.worker_lost(record, msg.body.reason or "disconnected", code=msg.body.code,
                             crashed=msg.body.code == "worker_stuck")
            self.dispatch()             # (its requeued jobs to another worker now)
        elif msg.cmd == P.HEARTBEAT:
            record.heartbeats += 1
            if msg.body is not None and msg.body.steps is not None:
                record.steps = msg.body.steps
            if msg.body is not None and msg.body.leaving and not record.draining:
                record.draining = True    # stopped by SIGTERM: it finishes what it runs
                log.info("worker %s is stopping: it finishes its %d running request(s) and "
                         "takes no more", record.name, len(record.running))
        else:
            log.warning("unknown command %s from worker %s", P.command_name(msg.cmd),
                        record.name)
        return self._take()

    def _reregistered(self, record: WorkerRecord) -> None:
        """A known worker says READY again: it reconnected, and dropped what its old
        connection had been handed. What it was handed since, before this READY was read
        (its identity is its name), would run there for nobody: the jobs are requeued
        or failed as any lost worker's, and those attempts cancelled there (the next
        attempt may come to the same worker: it is not cancelled, P.CancelUpTo)."""
        held = [(job.request_id, job.attempt)
                for job in (*record.running.values(), *record.ops.values())]
        self.worker_lost(record, "re-registered")
        for request_id, attempt in held:
            self._to_worker(record.identity, P.CANCEL, request_id,
                            P.CancelUpTo(attempt=attempt))

    def job_done(self, record: WorkerRecord, request_id: str, body: P.Done) -> None:
        job = record.running.get(request_id) or record.ops.get(request_id)
        if job is None or body.attempt != job.attempt:
            return
        record.running.pop(request_id, None)
        record.ops.pop(request_id, None)
        if body.unshared:          # the worker lacked the prompt it was named by
            record.shared_sent.clear()    # ... so it is sent whole from now on
            if job.cancelled:             # (nobody waits for it any more)
                self._forget(job)
                return
            job.attempt -= 1              # (not a new attempt: it never ran)
            self._requeue(job)
            self.dispatch()
            return
        if body.released:          # a stopping worker handed it back unstarted
            record.draining = True        # ... and takes nothing more
            if job.cancelled:
                self._forget(job)
            else:
                job.handed_back += 1      # (not a try that failed: MAX_ATTEMPTS)
                self._requeue(job)
                self.dispatch()
            return
        self._forget(job)
        tokens = body.usage.completion_tokens if body.usage else 0
        record.tokens += tokens
        if body.adopted_by:
            self.stats["adopted"] += 1
        if body.cancelled:
            record.cancelled += 1
            self.stats["cancelled"] += 1
        else:
            record.completed += 1
            self.stats["completed"] += 1
        record.last_done = {"id": request_id, **P.to_dict(body)}
        record.history.append((self.now, tokens))
        self.metrics.job_done(record.name, record.info.device, body)
        self._to_frontend(job.frontend, P.FINISHED, request_id,
                          P.Finished(attempt=job.attempt, last_seq=body.last_seq))
        self.dispatch()

    def worker_exited(self, name: str, pid: int, reason: str,
                      code: str | None = None, crashed: bool = False) -> list[Send]:
        """The launcher saw a worker's process exit (`crashed`: by a signal or an error,
        not a stop: its unstarted jobs count the crash, MAX_CRASHES)."""
        record = self.registry.get(name.encode())
        if record is not None and record.info.pid == pid:
            self.worker_lost(record, reason, code, crashed=crashed)
            self.dispatch()
        return self._take()

    def send_failed(self, send: Send, gone: bool = True) -> list[Send]:
        """The broker could not deliver `send`: the peer is `gone` (its connection closed:
        EHOSTUNREACH), or not keeping up (its pipe full: EAGAIN)."""
        if send.to == "worker":
            record = self.registry.get(send.peer)
            if record is not None:
                # (gone without a word: a crash, whose exit the launcher reaps after this,
                # when the record is gone; counted here, MAX_CRASHES)
                self.worker_lost(record, "unreachable" if gone else "not keeping up",
                                 crashed=gone)
                self.dispatch()
        elif send.cmd in (P.REJECTED, P.FAILED, P.ACCEPTED, P.FINISHED):
            # a front end gone (its requests with it) or not keeping up (1,000 messages
            # behind): counted and said, at most once a minute
            self.stats["frontend_undelivered"] += 1
            if self.now - self._undelivered_said >= 60.0:
                self._undelivered_said = self.now
                log.warning("could not deliver %s for %s to front end %s (gone, or not "
                            "keeping up); %d so far", P.command_name(send.cmd),
                            send.request_id, send.peer.decode(errors="replace"),
                            self.stats["frontend_undelivered"])
        return self._take()

    def _requeue(self, job: QueuedJob) -> None:
        job.worker, job.started, job.first_token = None, False, False
        job.attempt += 1
        self.stats["requeued"] += 1
        self.queue.push(job, front=True)

    def note_loss(self, name: str, reason: str, code: str | None) -> None:
        """A worker's latest loss, for `status` (the newest replaces an older one)."""
        self.losses.pop(name, None)
        self.losses[name] = {"reason": reason, "code": code, "at": self.now}
        while len(self.losses) > 256:             # (names with a pid in them come and go)
            del self.losses[next(iter(self.losses))]

    def worker_lost(self, record: WorkerRecord, reason: str, code: str | None = None,
                    silent: bool = False, crashed: bool = False) -> None:
        """Drop a worker; requeue its jobs that had not started (they cannot be what
        killed it), fail the others: a request that was being prefilled or generated when
        its worker died is never handed to a second worker to kill. A worker lost by
        going `silent` (no heartbeats: its IO thread could not run, as when its
        generation thread held the GIL) may not have been able to say a job started
        either, so none of its jobs is requeued. A job unstarted on a worker that
        `crashed` is requeued only until its MAX_CRASHES-th such crash. `code` is the
        error its failed requests get (worker_lost, or worker_stuck from the watchdog)."""
        lost = refusals.worker_lost(code, reason)
        self.registry.remove(record.identity)
        log.error("worker %s lost (%s) with %d request(s)", record.name, reason,
                  len(record.running))
        self.note_loss(record.name, reason, lost.code)
        failed = 0                           # (requeued and cancelled ones are no loss)
        for job in record.running.values():
            job.worker = None
            if crashed and not job.started:
                job.crashes += 1
        # requests one of whose jobs fails here: failed whole (their other jobs here too)
        ended = {job.parent for job in record.running.values() if not job.cancelled and (
            job.started or silent or job.crashes >= MAX_CRASHES or
            job.attempt - job.handed_back >= MAX_ATTEMPTS)}
        requeued = []
        for job in record.running.values():
            if job.cancelled:                # nobody waits for it any more
                self._forget(job)
            elif job.parent not in ended:
                requeued.append(job)
            else:
                self.stats["failed"] += 1
                failed += 1
                self._forget(job)
                self._fail(job, lost)
        for job in reversed(requeued):       # (each to the queue's front, the last first:
            self._requeue(job)               # they keep the order they came in)
        self._fail_queued(ended, lost)       # (theirs elsewhere: not this worker's loss)
        for job in record.ops.values():
            self._fail(job, lost)
        self.metrics.worker_lost(record.name, record.info.device, failed + len(record.ops),
                                 "stuck" if lost.code == "worker_stuck" else "lost")
        record.running.clear()
        record.ops.clear()
        self.broadcast_state()

    def _fail_queued(self, parents: set[str], error: P.WireError) -> None:
        """Fail the queued jobs of `parents` (requests one job of which failed: the front
        end fails a request whole at its first error, and a choice of a crashing prompt
        requeued beside it went on to crash another worker before its CANCEL came)."""
        if not parents:
            return
        for job in [job for job in self.queue if job.parent in parents]:
            self.queue.take(job)
            self.stats["failed"] += 1
            self._forget(job)
            self._fail(job, error)

    def dispatch(self) -> None:
        """Hand queued jobs to the worker the registry chooses for each (cache affinity
        weighed against load), requests with the fewest jobs running first, then oldest
        first; a job no free worker fits waits without blocking the jobs behind it
        (`DispatchPass`: what one pass decides)."""
        if not len(self.queue) or not self.registry.with_free_slots():
            return
        turn = DispatchPass(self.queue, self.registry, self.shares)
        for job in turn.jobs():
            if not turn.may_run(job):
                continue
            try:
                worker = turn.choose(job)
                if worker is None:
                    continue
                self.queue.take(job)
                self._assign(job, worker)
            except Exception:
                self._dispatch_failed(job)
                turn.failed(job)
                continue
            turn.placed(job, worker)
            if not self.registry.with_free_slots():
                return

    def _dispatch_failed(self, job: QueuedJob) -> None:
        """Choosing a worker for `job`, or sending it there, raised: it is cancelled
        wherever it got to and answered 500 with its request's other queued jobs (the
        front end fails a request whole), and the queue goes on. Left queued, every
        later dispatch met it again: each SUBMIT's handling raised (its innocent job
        answered 500), every tick did, and after TEND_FAULTS ticks the loop stopped, every
        stream with it."""
        self.stats["loop_faults"] += 1
        if self.now - self._dispatch_fault_said >= 60.0:   # (a trace a minute at most: a
            self._dispatch_fault_said = self.now           # request of 128 choices meets
            log.exception("dispatching %s failed; its request is answered 500 and the "
                          "queue goes on", job.request_id)    # it 128 times)
        else:
            log.debug("dispatching %s failed", job.request_id, exc_info=True)
        self.queue.remove(job.request_id)
        self._forget(job)
        # (a REQUEST made for it is not sent yet: taken back, so no worker runs it; nor
        # the prompt it would have carried: a worker's later jobs are sent it whole)
        self._out = [send for send in self._out
                     if not (send.cmd == P.REQUEST and send.request_id == job.request_id)]
        for record in self.registry.workers.values():
            record.running.pop(job.request_id, None)
            if job.share_key is not None:
                record.shared_sent.pop(job.share_key, None)
        job.worker = None
        self._fail(job, refusals.dispatcher_fault())
        self._fail_queued({job.parent}, refusals.dispatcher_fault())

    def _assign(self, job: QueuedJob, worker: WorkerRecord, **extra) -> None:
        """Send `job` to `worker` (with `extra` fields) and count it as running there.
        A job whose prompt fields that worker was sent lately names them instead
        (protocol.SHARED_FIELDS)."""
        body = job.for_worker(**extra)
        key = job.share_key
        if key is not None:
            if key in worker.shared_sent:
                body = P.without_prompt(body, key)
            else:
                body = msgspec.structs.replace(body, share_as=key)
                worker.shared_sent[key] = None
                while len(worker.shared_sent) > P.DISPATCHER_SHARED:
                    worker.shared_sent.popitem(last=False)
        self._to_worker(worker.identity, P.REQUEST, job.request_id, body)
        self.shares.served_now(job.body.api_key)
        job.worker = worker.identity
        worker.running[job.request_id] = job
        # a request with a choice served keeps its place for the others (expire_deadlines);
        # a request of one job has no others: sent back to the queue (its worker lost or
        # stopping before it started), its deadline holds as before
        if job.body.fanout > 1:
            self.served_parents.served(job.parent, job.body.api_key, self.now)
        worker.last_assigned = self.now
        worker.remember(job)

    # -- views -------------------------------------------------------------------------
    def models(self) -> dict[str, dict]:
        configured = self.fleet.configured_models()    # what workers are set to load now
        models = {m: {"ready": 0, "n_ctx": info.get("n_ctx", 0), "slots": 0, "fim": False}
                  for m, info in self.known_models.items()
                  if configured is None or m in configured}
        models.update(self.registry.models())
        for info in models.values():
            info["created"] = int(self.started)
        return models

    def state(self) -> P.State:
        models = self.models()
        return P.State(
            epoch=self.epoch, workers_ready=len(self.registry),
            workers_drained=len(self.registry.infos_by_pause(self.paused)[1]),
            models={m: P.ModelState(**info) for m, info in models.items()},
            # what a request without a `model` gets: the config's first model
            default_model=next(iter(models), None),
            aliases={alias: model for model, info in self.known_models.items()
                     for alias in info.get("aliases", ())},
            queued=len(self.queue), expected_workers=self.fleet.expected_workers(),
            coming_workers=self.fleet.expected_workers(coming=True),
            draining=self.draining_until is not None,
            workers=[info.capabilities() for info in self.registry.infos()])

    def broadcast_state(self) -> None:
        state = self.state()
        for fe_id in list(self.frontends):
            self._to_frontend(fe_id, P.STATE, body=state)
