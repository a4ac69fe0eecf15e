"""What the generation loop's inbox carries: one small type per message, matched by type.

The IO thread (workers/worker.py), the preparing thread (workers/preparation.py) and the
vocabulary thread (tokenize/detokenize) put these; only the generation loop
(workers/generation.py) takes them, and it alone touches the engine and the sockets'
publisher.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

from dispatcher.common import protocol as P


@dataclass(frozen=True, slots=True)
class NewJob:
    """A REQUEST to run (or a tokenize/detokenize op), not prepared beforehand."""
    request_id: str
    body: P.WorkerJob


@dataclass(frozen=True, slots=True)
class PreparedJob:
    """A REQUEST whose prompt was tokenized and sampler chain built on the preparing
    thread (`workers.preparation.Prepared`)."""
    request_id: str
    body: P.WorkerJob
    prepared: Any


@dataclass(frozen=True, slots=True)
class OpDone:
    """A tokenize/detokenize op finished on the vocabulary thread: its result or error."""
    request_id: str
    body: P.WorkerJob
    result: Any = None
    error: BaseException | None = None


@dataclass(frozen=True, slots=True)
class Invalid:
    """A REQUEST whose body did not decode: answered with a 400 on its topic."""
    request_id: str
    topic: str
    attempt: int
    message: str


@dataclass(frozen=True, slots=True)
class Cancel:
    """The job's attempts up to `attempt` (None: any) are cancelled (P.CancelUpTo)."""
    request_id: str
    attempt: int | None = None


@dataclass(frozen=True, slots=True)
class Reset:
    """The dispatcher forgot this worker: it has requeued or failed everything it held.
    `preparing`: the jobs on the preparing thread when it did ((id, attempt)); a job the
    new connection hands over goes there before the generation loop reads this, and
    stays wanted."""
    preparing: frozenset[tuple[str, int]] = frozenset()


Message = Union[NewJob, PreparedJob, OpDone, Invalid, Cancel, Reset]
