"""Who may take a slot, or a place in the queue, next: each API key's share of a model's
slots and of its queue, the share of a request of long choices, and whose turn it is.

With several keys (tenants), one key's request of 16 choices without max_tokens must not
hold every slot while another key's keystroke waits: a key runs at most
`key_slot_share` of a model's slots at once (past it only brief jobs, while no other
key's wait for the model) and queues at most `max_queue_per_key` requests; a request whose choices are long runs at most REQUEST_SLOT_SHARE of them
(short fan-outs fill every slot); among the keys whose jobs wait, the one served longest
ago goes first (`served`, read by `RequestQueue.in_fair_order`).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from dispatcher.common import config

SERVED_KEYS = 4096          # keys whose last turn is remembered, least recent forgotten


class Shares:
    def __init__(self, key_slot_share: float = 1.0, max_queue_per_key: int = 0):
        self.key_slot_share = key_slot_share          # 1: a key may run every slot
        self.max_queue_per_key = max_queue_per_key    # 0: no share of the queue per key
        # API key fingerprint -> the number of the dispatch that last served it (turns)
        self.served: OrderedDict[str, int] = OrderedDict()
        self._dispatched = 0

    def key_queue_full(self, queued: int) -> bool:
        """Whether an API key with `queued` requests waiting in a lane has its share."""
        return bool(self.max_queue_per_key) and queued >= self.max_queue_per_key

    @staticmethod
    def running(workers) -> "Running":
        """Jobs running now, by request (parent id), by key, and by key and model; a
        cancelled job's slot is as good as free."""
        now = Running()
        for record in workers:
            for job in record.running.values():
                if not job.cancelled:
                    now.add(job)
        return now

    def may_run(self, job, running: "Running", slots: int,
                key_running: int | None = None, alone: bool = False) -> bool:
        """Whether `job` may take a slot of its model's `slots` now (those that take its
        work): its key (on this model: a key's chat on one model takes nothing from its
        completions on another; `key_running`, its jobs on those slots, where known) and
        its request below their shares. `alone`: no other key's job waits for the model,
        so a brief job (QueuedJob.brief) may go past its key's share: a free slot kept
        for nobody made the key's own users wait for whole completions, and a key that
        comes waits for one brief job."""
        api_key = job.body.api_key
        if key_running is None:
            key_running = running.by_key_model.get((api_key, job.body.model), 0)
        if api_key is not None and self.key_slot_share < 1.0 and \
                key_running >= share_of(slots, self.key_slot_share) and \
                not (alone and job.brief):
            return False                        # its key runs its share: others' turn
        if job.long and running.by_request.get(job.parent, 0) >= share_of(
                slots, config.REQUEST_SLOT_SHARE):
            return False                        # its long choices run their share
        return True

    def served_now(self, api_key: str | None) -> None:
        if api_key is None:
            return
        self._dispatched += 1
        self.served[api_key] = self._dispatched
        self.served.move_to_end(api_key)
        while len(self.served) > SERVED_KEYS:
            self.served.popitem(last=False)


@dataclass
class Running:
    """Jobs running, counted three ways (`Shares.running`); `add` counts one more."""
    by_request: dict[str, int] = field(default_factory=dict)
    by_api_key: dict[str | None, int] = field(default_factory=dict)
    by_key_model: dict[tuple[str | None, str], int] = field(default_factory=dict)

    def add(self, job) -> None:
        api_key = job.body.api_key
        self.by_request[job.parent] = self.by_request.get(job.parent, 0) + 1
        self.by_api_key[api_key] = self.by_api_key.get(api_key, 0) + 1
        pair = (api_key, job.body.model)
        self.by_key_model[pair] = self.by_key_model.get(pair, 0) + 1


def share_of(slots: int, share: float) -> int:
    """`share` of `slots`, at least one."""
    return max(1, int(slots * share))
