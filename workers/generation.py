"""The worker's generation loop: admit jobs into engine slots, step, hand each token to
the request's output (`workers.output`: its events and notices).

Runs in one thread that owns the engine and the XPUB socket. Jobs and cancels arrive
from the IO thread through a queue of typed messages (`workers.inbox`) and take effect
between steps, so a cancel frees its slot within one token. Tokenize/detokenize jobs
take no slot: a thread of their own computes them beside the decoding, and their answer
comes back through the same queue (`OpDone`) to go out between steps. A session's new
request may take over its running generation (type-along adoption, below).
"""
from __future__ import annotations

import bisect
import logging
import queue
import time
from collections import Counter, deque
from typing import Callable

from dispatcher.common import protocol as P
from workers import inbox
from workers.errors import EngineError, InvalidInput, Stopping
from workers.prefill import PrefillMeter
from workers.faults import FaultInjection
from workers.output import Output
from workers.publisher import Publisher
from workers.interface import Engine
from workers.active import Active, EditorLimits, LogprobLedger
from workers.preparation import Preparer, TakingTurns, ThreadWatch, sampling_of
from workers.prompts import (context_limit, fitted_prompt, may_drop_extra, prompt_text,
                             tenant_of, vocabulary_op)
from workers.sampling import SamplingParams
from workers.textstream import TextAssembler

log = logging.getLogger(__name__)


