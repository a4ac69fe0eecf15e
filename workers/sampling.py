"""Per-request sampling settings, as the engines take them."""
from __future__ import annotations

from dataclasses import dataclass, fields

RANDOM_SEED = 0xFFFFFFFF     # llama.cpp's LLAMA_DEFAULT_SEED: draw a random seed


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0               # 0 or less: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    @classmethod
    def from_job(cls, sampling: dict) -> "SamplingParams":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in sampling.items() if k in names and v is not None})

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
