"""Pin this process to its device, before the inference library is imported.

`cuda:N` and `npu:N` make exactly one accelerator visible (index 0 inside the process);
`cpu:A-B` restricts the process to those cores and sizes the thread pool to match.

A worker that offloads to an accelerator needs few CPU threads: the device runs the
layers, the host samples and runs the odd operation. It gets at most ACCELERATOR_THREADS
(llama.cpp's own benchmarks of offloaded models gain nothing past a few), so that one
worker per GPU does not take every core once per GPU. Where the machine says which cores
are near the GPU (the PCI device's `local_cpulist` in sysfs, found through nvidia-smi's
bus id), the worker runs on those.
"""
from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path

from dispatcher.common.devices import DeviceSpec


@dataclass(frozen=True)
class Placement:
    device: str
    compute: str                 # cpu, gpu or npu
    cores: tuple[int, ...]       # CPU cores this process may run on
    n_threads: int
    n_gpu_layers: int
    visible_devices: dict[str, str]

    def for_layers(self, n_layer: int) -> "Placement":
        """A model with layers left on the CPU (--ngl below its layers and output layer,
        as llama.cpp counts them) runs those on every core it may use."""
        if 0 < self.n_gpu_layers < n_layer + 1 and self.n_threads < len(self.cores):
            return replace(self, n_threads=len(self.cores))
        return self

    def to_dict(self) -> dict:
        return {"device": self.device, "compute": self.compute, "cores": list(self.cores),
                "n_threads": self.n_threads, "n_gpu_layers": self.n_gpu_layers,
                "visible_devices": self.visible_devices}


ACCELERATOR_THREADS = 4      # CPU threads of a worker whose layers are on an accelerator
SYSFS = Path("/sys")


def pin(spec: DeviceSpec, ngl: int) -> Placement:
    """Apply `spec` to this process; raises ValueError for cores it may not use."""
    allowed = os.sched_getaffinity(0)
    if spec.kind == "cpu" and spec.cores is not None:
        missing = sorted(set(spec.cores) - allowed)
        if missing:
            raise ValueError(f"{spec}: cores {missing} are not available "
                             f"(this process may use {sorted(allowed)})")
        os.sched_setaffinity(0, spec.cores)
    offloads = spec.kind != "cpu" and ngl > 0
    if offloads and spec.kind == "cuda":
        near = gpu_local_cores(spec) & allowed
        if near:
            os.sched_setaffinity(0, near)
    visible = spec.visible_devices()
    os.environ.update(visible)
    cores = tuple(sorted(os.sched_getaffinity(0)))
    threads = min(len(cores), ACCELERATOR_THREADS) if offloads else len(cores)
    return Placement(device=str(spec), compute=spec.compute, cores=cores,
                     n_threads=threads, n_gpu_layers=0 if spec.kind == "cpu" else ngl,
                     visible_devices=visible)


def gpu_local_cores(spec: DeviceSpec) -> set[int]:
    """The cores sysfs says are near this worker's GPUs; empty where nothing says (no
    nvidia-smi, no such device, no NUMA information)."""
    near: set[int] = set()
    for ordinal in spec.ordinals:       # a split model: the cores near any of its GPUs
        near |= _local_cores(ordinal)
    return near


def _local_cores(ordinal: str) -> set[int]:
    try:
        done = subprocess.run(
            ["nvidia-smi", "-i", ordinal, "--query-gpu=pci.bus_id",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=10,
            env={**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    except (OSError, subprocess.SubprocessError):
        return set()
    lines = done.stdout.split() if done.returncode == 0 else []
    domain, sep, rest = (lines[0].lower() if lines else "").partition(":")
    if not sep or len(domain) < 4:               # nvidia-smi: 00000000:17:00.0
        return set()
    device = f"{domain[-4:]}:{rest}"             # sysfs: 0000:17:00.0
    try:
        return parse_cpulist((SYSFS / "bus/pci/devices" / device / "local_cpulist")
                             .read_text())
    except (OSError, ValueError):
        return set()


def parse_cpulist(text: str) -> set[int]:
    """`0-15,32-47` (the kernel's cpulist format) as a set of cores."""
    cores: set[int] = set()
    for part in text.strip().split(","):
        if part:
            low, _, high = part.partition("-")
            cores.update(range(int(low), int(high or low) + 1))
    return cores
