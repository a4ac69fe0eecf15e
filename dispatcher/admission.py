"""The bookkeeping of admission that spans several messages, as two small objects the
core (`dispatcher.core`) owns and asks; every decision stays in the core.

`Units`: a request's prompts × choices arrive as separate jobs and are admitted (or
refused) as one unit; while they arrive, the later ones may name the first job of their
prompt instead of carrying the prompt again (protocol.SHARED_FIELDS).

`Sessions`: the open jobs of each session (X-Session-Id) and the client's order of its
newest request, so that a newer request ends the older ones and an older one arriving
late is itself superseded.

`InferredSessions`: a session for editors' FIM requests that send no X-Session-Id, from
who sent them and how their text before the cursor changes.
"""
from __future__ import annotations

import hashlib
import sys
from collections import OrderedDict
from dataclasses import dataclass, field

from dispatcher.common import protocol as P
from dispatcher.queues import QueuedJob

# How long the rest of an admitted request's jobs may take to arrive.
UNIT_TIMEOUT = 60.0
# How long the newest request of an idle session is remembered (to refuse a late older one).
SESSION_MEMORY = 600.0
# A session whose client's counter (X-Session-Seq) starts again: a request numbered at most
# this, or one arriving this long after the newest has ended, begins a new epoch.
RESTARTED_SEQ = 1
RESTART_GAP = 10                # (a late 0 or 1 among the first few is only a late one)
EPOCH_PAUSE = 2.0
# Arrival stamps are the front ends' wall clocks (the one clock front ends on several
# hosts share). A request is late by at most this (its first byte to its job here: the
# head within --header-timeout, 10 s, the body within --body-timeout, 60 s, by default):
# a stamp older than the session's newest by more is a clock stepped back, and the
# request is newer by arriving later (else a step back of D seconds refused the
# session's requests for D, up to SESSION_MEMORY).
STAMP_LATE_LIMIT = 90.0
# Sessions remembered at most, all keys together (about 5 MB with ids of at most 128
# characters, the front end's limit); past it the key remembered for the most loses its
# least recently used session, one without open jobs first (`Sessions.remember`).
MAX_SESSIONS = 10_000


@dataclass
class Pending:
    """A request being admitted job by job."""
    left: int                   # its jobs still to come
    since: float


@dataclass
class SharedPrompts:
    """A request's prompt fields, by the job that first carried them, while its jobs
    arrive (the later ones name that job: `same_as`)."""
    since: float
    fields: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Newest:
    """The newest request a session's client sent."""
    order: int                  # the client's order (X-Session-Seq or arrival stamp)
    parent: str                 # the request (all its jobs share it)
    when: float                 # when it arrived here
    counted: bool               # whether `order` is X-Session-Seq


class Units:
    def __init__(self) -> None:
        self.pending: dict[str, Pending] = {}           # by parent id
        self.shared: dict[str, SharedPrompts] = {}      # by parent id

    def fill(self, request_id: str, body: P.SubmittedJob) -> P.SubmittedJob | None:
        """The job whole: an earlier job's prompt fields filled in for `same_as` (the same
        objects: nothing is copied). None if `same_as` names nothing known."""
        same = body.same_as
        if same is None:
            return body
        entry = self.shared.get(body.parent or request_id)
        fields = entry.fields.get(same) if entry else None
        if fields is None:
            return None
        return P.with_prompt(body, fields)

    def later_job(self, parent: str) -> bool:
        """True for a later job of a request whose first job was admitted: a request's
        prompts × choices are admitted (or refused) as one unit, never half of them."""
        unit = self.pending.get(parent)
        if unit is None:
            return False
        unit.left -= 1
        if unit.left <= 0:
            del self.pending[parent]
            self.shared.pop(parent, None)    # every job of it is here now
        return True

    def admitted(self, job: QueuedJob, now: float, later: bool) -> None:
        """`job` was queued (`later`: as a later job of its unit, `later_job`): the first
        of a fan-out opens its unit; the first job of each prompt leaves its prompt
        fields for the jobs that will name it, while the unit is open (the last job of a
        unit, the first of its own prompt, leaves nothing: no job is left to name it)."""
        fanout = job.body.fanout
        if fanout > 1 and not later and job.parent not in self.pending:
            self.pending[job.parent] = Pending(fanout - 1, now)
        if job.share_key == job.request_id and job.parent in self.pending:
            entry = self.shared.setdefault(job.parent, SharedPrompts(now))
            entry.fields[job.request_id] = P.prompt_fields(job.body)

    def expire(self, now: float) -> None:
        for parent, unit in list(self.pending.items()):
            if unit.since < now - UNIT_TIMEOUT:     # its front end never sent the rest
                del self.pending[parent]
        for parent, entry in list(self.shared.items()):
            if entry.since < now - UNIT_TIMEOUT and parent not in self.pending:
                del self.shared[parent]


