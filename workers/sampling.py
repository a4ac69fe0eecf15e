"""Per-request sampling settings and what one step yields, as every engine takes them
(the llama.cpp sampler chain built from them: `workers.engine.samplers`)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields, make_dataclass

from dispatcher.common.fields import DEFAULT_ORDER, RANDOM_SEED, SAMPLER_ALIASES, SAMPLING

BAN = -100.0                 # a bias this low bans its token (OpenAI's -100, llama.cpp's
                             # `false`, which the front end sends as -100): -inf to the
                             # chain, made here (JSON has no -inf: msgspec writes null)

# The worker's value where a request leaves a field out: its declared default
# (dispatcher.common.fields), in the form the sampler chain takes.
_KINDS = {"seed": int | None, "logit_bias": dict, "grammar": str | None,
          "strings": tuple, "samplers": tuple | None}
_WORKER_DEFAULTS = {"logit_bias": field(default_factory=dict)}     # (None: no biases)
_Values = make_dataclass("_Values", [
    (knob.name, _KINDS.get(knob.kind, knob.kind),
     _WORKER_DEFAULTS.get(knob.name, knob.default))
    for knob in SAMPLING if knob.name != "json_schema"], frozen=True)  # (-> grammar)


@dataclass(frozen=True)
class SamplingParams(_Values):
    """One request's sampling settings: the fields of dispatcher.common.fields.SAMPLING
    (json_schema arrives converted into `grammar`)."""

    @classmethod
    def from_job(cls, sampling: dict) -> "SamplingParams":
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in sampling.items() if k in names and v is not None}
        if "logit_bias" in values:
            values["logit_bias"] = {int(k): float(v) if float(v) > BAN else float("-inf")
                                    for k, v in values["logit_bias"].items()}
        for name in ("dry_sequence_breakers", "samplers"):
            if name in values:
                values[name] = tuple(values[name])
        if values.get("mirostat"):
            # llama.cpp's Mirostat chain is the logit bias, the temperature and Mirostat:
            # no penalties, no DRY (common_sampler_init builds them only without it)
            values.update(repetition_penalty=1.0, frequency_penalty=0.0,
                          presence_penalty=0.0, dry_multiplier=0.0)
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
    def wide(self) -> bool:
        """A draw from (nearly) the whole distribution: temperature 0.7 or more (or none in
        the chain) and no top-k, top-p or min-p cut. Such a draw leaves any copied text at
        its first uncertain token; with a cut (llama.cpp's defaults, llama.vim's top-k 40
        and top-p 0.9) a confident token is drawn every time."""
        order = self.order
        cut = ("top_k" in order and self.top_k > 0) or \
            ("top_p" in order and self.top_p < 1.0) or ("min_p" in order and self.min_p > 0.0)
        hot = "temperature" not in order or self.temperature >= 0.7
        return not self.greedy and hot and not cut

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
