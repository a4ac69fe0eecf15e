"""POST /v1/completions: validate, hand the jobs to the dispatcher, relay the events.

Validation lives in `app.requests`, the answer's shape in `app.responses`; this module is
the route and the stream between them.
"""
from __future__ import annotations

import itertools
import time

from flask import Blueprint, Response, current_app, request, stream_with_context

from app import access, sse
from app.writes import SEND_RATE_FLOOR, allow_write, drain_deadline
from app.client import ClientGone, get_client
from app.disconnect import watch_disconnect
from app.errors import RequestTimeout, from_wire
from app.bodies import parse_json_body
from app.fanout import MAX_BACKLOG_BYTES, Fanout
from app.jobs import plan_jobs
from app.requests import (SEQUENCE_HEADER, api_key_fingerprint, profile_of,
                          check_answer_size, check_prompt_size, check_route,
                          check_token_prompts, client_of, json_answer, queue_timeout,
                          resolve_model, session_of, session_order, tenant_of, validate)
from app.responses import Result
from dispatcher.common import protocol as P

bp = Blueprint("completions", __name__)

# Seconds each write of the error event and [DONE] may take for a stream that missed
# its drain deadline (app.writes.drain_deadline)
LAST_WORDS = 1.0
# Wire bytes of events a stream of several prompts holds while it waits for each prompt
# to pass the worker's checks (see _admitted)
HOLD_BYTES = 1 << 20


def measured(events, started: float, recorder, record: access.RequestRecord):
    """Pass events through, recording time to first text and between texts per job, and
    what the access log says of the request."""
    last_text: dict[int, float] = {}
    origin: dict[int, tuple[str, str]] = {}
    for index, event in events:
        now = time.perf_counter()
        if isinstance(event, P.Start):
            origin[index] = (str(event.worker or "unknown"), str(event.device or "unknown"))
            record.observe(index, event, "start", now)
        elif isinstance(event, P.Text):
            worker, device = origin.get(index, ("unknown", "unknown"))
            if index in last_text:
                recorder.observe("itl", worker, device, now - last_text[index])
            else:
                recorder.observe("ttft", worker, device, now - started)
            last_text[index] = now
            record.observe(index, event, "text", now)
        elif isinstance(event, P.End):
            record.observe(index, event, "end", now)
        elif isinstance(event, P.Error):
            record.failed(event.code)
        yield index, event


@bp.post("/v1/completions")
def create_completion():
    req = validate(parse_json_body())
    return serve(req, Result)


def serve(req: dict, result_class, native: bool = False, infill: P.Infill | None = None):
    """Run a validated request (OpenAI's or llama.cpp's shape: `result_class` assembles
    the answer) through the dispatcher: whole, or as a stream. `native`: a llama.cpp
    route's, in llama-server's ways (`n_predict: 0` fills the cache, the penalties
    count the prompt too)."""
    started = time.perf_counter()
    arrived = request.environ.get("completions.arrived_ns") or time.time_ns()
    check_prompt_size(req)
    timeout = queue_timeout()
    client = get_client(current_app)
    state = client.wait_state()
    model = resolve_model(req["model"], state)
    known = state.models.get(model)
    if req.get("suffix") == "" and infill is None and known is not None and known.ready \
            and not known.fim:
        # nothing after the cursor, on a model with no fill-in-the-middle: a completion
        # of the prompt (refused as fim_unsupported, a client that always sends the
        # suffix failed at the end of every file)
        req["suffix"] = None
    n_ctx = known.n_ctx if known is not None else 0     # (0: no worker has said yet)
    if req.get("nctx"):                 # (geniex's nctx: the request's context, at most)
        n_ctx = min(n_ctx, int(req["nctx"])) if n_ctx else int(req["nctx"])
    check_answer_size(req, n_ctx, native)
    check_token_prompts(req, n_ctx)
    request_id = P.new_request_id()
    plans = plan_jobs(request_id, model, req, profile_of(request),
                      session_of(request), timeout, native, infill, session_order(arrived),
                      tenant_of(request), api_key_fingerprint(request),
                      SEQUENCE_HEADER in request.headers, client_of(request))
    check_route(plans[0].job, state)
    record = access.current()
    record.update(request_id=request_id, model=model)
    record.jobs(plans)
    fanout = Fanout(client, [p.job for p in plans])
    watcher = watch_disconnect(request.environ, fanout.client_gone)
    result = result_class(request_id, int(time.time()), model, req, plans)
    try:
        fanout.submit()
        events = measured(fanout.events(), started, client.recorder, record)
        held = _admitted(events, plans if req["stream"] else plans[:1], fanout)
    except BaseException as exc:
        _stop(watcher)
        fanout.close()
        if isinstance(exc, ClientGone):
            record.failed("client_closed")
            return Response(status=499)     # nobody is listening; nginx logs 499 too
        raise
    events = itertools.chain(held, events)
    headers = {"X-Request-Id": request_id}
    if req["stream"]:
        body = _stream(result, events, fanout, watcher, record)
        return Response(stream_with_context(body), mimetype="text/event-stream",
                        headers={**sse.SSE_HEADERS, **headers})
    try:
        for index, event in events:
            if isinstance(event, P.Error):
                raise from_wire(event)
            result.add(index, event)
        return json_answer(result.body, headers=headers)
    except ClientGone:
        record.failed("client_closed")
        return Response(status=499)
    finally:
        _stop(watcher)
        fanout.close()


