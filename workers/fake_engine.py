"""FakeEngine: a test double of `LlamaEngine` for fast plumbing tests. Not a model.

It has the engine's interface and timing shape (one `step()` per token for all slots),
with byte-level tokens (0..255), BOS 256 and EOS 257. It "generates" a fixed script,
byte by byte, so stop strings and UTF-8 characters span several tokens, as they do
with a real tokenizer. Its logprobs are made up (-0.5 for the sampled token). Prompt
markers steer it for tests:

    [eos=N]     end of generation (EOS) after N tokens
    [slow=S]    this request's steps take S seconds each
    [slowtok=S] tokenizing this text takes S seconds (a /tokenize of a megabyte)
    [crash]     the worker process exits abruptly at its first generated token
"""
from __future__ import annotations

import os
import re
import time

from dispatcher.common import protocol as P
from dispatcher.common.fakescript import SCRIPT
from workers.errors import InvalidInput
from workers.sampling import SamplingParams, TokenOut

BOS, EOS = 256, 257


class FakeEngine:
    name = "fake"
    fingerprint = "fp_fake"
    fim_tokens = None
    fim_repo = None
    n_layer = 1
    layers_offloaded, layers_total = 0, 2    # nothing is offloaded: there are no weights
    step_costs = None                        # nothing measured: no drafts to weigh

    def __init__(self, model_path: str, n_ctx: int, slots: int, n_threads: int = 1,
                 n_gpu_layers: int = 0, verbose: bool = False, deterministic: bool = False,
                 step_delay: float | None = None):
        self.n_ctx = n_ctx
        self.deterministic = deterministic
        self.n_ctx_train = n_ctx
        self.n_vocab = 258
        if step_delay is None:
            step_delay = float(os.environ.get("COMPLETIONS_FAKE_STEP_DELAY", "0.01"))
        self.step_delay = step_delay
        self._slots: list[dict | None] = [None] * slots
        self.totals = P.StepTotals()     # the step profile: one row per busy slot a step
        self.budgets: dict[int, int | None] = {}     # set_budget's, by slot
        self.least: dict[int, int] = {}

    @property
    def n_slots(self) -> int:
        return len(self._slots)

    def tokenize(self, text: str, add_special: bool = True,
                 parse_special: bool = True) -> list[int]:
        slow = re.search(r"\[slowtok=([0-9.]+)\]", text)
        if slow:
            time.sleep(float(slow.group(1)))
        return ([BOS] if add_special else []) + list(text.encode("utf-8"))

    def bos(self) -> list[int]:
        return [BOS]

    def sampler_chain(self, sampling: SamplingParams, tenant: str | None = None):
        if sampling.grammar is not None:
            raise InvalidInput("the fake engine has no grammar support", param="grammar")
        return None                      # (its sampling is scripted by the prompt)

    def piece(self, token: int, special: bool = False) -> bytes:
        return bytes([token]) if token < 256 else b""

    def is_eog(self, token: int) -> bool:
        return token == EOS

    def longest_piece(self) -> int:
        return 1                         # (a token a byte)

    def check_tokens(self, tokens: list[int], param: str = "prompt") -> None:
        if any(not 0 <= t < self.n_vocab for t in tokens):
            raise InvalidInput("token ids outside the vocabulary", param=param)

    def draft_stats(self, slot_id: int) -> tuple[int, int]:
        return (0, 0)

    def cached_prefix(self, tokens: list[int], free: list[int]) -> int:
        return 0

    def best_slot(self, tokens: list[int], free: list[int]) -> int:
        return free[0]

    def clear_caches(self) -> None:
        pass

    copies, copy_at_least = False, 0     # (no sibling copies: its prompts take no steps)

    def prefill_left(self, slot_id: int) -> int:
        return 0

    def copy_prefix(self, src: int, dst: int, tokens: list[int]) -> int:
        return 0

    def set_budget(self, slot_id: int, left: int | None, least: int = 0) -> None:
        self.budgets[slot_id] = left             # (nothing drafts here: only recorded)
        self.least[slot_id] = least

    def add(self, slot_id: int, tokens: list[int], sampling: SamplingParams,
            logprobs: int | None = None, prompt_logprobs: bool = False,
            reuse: bool = True, draft_max: int | None = None,
            history: str | None = None, budget: int | None = None,
            chain=None, penalize_prompt: bool = False) -> int:
        self.check_tokens(tokens)
        if sampling.grammar is not None:
            raise InvalidInput("the fake engine has no grammar support", param="grammar")
        prompt = bytes(t for t in tokens if t < 256).decode("utf-8", "replace")
        eos = re.search(r"\[eos=(\d+)\]", prompt)
        slow = re.search(r"\[slow=([0-9.]+)\]", prompt)
        self._slots[slot_id] = {
            "n": 0, "logprobs": logprobs, "tokens": tokens, "prompt_logprobs": prompt_logprobs,
            "eos_after": int(eos.group(1)) if eos else None,
            "delay": float(slow.group(1)) if slow else self.step_delay,
            "crash": "[crash]" in prompt,
        }
        return 0

    def release(self, slot_id: int, keep_cache: bool = True) -> None:
        self._slots[slot_id] = None

    def step(self) -> dict[int, TokenOut]:
        busy = {i: s for i, s in enumerate(self._slots) if s is not None}
        if not busy:
            return {}
        started = time.perf_counter()
        time.sleep(max(s["delay"] for s in busy.values()))
        self.totals.steps += 1
        self.totals.token_rows += len(busy)
        self.totals.batches += 1
        self.totals.decode_seconds += time.perf_counter() - started
        out = {}
        for slot_id, state in busy.items():
            if state["crash"]:
                os._exit(3)
            if state["eos_after"] is not None and state["n"] >= state["eos_after"]:
                token = EOS
            else:
                token = SCRIPT[state["n"] % len(SCRIPT)]
            result = TokenOut(token)
            if state["logprobs"] is not None:
                result.logprob, result.top = -0.5, [(token, -0.5)][:state["logprobs"]]
            if state["prompt_logprobs"] and state["n"] == 0:
                result.prompt = [(t, -1.0, []) for t in state["tokens"][1:]]
            out[slot_id] = result
            state["n"] += 1
        return out

    def after_load(self) -> None:
        """Nothing to make beside serving."""

    def full_step_seconds(self) -> float:
        """The fake step's own delay (a step's largest batch costs it nothing more)."""
        return self.step_delay

    def close(self) -> None:
        self._slots = [None] * len(self._slots)
