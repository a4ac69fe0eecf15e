"""Per-request sampling settings, as the engines take them."""
from __future__ import annotations

from dataclasses import dataclass, field, fields

RANDOM_SEED = 0xFFFFFFFF     # llama.cpp's LLAMA_DEFAULT_SEED: draw a random seed


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0               # 0 or less: off
    min_p: float = 0.0
    typical_p: float = 1.0       # 1: off
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    repeat_last_n: int = -1      # penalty window in tokens; -1: everything generated
    mirostat: int = 0            # 0 off, 1 Mirostat, 2 Mirostat 2.0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    logit_bias: dict[int, float] = field(default_factory=dict)
    grammar: str | None = None   # GBNF, root rule "root"
    min_tokens: int = 0          # end of generation is impossible before this many tokens
    ignore_eos: bool = False     # ... or at all

    @classmethod
    def from_job(cls, sampling: dict) -> "SamplingParams":
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in sampling.items() if k in names and v is not None}
        if "logit_bias" in values:
            values["logit_bias"] = {int(k): float(v) for k, v in values["logit_bias"].items()}
        return cls(**values)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def seed32(self) -> int:
        """The seed as llama.cpp's uint32, never the value that means 'random'."""
        if self.seed is None:
            return RANDOM_SEED
        value = self.seed % 2 ** 32
        return value - 1 if value == RANDOM_SEED else value

    @property
    def penalized(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


@dataclass
class TokenOut:
    """What one engine step produced for one slot."""
    token: int
    logprob: float | None = None                     # of the sampled token (model distribution)
    top: list[tuple[int, float]] | None = None       # the k most likely tokens
    prompt: list[tuple[int, float, list]] | None = None   # echo: (token, logprob, top) per
                                                          # prompt token after the first
    error: Exception | None = None   # sampling this slot failed: its request fails alone
