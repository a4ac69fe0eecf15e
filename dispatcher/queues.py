"""The dispatcher's state: the request queue and the worker registry."""
from __future__ import annotations

import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

import msgspec

from dispatcher.common import config, protocol as P
from dispatcher.common.fit import fits
from dispatcher.routing import BLOCK_CHARS, choose_worker, prefix_blocks, shared_blocks


@dataclass
class QueuedJob:
    """The dispatcher's record of one job while it is queued or running: the front end's
    `protocol.Job` (its `body`) and where it stands here."""
    request_id: str
    frontend: bytes              # the owning front end's id (also its token topic)
    body: P.SubmittedJob         # the job as the front end sent it (prompt filled in)
    attempt: int = 1
    handed_back: int = 0         # attempts a stopping worker handed back unstarted
    crashes: int = 0             # workers that crashed while it was on them unstarted
    enqueued_at: float = field(default_factory=time.monotonic)
    worker: bytes | None = None  # the worker running it, once dispatched
    started: bool = False        # the worker took it into a slot (prefill began)
    cancelled: bool = False      # cancelled or superseded while on a worker: never requeued
    first_token: bool = False    # the worker said its first text is going out
    deadline: float | None = None   # leave the queue with a 504 after this (monotonic)
    adopt_from: "QueuedJob | None" = None  # the session's running job it may take over
    unservable_since: float | None = None  # since when no worker can run it (expire)
    share_key: str | None = None     # the id its prompt fields go by (protocol.SHARED_FIELDS)
    _blocks: tuple | None = field(default=None, repr=False)

    @property
    def blocks(self) -> tuple[int, ...]:
        """The prompt's chained block hashes (routing.prefix_blocks), computed once."""
        if self._blocks is None:
            self._blocks = prefix_blocks(self.body)
        return self._blocks

    @property
    def model(self) -> str:
        return self.body.model

    @property
    def long(self) -> bool:
        """One of several choices of a request that may generate more than
        config.LONG_REQUEST_TOKENS together, or has no limit, or whose prompts take that
        much prefilling (`prompt_work`: eight 3,000-token prompts, max_tokens 1, held
        every slot for a minute): they take turns at config.REQUEST_SLOT_SHARE of the
        model's slots."""
        body = self.body
        if body.fanout <= 1 or body.op is not None:
            return False
        return body.tokens is None or \
            body.fanout * body.tokens + body.prompt_work > config.LONG_REQUEST_TOKENS

    @property
    def brief(self) -> bool:
        """A completion with at most config.BRIEF_TOKENS to write and, with its prompt's
        prefill (`prompt_work`, as the front end estimates it), at most
        config.BRIEF_WORK tokens of work: it frees its slot soon (Shares.may_run lets a
        key alone go past its share with such jobs; eight 3,000-token prompts would
        have held every slot through their prefills)."""
        body = self.body
        return body.op is None and body.tokens is not None and \
            0 <= body.tokens <= config.BRIEF_TOKENS and \
            body.tokens + body.prompt_work <= config.BRIEF_WORK

    def for_worker(self, **changes) -> P.SubmittedJob:
        """The REQUEST body: the job as submitted, with its owner's topic and attempt."""
        return msgspec.structs.replace(self.body, topic=self.frontend.decode(),
                                       attempt=self.attempt, **changes)

    @property
    def parent(self) -> str:
        """The HTTP request this job is part of (one of its prompts × choices)."""
        return self.body.parent or self.request_id


