"""Admission, the front-end half of the dispatcher's core (`DispatcherCore` is an
`Admission`): which jobs are queued, refused, superseded or cancelled.

Pure state like the rest of the core: it appends the messages to send to the core's
outbox (`_to_frontend`, `_to_worker`, `_reject`, `_fail`).
"""
from __future__ import annotations

import logging

import msgspec

from dispatcher.common import config, protocol as P
from dispatcher.queues import Job
from dispatcher.common.fit import explain_unfit, fits

log = logging.getLogger("dispatcher.broker")


class Admission:
    def submit(self, fe_id: bytes, request_id: str, body: P.SubmittedJob) -> None:
        # the id its prompt fields go by: the first job of its prompt (fan-outs only)
        share_key = body.same_as or (request_id if body.fanout > 1 else None)
        body = self._with_shared(request_id, body)
        if body is None:
            return self._reject(fe_id, request_id, P.WireError(
                status=400, code="bad_job",
                message="the job's same_as names no earlier job of its request"))
        model = body.model
        models = self.models()
        if not request_id:
            return self._reject(fe_id, request_id, P.WireError(
                status=400, code="bad_job", message="the job lacks an id"))
        if self.draining_until is not None:
            return self._reject(fe_id, request_id, P.WireError(
                status=503, code="shutting_down", message="the server is shutting down",
                retry_after=config.RETRY_AFTER_SECONDS))
        if not models:
            return self._reject(fe_id, request_id, P.WireError(
                status=503, code="no_worker_ready", message="no worker is ready",
                retry_after=config.RETRY_AFTER_SECONDS))
        if model not in models:
            return self._reject(fe_id, request_id, P.WireError(
                status=404, code="model_not_found",
                message=f"The model '{model}' does not exist"))
        infos = self.registry.infos()
        if not any(fits(model, body.route, info) for info in infos):
            if not models[model]["ready"] or \
                    len(self.registry) < self.fleet.expected_workers():
                return self._reject(fe_id, request_id, P.WireError(
                    status=503, code="no_worker_ready",
                    message=f"no worker for '{model}' that can run this is ready",
                    retry_after=config.RETRY_AFTER_SECONDS))
            param, code, message = explain_unfit(model, body.route, infos)
            return self._reject(fe_id, request_id, P.WireError(
                status=400, code=code, message=message, param=param))
        self.stats["submitted"] += 1
        job = Job(request_id, fe_id, body, enqueued_at=self.now, share_key=share_key)
        if body.op:
            return self._run_op(job)
        key = self.queue.key(job)
        if not self._admit_unit(job) and self.queue.depth(key) >= self.max_queue:
            self.stats["queue_full"] += 1           # (refused before it supersedes anything)
            return self._reject(fe_id, request_id, P.WireError(
                status=429, code="queue_full", message=f"{self.max_queue} requests are "
                f"already waiting for '{key[0]}'" + (f" (profile '{key[1]}')" if key[1]
                                                     else ""),
                retry_after=1))
        if body.session and not self._supersede(job):
            return self._reject(fe_id, request_id, P.WireError(
                status=409, code="superseded",
                message="superseded: the session sent a newer request first"))
        if job.adopt_from is not None:
            return self._hand_over(job)
        timeout = body.timeout or self.queue_timeout
        if timeout:
            job.deadline = job.enqueued_at + float(timeout)
        fanout = body.fanout
        if fanout > 1 and job.parent not in self.units:
            self.units[job.parent] = [fanout - 1, self.now]
        if share_key == request_id and job.parent in self.units:
            # admitted, with more of its request to come: they may name its prompt
            entry = self.shared.setdefault(job.parent, [self.now, {}])
            entry[1][request_id] = P.prompt_fields(body)
        self.queue.push(job)
        self._to_frontend(fe_id, P.ACCEPTED, request_id)
        self.dispatch()

    def _with_shared(self, request_id: str, body: P.SubmittedJob) -> P.SubmittedJob | None:
        """The job whole: an earlier job's prompt fields filled in for `same_as` (the same
        objects: nothing is copied; protocol.SHARED_FIELDS; `submit` keeps those of a job
        admitted with more of its request to come). None if `same_as` names nothing
        known."""
        same = body.same_as
        if same is None:
            return body
        entry = self.shared.get(body.parent or request_id)
        fields = entry[1].get(same) if entry else None
        if fields is None:
            return None
        return msgspec.structs.replace(body, same_as=None, **fields)

    def _admit_unit(self, job: Job) -> bool:
        """True for a later job of a request whose first job was admitted: a request's
        prompts × choices are admitted (or refused) as one unit, never half of them."""
        unit = self.units.get(job.parent)
        if unit is None:
            return False
        unit[0] -= 1
        if unit[0] <= 0:
            del self.units[job.parent]
            self.shared.pop(job.parent, None)    # every job of it is here now
        return True

    def _supersede(self, job: Job) -> bool:
        """A request of a session (X-Session-Id) ends the session's requests the client
        sent before it, queued or running: an editor sends one per keystroke and wants
        only the last. Order is the client's (`session_order`: the front end's arrival
        time, or the client's X-Session-Seq), never the order of arrival here: a request
        that reaches the dispatcher after a newer one of its session is itself superseded
        (False), whether that newer one is still open or already done."""
        session, parent = job.body.session, job.body.parent
        order = job.body.session_order
        newest = self.session_newest.get(session)
        if newest is not None and newest[1] != parent and newest[0] > order:
            self.stats["superseded"] += 1
            return False
        self.session_newest[session] = (order, parent, self.now)
        older = self.sessions.setdefault(session, {})
        for request_id, old in list(older.items()):
            if old.body.parent == parent:
                continue                     # a sibling (n > 1, batch): same request
            del older[request_id]
            self.stats["superseded"] += 1
            self._fail(old, P.WireError(
                status=409, code="superseded",
                message="superseded by a newer request of the same session"))
            if self.queue.remove(request_id) is None and old.worker is not None:
                old.cancelled = True
                key, record = job.body.adopt_key, self.registry.get(old.worker)
                if key and job.adopt_from is None and old.body.adopt_key == key \
                        and record is not None and not record.draining:
                    job.adopt_from = old     # its worker decides: adopt, or cancel it
                else:
                    self._to_worker(old.worker, P.CANCEL, request_id)
        older[job.request_id] = job
        return True

    def _hand_over(self, job: Job) -> None:
        """Type-along adoption: the new request goes straight to the worker running the
        one it supersedes, marked `adopt`. If the user typed what that generation had
        produced, the worker hands the running generation to the new request (no
        prefill, no lost tokens); otherwise it cancels the old one and runs the new one
        in the freed slot, its prompt mostly cached."""
        old, job.adopt_from = job.adopt_from, None
        self._to_frontend(job.frontend, P.ACCEPTED, job.request_id)
        self._assign(job, self.registry.get(old.worker), adopt=old.request_id)

    def _forget(self, job: Job) -> None:
        session = job.body.session
        if session and session in self.sessions:
            self.sessions[session].pop(job.request_id, None)
            if not self.sessions[session]:
                del self.sessions[session]

    def _run_op(self, job: Job) -> None:
        """Tokenize/detokenize: no queue, no slot; the least busy fitting worker."""
        worker = self.registry.pick(job.body, config.MAX_OPS_PER_WORKER)
        if worker is None and self.registry.pick(job.body) is not None:
            return self._reject(job.frontend, job.request_id, P.WireError(
                status=429, code="tokenizer_busy", message=f"every worker already has "
                f"{config.MAX_OPS_PER_WORKER} tokenize/detokenize requests running",
                retry_after=1))
        self._to_frontend(job.frontend, P.ACCEPTED, job.request_id)
        if worker is None:
            return self._fail(job, P.WireError(status=503, code="no_worker_ready",
                                               message="no worker could take the request"))
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
                    job.cancelled = True
                    self._to_worker(record.identity, P.CANCEL, job.request_id)
        log.warning("front end %s stopped heartbeating", fe_id.decode(errors="replace"))