class Sessions:
    def __init__(self) -> None:
        self.open: dict[str, dict[str, QueuedJob]] = {}   # X-Session-Id -> its open jobs
        # API key -> X-Session-Id -> the newest request the client sent, least recently
        # used first (session ids are scoped by key: one id is always one key's)
        self.newest: dict[str | None, OrderedDict[str, Newest]] = {}
        self.remembered = 0             # sessions in `newest`, all keys together

    def arrives(self, job: QueuedJob, now: float) -> tuple[bool, list[QueuedJob]]:
        """A job of a session arrives: (False, []) if the client sent a newer request of
        the session before it (it is superseded itself), else (True, the session's open
        jobs of older requests, which it supersedes; they are forgotten here). Order is
        the client's (`session_order`), never the order of arrival here."""
        session, parent = job.body.session, job.body.parent
        order, counted = job.body.session_order, job.body.session_seq
        if self._older(job, now):
            return False, []
        self.remember(job.body.api_key, session, Newest(order, parent, now, counted))
        jobs = self.open.setdefault(session, {})
        older = [old for old in jobs.values() if old.body.parent != parent]  # not siblings
        for old in older:
            del jobs[old.request_id]
        jobs[job.request_id] = job
        return True, older

    def remember(self, api_key: str | None, session: str, newest: Newest) -> None:
        """`newest` is the session's newest request now. Past MAX_SESSIONS the key
        remembered for the most sessions loses its least recently used one without open
        jobs (else its least recently used): a key opening session after session
        forgets its own, never another key's while it holds more (one global list let it
        push out a session whose jobs were still open, and that session's late older
        request then ended the newer one)."""
        sessions = self.newest.setdefault(api_key, OrderedDict())
        if session not in sessions:
            self.remembered += 1
        sessions[session] = newest
        sessions.move_to_end(session)
        while self.remembered > MAX_SESSIONS:
            keys = [k for k, held in self.newest.items()
                    if k != api_key or len(held) > 1]               # (never `session`)
            if not keys:
                return
            victim = max(keys, key=lambda k: len(self.newest[k]))
            held = self.newest[victim]
            gone = next((s for s in held if s not in self.open and s != session),
                        next(iter(held)))
            del held[gone]
            self.remembered -= 1
            if not held:
                del self.newest[victim]

    def _newest(self, job: QueuedJob) -> Newest | None:
        return self.newest.get(job.body.api_key, {}).get(job.body.session)

    def would_end(self, job: QueuedJob, now: float) -> list[QueuedJob]:
        """The open jobs `arrives` would hand back for `job` to supersede, changing
        nothing (admission counts the queue places they leave)."""
        if self._older(job, now):
            return []
        return [old for old in self.open.get(job.body.session, {}).values()
                if old.body.parent != job.body.parent]

    def _older(self, job: QueuedJob, now: float) -> bool:
        """Whether the client sent a newer request of the session before `job`. A
        client's counter and arrival stamps are different scales: a request of the
        other kind is newer by arriving later (X-Session-Seq 2**63-1 once must not lock
        out a client that sends none)."""
        newest = self._newest(job)
        return newest is not None and newest.parent != job.body.parent and \
            newest.counted == job.body.session_seq and \
            newest.order > job.body.session_order and not self._new_epoch(job, newest, now)

    def _new_epoch(self, job: QueuedJob, newest: Newest, now: float) -> bool:
        """A lower X-Session-Seq that starts the client's count again (an editor restarted
        with the same session id) rather than a late older request: numbered 0 or 1, or
        sent after a pause once the session's requests have all ended."""
        if not job.body.session_seq:     # arrival stamps go back only with the clock
            return newest.order - job.body.session_order > STAMP_LATE_LIMIT * 1e9
        idle = not self.open.get(job.body.session)
        restarted = job.body.session_order <= RESTARTED_SEQ and \
            newest.order >= job.body.session_order + RESTART_GAP
        return restarted or (idle and now - newest.when >= EPOCH_PAUSE)

    def forget(self, job: QueuedJob) -> None:
        session = job.body.session
        if session and session in self.open:
            self.open[session].pop(job.request_id, None)
            if not self.open[session]:
                del self.open[session]

    def expire(self, now: float) -> None:
        for api_key, sessions in list(self.newest.items()):
            for session, newest in list(sessions.items()):
                if newest.when < now - SESSION_MEMORY and session not in self.open:
                    del sessions[session]
                    self.remembered -= 1
            if not sessions:
                del self.newest[api_key]


