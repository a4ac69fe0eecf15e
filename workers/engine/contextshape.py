"""A llama.cpp context's shape beyond its length and slots: the KV cache's cell type and
the batch sizes (`--kv-type`, `--batch`, `--ubatch`, per worker). Pure: read before
llama.cpp is loaded, by the memory check, the engine and the step costs' key."""
from __future__ import annotations

from dataclasses import dataclass

from dispatcher.common.config import KV_TYPES, check_context_shape

GGML_TYPES = {"f16": 1, "q8_0": 8, "q4_0": 2}    # enum ggml_type


@dataclass(frozen=True)
class ContextShape:
    kv_type: str = "f16"
    n_batch: int = 512
    n_ubatch: int = 512

    def __post_init__(self):
        check_context_shape(self.kv_type, self.n_batch, self.n_ubatch)

    @classmethod
    def of(cls, args) -> "ContextShape":
        """From a worker's options (--kv-type, --batch, --ubatch)."""
        return cls(args.kv_type, args.batch, args.ubatch)

    @property
    def cell_bytes(self) -> float:
        """Bytes of one K or V element in the cache."""
        return KV_TYPES[self.kv_type]

    @property
    def ggml_type(self) -> int:
        return GGML_TYPES[self.kv_type]
