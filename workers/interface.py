"""What the generation loop needs of an inference engine.

`workers.engine.llama.LlamaEngine` (llama.cpp through llama-cpp-python) and
`workers.fake_engine.FakeEngine` (the test double) both implement it, so the loop
(`workers.generation`) runs in-process on the fake in the tests.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from dispatcher.common.protocol import StepTotals
from workers.sampling import SamplingParams, TokenOut

if TYPE_CHECKING:
    from workers.engine.stepcosts import StepCosts


class Engine(Protocol):
    name: str                       # "llama" or "fake", reported in READY
    fingerprint: str                # model file and build, for `system_fingerprint`
    fim_tokens: tuple[int, int, int] | None    # (PRE, SUF, MID), None: no FIM
    fim_repo: tuple[int | None, int | None] | None   # (REP, SEP): repository-level FIM
    n_ctx: int                      # context per sequence, in tokens
    n_layer: int
    layers_offloaded: int           # layers on an accelerator, as the load reported
    layers_total: int               # ... of these (llama.cpp counts the output layer)
    deterministic: bool             # batch-invariant output (no drafts, no repacking)
    step_costs: StepCosts | None    # the device's measured step costs (None: unmeasured)
    totals: StepTotals              # the step profile's counters, kept by `step`

    @property
    def n_slots(self) -> int: ...

    # vocabulary
    def tokenize(self, text: str, add_special: bool = True,
                 parse_special: bool = True) -> list[int]: ...

    def bos(self) -> list[int]: ...

    def piece(self, token: int, special: bool = False) -> bytes: ...

    def is_eog(self, token: int) -> bool: ...

    def check_tokens(self, tokens: list[int], param: str = "prompt") -> None: ...

    def longest_piece(self) -> int: ...  # the most bytes one token's text has (0: no bound)

    # sequences
    def cached_prefix(self, tokens: list[int], free: list[int]) -> int: ...

    def draft_stats(self, slot_id: int) -> tuple[int, int]: ...

    def best_slot(self, tokens: list[int], free: list[int]) -> int: ...

    copies: bool           # a sibling choice may copy a decoded prompt (copy_prefix)
    copy_at_least: int     # ... of at least this many tokens

    def prefill_left(self, slot_id: int) -> int: ...   # prompt tokens still to decode

    # the tokens a busy sequence may still generate, from now (None: to the context's
    # end): an adopted generation goes on for another request, with its max_tokens
    def set_budget(self, slot_id: int, left: int | None, least: int = 0) -> None: ...

    def copy_prefix(self, src: int, dst: int, tokens: list[int]) -> int: ...

    def add(self, slot_id: int, tokens: list[int], sampling: SamplingParams,
            logprobs: int | None = None, prompt_logprobs: bool = False,
            reuse: bool = True, draft_max: int | None = None,
            history: str | None = None, budget: int | None = None,
            chain: object | None = None, penalize_prompt: bool = False) -> int: ...

    def sampler_chain(self, sampling: SamplingParams, tenant: str | None = None
                      ) -> object | None: ...

    def release(self, slot_id: int, keep_cache: bool = True) -> None: ...

    def clear_caches(self) -> None: ...

    def step(self) -> dict[int, TokenOut]: ...

    def full_step_seconds(self) -> float: ...

    def after_load(self) -> None: ...

    def close(self) -> None: ...
