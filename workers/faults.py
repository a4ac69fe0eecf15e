"""Test hooks that lose or break a worker's work on purpose, to show what the rest of the
system does about it. Read from the environment once, by the worker's main, and handed to
the generation loop (which has none unless given them)."""
from __future__ import annotations

import os
import signal
import time

from dispatcher.common import protocol as P


class FaultInjection:
    """Test hooks. Lost stream events, to show that a front end turns the loss into an
    error: COMPLETIONS_FAULT_DROP_EVENT=N drops every request's event with sequence number
    N; COMPLETIONS_FAULT_DROP_END=1 drops every `end` event. A failure inside one request,
    to show that it ends that request alone: COMPLETIONS_FAULT_RAISE=PHASE:MARKER raises
    in PHASE (admit, token, finish) for requests whose prompt contains MARKER (several
    PHASE:MARKER pairs separated by commas). A step that never returns, to show that the
    watchdog replaces a stuck worker: COMPLETIONS_FAULT_HANG=MARKER hangs the generation
    loop at the first token of a request whose prompt contains MARKER. A worker that dies
    at start, as a crash inside the inference library would kill it, to show what the
    launcher and `deploy/gpu-check.sh` do about it: COMPLETIONS_FAULT_CRASH_AT_LOAD=1
    (SIGSEGV just before the model is loaded)."""

    PHASES = ("admit", "token", "finish")

    def __init__(self, drop_seq: int | None = None, drop_end: bool = False,
                 raises: dict[str, str] | None = None, hang: str | None = None,
                 crash_at_load: bool = False):
        self.drop_seq, self.drop_end = drop_seq, drop_end
        self.raises = raises or {}              # phase -> marker
        self.hang = hang
        self.crash_at_load = crash_at_load

    @classmethod
    def from_env(cls, environ=None) -> "FaultInjection":
        environ = os.environ if environ is None else environ
        seq = environ.get("COMPLETIONS_FAULT_DROP_EVENT")
        raises = {}
        for spec in environ.get("COMPLETIONS_FAULT_RAISE", "").split(","):
            phase, _, marker = spec.strip().partition(":")
            if phase in cls.PHASES and marker:
                raises[phase] = marker
        return cls(int(seq) if seq else None,
                   environ.get("COMPLETIONS_FAULT_DROP_END") == "1", raises,
                   environ.get("COMPLETIONS_FAULT_HANG") or None,
                   environ.get("COMPLETIONS_FAULT_CRASH_AT_LOAD") == "1")

    def at_load(self) -> None:
        if self.crash_at_load:
            os.write(2, b"fault injection: the worker crashes at load\n")
            os.kill(os.getpid(), signal.SIGSEGV)

    def drops(self, event: P.Event) -> bool:
        return event.seq == self.drop_seq or (self.drop_end and isinstance(event, P.End))

    def check(self, phase: str, prompt) -> None:
        if self.hang and phase == "token" and self.hang in str(prompt):
            os.write(2, b"fault injection: the generation loop hangs now\n")
            while True:                 # signals are handled, and the sleep goes on
                time.sleep(1)
        marker = self.raises.get(phase)
        if marker and marker in str(prompt):
            raise RuntimeError(f"fault injection: failing in {phase}")
