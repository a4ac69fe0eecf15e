"""What a job needs before its first step (its prompt's tokens, its sampler chain), made
on a thread of its own when that is more than a moment's work, so that every other
stream of the worker goes on decoding meanwhile.

Both are llama.cpp calls that release the GIL, and both grow with what a request sends:
tokenizing a prompt of 1 Mi characters took 5.3 s here, a DRY sampler with 16 sequence
breakers 1 s the first time its settings come (it scans the vocabulary for each; later
chains clone it: drysamplers.DryTemplates), a grammar sampler parses its grammar. In
the generation thread, that time was a freeze of every stream beside it. The IO thread
hands such a job here as it arrives and tells the dispatcher it has started (it is being
worked on: if it kills the process, it is not handed to another worker); the prepared job
then reaches the generation loop's inbox, which admits it like any other. Small plain
jobs (an editor's keystroke) go straight to the loop, as before. Jobs of 128 Ki
characters or more are prepared on a second such thread, so that none of a few KB
waits behind seconds of tokenizing. On each, the API keys take turns (`TakingTurns`).
"""
from __future__ import annotations

import copy
import logging
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import msgspec

from dispatcher.common import protocol as P
from dispatcher.common.fields import TEXT_BIAS
from workers import inbox
from workers.errors import EngineError, InvalidInput
from workers.prompts import Fitted, check_fits, chunk_chars, fitted_prompt, tenant_of
from workers.sampling import BAN, SamplingParams

log = logging.getLogger(__name__)

# Characters of prompt text (prefix, suffix, repository chunks) from which a job's tokens
# are made on the preparing thread (about 25 ms of tokenizing on this machine's core).
PREPARE_CHARS = 4096
# ... and from which on a thread of their own: a prompt of 1 Mi characters is seconds of
# tokenizing (refused after it, where the context is large), and every editor's request
# of a few KB prepared behind it waited as long
BIG_PREPARE_CHARS = 128 * 1024
# A job whose preparation has run this long (or the step timeout, where longer) is stuck
# in C (a tokenizer or sampler call that never returns): the watchdog gives the worker up
# as for a stuck step. Far past anything a request within the limits asks: a prompt of
# 1 Mi characters took 5.3 s, a megabyte /tokenize 17-23 s on a slower 2-core machine.
PREPARE_STUCK_SECONDS = 300.0
# Fitted prompts kept for the other choices of their request (share_as / same_as): an
# /infill's n choices each tokenized its prefix, suffix and chunks again (the vocabulary
# keeps four long texts: one with more, each choice missed them all), seconds each
FITTED_KEPT = 4


class ThreadWatch:
    """When each watched thread's current job began (the preparing threads', the
    vocabulary thread's): the IO thread's watchdog reads how long the longest has run."""

    def __init__(self) -> None:
        self.since: dict[int, float] = {}       # a thread's ident -> when its job began

    @contextmanager
    def job(self):
        me = threading.get_ident()
        self.since[me] = time.monotonic()
        try:
            yield
        finally:
            self.since.pop(me, None)

    def longest(self, now: float) -> float:
        """Seconds the longest job now running has taken (0: none)."""
        return max((now - since for since in list(self.since.values())), default=0.0)


@dataclass
class Prepared:
    """A job's tokens and sampler chain, made ahead; or the error making them raised."""
    fitted: Fitted | None = None    # its prompt (fitted_prompt)
    chain: Any = None               # the engine's sampler chain, handed to `Engine.add`
    sampling: dict | None = None    # its settings (sampling_of: a text bias tokenized)
    error: Exception | None = None

    def free(self) -> None:
        if self.chain is not None:
            self.chain.free()
            self.chain = None