class GenerationLoop:
    def __init__(self, engine: Engine, publisher: Publisher,
                 notify: Callable[[bytes, str, object], None],
                 identity: dict | None = None, fim_template=None,
                 faults: FaultInjection | None = None):
        self.engine = engine
        self.fim_template = fim_template          # FimTemplate for suffix / infill
        self.prefill = PrefillMeter(engine)       # its rate, for t_max_prompt_ms
        self.identity = identity or {}            # {"worker", "device"}: in start events
        self.publisher = publisher
        self.notify = notify                      # -> dispatcher, through the IO thread
        self.inbox: queue.Queue[inbox.Message] = queue.Queue()    # (workers/inbox.py)
        self.waiting: deque[tuple[str, P.WorkerJob]] = deque()
        self.active: dict[str, Active] = {}
        self.free_slots = list(range(engine.n_slots))
        # a superseding request's slot (its session's prompt cached there), kept free of
        # other jobs while it is prepared: request id -> slot
        self.held: dict[str, int] = {}
        # whose prompt each slot's KV cache holds (the job's tenant: None when shared); a
        # job reuses only a cache its own tenant filled (--cache-scope key)
        self.slot_tenant: dict[int, str | None] = {}
        self.faults = faults or FaultInjection()    # test hooks: none unless given
        self.busy_since: float | None = None    # see stuck_for
        self.leaving_by: float | None = None    # stopping with its own drain: see _left
        self.ops_running = 0                    # /tokenize, /detokenize on their thread,
        self.ops: dict[str, tuple] = {}         # request id -> (its Future, its body)
        # the keys in turn (one FIFO kept another key's small /tokenize behind a flood of
        # 1 MiB texts whose clients had left)
        self.vocabulary_thread = TakingTurns("vocabulary")
        # large jobs' tokens and sampler chains, made beside the decoding (preparation.py)
        self.watch = ThreadWatch()      # (the preparing and vocabulary threads' jobs)
        self.preparer = Preparer(engine, fim_template, self.inbox, self.watch)
        self.output = Output(engine, publisher, notify, self.faults, self.prefill, self._drop)

    # -- inbox -------------------------------------------------------------------------
    def run(self, stopping) -> None:          # a StopFlag, or a threading.Event
        while not stopping.is_set():
            if self._left(getattr(stopping, "drain_deadline", None)):
                return
            try:
                self.publisher.tick()            # events held for a late subscription
                self._read_inbox(block=not self.active and not self.waiting)
                self._admit()
                if self.active:
                    self._step()
            except Exception:
                # Every request-level failure is caught where it happens; this is the last
                # line: whatever escaped, the worker goes on serving.
                log.exception("generation loop error")

    def _left(self, deadline: float | None) -> bool:
        """Stopping with its own drain (`deadline`: a worker stopped by SIGTERM that no
        launcher drained first, as systemd stops it): the jobs not started go back to the
        dispatcher at once, as does every job it sends from now; the running ones finish.
        True once none runs, or at the deadline (run's caller fails what is left)."""
        if deadline is None:
            return False
        if self.leaving_by is None:
            self.leaving_by = deadline
            log.info("stopping: %d running request(s) finish (at most %.0fs); the %d not "
                     "started go back to the dispatcher", len(self.active),
                     max(0.0, deadline - time.monotonic()), len(self.waiting))
            self._hand_back()
            self.notify(P.HEARTBEAT, "", P.WorkerBeat(leaving=True))   # takes no more
        return (not self.active and not self.ops_running and self.inbox.empty()) or \
            time.monotonic() >= deadline

    def _hand_back(self) -> None:
        """Every job not yet started back to the dispatcher (released: it queues them
        again for another worker, or for this one's successor)."""
        for request_id, body in self.waiting:
            self.preparer.drop(request_id)
            self.notify(P.DONE, request_id, P.Done(attempt=body.attempt, released=True))
        self.waiting.clear()
        preparing = self.preparer.being_prepared()
        for request_id, attempt in preparing:
            self.notify(P.DONE, request_id, P.Done(attempt=attempt, released=True))
        self.preparer.reset(preparing)

    def stuck_for(self, now: float) -> float:
        """Seconds the loop has been in its current piece of work (0 while it waits for
        work): read by the IO thread's watchdog."""
        since = self.busy_since
        return 0.0 if since is None else now - since

    def _read_inbox(self, block: bool) -> None:
        # what follows (this inbox, admission, a step) is one piece of work, timed
        self.busy_since = None if block else time.monotonic()
        try:
            # idle: wait briefly, so that a stop (a flag set by a signal) is seen at once
            item = self.inbox.get(timeout=0.05) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        self.busy_since = time.monotonic()
        while True:
            self._apply(item)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _apply(self, item: inbox.Message) -> None:
        match item:
            case inbox.PreparedJob(request_id, body, prepared):   # (the preparing thread)
                self._unhold(request_id)
                if self.preparer.arrived(request_id, body.attempt, prepared):
                    # (a superseding one goes first, into the slot its old one freed)
                    (self.waiting.appendleft if body.adopt else self.waiting.append)(
                        (request_id, body))
                    if self.leaving_by is not None:
                        self._hand_back()
            case inbox.NewJob(request_id, body) if self.leaving_by is not None and \
                    body.topic and not body.op:
                if body.adopt:            # (its old generation was superseded: end it)
                    self.cancel(body.adopt)
                self.notify(P.DONE, request_id, P.Done(attempt=body.attempt, released=True))
            case inbox.NewJob(request_id, body):
                if not body.topic:
                    log.warning("job %s without a topic: dropped", request_id)
                elif body.op:
                    self._utility(request_id, body)
                elif body.adopt:
                    self._adopt_or_supersede(request_id, body)
                else:
                    self.waiting.append((request_id, body))
            case inbox.OpDone():
                self._op_done(item)
            case inbox.Invalid(request_id, topic, attempt, message):
                self.output.reject(request_id, topic.encode(), attempt,
                             InvalidInput(message, code="bad_job"))
            case inbox.Cancel(request_id, attempt):
                self.cancel(request_id, attempt)
            case inbox.Reset(preparing):
                for request_id in list(self.active):
                    self._drop(self.active[request_id])
                self.waiting.clear()
                # the old connection's /tokenize jobs not started (the new one's come
                # after this in the inbox): the dispatcher forgot them, and a megabyte's
                # ran for nobody, the new connection's waiting behind it
                for request_id in list(self.ops):
                    self._cancel_op(request_id, answer=False)
                for request_id in list(self.held):
                    self._unhold(request_id)
                # (with the superseding jobs this loop handed the preparing thread since
                # the snapshot: they came from the forgotten connection, before the Reset)
                self.preparer.reset(preparing | self.preparer.from_loop())

    def _unhold(self, request_id: str) -> None:
        slot = self.held.pop(request_id, None)
        if slot is not None:
            self.free_slots.append(slot)

    def cancel(self, request_id: str, upto: int | None = None) -> None:
        """Cancel the job wherever it is here: its attempts up to `upto` (None: any). A
        later attempt is at most on the preparing thread when this is read (the inbox
        keeps the socket's order), and is left there: the one the dispatcher waits for."""
        def wanted(attempt: int) -> bool:
            return upto is None or attempt <= upto
        if self._cancel_op(request_id, upto):
            return
        self._unhold(request_id)                 # (a slot held is an earlier NewJob's)
        attempt = self.preparer.cancel(request_id, upto)
        if attempt is not None:                  # still on the preparing thread
            self.notify(P.DONE, request_id, P.Done(attempt=attempt, cancelled=True,
                                                   usage=P.Usage()))
            return
        for i, (waiting_id, body) in enumerate(self.waiting):
            if waiting_id == request_id and wanted(body.attempt):
                del self.waiting[i]
                self.preparer.drop(request_id)
                self.notify(P.DONE, request_id, P.Done(attempt=body.attempt,
                                                       cancelled=True))
                return
        active = self.active.get(request_id)
        if active is not None and wanted(active.attempt):
            self._drop(active)
            self.notify(P.DONE, request_id, active.done(cancelled=True, usage=active.usage()))
            log.info("%s cancelled after %d tokens", request_id, active.generated)

    def _drop(self, active: Active, keep_cache: bool = True) -> None:
        """Free the request's slot (idempotent). A failed sequence's cache is not kept:
        nothing of a request that broke something is reused."""
        if self.active.pop(active.request_id, None) is None:
            return
        try:
            self.engine.release(active.slot, keep_cache=keep_cache)
        except Exception:               # (the engine frees the slot first, whatever fails)
            log.exception("%s: releasing slot %d failed", active.request_id, active.slot)
        self.free_slots.append(active.slot)

    # -- utility jobs ------------------------------------------------------------------
    def _utility(self, request_id: str, body: P.WorkerJob) -> None:
        """/tokenize and /detokenize: computed on a thread of their own (llama.cpp's
        tokenizer releases the GIL), so decoding goes on meanwhile; the answer (one `end`
        event with a result) goes out from this loop, which owns the sockets."""
        def work():
            try:
                with self.watch.job():
                    result = vocabulary_op(self.engine, body)
                done = inbox.OpDone(request_id, body, result=result)
            except Exception as exc:     # bad content must never end the worker
                if not isinstance(exc, EngineError):
                    log.exception("%s: %s failed", request_id, body.op)
                done = inbox.OpDone(request_id, body, error=exc)
            self.inbox.put(done)
        self.ops_running += 1
        try:
            future = self.vocabulary_thread.submit(work, key=body.api_key)
        except RuntimeError as exc:      # (its thread could not start, or has stopped)
            log.error("%s: the vocabulary thread took no job: %s", request_id, exc)
            return self._op_done(inbox.OpDone(request_id, body, error=exc))
        self.ops[request_id] = (future, body)

    def _cancel_op(self, request_id: str, upto: int | None = None,
                   answer: bool = True) -> bool:
        """A /tokenize or /detokenize cancelled (its client left): dropped if its thread
        has not started it (one started runs to its end, answering nobody). False: not
        an op of this worker's (of an attempt up to `upto`), or one already running.
        `answer`: its DONE is sent (not after a Reset: nobody holds it any more)."""
        future, body = self.ops.get(request_id, (None, None))
        if future is None or (upto is not None and body.attempt > upto) \
                or not future.cancel():
            return False
        del self.ops[request_id]
        self.ops_running -= 1
        if answer:
            self.notify(P.DONE, request_id, P.Done(attempt=body.attempt, cancelled=True))
        return True

    def _op_done(self, done: inbox.OpDone) -> None:
        self.ops_running -= 1
        self.ops.pop(done.request_id, None)
        topic, attempt = done.body.topic.encode(), done.body.attempt
        if done.error is not None:
            return self.output.reject(done.request_id, topic, attempt, done.error)
        self.publisher.publish(topic, done.request_id, P.End(seq=0, attempt=attempt,
                                                              result=done.result))
        self.notify(P.DONE, done.request_id, P.Done(attempt=attempt, last_seq=0))

    # -- admission ---------------------------------------------------------------------
    def _admit(self) -> None:
        held = []                        # siblings waiting for a prompt being prefilled
        try:
            while self.waiting and self.free_slots:
                request_id, body = self.waiting.popleft()
                if self._sibling(body, prefilling=True) is not None:
                    held.append((request_id, body))
                    continue
                try:
                    self._start(request_id, body)
                except Exception as exc:     # this request fails; the others go on
                    if not isinstance(exc, EngineError):
                        log.exception("%s: admission failed", request_id)
                    active = self.active.get(request_id)
                    if active is not None:
                        self.output.fail(active, exc)
                    else:
                        self.output.reject(request_id, body.topic.encode(), body.attempt,
                                           exc)
        finally:
            self.waiting.extendleft(reversed(held))

    def _sibling(self, body: P.WorkerJob, prefilling: bool) -> Active | None:
        """A running job of the same prompt, tenant and layout (another choice of the
        same request, `n` or `n_cmpl`): while it is `prefilling` (more than its last
        token left), this one waits, and then copies its decoded prompt
        (`_start_prepared`, `Engine.copy_prefix`) instead of prefilling it beside it.
        Only where a copy can follow: the prompt cache on, an engine that copies (not
        deterministic, not a recurrent model), no prompt logprobs (every row is
        decoded), a prompt of at least `copy_at_least` tokens, and not behind a warm-up
        (last in line for prefill room)."""
        gen = body.generation
        if gen.cache_prompt is False or (gen.echo and gen.logprobs is not None) or \
                not self.engine.copies:
            return None
        for active in self.active.values():
            if active.source is None or active.tenant != body.tenant or \
                    active.max_tokens == 0 or active.prompt_tokens < self.engine.copy_at_least or \
                    active.source != (body.prompt, body.suffix, body.infill):
                continue
            left = self.engine.prefill_left(active.slot)
            if (left > 1) if prefilling else (left <= 1):
                return active
        return None

    def _start(self, request_id: str, body: P.WorkerJob) -> None:
        prepared = self.preparer.take(request_id)
        running = self.active.get(request_id)
        if running is not None:
            # one request, two attempts here (a Reset raced the dispatcher handing it
            # over again): the later one is the dispatcher's, the other runs for nobody
            # and would hold its slot under an id no longer its own
            log.warning("%s: attempt %d arrived while attempt %d runs; the earlier one "
                        "is dropped", request_id, body.attempt, running.attempt)
            if running.attempt >= body.attempt:
                if prepared is not None:
                    prepared.free()
                return
            self._drop(running)
        try:
            self._start_prepared(request_id, body, prepared)
        finally:
            if prepared is not None:
                prepared.free()          # (what the engine did not take)

    def _chunks_kept(self, body: P.WorkerJob, fitted, sibling: Active | None
                     ) -> tuple[list[int], int]:
        """The prompt's tokens and the extra chunks left out of them: the fitted
        prompt's; its decoded sibling's choice (it copies that); or fewer chunks where
        t_max_prompt_ms asks (llama.cpp declares it and never implemented it: the oldest
        chunks go until the prefill fits, at this worker's measured rate)."""
        gen, parts = body.generation, fitted.parts
        tokens, dropped = fitted.tokens, fitted.dropped
        if parts is None:                # (not an /infill, or cut: no chunks left)
            return tokens, dropped
        if sibling is not None:
            # the same prompt as its decoded sibling's, to copy it (t_max_prompt_ms
            # would judge its own, against a cache that is busy)
            if sibling.dropped_chunks > dropped and not fitted.cut:
                dropped = sibling.dropped_chunks
                tokens = parts.tokens(self.engine, dropped)
            return tokens, dropped
        left = len(body.infill.extra) - dropped if body.infill else 0
        if left > 0 and may_drop_extra(gen):
            over = self.prefill.chunks_over_budget(
                lambda k: parts.tokens(self.engine, dropped + k), left,
                float(gen.t_max_prompt_ms), self._own_slots(body.tenant), gen.cache_prompt,
                lambda k: parts.length(self.engine, dropped + k))
            if over:
                dropped += over
                tokens = parts.tokens(self.engine, dropped)
        return tokens, dropped

    def _start_prepared(self, request_id: str, body: P.WorkerJob, prepared) -> None:
        if prepared is None:
            # From here on the request counts as started: if this process dies now, the
            # dispatcher fails it rather than handing a possible poison pill to another
            # worker (a prepared job was reported started when it arrived).
            self.notify(P.STARTED, request_id, P.Attempt(attempt=body.attempt))
        elif prepared.error is not None:
            raise prepared.error
        self.faults.check("admit", body.prompt)
        gen = body.generation
        topic = body.topic.encode()
        if prepared is not None and prepared.sampling is not None:
            sampling = prepared.sampling
        else:
            with tenant_of(self.engine, body):      # (a text bias's tokens: its own)
                sampling = sampling_of(gen, self.engine)
        fitted = prepared.fitted if prepared is not None else fitted_prompt(
            self.engine, body, self.fim_template,
            list(body.infill.extra) if body.infill else [])
        sibling = self._sibling(body, prefilling=False)
        tokens, dropped = self._chunks_kept(body, fitted, sibling)
        n_ctx = context_limit(self.engine, body)
        if len(tokens) >= n_ctx:
            raise InvalidInput(f"This model's maximum context length is {n_ctx} tokens, but "
                               f"the prompt has {len(tokens)} tokens.",
                               code="context_length_exceeded", param="prompt")
        if not tokens:
            raise InvalidInput("the prompt has no tokens", param="prompt")
        logprobs = gen.logprobs
        echo = gen.echo
        slot, reuse = self._slot_for(tokens, body.tenant, gen.cache_prompt)
        if sibling is not None and self.engine.copy_prefix(sibling.slot, slot, tokens):
            reuse = True                 # (its sibling's cache: its own tenant's)
        active = Active(request_id, topic, body.attempt, slot, gen.max_tokens, n_ctx,
                        len(tokens), TextAssembler(gen.stop),
                        ledger=LogprobLedger(logprobs) if logprobs is not None else None,
                        score=gen.score)
        want = logprobs if logprobs is not None else (0 if active.score else None)
        active.n_probs = int(gen.n_probs or 0)
        active.return_tokens = bool(gen.return_tokens)
        active.timings_per_token = gen.timings_per_token
        active.prompt = body.prompt
        active.source, active.tenant = (body.prompt, body.suffix, body.infill), body.tenant
        active.dropped_chunks = dropped
        active.truncated = fitted.cut
        active.limits = EditorLimits.of(gen)
        if active.n_probs:
            want = max(want or 0, active.n_probs)
        prompt_lp = echo and logprobs is not None
        chain = prepared.chain if prepared is not None else None
        cached = self.engine.add(slot, tokens, SamplingParams.from_job(sampling), want,
                                 prompt_logprobs=prompt_lp,
                                 reuse=reuse, draft_max=gen.draft_max,
                                 history=body.tenant or "", budget=gen.max_tokens,
                                 chain=chain, penalize_prompt=gen.penalize_prompt)
        if prepared is not None:
            prepared.chain = None            # the engine's now
        self.slot_tenant[slot] = body.tenant
        self.free_slots.remove(slot)
        self.active[request_id] = active     # from here a failure frees the slot
        active.cached = cached
        self.output.publish(active, P.Start(prompt_tokens=len(tokens), cached_tokens=cached,
                                      fingerprint=self.engine.fingerprint, **self.identity))
        if echo:
            active.echo_text = prompt_text(self.engine, body.prompt, tokens)
            active.echo_pending = prompt_lp        # then it waits for the prompt logprobs
            active.prompt_ids = tokens if prompt_lp else None
            if not prompt_lp:
                self.output.echo(active, None, tokens)
        if active.max_tokens == 0 and not prompt_lp and not gen.warm:
            self.output.finish(active, "length")          # (warm-up: after the prefill)

    def _own_slots(self, tenant: str | None) -> list[int]:
        """Free slots whose cache this tenant may reuse: its own, and empty ones."""
        return [s for s in self.free_slots if self.slot_tenant.get(s, tenant) == tenant]

    def _slot_for(self, tokens: list[int], tenant: str | None,
                  reuse: bool) -> tuple[int, bool]:
        """The free slot for a prompt, and whether its cache may be reused: the best of the
        tenant's own (most of the prompt cached); else one of the tenant holding the most
        slots, prefilled from scratch (its cache is dropped, never read). (The least
        cached of any tenant's went first: a key keeping long prompts in its slots kept
        them, and the other keys took each other's caches at every keystroke.)"""
        own = self._own_slots(tenant)
        if own:
            return self.engine.best_slot(tokens, own), reuse
        held = Counter(self.slot_tenant.values())
        most = max(held[self.slot_tenant.get(s)] for s in self.free_slots)
        return self.engine.best_slot([], [s for s in self.free_slots
                                          if held[self.slot_tenant.get(s)] == most]), False

    # -- type-along adoption ------------------------------------------------------------
    # Type-along adoption: a session's new request takes over its running generation.
    #
    # An editor sends a request per keystroke and drops the previous one. When the user types
    # exactly what the running completion had suggested, cancelling it throws away a
    # generation that was right and starts a new prefill of the same text. Instead the
    # dispatcher sends the new request to the worker running the old one, marked `adopt`
    # (only when their `adopt_key`s match: same session, model, suffix, sampling and output
    # options; see app/jobs.py). Here, if the new prompt is the old prompt plus a prefix of
    # the text generated so far, the slot's running sequence is handed to the new request:
    # its stream starts with what was generated after the typed text and goes on from there;
    # the old request ends as superseded (its client has already been told by the
    # dispatcher). Otherwise the old request is cancelled and the new one is admitted first,
    # into the slot it freed (its prompt is then mostly cached there).
    def _adopt_or_supersede(self, request_id: str, body: P.WorkerJob) -> None:
        old_id = body.adopt
        old = self.active.get(old_id)
        found = self._typed(old, body)
        if found is not None:
            return self._adopt(old, *found, request_id, body)
        log.info("%s: %s cannot be adopted; cancelled, the new request goes first", request_id,
                 old_id)
        self.cancel(old_id)
        # much text, a grammar or DRY: made on the preparing thread, as any such job (the
        # streams beside it go on: 100 KB of code is 0.15 s of tokenizing on this machine),
        # the slot its old one freed kept for it meanwhile (its prompt is mostly there)
        if self.preparer.submit(request_id, body, superseding=True):
            self.notify(P.STARTED, request_id, P.Attempt(attempt=body.attempt))
            if old is not None and old.slot in self.free_slots:
                self.free_slots.remove(old.slot)
                self.held[request_id] = old.slot
        else:
            self.waiting.appendleft((request_id, body))


    def _typed(self, old: Active | None, body: P.WorkerJob) -> tuple[str, int] | None:
        """What the user typed since `old`'s prompt, if it is a prefix of what `old` has
        generated, and how many generated tokens it covers (None: not adoptable)."""
        if old is None or not isinstance(old.prompt, str) or old.assembler.stopped \
                or self.engine.deterministic:
            return None             # (deterministic: a result never depends on another one)
        prompt = body.prompt
        if not isinstance(prompt, str) or not prompt.startswith(old.prompt):
            return None
        typed = prompt[len(old.prompt):]
        if old.echo_text is not None or old.ledger is not None or old.n_probs or old.score \
                or not old.assembler.text.startswith(typed):
            return None
        # the tokens whose text lies within what was typed become prompt tokens
        covered = bisect.bisect_right(old.offsets, len(typed))
        limit = body.generation.max_tokens
        if limit is not None and old.generated - covered > limit:
            return None             # it has already generated more than the new one may
        return typed, covered


    def _adopt(self, old: Active, typed: str, covered: int, request_id: str,
                   body: P.WorkerJob) -> None:
        gen = body.generation
        new = Active(request_id, body.topic.encode(), body.attempt, old.slot, gen.max_tokens,
                     old.n_ctx, old.prompt_tokens + covered, TextAssembler(gen.stop))
        new.prompt, new.cached = body.prompt, new.prompt_tokens
        new.generated = old.generated - covered
        self.engine.set_budget(old.slot, None if gen.max_tokens is None else
                               gen.max_tokens - new.generated,
                               least=(gen.sampling.min_tokens or 0) - new.generated)
        new.offsets = [offset - len(typed) for offset in old.offsets[covered:]]
        if old.return_tokens:       # (what it takes over goes out as its own)
            new.return_tokens, new.ids = True, old.ids[covered:]
            new.pending_ids = list(new.ids)
        new.first_at = new.started                  # no prefill: it starts generating
        new.timings_per_token = gen.timings_per_token
        new.limits = EditorLimits.of(gen)
        # the slot changes hands: the engine's sequence goes on as it was
        del self.active[old.request_id]
        self.active[request_id] = new
        self.notify(P.STARTED, request_id, P.Attempt(attempt=new.attempt))
        # its output is what the user typed; the rest is counted with the new request
        self.notify(P.DONE, old.request_id, old.done(cancelled=True, adopted_by=request_id,
                                                     usage=old.usage(covered)))
        self.output.publish(new, P.Start(prompt_tokens=new.prompt_tokens, cached_tokens=new.cached,
                                   adopted=True, fingerprint=self.engine.fingerprint,
                                   **self.identity))
        log.info("%s adopted the generation of %s (%d characters typed along, %d generated "
                 "tokens kept)", request_id, old.request_id, len(typed), new.generated)
        text = new.assembler.take_over(old.assembler, len(typed))
        ended = False
        if new.limits is not None:
            new.limits.generated(text.encode())    # (what it takes over was generated)
            text, ended = new.limits.cut(text)
        if text:
            self.output.text(new, text)
        if ended:                                   # n_indent: the text held so far ends it
            new.assembler.stopped = True
            self.output.finish(new, "length", "limit")
        elif new.assembler.stopped:                 # one of the new request's stop strings
            self.output.finish(new, "stop", "word")
        elif new.max_tokens is not None and new.generated >= new.max_tokens:
            self.output.finish(new, "length", "limit")

    # -- generation --------------------------------------------------------------------
    def _step(self) -> None:
        try:
            produced = self.engine.step()
        except Exception as exc:          # the decode itself failed: every sequence in it
            log.error("engine step failed: %r", exc)
            for active in list(self.active.values()):
                self.output.fail(active, exc, keep_cache=False)
            self.engine.clear_caches()
            return
        by_slot = {a.slot: a for a in self.active.values()}
        for slot, outs in produced.items():
            active = by_slot.get(slot)
            # a verified speculative draft gives several tokens in one step
            for out in outs if isinstance(outs, list) else [outs]:
                if active is None or active.request_id not in self.active:
                    break                 # it finished (stop, length) within the step
                try:
                    if out.error is not None:
                        raise out.error
                    self.output.token(active, out)
                except Exception as exc:  # sampling or finishing this one request failed
                    if not isinstance(exc, EngineError):
                        log.exception("%s: generation failed", active.request_id)
                    if active.request_id in self.active:
                        self.output.fail(active, exc, keep_cache=False)

    def abort_all(self, reason: str) -> None:
        """On shutdown: fail requests that already sent text; hand the others back to the
        dispatcher (released), which queues them again for another worker."""
        for active in list(self.active.values()):
            if active.text_sent:
                self.output.fail(active, Stopping(reason))
            else:
                self._drop(active)
                self.notify(P.DONE, active.request_id, active.done(released=True))
        self._hand_back()

    def release_unread(self) -> None:
        """The last of a shutdown, the preparing thread stopped: jobs the IO thread handed
        over after `abort_all` (its STARTED sent, the thread's shutdown dropping them; or
        unread in the inbox) go back released. Lost with the worker, the started ones
        were failed as `worker_lost` rather than queued again. (/tokenize jobs are
        answered by the dispatcher's loss of the worker.)"""
        self._hand_back()
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return
            match item:
                case inbox.NewJob(request_id, body) if body.topic and not body.op and (
                        request_id, body.attempt) not in self.preparer.cancelled:
                    # (one the closed preparing thread refused: released above already)
                    self.notify(P.DONE, request_id, P.Done(attempt=body.attempt,
                                                           released=True))
                case inbox.PreparedJob(request_id, body, prepared):
                    if self.preparer.arrived(request_id, body.attempt, prepared):
                        self.preparer.drop(request_id)
                        self.notify(P.DONE, request_id, P.Done(attempt=body.attempt,
                                                               released=True))
