"""Type-along adoption: a session's new request takes over its running generation.

An editor sends a request per keystroke and drops the previous one. When the user types
exactly what the running completion had suggested, cancelling it throws away a
generation that was right and starts a new prefill of the same text. Instead the
dispatcher sends the new request to the worker running the old one, marked `adopt`
(only when their `adopt_key`s match: same session, model, suffix, sampling and output
options; see app/jobs.py). Here, if the new prompt is the old prompt plus a prefix of
the text generated so far, the slot's running sequence is handed to the new request:
its stream starts with what was generated after the typed text and goes on from there;
the old request ends as superseded (its client has already been told by the
dispatcher). Otherwise the old request is cancelled and the new one is admitted first,
into the slot it freed (its prompt is then mostly cached there).
"""
from __future__ import annotations

import bisect
import logging

from dispatcher.common import protocol as P
from workers.requests import Active, EditorLimits
from workers.textstream import TextAssembler

log = logging.getLogger(__name__)


def adopt_or_supersede(loop, request_id: str, body: P.WorkerJob) -> None:
    old_id = body.adopt
    old = loop.active.get(old_id)
    found = _typed(loop, old, body)
    if found is not None:
        return _adopt(loop, old, *found, request_id, body)
    log.info("%s: %s cannot be adopted; cancelled, the new request goes first", request_id,
             old_id)
    loop.cancel(old_id)
    loop.waiting.appendleft((request_id, body))


def _typed(loop, old: Active | None, body: P.WorkerJob) -> tuple[str, int] | None:
    """What the user typed since `old`'s prompt, if it is a prefix of what `old` has
    generated, and how many generated tokens it covers (None: not adoptable)."""
    if old is None or not isinstance(old.prompt, str) or old.assembler.stopped \
            or getattr(loop.engine, "deterministic", False):
        return None             # (deterministic: a result never depends on another one)
    prompt = body.prompt
    if not isinstance(prompt, str) or not prompt.startswith(old.prompt):
        return None
    typed = prompt[len(old.prompt):]
    if old.echo_text is not None or old.ledger is not None or old.n_probs or old.score \
            or old.return_tokens or not old.assembler.text.startswith(typed):
        return None
    # the tokens whose text lies within what was typed become prompt tokens
    covered = bisect.bisect_right(old.offsets, len(typed))
    limit = body.generation.max_tokens
    if limit is not None and old.generated - covered > limit:
        return None             # it has already generated more than the new one may
    return typed, covered


def _adopt(loop, old: Active, typed: str, covered: int, request_id: str,
           body: P.WorkerJob) -> None:
    gen = body.generation
    new = Active(request_id, body.topic.encode(), body.attempt, old.slot, gen.max_tokens,
                 old.n_ctx, old.prompt_tokens + covered, TextAssembler(gen.stop))
    new.prompt, new.cached = body.prompt, new.prompt_tokens
    new.generated = old.generated - covered
    new.offsets = [offset - len(typed) for offset in old.offsets[covered:]]
    new.first_at = new.started                  # no prefill: it starts generating
    new.limits = EditorLimits.of(gen)
    # the slot changes hands: the engine's sequence goes on as it was
    del loop.active[old.request_id]
    loop.active[request_id] = new
    loop.notify(P.STARTED, request_id, P.Attempt(attempt=new.attempt))
    # its output is what the user typed; the rest is counted with the new request
    loop.notify(P.DONE, old.request_id, old.done(cancelled=True, adopted_by=request_id,
                                                 usage=old.usage(covered)))
    loop._publish(new, P.Start(prompt_tokens=new.prompt_tokens, cached_tokens=new.cached,
                               adopted=True, fingerprint=loop.engine.fingerprint,
                               **loop.identity))
    log.info("%s adopted the generation of %s (%d characters typed along, %d generated "
             "tokens kept)", request_id, old.request_id, len(typed), new.generated)
    text = new.assembler.take_over(old.assembler, len(typed))
    ended = False
    if new.limits is not None:
        text, ended = new.limits.cut(text)
    if text:
        loop._send_text(new, text)
    if ended:                                   # n_indent: the text held so far ends it
        new.assembler.stopped = True
        loop._finish(new, "length", "limit")
    elif new.assembler.stopped:                 # one of the new request's stop strings
        loop._finish(new, "stop", "word")
    elif new.max_tokens is not None and new.generated >= new.max_tokens:
        loop._finish(new, "length", "limit")
