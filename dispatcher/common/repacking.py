"""Whether llama.cpp's CPU "extra buffer types" (weight repacking, AMX) work here.

llama.cpp built natively on a CPU with AMX puts quantized weights into its AMX buffer
type, and on some machines (seen in sandboxed VMs that advertise `amx_tile` but do not
grant the tile state) the first matrix product then dies with SIGSEGV, so every decode
kills the worker. Where the CPU advertises AMX and the build contains the AMX code, a
throw-away child process loads the bundled model with extra buffer types and decodes a
few tokens once; the answer is cached per llama.cpp build and CPU. Elsewhere nothing is
probed. When the probe fails, workers load weights without extra buffer types (plain
CPU kernels: slower, never crashing) and say so in their log.

`COMPLETIONS_EXTRA_BUFFERS=on|off` overrides the probe.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from dispatcher.common.models import bundled_model_path, cache_dir

PROBE = """
import sys, llama_cpp
quiet = llama_cpp.llama_log_callback(lambda *a: None)     # kept alive: llama.cpp calls it
llama_cpp.llama_log_set(quiet, None)
llama_cpp.llama_backend_init()
params = llama_cpp.llama_model_default_params()
params.use_extra_bufts = True
model = llama_cpp.llama_model_load_from_file(sys.argv[1].encode(), params)
cparams = llama_cpp.llama_context_default_params()
cparams.n_ctx, cparams.n_batch, cparams.n_threads, cparams.n_threads_batch = 256, 64, 1, 1
ctx = llama_cpp.llama_init_from_model(model, cparams)
tokens = (llama_cpp.llama_token * 8)(*([2] * 8))
sys.exit(llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(tokens, 8)))
"""


def cpu_identity() -> str:
    """The CPU's model name and flags (what measured costs depend on)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    name = next((line for line in lines if line.startswith("model name")), "")
    return hashlib.sha256(f"{name}:{sorted(_cpu_flags())}".encode()).hexdigest()[:16]


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def _ggml_cpu_library() -> Path | None:
    import importlib.util
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.origin:
        return None
    libs = sorted((Path(spec.origin).parent / "lib").glob("libggml-cpu*.so*"))
    return libs[0] if libs else None


def _has_amx_code(library: Path) -> bool:
    return b"AMX is not ready" in library.read_bytes()


def extra_buffers_work(model_path: str | os.PathLike | None = None) -> bool:
    """True unless this CPU advertises AMX, the build has AMX code, and a probe crashed.
    The probe loads `model_path` (the model the caller is about to load; the bundled one
    where none is named), so a machine without the bundled package probes too."""
    forced = os.environ.get("COMPLETIONS_EXTRA_BUFFERS", "").lower()
    if forced in ("on", "off"):
        return forced == "on"
    if "amx_tile" not in _cpu_flags():
        return True
    library = _ggml_cpu_library()
    if library is None or not _has_amx_code(library):
        return True
    stat = library.stat()
    key = hashlib.sha256(f"{library}:{stat.st_size}:{stat.st_mtime_ns}:"
                         f"{sorted(_cpu_flags())}".encode()).hexdigest()[:16]
    cache = cache_dir() / f"extra-buffers-{key}.json"
    try:
        return bool(json.loads(cache.read_text())["works"])
    except (OSError, ValueError, KeyError):
        pass
    try:
        probed = model_path if model_path is not None else bundled_model_path()
        works = subprocess.run([sys.executable, "-c", PROBE, str(probed)],
                               capture_output=True, timeout=120).returncode == 0
    except subprocess.TimeoutExpired:
        works = False
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        partial = cache.with_name(f"{cache.name}.{os.getpid()}")     # workers probing at
        partial.write_text(json.dumps({"works": works, "library": str(library)}))
        os.replace(partial, cache)                                  # once never see half
    except OSError:
        pass
    return works
