"""llama.cpp's own log, with request content kept out of it.

llama.cpp logs through one callback per process, and some of its lines carry request
text (a grammar it cannot parse is printed whole, at error level). By default only its
errors are written, each cut to `LINE_LIMIT` characters, at most `BURST` of them per
`WINDOW` seconds (the rest counted, and said in one line): a request can add a bounded
amount to the log whatever it contains. With `verbose` (--log-level debug) every line is
written, cut the same way; only `content` (--log-content) writes lines whole.
"""
from __future__ import annotations

import collections
import ctypes
import itertools
import re
import sys
import time
import weakref

# llama.cpp's load names where the layers went (a build without a GPU backend says nothing)
OFFLOADED = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")
GGML_LOG_ERROR = 4         # ggml_log_level: NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5
LINE_LIMIT = 200
# how a line is written (None: as llama.cpp gave it); the worker sets a json one with
# --log-format json: (ggml level, text) -> the line
LINE = None
BURST = 20
WINDOW = 10.0


class LlamaLog:
    def __init__(self, verbose: bool = False, content: bool = False, stream=None,
                 clock=time.monotonic):
        self.verbose, self.content = verbose, content
        self.stream, self.clock = stream, clock
        self.window_start, self.written, self.suppressed = 0.0, 0, 0
        self.offloaded: tuple[int, int] | None = None   # (layers on the device, of all)
        # while a model loads: its last lines, every level, each cut to LINE_LIMIT (what
        # a refusal quotes: llama.cpp says why a load failed only in its log)
        self.recent: collections.deque[str] | None = None

    def write(self, level: int, text: str) -> None:
        if "layers to GPU" in text and (found := OFFLOADED.search(text)):
            self.offloaded = (int(found.group(1)), int(found.group(2)))
        if self.recent is not None and text.strip(" .\n"):     # (not the progress dots)
            self.recent.append(text.strip()[:LINE_LIMIT])
        if level != GGML_LOG_ERROR and not self.verbose:
            return
        out = self.stream or sys.stderr
        if not self.content:
            if len(text) > LINE_LIMIT:
                text = f"{text[:LINE_LIMIT]}… ({len(text) - LINE_LIMIT} characters cut)\n"
            if not self.verbose:
                now = self.clock()
                if now - self.window_start >= WINDOW:
                    if self.suppressed:
                        note = (f"llama.cpp: {self.suppressed} more error lines in "
                                f"{WINDOW:.0f}s not logged\n")
                        out.write(note if LINE is None or self.stream is not None
                                  else LINE(GGML_LOG_ERROR, note))
                    self.window_start, self.written, self.suppressed = now, 0, 0
                if self.written >= BURST:
                    self.suppressed += 1
                    return
                self.written += 1
        out.write(text if LINE is None or self.stream is not None else LINE(level, text))


# llama.cpp keeps one log callback per process; `user_data` names the LlamaLog it writes
# through. Held weakly: a log whose engine is gone falls back to a bounded errors-only one
# (a raw pointer to it would dangle). llama_cpp is imported on first use: this module is
# read before a worker pins its device (llama.cpp's backends start when it is imported).
_LOGS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_FALLBACK = LlamaLog()
_NEXT = itertools.count(1)
_CALLBACK = []                  # the one ctypes callback, made once and kept alive


RECENT = 8               # lines of llama.cpp's log a failed load quotes


def set_llama_log(log: LlamaLog) -> LlamaLog:
    """Send llama.cpp's log through `log` (for as long as the caller keeps it)."""
    import llama_cpp
    if not _CALLBACK:
        @llama_cpp.llama_log_callback
        def to_the_log(level: int, text: bytes, user_data) -> None:
            _LOGS.get(user_data or 0, _FALLBACK).write(level, text.decode("utf-8", "replace"))
        _CALLBACK.append(to_the_log)
    key = next(_NEXT)
    _LOGS[key] = log
    llama_cpp.llama_log_set(_CALLBACK[0], ctypes.c_void_p(key))
    return log


def last_lines(log: LlamaLog) -> str:
    """What llama.cpp logged last while a model loaded, for a refusal (empty: nothing)."""
    lines = list(log.recent or ())[-3:]
    return f" (llama.cpp: {' | '.join(lines)})" if lines else ""


def quiet_llama_log() -> LlamaLog:
    """llama.cpp's log to bounded errors only, before any engine exists (probes)."""
    return set_llama_log(LlamaLog())