def sampling_of(gen: P.Generation, engine=None) -> dict:
    """The job's sampling settings (a copy); a logit_bias given as text (llama.cpp's
    `[["Hello", -0.5]]`) as the bias of each of its tokens, by `engine`'s vocabulary."""
    sampling = msgspec.structs.asdict(gen.sampling)
    biases = sampling.get("logit_bias")
    if biases and engine is not None and any(k.startswith(TEXT_BIAS) for k in biases):
        ids: dict[str, float] = {}
        for key, bias in biases.items():
            tokens = engine.tokenize(key[len(TEXT_BIAS):], add_special=False,
                                     parse_special=False) \
                if key.startswith(TEXT_BIAS) else [int(key)]
            for t in tokens:        # (a token met twice: the biases add up, as in
                # llama-server; a ban stays one)
                ids[str(t)] = bias if str(t) not in ids else \
                    BAN if min(ids[str(t)], bias) <= BAN else ids[str(t)] + bias
        sampling["logit_bias"] = ids
    if sampling.get("json_schema") is not None:
        # the front end makes schemas into grammars, within their budget
        # (dispatcher/common/schemagrammar.py): a worker never runs the converter
        raise InvalidInput("a json_schema reaches a worker only as a grammar",
                           param="json_schema")
    return sampling


def text_size(body: P.WorkerJob) -> int:
    """Characters of text the job's prompt and its text biases are made of."""
    prompt = body.prompt
    size = len(prompt) if isinstance(prompt, str) else \
        sum(len(p) for p in prompt or [] if isinstance(p, str))
    size += len(body.suffix or "")
    # llama.cpp's text biases are tokenized too (16 Ki characters at most: app/fields.py)
    size += sum(len(key) - len(TEXT_BIAS) for key in body.generation.sampling.logit_bias
                or () if key.startswith(TEXT_BIAS))
    if body.infill:
        size += len(body.infill.middle) + sum(chunk_chars(c) for c in body.infill.extra)
    return size


def worth_preparing(body: P.WorkerJob) -> bool:
    """Whether the job's preparation could take long enough to stall the streams beside
    it: much text, a DRY sampler, a grammar."""
    if body.op or body.adopt or not body.topic:
        return False                # (adopt: the loop tries the takeover first)
    sampling = body.generation.sampling
    return text_size(body) >= PREPARE_CHARS or bool(sampling.dry_multiplier) \
        or sampling.grammar is not None


class TakingTurns:
    """One thread working the jobs of several API keys in turn: each key's jobs in the
    order they came, the keys round robin. One FIFO let a key fill the preparing thread
    with jobs slow to prepare (DRY settings each new, grammars of 32,768 rules) within its
    share of slots, and every other key's editor requests of a few KB waited behind all of
    them; now each waits for at most one job of each other key."""

    def __init__(self, name: str) -> None:
        self.queues: OrderedDict[str | None, deque] = OrderedDict()   # keys with work,
        self.cond = threading.Condition()                          # in their turn
        self.closed = False
        self.name = name
        self.thread: threading.Thread | None = None     # (started by the first job)

    def submit(self, work, *args, key: str | None = None) -> Future:
        """`work(*args)` in `key`'s turn; its Future (as an executor's)."""
        future: Future = Future()
        with self.cond:
            if self.closed:
                raise RuntimeError("cannot take jobs after shutdown")   # (as an executor)
            if self.thread is None:
                thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                thread.start()                 # (where it cannot, the next job tries again)
                self.thread = thread
            self.queues.setdefault(key, deque()).append((future, work, args))
            self.cond.notify()
        return future

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.queues and not self.closed:
                    self.cond.wait()
                if not self.queues:             # (closed, and nothing left to work)
                    return
                key, queue = self.queues.popitem(last=False)
                future, work, args = queue.popleft()
                if queue:
                    self.queues[key] = queue            # its next, after the others'
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(work(*args))
            except BaseException as exc:    # (the work reports its own: never the thread)
                future.set_exception(exc)
            del future, work, args          # (the job's body is not held while idle)

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        """As an executor's: no more jobs; those not started dropped (their futures
        cancelled) or, by default, worked first; `wait`: until the thread is done."""
        with self.cond:
            self.closed = True
            if cancel_futures:
                for queue in self.queues.values():
                    for future, _, _ in queue:
                        future.cancel()
                self.queues.clear()
            self.cond.notify_all()
        if wait and self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join()


