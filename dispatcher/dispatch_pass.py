"""One pass of the dispatch over the queue: which queued job may take a slot now, and on
which worker. The core (`DispatcherCore.dispatch`) runs a pass after every change that
may free a slot or queue a job, and sends what it decides; this keeps what one pass
learns (the workers of each route, each key's jobs there, the requests and prompts
that wait) so that a queue of thousands of jobs is looked at once a pass, not once a
job (64 requests of 128 choices queued made each pass 8,192 choices: 18 ms a message,
and a burst of them held the dispatcher past the workers' heartbeats).
"""
from __future__ import annotations

from typing import Iterator

import msgspec

from dispatcher.common.fit import fits
from dispatcher.queues import QueuedJob, RequestQueue, WorkerRecord, WorkerRegistry
from dispatcher.shares import Shares


class DispatchPass:
    def __init__(self, queue: RequestQueue, registry: WorkerRegistry, shares: Shares):
        self.queue, self.registry, self.shares = queue, registry, shares
        self.running = shares.running(registry.workers.values())
        self.takers = [record for record in registry.workers.values() if not record.draining]
        # a route's (its job's model, profile, ...) workers among those that take work
        self.routes: dict[bytes, list[WorkerRecord]] = {}
        # an API key's jobs running on a route's workers (counted where keys have shares)
        self.on_route: dict[tuple[bytes, str | None], int] = {}
        # requests one of whose jobs may not run now, or that no free worker fits: their
        # other jobs (choices of one prompt, alike in all of that) neither, this pass
        self.waits: set[str] = set()
        self.leaders, self.written = registry.leaders()
        self.held: set[str] = set()     # prompts whose choices wait for their first's worker
        # the keys with jobs queued, by model (where keys have shares: `alone` below)
        self.waiting_keys: dict[str, set] = {}
        if shares.key_slot_share < 1.0:
            for job in queue:
                self.waiting_keys.setdefault(job.model, set()).add(job.body.api_key)

    def jobs(self) -> Iterator[QueuedJob]:
        """The queued jobs in their fair order (`RequestQueue.in_fair_order`), less those
        of requests and prompts this pass has already seen wait."""
        for job in self.queue.in_fair_order(self.running.by_request,
                                            self.running.by_key_model, self.shares.served):
            if job.parent not in self.waits and job.share_key not in self.held:
                yield job

    def may_run(self, job: QueuedJob) -> bool:
        """Whether `job`'s key and request are below their shares of its route's slots
        (`Shares.may_run`); if not, its request waits this pass."""
        route = msgspec.json.encode((job.model, job.body.route))
        if route not in self.routes:           # (a drained worker's slots, another
            self.routes[route] = [record for record in self.takers   # profile's: not its)
                                  if fits(job.model, job.body.route, record.info)]
        mine = self.routes[route]
        counted = (route, job.body.api_key)
        if counted not in self.on_route and self.shares.key_slot_share < 1.0 \
                and job.body.api_key is not None:      # (once a pass, when it matters)
            self.on_route[counted] = sum(
                1 for record in mine for other in record.running.values()
                if not other.cancelled and other.body.api_key == job.body.api_key)
        if self.shares.may_run(job, self.running, sum(r.slots for r in mine),
                               self.on_route.get(counted),
                               alone=self.waiting_keys.get(job.model) == {job.body.api_key}):
            return True
        self.waits.add(job.parent)
        return False

    def choose(self, job: QueuedJob) -> WorkerRecord | None:
        """The worker `job` goes to now (`WorkerRegistry.choose`: a prompt of several
        choices goes to its first choice's worker until one has written), or None: its
        request waits this pass (its prompt only, where it waits for its leader)."""
        leader = self.leaders.get(job.share_key)
        worker = self.registry.choose(job, leader)
        if worker is None:
            if leader is not None:       # (its request's other prompts may go on)
                self.held.add(job.share_key)
            else:
                self.waits.add(job.parent)
        elif job.share_key is not None and job.share_key not in self.written:
            self.leaders.setdefault(job.share_key, worker)
        return worker

    def failed(self, job: QueuedJob) -> None:
        """Choosing or sending `job` raised: its request's other jobs (failed with it)
        are passed over."""
        self.waits.add(job.parent)

    def placed(self, job: QueuedJob, worker: WorkerRecord) -> None:
        """`job` went to `worker`: counted as running there, for the rest of the pass."""
        self.running.add(job)
        for route, records in self.routes.items():       # (its slot is theirs too)
            if worker in records and (route, job.body.api_key) in self.on_route:
                self.on_route[route, job.body.api_key] += 1