# Sessions inferred for requests without X-Session-Id (InferredSessions)
INFER_WINDOW = 3.0          # seconds since a request of the session last arrived
CURSOR_REGION = 64          # characters before the cursor a keystroke may change
KEYSTROKE_CHARS = 16        # ... removed and added together at most (a few keystrokes)
MIN_SHARED = 32             # ... and at least this much (or all of the shorter) shared
MAX_ENTRIES = 16            # sessions remembered per client and route
MAX_CLIENTS = 4096          # places (client, route, where) remembered, all keys together
MAX_TEXT = 32 << 20         # ... and bytes of text kept in all, as Python holds it (1-4 a
                            # character: `held`; prompts are <= 1 Mi characters)
                            # (past either, the key holding the most loses its oldest)


def cursor_text(body: P.SubmittedJob) -> tuple[str, str] | None:
    """(where the cursor is, the text before it on its line or in its file) of a
    fill-in-the-middle request; None for any other request: only editors' FIM requests
    are ever inferred to replace one another. Where: a digest of the text after the
    cursor and, for /infill with the cursor's line in `prompt` (`middle` here), of the
    lines above it (`input_prefix`, `prompt` here), so that
    only requests at one place (the same text around the one being typed) are compared;
    a warm-up with no text at all is never one (llama.vim's ring-buffer updates)."""
    if not isinstance(body.prompt, str) or not (body.suffix is not None or body.infill):
        return None
    if body.infill and body.infill.middle:    # llama.vim's: the cursor's line so far
        before, around = body.infill.middle, (body.prompt, body.suffix or "")
    else:                                     # the whole text before the cursor
        before, around = body.prompt, ("", body.suffix or "")
    if not before and not around[0] and not around[1]:
        return None
    digest = hashlib.sha256()
    for part in around:
        digest.update(part.encode("utf-8", "surrogatepass"))
        digest.update(b"\x00")
    return digest.hexdigest()[:24], before


def same_cursor(old: str, new: str) -> bool:
    """A keystroke's change: the texts differ only within the last CURSOR_REGION
    characters of the shorter, by at most KEYSTROKE_CHARS characters removed and added
    (typing, deleting, a word completed), sharing at least MIN_SHARED characters (or all
    of the shorter). The long common part is compared at C speed (texts run to 1 MiB)."""
    if old == new:
        return False
    n = min(len(old), len(new))
    fixed = max(0, n - CURSOR_REGION)
    if old[:fixed] != new[:fixed]:
        return False
    shared = fixed
    while shared < n and old[shared] == new[shared]:
        shared += 1
    changed = len(old) + len(new) - 2 * shared
    return changed <= KEYSTROKE_CHARS and shared >= min(MIN_SHARED, n)


@dataclass
class Cursor:
    """A session inferred for one place in a file: the text before the cursor of its
    newest request, and when a request of it last came."""
    text: str
    session: str
    seen: float
    order: int                  # the arrival stamp of the request `text` is from


def held(text: str) -> int:
    """The bytes `text` takes in memory: a character of an emoji-laden text takes four
    (counted in characters, the 32 Mi of MAX_TEXT held 128 MiB)."""
    return sys.getsizeof(text)


