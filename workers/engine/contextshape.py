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

    def context_params(self, lib, n_ctx: int, slots: int, n_threads: int):
        """llama.cpp's context parameters for `slots` sequences of `n_ctx` tokens of this
        shape (`lib`: llama-cpp-python's module, handed over by its one importer)."""
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = n_ctx * slots
        cparams.n_seq_max = slots
        cparams.n_batch, cparams.n_ubatch = self.n_batch, self.n_ubatch
        cparams.type_k = cparams.type_v = self.ggml_type
        cparams.n_threads = cparams.n_threads_batch = n_threads
        # One KV stream per slot: a sequence attends over its own cells only (a unified
        # pool makes every sequence scan every slot's cells, cached prefixes included).
        cparams.kv_unified = False
        # llama.cpp picks flash attention where the backend has it (on CPU too: ~10%
        # faster batched decode here); it changes the numbers slightly, so reference
        # runs of llama-cpp-python must use flash_attn=True to compare token for token.
        cparams.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_AUTO
        cparams.no_perf = True
        return cparams
