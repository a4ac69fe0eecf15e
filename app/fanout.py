"""One HTTP request, several jobs (prompts × candidates): their events merged.

Each job's `RequestStream` is read by its own greenlet, which forwards events tagged with
the job's position into one queue; the HTTP handler reads that queue. A disconnect of
the HTTP client reaches every job.
"""
from __future__ import annotations

import time

import gevent
import gevent.queue

from app.client import ClientGone, DispatcherClient, RequestStream
from dispatcher.common import protocol as P

# Wire bytes of events one HTTP request's jobs may send while its handler is busy (writing)
# since it last caught up (took the last event waiting): a client that stopped reading (its
# socket full, the handler blocked in a write) was sent everything its jobs generated
# into memory, 128 choices of n_probs 100 for a whole context; past this its jobs are
# cancelled as if it had left. Events that come while the handler waits for them count
# for nothing, however large: one echo with logprobs of 9 MB, or several choices' echoes
# arriving in one turn of the loop, cancelled a request whose client read everything (a
# non-streaming one with an empty 499); nor does the event just come, nor more than
# is waiting. So one that reads holds at most such a burst, one event and this much.
MAX_BACKLOG_BYTES = 8 << 20


class Fanout:
    def __init__(self, client: DispatcherClient, jobs: list[P.WorkerJob]):
        self.client = client
        self.jobs = jobs
        self.streams: list[RequestStream] = []
        self.merged: gevent.queue.Queue = gevent.queue.Queue()
        self._readers: list[gevent.Greenlet] = []
        self._gone = False
        self.backlog = 0                # wire bytes of the events in `merged`
        self.unwaited = 0               # ... that came while the handler was busy, since
                                        # it last caught up (MAX_BACKLOG_BYTES)
        self.last_size = 0              # ... of the event `events` gave last
        self.overflowed = False         # ... went past MAX_BACKLOG_BYTES: jobs cancelled
        self.waiting = False            # the handler waits in `events` for the next event
        self.ended_at: float | None = None  # time.monotonic() when every job had ended
        self._running = 0               # jobs whose end has not come

    def submit(self) -> None:
        """Queue every job (raises the first rejection, after cancelling the others).
        Choices of one prompt share its objects (app.jobs): the first carries them, the
        others name it (protocol.SHARED_FIELDS), so a long prompt crosses once."""
        first: dict[tuple, str] = {}
        try:
            for job in self.jobs:
                if self._gone:
                    raise ClientGone()
                key = tuple(id(value) for value in P.prompt_fields(job).values())
                if key in first:
                    wire = P.without_prompt(job, first[key])
                else:
                    first[key], wire = job.id, job
                self.streams.append(self.client.submit(wire))
        except BaseException:
            self.close()
            raise
        self._running = len(self.streams)
        self._readers = [gevent.spawn(self._read, i, s) for i, s in enumerate(self.streams)]

    def _read(self, index: int, stream: RequestStream) -> None:
        while True:
            try:
                event = stream.next_event()
            except ClientGone:
                self.merged.put((None, None, 0))
                return
            self.backlog += stream.last_size
            if not self.waiting:
                self.unwaited += stream.last_size
            self.merged.put((index, event, stream.last_size))
            if isinstance(event, P.ENDS):
                self._running -= 1
                if not self._running:   # (what is left now only waits for its client)
                    self.ended_at = time.monotonic()
                return
            # (what waited before this event: one event larger than the bound, coming
            # while the handler writes the one before, is no backlog of a slow client)
            if min(self.unwaited, self.backlog) - stream.last_size > MAX_BACKLOG_BYTES \
                    and not self._gone:
                self.overflowed = True
                self._drop_waiting()
                self.client_gone()
                return

    def _drop_waiting(self) -> None:
        """What waits unwritten goes: the answer ends in an error anyway, and those 8 MB
        (about five times that as decoded events) were held until the slow client had
        read them, for hours at a few KB a minute, on as many connections as it kept."""
        while True:
            try:
                self.merged.get_nowait()
            except gevent.queue.Empty:
                break
        self.backlog = 0

    def client_gone(self) -> None:
        """The HTTP client left (or fell too far behind): every job is cancelled now,
        and its reader stops. Not when the handler next reads: one blocked writing a
        backlog to a slow client would first write all of it (8 MB at 10 KB/s: 800 s)
        while the jobs generated on into their readers' queues."""
        self._gone = True
        for job in self.jobs:
            self.client.client_gone(job.id)
        for stream in self.streams:
            stream.close()              # (CANCEL, forgotten: nothing more is queued)
        self.merged.put((None, None, 0))

    def events(self):
        """(job index, event) in arrival order until every job has ended; raises
        ClientGone when the HTTP client left."""
        open_jobs = len(self.streams)
        while open_jobs:
            if self.merged.empty():     # caught up: what came while it was busy is taken
                self.unwaited = 0
            self.waiting = True
            try:
                index, event, size = self.merged.get()
            finally:
                self.waiting = False
            self.backlog -= size
            self.last_size = size
            if index is None:
                raise ClientGone()
            if isinstance(event, P.ENDS):
                open_jobs -= 1
            yield index, event

    def close(self) -> None:
        """Stop reading; cancel every job that has not finished (idempotent)."""
        gevent.killall(self._readers, block=False)
        for stream in self.streams:
            stream.close()
