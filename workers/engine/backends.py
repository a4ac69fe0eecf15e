"""What llama.cpp sees of this process's devices, and what a model needs of one.

ggml's device registry (`ggml_backend_dev_*`, not wrapped by llama-cpp-python; bound
here through ctypes on the library it already loaded) names each backend device, its
kind and its free memory. `check_placement` is run by every llama worker and by
`python -m workers.selftest` before loading a model: a device the build cannot drive, or
that is not visible, or too small for nctx × slots, is refused in one line (with the
numbers, and the largest context that would fit) instead of failing inside llama.cpp or
loading on the CPU while the worker says it is on a GPU.
"""
from __future__ import annotations

import collections
import ctypes
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from workers.errors import EngineError

from workers.engine.contextshape import ContextShape
from workers.engine.ggufheader import Array, GGUFHeaderError, read_metadata

if TYPE_CHECKING:
    from dispatcher.common.devices import DeviceSpec
    from workers.pinning import Placement

DEVICE_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel"}   # enum ggml_backend_dev_type
MIB = 1 << 20
RUNTIME_PREFIX = {"cuda": "CUDA", "npu": "CANN"}   # ggml's device names per device kind


@dataclass(frozen=True)
class BackendDevice:
    name: str              # CPU, CUDA0, CANN0, ...
    description: str       # the product name
    type: str              # cpu, gpu, igpu, accel
    free: int              # bytes
    total: int

    def to_dict(self) -> dict:
        return {"name": self.name, "description": self.description, "type": self.type,
                "free_mib": self.free // MIB, "total_mib": self.total // MIB}


def _bind(lib) -> None:
    if getattr(lib, "_completions_bound", False):
        return
    lib.ggml_backend_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_dev_count.argtypes = []
    lib.ggml_backend_dev_get.restype = ctypes.c_void_p
    lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    for name in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
        getattr(lib, name).restype = ctypes.c_char_p
        getattr(lib, name).argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_type.restype = ctypes.c_int
    lib.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_memory.restype = None
    lib.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                            ctypes.POINTER(ctypes.c_size_t)]
    lib._completions_bound = True


def backend_devices() -> list[BackendDevice]:
    """Every device ggml's registry holds in this process (after pinning: CUDA sees
    only the devices CUDA_VISIBLE_DEVICES leaves it)."""
    import llama_cpp
    from llama_cpp._ggml import libggml
    llama_cpp.llama_backend_init()
    _bind(libggml)
    devices = []
    for i in range(libggml.ggml_backend_dev_count()):
        dev = libggml.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        libggml.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        devices.append(BackendDevice(
            name=(libggml.ggml_backend_dev_name(dev) or b"?").decode(errors="replace"),
            description=(libggml.ggml_backend_dev_description(dev) or b"").decode(
                errors="replace"),
            type=DEVICE_TYPES.get(libggml.ggml_backend_dev_type(dev), "other"),
            free=free.value, total=total.value))
    return devices


def gpu_support() -> bool:
    import llama_cpp
    return bool(llama_cpp.llama_supports_gpu_offload())


def own_cgroup(root: str = "/sys/fs/cgroup", table: str = "/proc/self/cgroup") -> str:
    """This process's cgroup v2 directory (systemd's MemoryMax= is set there)."""
    try:
        with open(table) as f:
            for line in f:
                if line.startswith("0::"):
                    return os.path.join(root, line[3:].strip().lstrip("/"))
    except OSError:
        pass
    return root