class RequestQueue:
    """One FIFO; the dispatcher takes, oldest first, the jobs some free worker can run, so
    a job waits only behind jobs that could run on the same workers."""

    def __init__(self) -> None:
        self._jobs: deque[QueuedJob] = deque()

    def __len__(self) -> int:
        return len(self._jobs)

    def push(self, job: QueuedJob, front: bool = False) -> None:
        (self._jobs.appendleft if front else self._jobs.append)(job)

    def remove(self, request_id: str) -> QueuedJob | None:
        for job in self._jobs:
            if job.request_id == request_id:
                self._jobs.remove(job)
                return job
        return None

    def take(self, job: QueuedJob) -> None:
        self._jobs.remove(job)

    @staticmethod
    def lane(job: QueuedJob) -> tuple[str, str | None]:
        """The queue's lane of a job, (model, machine profile): admission is bounded per
        lane."""
        return job.model, job.body.route.profile

    def depth(self, lane: tuple[str, str | None]) -> int:
        """Queued requests of a lane (not jobs: a request's n × prompts jobs count once)."""
        return len({job.parent for job in self._jobs if self.lane(job) == lane})

    def in_fair_order(self, running: dict[str, int],
                      by_key_model: dict[tuple[str | None, str], int] | None = None,
                      served: dict[str, int] | None = None) -> list[QueuedJob]:
        """The jobs in the order they should get a slot: API keys in turn on each model (a
        job's turn is its key's jobs running on its model plus its key's jobs for that
        model queued before it; at equal turns, the key served least recently, `served`),
        then requests with the fewest jobs running, then oldest first. One key's 80
        requests cannot keep another key's behind them, nor a request of 128 choices a
        single-choice one; a key busy on one model waits on no other for it."""
        jobs, by_key_model, served = list(self._jobs), by_key_model or {}, served or {}
        turn, seen = [], {}
        for job in jobs:
            api_key = job.body.api_key
            if api_key is None:
                turn.append(0)
                continue
            pair = (api_key, job.body.model)
            turn.append(by_key_model.get(pair, 0) + seen.get(pair, 0))
            seen[pair] = seen.get(pair, 0) + 1
        order = sorted(range(len(jobs)), key=lambda i: (
            turn[i], served.get(jobs[i].body.api_key, 0), running.get(jobs[i].parent, 0), i))
        return [jobs[i] for i in order]

    def depth_of_api_key(self, lane: tuple[str, str | None], api_key: str) -> int:
        """Queued requests of one API key in a lane (model, profile)."""
        return len({job.parent for job in self._jobs
                    if job.body.api_key == api_key and self.lane(job) == lane})

    def past_deadline(self, now: float, in_service: set[str] = frozenset()) -> list[QueuedJob]:
        """Remove and return the jobs past their queue deadline, but those of a request
        with a choice running (`in_service`: its own share of slots holds them back)."""
        late = [j for j in self._jobs if j.deadline is not None and j.deadline <= now
                and j.parent not in in_service]
        for job in late:
            self._jobs.remove(job)
        return late

    def expire(self, now: float, timeout: float, infos: list[P.Capabilities],
               loading: set[str] = frozenset()) -> list[QueuedJob]:
        """Remove and return the jobs no worker in `infos` has been able to run for
        `timeout` s, counted from when none could (called every tick): a job requeued
        when its model's last worker went waits its while from then, however long it
        was queued before; one whose model a worker is `loading` waits for it."""
        old = []
        for job in self._jobs:
            if job.model in loading or \
                    any(fits(job.model, job.body.route, info) for info in infos):
                job.unservable_since = None
            elif job.unservable_since is None:
                job.unservable_since = now
            elif now - job.unservable_since >= timeout:
                old.append(job)
        for job in old:
            self._jobs.remove(job)
        return old

    def depth_by_model(self) -> dict[str, int]:
        depth: dict[str, int] = {}
        for job in self._jobs:
            depth[job.model] = depth.get(job.model, 0) + 1
        return depth

    def __iter__(self):
        return iter(list(self._jobs))


