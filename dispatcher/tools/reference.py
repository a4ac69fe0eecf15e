"""llama-cpp-python's own `Llama`, loaded the way the workers load the model here: the
bench's in-process target (`--in-process`, the library's own speed) and the tests'
reference. With the engine layer (workers/engine/), the one place that imports
llama_cpp: the bench measures the library itself, in its own process, on purpose."""
from __future__ import annotations

import contextlib
import os

from dispatcher.common.repacking import extra_buffers_work


@contextlib.contextmanager
def llama_loads_like_workers(model_path: str | os.PathLike | None = None):
    """For llama-cpp-python's own `Llama` in this process (the tests' reference, the
    bench's in-process target): load weights as workers do on this machine, without
    extra buffer types where they crash (`Llama` has no option for it)."""
    if extra_buffers_work(model_path):
        yield
        return
    import llama_cpp.llama_cpp as bindings        # the module `Llama` calls into
    original = bindings.llama_model_default_params

    def without_extra_buffers():
        params = original()
        params.use_extra_bufts = False
        return params

    bindings.llama_model_default_params = without_extra_buffers
    try:
        yield
    finally:
        bindings.llama_model_default_params = original


def reference_llama(model_path: str, n_ctx: int, n_threads: int, **kwargs):
    """llama-cpp-python's own `Llama`, loaded with the workers' settings (flash attention,
    a batch of 512, repacking as workers do here): the bench's in-process target and the
    tests' reference."""
    from llama_cpp import Llama
    with llama_loads_like_workers(model_path):
        return Llama(str(model_path), n_ctx=n_ctx, n_batch=512, flash_attn=True,
                     n_threads=n_threads, verbose=False, **kwargs)