def host_memory_available(meminfo: str = "/proc/meminfo", cgroup: str | None = None) -> int:
    """Bytes this process can still allocate on the host: MemAvailable, or less where a
    cgroup (systemd's MemoryMax=, a container) caps the process."""
    cgroup = own_cgroup() if cgroup is None else cgroup
    available = 0
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        with open(os.path.join(cgroup, "memory.max")) as f:
            limit = f.read().strip()
        with open(os.path.join(cgroup, "memory.current")) as f:
            used = int(f.read().strip())
        if limit != "max":
            available = min(available or 1 << 62, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return available


def diagnose_device(kind: str, index: str | None, supports_gpu: bool,
                    devices: list[BackendDevice], visible_env: dict[str, str],
                    wanted: int = 1) -> str | None:
    """Why a worker for this device (`wanted` accelerators of it, for a split model)
    cannot run, in one line; None when it can."""
    if kind == "cpu":
        return None
    runtime = {"cuda": "CUDA", "npu": "CANN"}[kind]
    if not supports_gpu:
        flag = {"cuda": "-DGGML_CUDA=on", "npu": "-DGGML_CANN=on"}[kind]
        return (f"no {runtime} in this llama-cpp-python build (it offloads nothing): "
                f"reinstall it with CMAKE_ARGS='{flag}' (docs/deploying.md: GPU workstation)")
    accelerators = [d for d in devices if d.type in ("gpu", "igpu", "accel")
                    and d.name.startswith(RUNTIME_PREFIX[kind])]
    if not accelerators:
        variables = " ".join(f"{k}={v}" for k, v in visible_env.items()
                             if k.endswith("VISIBLE_DEVICES"))
        return (f"{kind}:{index} is not visible: with {variables} llama.cpp sees no "
                f"{runtime} device (check the index against nvidia-smi -L / npu-smi info)")
    if len(accelerators) < wanted:
        variables = " ".join(f"{k}={v}" for k, v in visible_env.items()
                             if k.endswith("VISIBLE_DEVICES"))
        return (f"{kind}:{index} asks for {wanted} devices, but with {variables} llama.cpp "
                f"sees {len(accelerators)} (check the indexes against nvidia-smi -L / "
                f"npu-smi info)")
    return None


@dataclass(frozen=True)
class MemoryNeed:
    weights: int        # bytes: the model file (its tensors)
    kv_per_token: int   # bytes of K and V cache per token of context, all layers
    compute: int        # bytes: llama.cpp's compute buffer, about one ubatch of logits
    tokens: int         # nctx × slots

    @property
    def kv(self) -> int:
        return self.kv_per_token * self.tokens

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute

    def nctx_that_fits(self, free: int, slots: int, step: int = 256) -> int:
        """The largest nctx (a multiple of `step`) whose need fits in `free` bytes at
        `slots` sequences; 0 if not even the weights fit."""
        room = free - self.weights - self.compute
        if room <= 0 or self.kv_per_token <= 0:
            return 0
        return (room // (self.kv_per_token * slots)) // step * step


def kv_bytes_per_token(n_layer: int, n_head_kv: int, key_length: int, value_length: int,
                       cell_bytes: float = 2) -> int:
    """K and V (f16 by default) for one token of context over every layer."""
    return int(n_layer * n_head_kv * (key_length + value_length) * cell_bytes)


def memory_need(model_file_bytes: int, n_layer: int, n_head_kv: int, key_length: int,
                value_length: int, n_vocab: int, nctx: int, slots: int,
                n_ubatch: int = 512, cell_bytes: float = 2) -> MemoryNeed:
    return MemoryNeed(weights=model_file_bytes,
                      kv_per_token=kv_bytes_per_token(n_layer, n_head_kv, key_length,
                                                      value_length, cell_bytes),
                      compute=n_ubatch * n_vocab * 4, tokens=nctx * slots)


def model_shape(model_path: str) -> dict:
    """Sizes from the GGUF's metadata: read from its header (`ggufheader`), or where that
    reader does not know the header, from llama.cpp's vocabulary-only load (no tensors
    are read, but the whole tokenizer is built)."""
    try:
        return shape_from_metadata(read_metadata(model_path))
    except GGUFHeaderError:
        return shape_from_llama(model_path)


def shape_from_metadata(meta: dict) -> dict:
    """The sizes `memory_need` takes, from the header's key-value pairs; GGUFHeaderError
    where the vocabulary's size is not there. As llama.cpp reads them, except that a
    per-layer array (KV heads that differ by layer) counts its largest element, where
    llama.cpp's metadata leaves arrays out and the fallback (all heads) would count
    more. (A file llama.cpp refuses for what lies past these keys is refused by its
    load, after this check.)"""
    arch = meta.get("general.architecture")
    arch = arch if isinstance(arch, str) and arch else "llama"
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, Array):
        raise GGUFHeaderError("no tokenizer.ggml.tokens")

    def number(key: str, fallback: int) -> int:
        value = meta.get(f"{arch}.{key}")
        if isinstance(value, Array):              # a per-layer array: the largest element
            value = max(value.values) if value.values else None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not math.isfinite(value):
            return fallback
        return int(value)
    return sizes(arch, number, tokens.count)


def sizes(arch: str, number, n_vocab: int) -> dict:
    """`model_shape`'s sizes, `number(key, fallback)` reading the architecture's keys."""
    n_embd = number("embedding_length", 0)
    n_head = number("attention.head_count", 1) or 1
    head_dim = n_embd // n_head
    return {"arch": arch, "n_layer": number("block_count", 0),
            "n_head_kv": number("attention.head_count_kv", n_head),
            "key_length": number("attention.key_length", head_dim),
            "value_length": number("attention.value_length", head_dim),
            "sliding_window": number("attention.sliding_window", 0),
            "n_vocab": n_vocab}


def shape_from_llama(model_path: str) -> dict:
    """The same sizes as llama.cpp reads them (a vocabulary-only load; a size that is not
    a finite number, or is an array, gives its fallback)."""
    import llama_cpp
    from workers.engine.llamalog import RECENT, last_lines, quiet_llama_log
    log = quiet_llama_log()            # held while the model is read
    log.recent = collections.deque(maxlen=RECENT)
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    try:
        model = llama_cpp.llama_model_load_from_file(model_path.encode(), params)
    finally:
        said, log.recent = last_lines(log), None
    if not model:
        raise EngineError(f"llama.cpp cannot read {model_path}{said}")
    buf = ctypes.create_string_buffer(512)

    def meta(key: str) -> str | None:
        n = llama_cpp.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
        return buf.value.decode(errors="replace") if n >= 0 else None

    def number(key: str, fallback: int) -> int:
        value = meta(f"{arch}.{key}")        # (a per-layer array is not among them)
        try:
            return int(float(value)) if value is not None else fallback
        except (ValueError, OverflowError):
            return fallback
    try:
        arch = meta("general.architecture") or "llama"
        return sizes(arch, number, llama_cpp.llama_vocab_n_tokens(
            llama_cpp.llama_model_get_vocab(model)))
    finally:
        llama_cpp.llama_model_free(model)
        del log


@dataclass
class PlacementCheck:
    """What `check_placement` found: the devices llama.cpp sees, the figures of the memory
    check, and why the worker must not load (None: it may)."""
    devices: list[BackendDevice]
    memory: dict = field(default_factory=dict)  # need_mib, free_mib, kv_estimate_mib
    refusal: str | None = None
    n_layer: int | None = None                  # the model's, where it could be read


def check_placement(spec: "DeviceSpec", placement: "Placement", model_path: str, nctx: int,
                    slots: int, shape: ContextShape = ContextShape()) -> PlacementCheck:
    """Whether this pinned process can load `model_path` at nctx × slots where it is
    asked to: the build drives the device, the device is visible, and weights + KV +
    compute buffers fit in its free memory (the host's, for what stays on the CPU)."""
    devices = backend_devices()
    found = PlacementCheck(devices)
    if placement.n_gpu_layers > 0:
        found.refusal = diagnose_device(spec.kind, ",".join(spec.ordinals), gpu_support(),
                                        devices, placement.visible_devices,
                                        wanted=len(spec.ordinals))
        if found.refusal:
            return found
    try:
        sizes = model_shape(model_path)
    except EngineError as exc:
        found.refusal = str(exc)
        return found
    found.n_layer = sizes["n_layer"]
    accelerators = [d for d in devices if d.type != "cpu" and d.name.startswith(
        RUNTIME_PREFIX.get(spec.kind, "?"))]
    if placement.n_gpu_layers >= sizes["n_layer"] + 1 and accelerators:
        # a model split over several (cuda:0,1) takes from each in proportion to its free
        # memory (llama.cpp's default split), so their free memory counts together
        free = sum(d.free for d in accelerators)
        where = " + ".join(d.name for d in accelerators)
    else:
        free, where = host_memory_available(), "the host"
    need = memory_need(os.path.getsize(model_path), sizes["n_layer"], sizes["n_head_kv"],
                       sizes["key_length"], sizes["value_length"], sizes["n_vocab"],
                       nctx, slots, n_ubatch=shape.n_ubatch, cell_bytes=shape.cell_bytes)
    found.memory = {"need_mib": need.total // MIB, "free_mib": free // MIB,
                    "kv_estimate_mib": need.kv // MIB}
    found.refusal = memory_refusal(need, free, where, nctx, slots)
    return found


def memory_refusal(need: MemoryNeed, free: int, where: str, nctx: int,
                   slots: int) -> str | None:
    """One line with the numbers where `need` does not fit in `free` bytes (0: unknown,
    so it fits); the largest nctx that would fit at these slots, or that none does."""
    if not free or need.total <= free:
        return None
    fits = need.nctx_that_fits(free, slots)
    advice = (f"nctx {fits} fits at {slots} slots" if fits else
              "not even the weights fit: use a smaller model or fewer offloaded layers")
    return (f"out of memory at nctx {nctx} × slots {slots}: needs about "
            f"{need.total // MIB} MiB (weights {need.weights // MIB}, KV "
            f"{need.kv // MIB}, compute {need.compute // MIB}), {free // MIB} MiB "
            f"free on {where}; {advice}")