def _admitted(events, plans, fanout: Fanout) -> list:
    """The events up to the first of each prompt's first job among `plans`, once none
    is an error (else the error is raised: the request's 4xx, before any answer). A
    stream of several prompts so starts once every prompt has passed the worker's checks
    (ids outside the vocabulary, a prompt over the context): only the first was awaited,
    and a refused second prompt was a 200 with an error event after the first's text.
    Held so, the others' events are at most HOLD_BYTES (a later prompt waiting for a
    slot while the earlier generate): past that the stream starts, and a refusal still
    to come is an error event in it, as before."""
    waiting = {i for i, plan in enumerate(plans) if plan.candidate == 0}
    held, size = [], 0
    while waiting and size <= HOLD_BYTES:
        index, event = next(events)
        if isinstance(event, P.Error):
            raise from_wire(event)
        held.append((index, event))
        size += fanout.last_size
        waiting.discard(index)
    return held


def _stop(watcher) -> None:
    if watcher is not None:
        watcher.kill(block=False)


def _stream(result, events, fanout: Fanout, watcher, record: access.RequestRecord):
    """SSE chunks; an error after the stream started goes out as an error event. Once
    every job has ended, the rest must be written by a deadline that each chunk moves
    on by its size (app.writes.drain_deadline)."""
    ended = late = False
    deadline = None
    try:
        for index, event in events:
            result.add(index, event)
            if isinstance(event, P.Error):
                yield sse.event(from_wire(event).to_dict())
                yield from result.trailer(error=True)
                ended = True
                return
            chunk = result.chunk(index, event)
            if chunk is not None:
                if deadline is None and fanout.ended_at is not None:
                    deadline = drain_deadline()
                if deadline is not None:
                    deadline += len(chunk) / SEND_RATE_FLOOR
                big = len(chunk) > SEND_RATE_FLOOR
                if (big or deadline is not None) and \
                        not allow_write(len(chunk) if big else 0, deadline):
                    late = True
                    raise ClientGone()
                yield chunk
                if big and deadline is None:
                    allow_write(0)
        if deadline is not None and not allow_write(0, deadline):
            late = True
            raise ClientGone()
        yield from result.trailer(error=False)
        ended = True
    except ClientGone:
        if fanout.overflowed or late:   # (a client still reading, slower: say so)
            # (each write within --send-timeout; past the deadline, a second)
            allow_write(0, at_most=LAST_WORDS if late else None)
            yield sse.event(RequestTimeout(
                f"the answer outran what this client read (more than {MAX_BACKLOG_BYTES >> 20} "
                "MB waited to be sent): its generation was stopped" if not late else
                "this client did not read the rest of the answer within --send-timeout "
                f"and a second per {SEND_RATE_FLOOR >> 10} KiB of it once it was "
                "generated",
                code="client_too_slow").to_dict())
            yield from result.trailer(error=True)
        return
    except Exception:
        record.failed("internal_error")
        raise
    finally:
        if not ended:           # the client left (noticed here, or by a failed write)
            # (a write that timed out at the deadline: the event loop's clock, which its
            # timers count from, may be a little behind time.monotonic())
            late = late or (deadline is not None and time.monotonic() >= deadline - 1)
            record.failed("client_too_slow" if fanout.overflowed or late
                          else "client_closed")
        _stop(watcher)
        fanout.close()
