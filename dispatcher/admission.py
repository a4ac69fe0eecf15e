"""The bookkeeping of admission that spans several messages, as two small objects the
core (`dispatcher.core`) owns and asks; every decision stays in the core.

`Units`: a request's prompts × choices arrive as separate jobs and are admitted (or
refused) as one unit; while they arrive, the later ones may name the first job of their
prompt instead of carrying the prompt again (protocol.SHARED_FIELDS).

`Sessions`: the open jobs of each session (X-Session-Id) and the client's order of its
newest request, so that a newer request ends the older ones and an older one arriving
late is itself superseded.
"""
from __future__ import annotations

from collections import OrderedDict

from dispatcher.common import protocol as P
from dispatcher.queues import Job

# How long the rest of an admitted request's jobs may take to arrive.
UNIT_TIMEOUT = 60.0
# How long the newest request of an idle session is remembered (to refuse a late older one).
SESSION_MEMORY = 600.0
# A session whose client's counter (X-Session-Seq) starts again: a request numbered at most
# this, or one arriving this long after the newest has ended, begins a new epoch.
RESTARTED_SEQ = 1
RESTART_GAP = 10                # (a late 0 or 1 among the first few is only a late one)
EPOCH_PAUSE = 2.0
# Sessions remembered at most, the least recently used forgotten first: with ids of at
# most 128 characters (the front end's limit) about 5 MB.
MAX_SESSIONS = 10_000


class Units:
    def __init__(self) -> None:
        # requests being admitted job by job: parent id -> [jobs still to come, since]
        self.pending: dict[str, list] = {}
        # parent id -> [since, {job id: its prompt fields}] while its jobs arrive
        self.shared: dict[str, list] = {}

    def fill(self, request_id: str, body: P.SubmittedJob) -> P.SubmittedJob | None:
        """The job whole: an earlier job's prompt fields filled in for `same_as` (the same
        objects: nothing is copied). None if `same_as` names nothing known."""
        same = body.same_as
        if same is None:
            return body
        entry = self.shared.get(body.parent or request_id)
        fields = entry[1].get(same) if entry else None
        if fields is None:
            return None
        return P.with_prompt(body, fields)

    def later_job(self, parent: str) -> bool:
        """True for a later job of a request whose first job was admitted: a request's
        prompts × choices are admitted (or refused) as one unit, never half of them."""
        unit = self.pending.get(parent)
        if unit is None:
            return False
        unit[0] -= 1
        if unit[0] <= 0:
            del self.pending[parent]
            self.shared.pop(parent, None)    # every job of it is here now
        return True

    def admitted(self, job: Job, now: float) -> None:
        """`job` was queued: the first of a fan-out opens its unit; the first job of each
        prompt leaves its prompt fields for the jobs that will name it."""
        fanout = job.body.fanout
        if fanout > 1 and job.parent not in self.pending:
            self.pending[job.parent] = [fanout - 1, now]
        if job.share_key == job.request_id and job.parent in self.pending:
            entry = self.shared.setdefault(job.parent, [now, {}])
            entry[1][job.request_id] = P.prompt_fields(job.body)

    def expire(self, now: float) -> None:
        for parent, (_, since) in list(self.pending.items()):
            if since < now - UNIT_TIMEOUT:         # its front end never sent the rest
                del self.pending[parent]
        for parent, (since, _) in list(self.shared.items()):
            if since < now - UNIT_TIMEOUT and parent not in self.pending:
                del self.shared[parent]


class Sessions:
    def __init__(self) -> None:
        self.open: dict[str, dict[str, Job]] = {}   # X-Session-Id -> its open jobs
        # X-Session-Id -> (order, parent, when) of the newest request the client sent,
        # least recently used first
        self.newest: OrderedDict[str, tuple] = OrderedDict()

    def arrives(self, job: Job, now: float) -> tuple[bool, list[Job]]:
        """A job of a session arrives: (False, []) if the client sent a newer request of
        the session before it (it is superseded itself), else (True, the session's open
        jobs of older requests, which it supersedes; they are forgotten here). Order is
        the client's (`session_order`), never the order of arrival here."""
        session, parent = job.body.session, job.body.parent
        order = job.body.session_order
        newest = self.newest.get(session)
        if newest is not None and newest[1] != parent and newest[0] > order \
                and not self._new_epoch(job, newest, now):
            return False, []
        self.newest[session] = (order, parent, now)
        self.newest.move_to_end(session)
        while len(self.newest) > MAX_SESSIONS:
            self.newest.popitem(last=False)
        jobs = self.open.setdefault(session, {})
        older = [old for old in jobs.values() if old.body.parent != parent]  # not siblings
        for old in older:
            del jobs[old.request_id]
        jobs[job.request_id] = job
        return True, older

    def _new_epoch(self, job: Job, newest: tuple, now: float) -> bool:
        """A lower X-Session-Seq that starts the client's count again (an editor restarted
        with the same session id) rather than a late older request: numbered 0 or 1, or
        sent after a pause once the session's requests have all ended."""
        if not job.body.session_seq:
            return False                 # arrival stamps never go back
        idle = not self.open.get(job.body.session)
        restarted = job.body.session_order <= RESTARTED_SEQ and \
            newest[0] >= job.body.session_order + RESTART_GAP
        return restarted or (idle and now - newest[2] >= EPOCH_PAUSE)

    def forget(self, job: Job) -> None:
        session = job.body.session
        if session and session in self.open:
            self.open[session].pop(job.request_id, None)
            if not self.open[session]:
                del self.open[session]

    def expire(self, now: float) -> None:
        for session, (_, _, seen) in list(self.newest.items()):
            if seen < now - SESSION_MEMORY and session not in self.open:
                del self.newest[session]
