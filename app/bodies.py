"""A request's body, from the socket to JSON: read within --body-timeout, its arrays and
objects counted in the raw bytes, parsed as strict JSON on a thread of gevent's pool (a
few big bodies at a time), every string checked to be Unicode text. What the body must
then be is `app.requests`'."""
from __future__ import annotations

import json
import re
import socket

import gevent
import gevent.monkey
from flask import current_app, has_request_context, request
from gunicorn.http.errors import NoMoreData, ParseException
from werkzeug.exceptions import ClientDisconnected

from app.auth import api_key_fingerprint
from app.errors import (ClientClosedRequest, InvalidRequest, PayloadTooLarge,
                        RequestTimeout, ServiceUnavailable, UnsupportedMediaType)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse_json_body(any_content_type: bool = False) -> object:
    """The body as strict JSON (no NaN/Infinity), with a JSON content type or none at all
    (any content type for llama.cpp's native endpoints, which do not look at it)."""
    mimetype = request.mimetype
    if mimetype and mimetype != "application/json" and not mimetype.endswith("+json") \
            and not any_content_type:
        raise UnsupportedMediaType(f"Content-Type must be application/json, not {mimetype}")
    encoding = (request.headers.get("Content-Encoding") or "").strip().lower() or "identity"
    if encoding != "identity":
        raise UnsupportedMediaType(f"Content-Encoding {encoding[:40]!r} is not accepted: "
                                   "send the body uncompressed")
    raw = read_body()
    if len(raw) > BIG_BODY:
        big_body_slots.take()       # (given back once validated, or as the request ends)
    return off_loop(decode_json_body, raw)


# Bytes of bodies over BIG_BODY read at once per front end: at most BIG_BODY_BYTES, taken
# once a body's first MiB has arrived (a client announcing 8 MiB and sending a byte a
# second holds nothing of it until then), its whole length at once (a body without one,
# chunked, a MiB at a time), and given back once the body is validated (or as the
# request ends). Read first, each body waited for its decode slot
# with its bytes in hand, so 4,096 connections could hold 8 MiB each: 32 GiB. A body
# that cannot have its next MiB within BODY_BYTES_WAIT s is a 503 server_busy. With API
# keys (several), one key holds at most half of it (KEY_BODY_SHARE; a body larger than that, alone
# of its key's): a key announcing eight bodies of 8 MiB and trickling them held all of
# it, and every other key's large body waited its 15 s for a 503.
BIG_BODY_BYTES = 64 << 20
KEY_BODY_SHARE = 0.5
BODY_BYTES_STEP = 1 << 20
BODY_BYTES_WAIT = 15.0
BODY_BYTES_KEY = "completions.body_bytes"