@dataclass
class WorkerRecord:
    identity: bytes
    info: P.WorkerInfo           # what the worker said in READY
    expires_at: float = 0.0
    running: dict[str, QueuedJob] = field(default_factory=dict)
    ops: dict[str, QueuedJob] = field(default_factory=dict)        # tokenize/detokenize: no slot
    ready_at: float = field(default_factory=time.monotonic)
    completed: int = 0
    cancelled: int = 0
    tokens: int = 0
    last_done: dict = field(default_factory=dict)
    last_assigned: float = 0.0
    recent: deque = field(default_factory=deque)      # (tenant, block hashes) of recent
                                                      # prompts
    held: Counter = field(default_factory=Counter)    # ... each with how many hold it
    held_at: dict = field(default_factory=dict)       # ... and when last given to it
    # the share keys whose prompt fields it was sent lately (protocol.DISPATCHER_SHARED)
    shared_sent: OrderedDict = field(default_factory=OrderedDict)
    history: deque = field(default_factory=lambda: deque(maxlen=512))  # (t, tokens) done
    draining: bool = False       # takes no new work (ops: drain, restart, reload)
    steps: P.StepTotals | None = None    # its step profile, as of its last heartbeat
    heartbeats: int = 0          # heartbeats received (`bench --profile` waits for them)

    def suspect(self, parent: str | None = None) -> bool:
        """Whether a job that was on a crashed worker unstarted waits here to start (one
        of another request than `parent`: a request's jobs are one suspect)."""
        return any(job.crashes and not job.started and not job.cancelled and
                   job.parent != parent for job in self.running.values())

    def remember(self, job: QueuedJob) -> None:
        """Note the prompt this worker now holds (or will hold) in a KV cache: the last
        2 × slots prompts, and past that the tenant with the most of them forgets its
        oldest (as the worker's slots go: a key sending many prompts pushed another key's
        out of routing's view while its cache was still in the worker, and that key's
        next keystroke went to another worker, its prompt prefilled from scratch)."""
        self.recent.append((job.body.tenant, job.blocks))
        self.held.update(job.blocks)
        now = time.monotonic()
        self.held_at.update(dict.fromkeys(job.blocks, now))
        while len(self.recent) > 2 * self.slots:
            counts = Counter(tenant for tenant, _ in self.recent)   # (ties: the oldest's)
            victim = max(counts, key=counts.__getitem__)
            index = next(i for i, (tenant, _) in enumerate(self.recent) if tenant == victim)
            _, old = self.recent[index]
            del self.recent[index]
            self.held.subtract(old)
            for block in old:               # no prompt holds it now
                if self.held[block] <= 0:
                    self.held.pop(block, None)
                    self.held_at.pop(block, None)

    def held_since(self, blocks: tuple[int, ...], shared: int) -> float:
        """When a prompt sharing `blocks`' first `shared` characters (cached_prefix) was
        last given to this worker (0: none): of two workers sharing as much, the later
        holds the longer prefix (a keystroke's prompt is the last one's and a character
        more, in the same last block)."""
        n = shared // BLOCK_CHARS
        return self.held_at.get(blocks[n - 1], 0.0) if n else 0.0

    def cached_prefix(self, blocks: tuple[int, ...]) -> int:
        """About how many characters of a prompt (its `blocks`) a prompt this worker ran
        recently shares with it, in whole blocks."""
        return shared_blocks(blocks, self.held) * BLOCK_CHARS

    @property
    def name(self) -> str:
        return self.identity.decode(errors="replace")

    @property
    def model(self) -> str:
        return self.info.model

    @property
    def slots(self) -> int:
        return max(1, self.info.slots)

    @property
    def busy(self) -> int:
        """Slots its running jobs hold, a cancelled one's not: the worker frees that
        slot when it reads the CANCEL, before any job sent after it (one socket keeps
        their order), so a job the dispatcher sends now takes that slot at once, where
        waiting for the worker's DONE would cost it a step of the worker's loop."""
        return sum(1 for job in self.running.values() if not job.cancelled)

    @property
    def free_slots(self) -> int:
        return self.slots - self.busy

    def refresh(self, now: float, expiry: float) -> None:
        self.expires_at = now + expiry


