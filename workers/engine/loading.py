"""A model on a device: its weights (on the accelerator as asked, CPU weight repacking on
or off), and one context holding every slot's sequences with the batch a step fills.
What `LlamaEngine` makes before anything else; llama.cpp's refusals become EngineErrors
carrying its last log lines."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from dispatcher.common.repacking import repacking_answer
from workers.engine.backends import model_shape
from workers.engine.contextshape import ContextShape
from workers.engine.llamalog import LlamaLog, last_lines
from workers.errors import EngineError

log = logging.getLogger(__name__)


@dataclass
class Weights:
    model: object                   # llama_model *
    vocab: object                   # llama_vocab *
    n_vocab: int
    n_layer: int
    layers_offloaded: int           # where the layers went, as llama.cpp's load said
    layers_total: int               # (its count has the output layer)
    repacking: bool                 # CPU weight repacking on


@dataclass
class Context:
    ctx: object                     # llama_context *
    memory: object                  # its llama_memory
    batch: object                   # llama_batch of n_batch rows, one sequence id a row
    n_ctx: int                      # tokens a sequence
    n_ctx_train: int
    n_batch: int
    n_ubatch: int


def load_weights(lib, model_path: str, n_gpu_layers: int, deterministic: bool,
                 llama_log: LlamaLog) -> Weights:
    """The weights, on the device as asked (EngineError where llama.cpp put none of the
    layers asked for there)."""
    lib.llama_backend_init()
    mparams = lib.llama_model_default_params()
    mparams.n_gpu_layers = n_gpu_layers
    # CPU weight repacking makes matmul results depend on how many rows a batch has;
    # where llama.cpp's AMX path crashes, it is off too (dispatcher.common.repacking)
    # (a model whose every layer is offloaded leaves no product's weights to the CPU)
    offloads_all = n_gpu_layers > 0 and n_gpu_layers > model_shape(model_path)["n_layer"]
    repacking = None if deterministic else repacking_answer(model_path, offloads_all)
    mparams.use_extra_bufts = bool(repacking and repacking.works)
    if repacking and not repacking.works:
        log.warning("CPU weight repacking is off: %s (COMPLETIONS_EXTRA_BUFFERS=on "
                    "forces it)", repacking.why)
    model = lib.llama_model_load_from_file(str(model_path).encode(), mparams)
    if not model:
        raise EngineError(f"llama.cpp could not load {model_path}{last_lines(llama_log)}")
    vocab = lib.llama_model_get_vocab(model)
    n_layer = lib.llama_model_n_layer(model)
    offloaded, total = llama_log.offloaded or (0, n_layer + 1)
    if n_gpu_layers > 0 and offloaded == 0:
        lib.llama_model_free(model)
        raise EngineError(
            "asked to offload layers, llama.cpp put none on an accelerator "
            + ("(it sees none)" if lib.llama_supports_gpu_offload() else
               "(this llama-cpp-python build has no GPU backend: reinstall it with "
               "CMAKE_ARGS='-DGGML_CUDA=on', docs/deploying.md)"))
    return Weights(model, vocab, lib.llama_vocab_n_tokens(vocab), n_layer, offloaded, total,
                   bool(mparams.use_extra_bufts))


def make_context(lib, model, n_ctx: int, slots: int, n_threads: int, shape: ContextShape,
                 llama_log: LlamaLog) -> Context:
    """One context of `slots` sequences of `n_ctx` tokens, and the batch of a step (the
    model freed where llama.cpp refuses the context)."""
    ctx = lib.llama_init_from_model(model, shape.context_params(lib, n_ctx, slots, n_threads))
    if not ctx:
        lib.llama_model_free(model)
        raise EngineError(f"llama.cpp could not create a context of {n_ctx * slots} "
                          f"tokens{last_lines(llama_log)}")
    n_batch = lib.llama_n_batch(ctx)
    return Context(ctx, lib.llama_get_memory(ctx), lib.llama_batch_init(n_batch, 0, 1), n_ctx,
                   lib.llama_model_n_ctx_train(model), n_batch, lib.llama_n_ubatch(ctx))


def drops_positions(lib, model) -> bool:
    """Whether the model's memory can drop its last positions, as a rejected draft
    needs: a recurrent or hybrid model's (Mamba, RWKV, Granite-H, LFM2) cannot, with
    llama.cpp's default context, so such a model serves without drafts."""
    if lib.llama_model_is_recurrent(model) or lib.llama_model_is_hybrid(model):
        log.warning("a recurrent or hybrid model: no speculative drafts (its memory "
                    "cannot drop rejected draft tokens)")
        return False
    return True