class BodyBytes:
    """The front end's bytes of big bodies held at once (a body larger than the whole
    budget is read alone)."""

    def __init__(self, budget: int = BIG_BODY_BYTES) -> None:
        self.budget = budget
        self.held = 0
        self.by_key: dict[str, int] = {}    # (with API keys) what each key holds
        self.changed = None                 # (made in the serving process, after forks)

    def cover(self, size: int, wait: float | None = None) -> None:
        """Hold at least `size` bytes for this request's body (what it holds already,
        then whole steps of BODY_BYTES_STEP), waiting up to `wait` s for room."""
        have = request.environ.get(BODY_BYTES_KEY, 0)
        if size <= have:
            return
        more = -(-(size - have) // BODY_BYTES_STEP) * BODY_BYTES_STEP
        wait = BODY_BYTES_WAIT if wait is None else wait
        if self.changed is None:
            import threading                # (gevent's, where the front end patched it)
            self.changed = threading.Condition()
        key = api_key_fingerprint(request) \
            if (current_app.config.get("API_KEY_COUNT") or 0) > 1 else None
        share = int(self.budget * KEY_BODY_SHARE)

        def room() -> bool:
            mine = self.by_key.get(key, 0)
            return (self.held == have or self.held + more <= self.budget) and \
                (key is None or mine == have or mine + more <= share)
        with self.changed:
            if not self.changed.wait_for(room, wait):
                raise ServiceUnavailable(
                    f"this front end is reading {self.held:,} bytes of large bodies; "
                    f"{more:,} more waited {wait:g} s for room", code="server_busy")
            self.held += more
            if key is not None:
                self.by_key[key] = self.by_key.get(key, 0) + more
        request.environ[BODY_BYTES_KEY] = have + more
        request.environ[BODY_BYTES_KEY + ".key"] = key

    def give_back(self) -> None:
        if not has_request_context():
            return
        size = request.environ.pop(BODY_BYTES_KEY, 0)
        key = request.environ.pop(BODY_BYTES_KEY + ".key", None)
        if size:
            with self.changed:
                self.held -= size
                if key is not None:
                    left = self.by_key.get(key, 0) - size
                    if left > 0:
                        self.by_key[key] = left
                    else:
                        self.by_key.pop(key, None)
                self.changed.notify_all()


body_bytes = BodyBytes()


# Bodies over BIG_BODY bytes are decoded and validated a few at a time per front end:
# decoded, a body is ten times its size or more (8 MB of two-letter strings: 80 MB), and
# each decoded one waited for the pool's threads behind every other's decode before
# validation let it go (a hundred at once: 8 GB and more). The C decoder holds the GIL: more at
# once would not be sooner.
BIG_BODY = 1 << 20
BIG_BODIES_AT_ONCE = 2


class BigBodySlots:
    """The front end's slots for big bodies, taken by `parse_json_body` and given back by
    `validate` (or, where a request ends before it, the app's teardown)."""

    def __init__(self, at_once: int = BIG_BODIES_AT_ONCE) -> None:
        self.at_once = at_once
        self.slots = None                   # (made in the serving process, after forks)

    def take(self) -> None:
        if self.slots is None:
            import threading                # (gevent's, where the front end patched it)
            self.slots = threading.BoundedSemaphore(self.at_once)
        if not self.slots.acquire(timeout=BODY_BYTES_WAIT):    # (each holder's decode and
            raise ServiceUnavailable(                          # validation are bounded)
                f"every large body's decoding in this front end was busy for "
                f"{BODY_BYTES_WAIT:g} s: try again.", code="server_busy")
        request.environ["completions.big_body"] = self.slots

    @staticmethod
    def give_back() -> None:
        if not has_request_context():
            return                          # (validate called on its own)
        taken = request.environ.pop("completions.big_body", None)
        if taken is not None:
            taken.release()


big_body_slots = BigBodySlots()


def read_body() -> bytes:
    """The whole body within --body-timeout: a client trickling it a byte at a time
    must not hold a connection (and its greenlet) for ever."""
    seconds = float(current_app.config.get("BODY_TIMEOUT") or 0)
    limit = current_app.config.get("MAX_CONTENT_LENGTH")
    if limit and (request.content_length or 0) > limit:
        # a body up to twice the limit is left to gunicorn to read past (a proxy sending
        # it, nginx, counts a connection closed under its upload as a failed upstream
        # and stops sending it requests for a while); a larger one is never read (it
        # was, and thrown away, for up to 75 s)
        if request.content_length > 2 * limit:
            _stop_reading()
        raise PayloadTooLarge(f"the body has {request.content_length:,} bytes; at most "
                              f"{limit:,} (--max-body)")
    try:
        with gevent.Timeout(seconds or None, False):
            if request.content_length is None and limit:
                return _pieces(request.environ["wsgi.input"], limit)
            if request.content_length > BIG_BODY:
                return _pieces(request.stream, limit, request.content_length)
            return request.get_data(cache=False)
    except ServiceUnavailable:
        _stop_reading()             # (the rest of the body is not read: it was, unbounded)
        raise
    except (ClientDisconnected, NoMoreData, ConnectionError):
        # the client left before its body was whole (werkzeug's reader, bounding the body
        # by --max-body, says so of any OSError: a generic 400 with no code)
        _stop_reading()
        raise ClientClosedRequest("the client closed the connection before the body "
                                  "arrived") from None
    except (ParseException, OSError) as exc:
        # a chunked body whose framing is wrong (a size that is not hex, data past its
        # size, no CRLF): gunicorn's reader raises, and it was a 500
        _stop_reading()
        why = clipped(str(exc) or type(exc).__name__)
        raise InvalidRequest(f"the body could not be read: {why}",
                             code="invalid_body") from None
    _stop_reading()
    raise RequestTimeout(f"the body did not arrive within {seconds:g} s")


def _pieces(stream, limit: int, length: int | None = None) -> bytes:
    """A body read piece by piece: its `length` bytes, or without one (chunked) to its
    end or past `limit`, its bytes past BIG_BODY covered by the front end's budget
    (`body_bytes`) before they are read. Without a length, werkzeug's bounded reader
    stopped at the limit without a word, and the request ran on the body's first 8 MiB
    (a body that never ended was read on, and thrown away, for 75 s)."""
    data = bytearray()
    want = length if length is not None else limit + 1
    while len(data) < want:
        size = min(CHUNK_READ, want - len(data))
        if len(data) + size > BIG_BODY:
            # a body whose length is known covers all of it once its first MiB came (a
            # body waiting holds nothing of the budget: bodies that each held a part
            # waited for each other until one gave up); one without, a MiB at a time
            body_bytes.cover(length if length is not None else len(data) + size)
        piece = stream.read(size)
        if not piece:
            if length is not None:
                raise ClientDisconnected()
            return bytes(data)
        data += piece
    if length is None:              # (past the limit)
        _stop_reading()
        raise PayloadTooLarge(f"the body is over {limit:,} bytes (--max-body)")
    return bytes(data)


CHUNK_READ = 1 << 16


def _stop_reading() -> None:
    """The rest of the body is never read: end the connection (what is left of it could
    not be parsed as a next request), and say so in the answer (CLOSE_KEY: it said
    keep-alive, and the client's next request on it failed)."""
    request.environ[CLOSE_KEY] = True
    sock = request.environ.get("gunicorn.socket")
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RD)
        except OSError:
            pass