class WorkerRegistry:
    """Ready workers by identity; expiry as in the guide's Paranoid Pirate pattern."""

    def __init__(self, expiry: float = config.Heartbeat().expiry) -> None:
        self.expiry = expiry        # seconds a worker may be silent
        self.workers: dict[bytes, WorkerRecord] = {}

    def __len__(self) -> int:
        return len(self.workers)

    def __contains__(self, identity: bytes) -> bool:
        return identity in self.workers

    def get(self, identity: bytes) -> WorkerRecord | None:
        return self.workers.get(identity)

    def add(self, identity: bytes, info: P.WorkerInfo, now: float) -> WorkerRecord:
        record = WorkerRecord(identity, info)
        record.refresh(now, self.expiry)
        self.workers[identity] = record
        return record

    def refusal(self, identity: bytes, info: P.WorkerInfo) -> str | None:
        """Why a worker must not register (None: it may): another worker serves a
        different model file under the same model id, so one `model` would answer with
        two models' text."""
        for other in self.workers.values():
            if other.identity != identity and other.info.model == info.model and \
                    None not in (other.info.model_digest, info.model_digest) and \
                    other.info.model_digest != info.model_digest:
                return (f"its model file {info.model_path} differs from "
                        f"{other.info.model_path} that worker {other.name} serves as "
                        f"'{info.model}': give it another model id, or the same file")
        return None

    def remove(self, identity: bytes) -> WorkerRecord | None:
        return self.workers.pop(identity, None)

    def expired(self, now: float) -> list[WorkerRecord]:
        return [w for w in self.workers.values() if w.expires_at < now]

    def choose(self, job: QueuedJob, only: WorkerRecord | None = None
               ) -> WorkerRecord | None:
        """Where a queued job should run now (`routing.choose_worker`), among the workers
        with a free slot that take work (`only` that one, where given); a job that was on
        a crashed worker unstarted, only where no other request's such job waits to
        start (so that the next crash names it)."""
        return choose_worker(job.body, [w for w in (
            self.workers.values() if only is None else (only,))
            if w.free_slots > 0 and not w.draining and
            not (job.crashes and w.suspect(job.parent))], job.blocks)

    def leaders(self) -> tuple[dict[str, WorkerRecord], set[str]]:
        """Where each prompt of several choices (`share_key`) runs while none of its
        choices has written a first token: its other choices go there alone until one
        has (where the worker holds them to copy its prefill anyway). Spread over the
        free workers at once, the n choices of a prompt that crashes llama.cpp in its
        prefill crashed n workers, each failing every request it ran, and n more when
        requeued. Also the prompts that have (their choices spread freely)."""
        leaders: dict[str, WorkerRecord] = {}
        written: set[str] = set()
        for record in self.workers.values():
            for job in record.running.values():
                if job.share_key is None or job.cancelled:
                    continue
                if job.first_token:
                    written.add(job.share_key)
                else:
                    leaders.setdefault(job.share_key, record)
        return {key: record for key, record in leaders.items() if key not in written}, \
            written

    def with_free_slots(self) -> list[WorkerRecord]:
        """Workers that can take a job, most free slots first (ties: least recently used)."""
        return sorted((w for w in self.workers.values() if w.free_slots > 0 and not w.draining),
                      key=lambda w: (-w.free_slots, w.last_assigned))

    def pick(self, job: P.SubmittedJob, max_ops: int | None = None,
             key_ops: int | None = None) -> WorkerRecord | None:
        """The least busy worker that can run `job`, free slot or not (for slotless work),
        among those with fewer than `max_ops` such jobs outstanding, and fewer than
        `key_ops` of its API key's."""
        candidates = [w for w in self.workers.values() if fits(job.model, job.route, w.info)
                      and (max_ops is None or len(w.ops) < max_ops)
                      and (key_ops is None or sum(
                          1 for o in w.ops.values() if o.body.api_key == job.api_key) < key_ops)]
        if not candidates:
            return None
        # a draining worker (one stopping) only where no other can: it serves them, but
        # each one it has delays its exit
        candidates = [w for w in candidates if not w.draining] or candidates
        return min(candidates, key=lambda w: (len(w.running) + len(w.ops), w.last_assigned))

    def infos(self) -> list[P.WorkerInfo]:
        return [w.info for w in self.workers.values()]

    def infos_by_pause(self, paused: set[str]) -> tuple[list, list]:
        """The infos of the workers queued work may count on, and of those it may not:
        the ones the operator drained (`paused`, by name; one drained for a restart or a
        stop is on its way back, or away)."""
        takers, held = [], []
        for w in self.workers.values():
            (held if w.name in paused else takers).append(w.info)
        return takers, held

    def models(self) -> dict[str, dict]:
        out: dict[str, dict] = {}
        for worker in self.workers.values():
            entry = out.setdefault(worker.model, {"ready": 0, "n_ctx": 0, "slots": 0,
                                                  "fim": False})
            entry["ready"] += 1
            entry["slots"] += worker.slots
            entry["n_ctx"] = max(entry["n_ctx"], worker.info.n_ctx)
            entry["fim"] = entry["fim"] or worker.info.fim
        return out