class InferredSessions:
    """Sessions for clients that send no X-Session-Id (no editor plugin does): a FIM
    request joins the session of a recent one from the same client (API key and address,
    `QueuedJob.client`), model and route whose text before the cursor it changes only near the
    cursor (`same_cursor`), within INFER_WINDOW seconds of that session's last request.
    Otherwise it starts a session of its own. The session id names the client, so no
    request of another key or address ever joins it; order is the arrival stamp, as for
    a header without X-Session-Seq.

    Places (client, model, route, where) are kept per API key, least recently seen first.
    Past MAX_CLIENTS places or MAX_TEXT bytes of text in all, the key holding the most (places,
    or bytes where the text is over) loses its least recently seen one: a key sending
    many clients or long texts evicts its own places, never another key's while it holds
    more than that key (an evicted place's next keystroke starts a session of its own, and
    the stale one it should have ended runs on)."""

    def __init__(self) -> None:
        # API key -> (client, model, route, where) -> the sessions at that place
        self.keys: dict[str | None, OrderedDict[tuple, list[Cursor]]] = {}
        self.key_bytes: dict[str | None, int] = {}
        self.counter = 0
        self.places = 0                 # places, all keys together
        self.bytes = 0                  # what the texts take (`held`), all keys together

    def _count(self, api_key: str | None, size: int) -> None:
        self.bytes += size
        self.key_bytes[api_key] = self.key_bytes.get(api_key, 0) + size

    def _drop(self, api_key: str | None, entries: list[Cursor]) -> None:
        self._count(api_key, -sum(held(e.text) for e in entries))

    def peek(self, body: P.SubmittedJob, now: float) -> str | None:
        """The session `session_for` would find for `body` (None: a new one or none),
        changing nothing: admission counts the queue places of the requests it would
        end before the request may be refused (a refused keystroke must leave the
        session as it was, or its retry matched nothing)."""
        cursor = cursor_text(body) if body.client and body.fanout == 1 else None
        if cursor is None:
            return None
        where, text = cursor
        places = self.keys.get(body.api_key, {})
        for entry in reversed(places.get((body.client, body.model, body.route, where), [])):
            if entry.seen >= now - INFER_WINDOW and same_cursor(entry.text, text):
                return entry.session
        return None

    def session_for(self, body: P.SubmittedJob, now: float) -> str | None:
        cursor = cursor_text(body) if body.client and body.fanout == 1 else None
        if cursor is None:
            return None
        where, text = cursor
        api_key, place = body.api_key, (body.client, body.model, body.route, where)
        places = self.keys.setdefault(api_key, OrderedDict())
        entries = places.pop(place, None)
        if entries is None:
            entries = []
            self.places += 1
        self._drop(api_key, [e for e in entries if e.seen < now - INFER_WINDOW])
        entries = [e for e in entries if e.seen >= now - INFER_WINDOW]
        places[place] = entries                 # the most recently seen of its key
        session = None
        for entry in reversed(entries):
            if same_cursor(entry.text, text):
                if body.session_order >= entry.order:   # the newest text goes on matching
                    self._count(api_key, held(text) - held(entry.text))
                    entry.text, entry.order = text, body.session_order
                entry.seen = now
                session = entry.session
                break
        if session is None:
            self.counter += 1
            session = f"~{body.client}:{self.counter}"   # (clients' ids are never ~...)
            entries.append(Cursor(text, session, now, body.session_order))
            self._count(api_key, held(text))
            self._drop(api_key, entries[:-MAX_ENTRIES])
            del entries[:-MAX_ENTRIES]
        self._evict(api_key, place)
        return session

    def _evict(self, api_key: str | None, kept: tuple) -> None:
        """Back within MAX_CLIENTS places and MAX_TEXT bytes, taking from the key that
        holds the most; never the place just used (`kept`, of `api_key`)."""
        while self.places > MAX_CLIENTS or self.bytes > MAX_TEXT:
            by_text = self.bytes > MAX_TEXT
            candidates = [k for k, places in self.keys.items()
                          if len(places) > (1 if k == api_key else 0)]
            if not candidates:
                return
            victim = max(candidates, key=lambda k: self.key_bytes.get(k, 0) if by_text
                         else len(self.keys[k]))
            places = self.keys[victim]
            oldest = next(iter(places))
            if oldest == kept and victim == api_key:   # (it is the newest: never first)
                return
            self._drop(victim, places.pop(oldest))
            self.places -= 1
            if not places:
                del self.keys[victim]
                self.key_bytes.pop(victim, None)


class ServedRequests:
    """Requests of several jobs a choice of which was served: their other choices keep
    their place in the queue (a finished first choice freed its slot for another key's
    turn, and the next tick 504'd the rest). Remembered `keep_for` s, `most` at most, per
    API key: past `most` the key remembered for the most forgets its oldest (one list
    let a key's many cheap fan-outs push out another key's request still half served).
    `parent in served` asks."""

    def __init__(self, keep_for: float, most: int) -> None:
        self.keep_for, self.most = keep_for, most
        self.by_key: dict[str | None, OrderedDict[str, float]] = {}   # parent -> when
        self.count = 0

    def __contains__(self, parent: object) -> bool:
        return any(parent in served for served in self.by_key.values())

    def __len__(self) -> int:
        return self.count

    def served(self, parent: str, api_key: str | None, now: float) -> None:
        served = self.by_key.setdefault(api_key, OrderedDict())
        if served.pop(parent, None) is None:
            self.count += 1
        served[parent] = now
        for key, held in list(self.by_key.items()):
            while held and next(iter(held.values())) < now - self.keep_for:
                held.popitem(last=False)
                self.count -= 1
            if not held:
                del self.by_key[key]
        while self.count > self.most:
            victim = max(self.by_key, key=lambda k: len(self.by_key[k]))
            held = self.by_key[victim]
            held.popitem(last=False)
            self.count -= 1
            if not held:
                del self.by_key[victim]
