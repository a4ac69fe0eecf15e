"""Per-request sampling settings and what one step yields, as every engine takes them
(the llama.cpp sampler chain built from them: `workers.engine.samplers`)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from dispatcher.common.protocol import SAMPLER_ALIASES

RANDOM_SEED = 0xFFFFFFFF     # llama.cpp's LLAMA_DEFAULT_SEED: draw a random seed
DEFAULT_ORDER = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p",
                 "xtc", "temperature")    # llama.cpp's (its `samplers` default)
DRY_BREAKERS = ("\n", ":", "\"", "*")


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
    dry_multiplier: float = 0.0  # DRY (don't repeat yourself); 0: off
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1  # -1: the context
    dry_sequence_breakers: tuple[str, ...] = DRY_BREAKERS
    xtc_probability: float = 0.0  # XTC (exclude top choices); 0: off
    xtc_threshold: float = 0.1
    top_n_sigma: float = -1.0    # < 0: off
    dynatemp_range: float = 0.0  # dynamic temperature: temperature ± range by entropy
    dynatemp_exponent: float = 1.0
    samplers: tuple[str, ...] | None = None   # llama.cpp's order list; None: the default

    @classmethod
    def from_job(cls, sampling: dict) -> "SamplingParams":
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in sampling.items() if k in names and v is not None}
        if "logit_bias" in values:
            values["logit_bias"] = {int(k): float(v) for k, v in values["logit_bias"].items()}
        for name in ("dry_sequence_breakers", "samplers"):
            if name in values:
                values[name] = tuple(values[name])
        return cls(**values)

    @property
    def order(self) -> tuple[str, ...]:
        """The samplers to apply, in order (unknown names are refused at validation)."""
        if self.samplers is None:
            return DEFAULT_ORDER
        return tuple(SAMPLER_ALIASES.get(n, n) for n in self.samplers)

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
