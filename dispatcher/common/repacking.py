"""Whether llama.cpp's CPU "extra buffer types" (weight repacking, AMX) work here.

llama.cpp built natively on a CPU with AMX puts quantized weights into its AMX buffer
type, and on some machines (seen in sandboxed VMs that advertise `amx_tile` but do not
grant the tile state) the first matrix product then dies with SIGSEGV, so every decode
kills the worker. Where the CPU advertises AMX and the build contains the AMX code, a
throw-away child process loads the model with extra buffer types, on the CPU alone (no
layer offloaded, accelerators hidden: on a GPU host the probe is of the host's kernels,
not the GPU's), and decodes a few tokens once; a clean exit or a crash is cached per
llama.cpp build, CPU and model (AMX repacks some quantized types only, so an F16 model's
answer says nothing of a Q4_K one), with the child's exit and the end of its stderr.
Elsewhere, and for a worker that offloads every layer, nothing is probed. When the probe fails, workers load weights without extra buffer types
(plain CPU kernels: slower, never crashing) and say so in their log, with how it failed.

`COMPLETIONS_EXTRA_BUFFERS=on|off` overrides the probe.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from dispatcher.common.models import bundled_model_path, cache_dir

PROBE = """
import sys, llama_cpp
quiet = llama_cpp.llama_log_callback(lambda *a: None)     # kept alive: llama.cpp calls it
llama_cpp.llama_log_set(quiet, None)
llama_cpp.llama_backend_init()
params = llama_cpp.llama_model_default_params()
params.use_extra_bufts = True
params.n_gpu_layers = 0                     # (llama.cpp's default offloads every layer)
model = llama_cpp.llama_model_load_from_file(sys.argv[1].encode(), params)
if not model:
    sys.exit("the probe could not load the model")
cparams = llama_cpp.llama_context_default_params()
cparams.n_ctx, cparams.n_batch, cparams.n_threads, cparams.n_threads_batch = 256, 64, 1, 1
cparams.op_offload = False
ctx = llama_cpp.llama_init_from_model(model, cparams)
if not ctx:
    sys.exit("the probe could not make a context")
tokens = (llama_cpp.llama_token * 8)(*([2] * 8))
status = llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(tokens, 8))
llama_cpp.llama_free(ctx)
llama_cpp.llama_model_free(model)
sys.exit(f"llama_decode returned {status}" if status else 0)
"""
# accelerators the probe's child must not see (CUDA's, ROCm's, Ascend's: it probes the
# host's kernels; with no layer offloaded and op_offload off no other device runs any)
HIDDEN = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES")
# exits that are the kernels' answer, kept: a crash (a negative status is a signal)
CRASHES = (-signal.SIGSEGV, -signal.SIGBUS, -signal.SIGILL, -signal.SIGABRT, -signal.SIGFPE)
STDERR_KEPT = 2000          # characters of the child's stderr kept with its answer


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


@dataclass(frozen=True)
class Answer:
    works: bool
    why: str = ""          # where it does not: how that was decided


def extra_buffers_work(model_path: str | os.PathLike | None = None) -> bool:
    """True unless this CPU advertises AMX, the build has AMX code, and a probe crashed
    (or COMPLETIONS_EXTRA_BUFFERS says otherwise)."""
    return repacking_answer(model_path).works


def repacking_answer(model_path: str | os.PathLike | None = None,
                     offloads_all: bool = False) -> Answer:
    """Whether extra buffer types work here, and why not. The probe loads `model_path`
    (the model the caller is about to load; the bundled one where none is named), so a
    machine without the bundled package probes too. `offloads_all`: every layer goes to
    an accelerator, no matrix product's weights stay with the CPU, so nothing is probed.
    One process probes at a time (a lock beside the cache: GPU workers start together),
    and only a clean exit or a crash is kept: a probe that ran out of time, was killed
    or could not load the model says "off" for this start only."""
    forced = os.environ.get("COMPLETIONS_EXTRA_BUFFERS", "").lower()
    if forced in ("on", "off"):
        return Answer(True) if forced == "on" else Answer(False, "COMPLETIONS_EXTRA_BUFFERS=off")
    if offloads_all or "amx_tile" not in _cpu_flags():
        return Answer(True)
    library = _ggml_cpu_library()
    if library is None or not _has_amx_code(library):
        return Answer(True)
    cache = cache_dir() / f"extra-buffers-{_key(library, model_path)}.json"
    answer = _cached(cache)
    if answer is not None:
        return answer
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        lock = open(cache.with_suffix(".lock"), "a")
    except OSError:
        lock = None
    try:
        if lock is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)        # another worker's probe: its answer
            answer = _cached(cache)
            if answer is not None:
                return answer
        record = probe(Path(model_path if model_path is not None else bundled_model_path()))
        record["library"] = str(library)
        if record["works"] or record["exit"] in CRASHES:
            try:
                partial = cache.with_name(f"{cache.name}.{os.getpid()}")
                partial.write_text(json.dumps(record))
                os.replace(partial, cache)          # a reader never sees half of it
            except OSError:
                pass
        return Answer(record["works"], _why(record))
    finally:
        if lock is not None:
            lock.close()                            # (releases the lock)


def _key(library: Path, model_path: str | os.PathLike | None) -> str:
    """The cache's key: the CPU library's build, the CPU, and the model probed."""
    stat = library.stat()
    if model_path is None:
        model_key = "bundled"               # (its path is found, and checked, on a probe)
    else:
        try:
            model = Path(model_path).stat()
            model_key = f"{Path(model_path).resolve()}:{model.st_size}:{model.st_mtime_ns}"
        except OSError:
            model_key = str(model_path)
    return hashlib.sha256(f"{library}:{stat.st_size}:{stat.st_mtime_ns}:"
                          f"{sorted(_cpu_flags())}:{model_key}".encode()).hexdigest()[:16]


def _cached(cache: Path) -> Answer | None:
    try:
        record = json.loads(cache.read_text())
        return Answer(bool(record["works"]), _why(record))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def probe(model: Path) -> dict:
    """The probe run once in a child on the CPU alone: {"works", "model", "exit",
    "stderr"} (its exit status, negative for a signal; None where it ran out of time)."""
    env = {**os.environ, **{name: "" for name in HIDDEN}}
    try:
        done = subprocess.run([sys.executable, "-c", PROBE, str(model)], env=env,
                              capture_output=True, timeout=120)
        status, stderr = done.returncode, done.stderr
    except subprocess.TimeoutExpired as exc:
        status, stderr = None, exc.stderr or b""
    except OSError as exc:                  # (no child at all: nothing learned)
        status, stderr = "not started", str(exc).encode()
    return {"works": status == 0, "model": str(model), "exit": status,
            "stderr": stderr.decode("utf-8", "replace")[-STDERR_KEPT:]}


def _why(record: dict) -> str:
    """How a probe that failed failed, in a few words."""
    if record.get("works"):
        return ""
    status = record.get("exit")
    if status is None and "exit" in record:
        how = "ran past 120 s"
    elif isinstance(status, int) and status < 0:
        try:
            how = f"died of {signal.Signals(-status).name}"
        except ValueError:
            how = f"died of signal {-status}"
    elif status == "not started":
        how = f"could not start ({record.get('stderr', '')})"
    elif isinstance(status, int):
        last = [line for line in str(record.get("stderr", "")).splitlines() if line.strip()]
        how = f"exited {status}" + (f" ({last[-1][:200]})" if last else "")
    else:
        how = "failed"
    return f"a probe of llama.cpp's CPU weight repacking (AMX) {how}"