class Preparer:
    """The preparing thread and what it holds. `submit` runs on the IO thread; the rest on
    the generation loop's, which owns the prepared jobs once they are in its inbox."""

    def __init__(self, engine, fim_template, inbox, watch: ThreadWatch | None = None
                 ) -> None:
        self.engine, self.fim_template, self.inbox = engine, fim_template, inbox
        self.watch = watch or ThreadWatch()     # (the watchdog's view of its threads)
        self.thread = TakingTurns("prepare")
        self.big_thread = TakingTurns("prepare-big")
        self.preparing: dict[str, int] = {}     # request id -> its latest attempt there
        self.on_thread: set[tuple[str, int]] = set()   # every (id, attempt) not back yet
        self.cancelled: set[tuple[str, int]] = set()   # ... cancelled while there
        self.ready: dict[str, Prepared] = {}    # prepared, waiting for a slot
        self.superseding: set[tuple[str, int]] = set()   # ... handed here by the loop
        self._fitted: OrderedDict[tuple, Fitted] = OrderedDict()   # (FITTED_KEPT)
        self._fitted_lock = threading.Lock()    # (the two threads share them)

    def submit(self, request_id: str, body: P.WorkerJob, superseding: bool = False) -> bool:
        """Prepare the job on the thread if that pays (True; it then arrives in the inbox
        as ("job", id, body, Prepared)), else False: the caller queues it as it is.
        `superseding`: the loop's, for a session's new request that could not take over
        the generation it superseded (worth_preparing leaves those to the loop, which
        tries the takeover first)."""
        if not worth_preparing(msgspec.structs.replace(body, adopt=None) if superseding
                               else body):
            return False
        self.preparing[request_id] = body.attempt
        self.on_thread.add((request_id, body.attempt))
        if superseding:
            self.superseding.add((request_id, body.attempt))
        # (one request's attempts are alike in size and of one key: they keep their
        # order on one thread)
        thread = self.big_thread if text_size(body) >= BIG_PREPARE_CHARS else self.thread
        try:
            thread.submit(self._work, request_id, body, key=body.api_key)
        except RuntimeError:            # (shut down: the worker is stopping; or no thread
            self.preparing.pop(request_id, None)    # could start) the loop takes it as
            self.on_thread.discard((request_id, body.attempt))        # it is
            self.superseding.discard((request_id, body.attempt))
            return False
        return True

    def _work(self, request_id: str, body: P.WorkerJob) -> None:
        if (request_id, body.attempt) in self.cancelled:
            # cancelled while it waited for the thread (a keystroke's job superseded by
            # the next: each was tokenized in turn, only the last wanted, and the lag
            # grew with every key): not prepared, only handed back to be dropped (its
            # error says why, were it ever admitted)
            self.inbox.put(inbox.PreparedJob(request_id, body, Prepared(
                error=EngineError("cancelled before it was prepared"))))
            return
        with self.watch.job():
            self._prepare(request_id, body)

    def _prepare(self, request_id: str, body: P.WorkerJob) -> None:
        prepared = Prepared()
        try:
            extra = list(body.infill.extra) if body.infill else []
            check_fits(self.engine, body, self.fim_template)
            prepared.fitted = self._fitted_prompt(body, extra)
            with tenant_of(self.engine, body):      # (a text bias's tokens: its own)
                prepared.sampling = sampling_of(body.generation, self.engine)
            prepared.chain = self.engine.sampler_chain(
                SamplingParams.from_job(prepared.sampling), body.tenant or "")
        except Exception as exc:           # raised when the job is admitted
            if not isinstance(exc, EngineError):
                log.exception("%s: preparing failed", request_id)
            prepared.free()
            prepared.error = exc
        self.inbox.put(inbox.PreparedJob(request_id, body, prepared))

    def _fitted_prompt(self, body: P.WorkerJob, extra: list[dict]) -> Fitted:
        """The job's fitted prompt; a copy of its request's other choices' where one of
        them was fitted lately (the same prompt fields, answer's room and context)."""
        shared = body.share_as          # (the first choice's id, on every choice here)
        if not shared:
            return fitted_prompt(self.engine, body, self.fim_template, extra)
        key = (shared, body.tenant, body.generation.max_tokens, body.route.n_ctx,
               body.generation.parse_special)
        with self._fitted_lock:
            fitted = self._fitted.get(key)
            if fitted is not None:
                self._fitted.move_to_end(key)
        if fitted is None:
            fitted = fitted_prompt(self.engine, body, self.fim_template, extra)
            with self._fitted_lock:
                self._fitted[key] = fitted
                while len(self._fitted) > FITTED_KEPT:
                    self._fitted.popitem(last=False)
        return copy.deepcopy(fitted)     # (an /infill's parts learn their length once)

    def arrived(self, request_id: str, attempt: int, prepared: Prepared) -> bool:
        """A prepared job reached the loop: kept for admission (True), or dropped if it
        was cancelled meanwhile."""
        self.on_thread.discard((request_id, attempt))
        self.superseding.discard((request_id, attempt))
        if (request_id, attempt) in self.cancelled:
            self.cancelled.discard((request_id, attempt))
            prepared.free()
            return False
        # (popped, not read then deleted: the IO thread may hand a later attempt over
        # in between, whose entry is then kept)
        current = self.preparing.pop(request_id, None)
        if current is not None and current != attempt:
            self.preparing.setdefault(request_id, current)      # another attempt's
            if current > attempt:
                prepared.free()             # a later attempt of it is on the way
                return False
        self.drop(request_id)               # (an earlier attempt's, never admitted)
        self.ready[request_id] = prepared
        return True

    def cancel(self, request_id: str, upto: int | None = None) -> int | None:
        """The latest attempt of a job still being prepared, now cancelled; None if none
        is, or if that one is later than `upto` (it stays). Every attempt of it on the
        thread up to `upto` is dropped as it arrives: an earlier one left to the later
        one's entry (`arrived`) ran for nobody once that entry went with a cancel."""
        def wanted(attempt: int) -> bool:
            return upto is None or attempt <= upto
        self.cancelled.update(key for key in self.on_thread.copy()
                              if key[0] == request_id and wanted(key[1]))
        # (popped, not read then deleted: the IO thread may hand a later attempt over)
        attempt = self.preparing.pop(request_id, None)
        if attempt is None:
            return None
        if not wanted(attempt):
            self.preparing.setdefault(request_id, attempt)      # a later attempt: kept
            return None
        self.cancelled.add((request_id, attempt))
        return attempt

    def from_loop(self) -> frozenset[tuple[str, int]]:
        """The superseding jobs the loop handed here that are not back yet ((id,
        attempt)): a Reset's snapshot, taken on the IO thread, cannot know of them."""
        return frozenset(self.superseding & self.on_thread)

    def shutdown(self) -> None:
        for thread in (self.thread, self.big_thread):
            thread.shutdown(wait=True, cancel_futures=True)

    def take(self, request_id: str) -> Prepared | None:
        return self.ready.pop(request_id, None)

    def drop(self, request_id: str) -> None:
        prepared = self.ready.pop(request_id, None)
        if prepared is not None:
            prepared.free()

    def being_prepared(self) -> frozenset[tuple[str, int]]:
        """The jobs on the preparing thread now ((id, attempt)), not cancelled, for a
        Reset (IO thread) or a hand-back (each copy is taken whole under the GIL)."""
        return frozenset(self.on_thread.copy() - self.cancelled.copy())

    def reset(self, preparing: frozenset[tuple[str, int]]) -> None:
        """The dispatcher forgot us: nothing it had handed over is wanted, the jobs being
        prepared then (`preparing`) and those prepared since (they were handed over
        before: the inbox keeps the order). Jobs the new connection handed over while this
        waited in the inbox are kept: the dispatcher holds them as started. A job of
        `preparing` is cancelled even where the new connection has handed the same
        request over again (a later attempt, on the thread behind it): the earlier one's
        arrival would otherwise take a second slot under the same id."""
        for request_id, attempt in preparing:
            if (request_id, attempt) not in self.on_thread:
                continue                    # back already: dropped below if kept
            current = self.preparing.pop(request_id, None)     # (popped: see `arrived`)
            if current is not None and current != attempt:
                self.preparing.setdefault(request_id, current)  # the new connection's
            self.cancelled.add((request_id, attempt))
        for request_id in list(self.ready):
            self.drop(request_id)
