"""Pin this process to its device, before the inference library is imported.

`cuda:N` and `npu:N` make exactly one accelerator visible (index 0 inside the process);
`cpu:A-B` restricts the process to those cores and sizes the thread pool to match.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from dispatcher.common.devices import DeviceSpec


@dataclass(frozen=True)
class Placement:
    device: str
    compute: str                 # cpu, gpu or npu
    cores: tuple[int, ...]       # CPU cores this process may run on
    n_threads: int
    n_gpu_layers: int
    visible_devices: dict[str, str]

    def to_dict(self) -> dict:
        return {"device": self.device, "compute": self.compute, "cores": list(self.cores),
                "n_threads": self.n_threads, "n_gpu_layers": self.n_gpu_layers,
                "visible_devices": self.visible_devices}


def pin(spec: DeviceSpec, ngl: int) -> Placement:
    """Apply `spec` to this process; raises ValueError for cores it may not use."""
    allowed = os.sched_getaffinity(0)
    if spec.kind == "cpu" and spec.cores is not None:
        missing = sorted(set(spec.cores) - allowed)
        if missing:
            raise ValueError(f"{spec}: cores {missing} are not available "
                             f"(this process may use {sorted(allowed)})")
        os.sched_setaffinity(0, spec.cores)
    visible = spec.visible_devices()
    os.environ.update(visible)
    cores = tuple(sorted(os.sched_getaffinity(0)))
    return Placement(device=str(spec), compute=spec.compute, cores=cores,
                     n_threads=len(cores), n_gpu_layers=0 if spec.kind == "cpu" else ngl,
                     visible_devices=visible)
