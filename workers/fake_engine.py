"""FakeEngine: a test double of `LlamaEngine` for fast plumbing tests. Not a model.

It has the engine's interface and timing shape (one `step()` per token for all slots),
with byte-level tokens (0..255), BOS 256 and EOS 257. It "generates" a fixed script,
byte by byte, so stop strings and UTF-8 characters span several tokens, as they do
with a real tokenizer. Prompt markers steer it for tests:

    [eos=N]     end of generation (EOS) after N tokens
    [slow=S]    this request's steps take S seconds each
    [crash]     the worker process exits abruptly at its first generated token
"""
from __future__ import annotations

import os
import re
import time

from workers.sampling import SamplingParams

BOS, EOS = 256, 257
SCRIPT = "The quick brown fox jumps over the lazy dog; café, naïve, 東京. ".encode()


class FakeEngine:
    name = "fake"

    def __init__(self, model_path: str, n_ctx: int, slots: int, n_threads: int = 1,
                 n_gpu_layers: int = 0, verbose: bool = False, step_delay: float | None = None):
        self.n_ctx = n_ctx
        self.n_ctx_train = n_ctx
        self.n_vocab = 258
        if step_delay is None:
            step_delay = float(os.environ.get("COMPLETIONS_FAKE_STEP_DELAY", "0.01"))
        self.step_delay = step_delay
        self._slots: list[dict | None] = [None] * slots

    @property
    def n_slots(self) -> int:
        return len(self._slots)

    def tokenize(self, text: str) -> list[int]:
        return [BOS] + list(text.encode("utf-8"))

    def piece(self, token: int) -> bytes:
        return bytes([token]) if token < 256 else b""

    def is_eog(self, token: int) -> bool:
        return token == EOS

    def add(self, slot_id: int, tokens: list[int], sampling: SamplingParams) -> None:
        prompt = bytes(t for t in tokens if t < 256).decode("utf-8", "replace")
        eos = re.search(r"\[eos=(\d+)\]", prompt)
        slow = re.search(r"\[slow=([0-9.]+)\]", prompt)
        self._slots[slot_id] = {
            "n": 0,
            "eos_after": int(eos.group(1)) if eos else None,
            "delay": float(slow.group(1)) if slow else self.step_delay,
            "crash": "[crash]" in prompt,
        }

    def release(self, slot_id: int) -> None:
        self._slots[slot_id] = None

    def step(self) -> dict[int, int]:
        busy = {i: s for i, s in enumerate(self._slots) if s is not None}
        if not busy:
            return {}
        time.sleep(max(s["delay"] for s in busy.values()))
        out = {}
        for slot_id, state in busy.items():
            if state["crash"]:
                os._exit(3)
            if state["eos_after"] is not None and state["n"] >= state["eos_after"]:
                out[slot_id] = EOS
            else:
                out[slot_id] = SCRIPT[state["n"] % len(SCRIPT)]
            state["n"] += 1
        return out

    def close(self) -> None:
        self._slots = [None] * len(self._slots)
