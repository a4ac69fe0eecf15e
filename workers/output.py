"""What a running request sends: its events on the token stream (start, text, end, error,
numbered per attempt, in order) and its notices to the dispatcher (FIRST, DONE), made
from each sampled token (stop strings, editors' limits, logprobs, llama.cpp's extra
fields). The generation loop (`workers.generation`) decides when a request starts, steps
and ends; this says what goes out, and frees the request's slot through `release`.
"""
from __future__ import annotations

import codecs
import logging
import time
from typing import Callable

from dispatcher.common import protocol as P
from workers.active import Active, LogprobLedger, probs_entry
from workers.errors import EngineError, wire_error
from workers.faults import FaultInjection
from workers.interface import Engine
from workers.prefill import PrefillMeter
from workers.prompts import token_text
from workers.publisher import Publisher

log = logging.getLogger(__name__)


class Output:
    def __init__(self, engine: Engine, publisher: Publisher,
                 notify: Callable[[bytes, str, object], None], faults: FaultInjection,
                 prefill: PrefillMeter, release: Callable[..., None]):
        self.engine, self.publisher, self.notify = engine, publisher, notify
        self.faults, self.prefill = faults, prefill
        self.release = release          # (active, keep_cache=True): its slot freed; never
                                        # raises (the loop's _drop logs a failed release)

    def echo(self, active: Active, prompt_lp: list | None, tokens: list[int]) -> None:
        active.echo_pending = False
        logprobs = None
        if active.ledger is not None:
            # offsets in the text as one decoder makes it: a character split over
            # tokens counts once, at the token that completes it
            offset, ledger = 0, LogprobLedger(active.ledger.k)
            decoder = codecs.getincrementaldecoder("utf-8")("replace")
            entries = [(tokens[0], None, None)] + (prompt_lp or [])
            text = active.echo_text or ""
            for token, lp, top in entries:
                piece = self.engine.piece(token)
                if not piece:       # a control token the prompt names ("<start_of_turn>")
                    named = self.engine.piece(token, special=True)   # is its text there
                    if named and text.startswith(named.decode("utf-8", "replace"), offset):
                        piece = named
                if top is not None:     # (with the token itself, as a generated one's)
                    top = self._top_dict(top)
                    top.setdefault(token_text(piece), lp)
                ledger.add(offset, token_text(piece), lp, top)
                offset += len(decoder.decode(piece))
            logprobs = ledger.release(None)
        self.text(active, active.echo_text, logprobs)

    def reject(self, request_id: str, topic: bytes, attempt: int, exc: EngineError) -> None:
        error = wire_error(exc)
        self.publisher.publish(topic, request_id, error.event(0, attempt))
        self.notify(P.DONE, request_id, P.Done(attempt=attempt, last_seq=0,
                                               error=error.code))

    def token(self, active: Active, out) -> None:
        self.faults.check("token", active.prompt)
        if active.echo_pending:
            self.echo(active, out.prompt, active.prompt_ids)
            if active.max_tokens == 0:
                self.finish(active, "length")
                return
        if active.first_at is None:
            active.first_at = time.monotonic()
            self.prefill.measure(active.prompt_tokens - active.cached,
                                 (active.first_at - active.started) * 1000)
        if active.max_tokens == 0:                   # a warm-up: the prompt is cached now
            self.finish(active, "length", "limit")
            return
        if self.engine.is_eog(out.token):
            if out.logprob is not None:     # (best_of: ending here is a choice scored too,
                active.logprob_sum += out.logprob   # or an empty answer scored 0 won)
                active.eos_scored = 1
            self.finish(active, "stop", "eos")
            return
        active.generated += 1
        piece = self.engine.piece(out.token)
        if out.logprob is not None:
            active.logprob_sum += out.logprob
        if active.ledger is not None:
            top = self._top_dict(out.top or [])
            top.setdefault(token_text(piece), out.logprob)
            active.ledger.add(len(active.echo_text or '') + active.assembler.decoded,
                              token_text(piece), out.logprob, top)
        if active.return_tokens:
            active.ids.append(out.token)
            active.pending_ids.append(out.token)
        if active.n_probs:
            active.pending_probs.append(probs_entry(self.engine, out.token, piece,
                                                   out.logprob,
                                                   (out.top or [])[:active.n_probs]))
        text = active.assembler.feed(piece)
        active.offsets.append(active.assembler.decoded)
        cut = timed = False
        if active.limits is not None:
            # (out of time: a token with a newline is the last, as llama.cpp's, the
            # first newline too, so the completion ends at a line's end)
            active.limits.generated(piece)
            timed = active.limits.out_of_time(active.first_at, time.monotonic())
            text, cut = active.limits.cut(text)
        if text:
            self.text(active, text)
        if cut:
            active.assembler.stopped = True       # the cut line's text is never sent
            self.finish(active, "length", "limit")
        elif timed:
            self.finish(active, "length", "limit")   # (what the stops held goes out)
        elif active.assembler.stopped:
            self.finish(active, "stop", "word")
        elif active.max_tokens is not None and active.generated >= active.max_tokens:
            self.finish(active, "length", "limit")
        elif active.prompt_tokens + active.generated >= active.n_ctx:
            active.truncated = True         # (llama-server's `truncated`: out of context)
            self.finish(active, "length", "limit")

    def _top_dict(self, top: list[tuple[int, float]]) -> dict:
        """OpenAI's top_logprobs: text -> logprob, likeliest first; two tokens of one
        text (a byte token and its character's, two control tokens written as "") keep
        the likelier's figure."""
        out: dict[str, float] = {}
        for t, lp in top:
            out.setdefault(token_text(self.engine.piece(t)), lp)
        return out

    def text(self, active: Active, text: str, logprobs: dict | None = None) -> None:
        if not active.text_sent:
            active.text_sent = True
            self.notify(P.FIRST, active.request_id, P.Attempt(attempt=active.attempt))
        active.chars_out += len(text)
        if logprobs is None and active.ledger is not None:
            logprobs = active.ledger.release(active.chars_out)
        event = P.Text(text=text, logprobs=logprobs, ids=active.pending_ids or None,
                       probs=active.pending_probs or None, generated=active.generated,
                       timings=active.timings() if active.timings_per_token else None)
        active.pending_ids, active.pending_probs = [], []
        self.publish(active, event)

    def finish(self, active: Active, reason: str, stop_type: str = "limit") -> None:
        """End the request: `reason` is OpenAI's finish_reason, `stop_type` llama.cpp's
        (eos, word, limit)."""
        self.faults.check("finish", active.prompt)
        tail = active.assembler.finish()
        if tail and active.limits is not None and not active.assembler.stopped:
            # (held back as a possible stop string's start, it met no n_indent yet)
            tail, cut = active.limits.cut(tail)
            if cut:
                active.assembler.stopped = True   # the cut line's text is never sent
                reason, stop_type = "length", "limit"
        if tail:
            self.text(active, tail)
        usage = active.usage()
        event = P.End(finish_reason=reason, usage=usage, stop_type=stop_type,
                      timings=active.timings(), dropped_chunks=active.dropped_chunks,
                      truncated=active.truncated)
        if stop_type == "word":
            event.stopping_word = active.assembler.stop_word
        if active.pending_ids:          # (their text held back, never sent: a stop string)
            event.ids, active.pending_ids = active.pending_ids, []
        drafted, accepted = self.engine.draft_stats(active.slot)
        if drafted:
            event.draft = {"proposed": drafted, "accepted": accepted}
        if active.ledger is not None:   # (stopped: a stop string or a cut line, unsent)
            event.logprobs = active.ledger.release(
                active.chars_out if active.assembler.stopped else None)
        if active.score:
            event.score = active.logprob_sum / max(1, active.generated + active.eos_scored)
        self.publish(active, event)
        self.release(active)    # (never raises: the slot comes back, its end is said)
        self.notify(P.DONE, active.request_id, active.done(
            finish_reason=reason, usage=usage, cached_tokens=active.cached,
            seconds=round(time.monotonic() - active.started, 3)))

    def fail(self, active: Active, exc: Exception, keep_cache: bool = True) -> None:
        error = wire_error(exc)
        self.release(active, keep_cache)
        self.publish(active, error.event())
        self.notify(P.DONE, active.request_id, active.done(error=error.code))

    def publish(self, active: Active, event: P.Event) -> None:
        event.seq = active.seq
        event.attempt = active.attempt
        active.seq += 1
        if self.faults.drops(event):
            log.warning("fault injection: dropping event %d of %s", event.seq,
                        active.request_id)
            return
        self.publisher.publish(active.topic, active.request_id, event)