# The environ key of a request whose connection ends after its answer (close_after)
CLOSE_KEY = "completions.close"


def close_after(wsgi_app):
    """WSGI middleware: a request marked CLOSE_KEY is answered `Connection: close` (gunicorn
    takes no hop-by-hop header from the app; its response, whose method start_response
    is, closes when told to)."""
    def app(environ, start_response):
        def start(status, headers, exc_info=None):
            owner = getattr(start_response, "__self__", None)
            if environ.get(CLOSE_KEY) and hasattr(owner, "force_close"):
                owner.force_close()
            return start_response(status, headers, exc_info)
        return wsgi_app(environ, start)
    return app


# Arrays and objects one body may hold, counted in the raw bytes before anything walks
# them (an 8 MB body of empty lists took 9 s to walk): prompts, stop strings, infill
# chunks, logit biases and JSON schemas need far fewer.
MAX_JSON_CONTAINERS = 100_000
# A string, or what is left of the body after a quote never closed: possessive and
# always matching, so each quote is read once (where a string had to end with a quote,
# an unclosed one over 70,000 escaped quotes was scanned again from each of them,
# quadratic: a 300 KB body held a front end's CPU past its 30 s heartbeat)
_JSON_STRING = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"?', re.S)


def check_shape(raw: bytes) -> None:
    """Refuse, at C speed, a body whose parse and checks would cost more than any
    request needs."""
    containers = raw.count(b"[") + raw.count(b"{")
    if containers > MAX_JSON_CONTAINERS:        # brackets inside strings do not count
        outside = _JSON_STRING.sub(b'""', raw)
        containers = outside.count(b"[") + outside.count(b"{")
    if containers > MAX_JSON_CONTAINERS:
        raise InvalidRequest(f"The request body has over {MAX_JSON_CONTAINERS} arrays and "
                             "objects.", code="invalid_json")


class _Raised:
    """An exception caught on a pool thread, to be raised again on the loop."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def _caught(function, args):
    try:
        return function(*args)
    except Exception as exc:      # (gevent's hub would print it, request text and all)
        return _Raised(exc)


def off_loop(function, *args):
    """`function(*args)` on a thread of gevent's pool when this process runs under gevent
    (the front ends): parsing and checking a large body takes the CPU for a while, and
    the loop's heartbeats and other requests must go on meanwhile. Exceptions are
    caught on the pool's thread and raised here: left to the pool, gevent's hub prints
    each with its traceback to stderr, and their messages quote the request."""
    if gevent.monkey.is_module_patched("socket"):
        result = gevent.get_hub().threadpool.apply(_caught, (function, args))
        if isinstance(result, _Raised):
            raise result.exc
        return result
    return function(*args)


def decode_json_body(raw: bytes) -> object:
    check_shape(raw)
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise InvalidRequest("The request body is not valid UTF-8.", code="invalid_json")
    except RecursionError:
        raise InvalidRequest("The request body is nested too deeply.", code="invalid_json")
    except ValueError as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc}", code="invalid_json")
    check_encodable(body)
    return body


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def unencodable_field(body: object) -> tuple[str, str] | None:
    """(top-level field, path) of the first string, object keys included, that is not
    Unicode text: a lone UTF-16 surrogate (`"\\ud800"`) is valid JSON but cannot be
    encoded as UTF-8, so it must never reach a tokenizer or a grammar parser. Iterative
    (any nesting json accepts), and a path is only built for the string it reports."""
    stack: list[tuple[object, tuple | None]] = [(body, None)]     # (value, (key, parent))
    while stack:
        value, where = stack.pop()
        if isinstance(value, str):
            if not _encodable(value):
                return _report(where)
        elif isinstance(value, dict):
            for key, item in value.items():
                if not _encodable(key):
                    return _report((key, where))
                if isinstance(item, (str, dict, list)):
                    stack.append((item, (key, where)))
        elif isinstance(value, list):
            stack.extend((item, (i, where)) for i, item in enumerate(value)
                         if isinstance(item, (str, dict, list)))
    return None


def _report(where: tuple | None) -> tuple[str, str]:
    path: list = []
    while where is not None:
        key, where = where
        path.append(key)
    path.reverse()
    return _path_text(path[:1]), _path_text(path)


def _path_text(path: list) -> str:
    text = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
    return text.encode("utf-8", "backslashreplace").decode("utf-8") or "_body"


def check_encodable(body: object) -> None:
    found = unencodable_field(body)
    if found is not None:
        param, where = found
        raise InvalidRequest(f"Invalid value for '{clipped(where)}': the text contains a "
                             "lone UTF-16 surrogate (\\ud800-\\udfff), which is not a "
                             "Unicode character and cannot be encoded as UTF-8.",
                             param=clipped(param), code="invalid_unicode")


MAX_PARAM = 128          # characters of a name the client chose quoted back to it


def clipped(name: str) -> str:
    """A name the client chose (a field's path, a model), as an error quotes it."""
    return name if len(name) <= MAX_PARAM else name[:MAX_PARAM] + "…"
