"""Device specs: `cpu`, `cpu:0-3`, `cpu:0-1+4-5`, `cuda:0`, `npu:1`, `cuda:0,1` (one
model split over several accelerators: llama.cpp spreads its layers over them in
proportion to their free memory), each optionally followed by `@profile`, the worker's
machine profile (SIE's X-SIE-MACHINE-PROFILE).

A spec says where one worker runs. Parsing lives here so that the launcher can reject a
bad spec before anything starts; applying it (pinning) is `workers.pinning`.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

KINDS = {"cpu": "cpu", "cuda": "gpu", "npu": "npu"}   # device kind -> compute class
# The variable each accelerator runtime reads to choose its visible devices. npu is
# llama.cpp's CANN backend (Ascend NPUs).
PROFILE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
SYSTEMD_ESCAPE = re.compile(r"\\x([0-9a-fA-F]{2})")
# nvidia-smi -L's identifiers: GPU-<uuid>, and MIG-<uuid> for a MIG instance
CUDA_UUID = re.compile(r"(?i:gpu|mig)-[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}")
VISIBLE_DEVICES_ENV = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}
# Linux's largest CPU count (NR_CPUS): a spec naming a higher core is refused as it is
# parsed, before any set of its cores is built. Cores this machine lacks are refused when
# the launcher plans the workers (configfile.plan), against the cores it may use.
MAX_CORES = 8192


@dataclass(frozen=True)
class DeviceSpec:
    kind: str                       # cpu, cuda or npu
    index: int | None = None        # accelerator index (cuda, npu): nvidia-smi's order
    cores: tuple[int, ...] | None = None   # CPU cores (cpu); None: every allowed core
    profile: str | None = None             # machine profile name
    uuid: str | None = None         # cuda:GPU-… or cuda:MIG-… (nvidia-smi -L), not an index
    also: tuple[str, ...] = ()      # cuda:0,1: the further accelerators the model spans

    @property
    def compute(self) -> str:
        return KINDS[self.kind]

    def __str__(self) -> str:
        if self.kind == "cpu":
            text = "cpu" if self.cores is None else "cpu:" + _format_cores(self.cores)
        else:
            text = f"{self.kind}:{','.join(self.ordinals)}"
        return text if self.profile is None else f"{text}@{self.profile}"

    @property
    def ordinal(self) -> str | None:
        """Which accelerator: its index, or its UUID where one was given."""
        return self.uuid if self.uuid is not None else \
            None if self.index is None else str(self.index)

    @property
    def ordinals(self) -> tuple[str, ...]:
        """Every accelerator this worker spans (one, or several for a split model)."""
        return () if self.ordinal is None else (self.ordinal, *self.also)

    def visible_devices(self) -> dict[str, str]:
        """Environment that makes exactly this worker's accelerators visible (as devices
        0, 1, ...). CUDA numbers devices fastest first unless told otherwise: PCI_BUS_ID
        order makes cuda:N the GPU nvidia-smi calls N."""
        listed = ",".join(self.ordinals)
        if self.kind == "cuda":
            return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": listed}
        if self.kind in VISIBLE_DEVICES_ENV:
            return {VISIBLE_DEVICES_ENV[self.kind]: listed}
        return {}

    @property
    def slug(self) -> str:
        """A name fragment safe in worker names and file names."""
        return str(self).replace(":", "").replace("+", "_").replace(",", "_") \
            .replace("@", "-")


def parse_device(text: str) -> DeviceSpec:
    # a systemd instance name (completions-worker@cuda:0,1): systemctl writes `,` and
    # `+` as \x2c and \x2b in it (systemd-escape `-` too), and %i passes that on
    text = SYSTEMD_ESCAPE.sub(lambda m: chr(int(m.group(1), 16)), text)
    text, at, profile = text.strip().partition("@")
    if at and not PROFILE_NAME.fullmatch(profile):
        raise ValueError(f"bad profile name {profile!r}: letters, digits, '.', '_', '-'")
    profile = profile if at else None
    kind, sep, given = text.partition(":")
    text, kind, rest = text.lower(), kind.lower(), given.lower()
    if kind not in KINDS:
        raise ValueError(f"unknown device kind {kind!r} in {text!r}: use cpu, cuda or npu")
    if kind == "cpu":
        if not sep:
            return DeviceSpec("cpu", profile=profile)
        return DeviceSpec("cpu", cores=_parse_cores(rest, text), profile=profile)
    ordinals = [_accelerator(kind, part.strip(), text) for part in given.split(",")] \
        if sep else [_accelerator(kind, "", text)]
    if len(set(ordinals)) < len(ordinals):
        raise ValueError(f"{text!r} names one {kind} device twice")
    first = ordinals[0]
    return DeviceSpec(kind, index=int(first) if first.isdigit() else None,
                      uuid=None if first.isdigit() else first, also=tuple(ordinals[1:]),
                      profile=profile)


def _accelerator(kind: str, given: str, text: str) -> str:
    """One accelerator of a spec: its index, or (cuda) its UUID, as written canonically."""
    if kind == "cuda" and CUDA_UUID.fullmatch(given):
        prefix, _, hexits = given.partition("-")
        return f"{prefix.upper()}-{hexits.lower()}"
    if not given.isdigit():
        raise ValueError(f"{kind} device needs an index, e.g. {kind}:0"
                         + (" or a UUID, cuda:GPU-…" if kind == "cuda" else "")
                         + f" (several, split: {kind}:0,1), got {text!r}")
    return str(int(given))


def split_device_list(text: str) -> list[str]:
    """A comma-separated list of specs (COMPLETIONS_DEVICE), where `cuda:0,1` is one spec:
    a comma starts a new spec only before a device kind."""
    specs: list[str] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if specs and part.partition(":")[0].partition("@")[0].lower() not in KINDS:
            specs[-1] += "," + part
        else:
            specs.append(part)
    return specs


def _parse_cores(rest: str, text: str) -> tuple[int, ...]:
    cores: set[int] = set()
    for part in rest.split("+"):
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"bad core list in {text!r}: use cpu:N, cpu:A-B or cpu:A-B+C-D")
        first, last = int(low), int(high) if dash else int(low)
        if last < first:
            raise ValueError(f"bad core range {part!r} in {text!r}")
        if last >= MAX_CORES:
            raise ValueError(f"core {last} in {text!r} cannot exist (Linux counts at most "
                             f"{MAX_CORES} cores); this machine has {machine_cores()}")
        cores.update(range(first, last + 1))
    return tuple(sorted(cores))


def machine_cores() -> int:
    return os.cpu_count() or 1


def format_cores(cores) -> str:
    """`0-3+8`: a core set as a short range list."""
    return _format_cores(tuple(sorted(cores)))


def _format_cores(cores: tuple[int, ...]) -> str:
    runs: list[str] = []
    start = prev = cores[0]
    for core in cores[1:] + (None,):
        if core is not None and core == prev + 1:
            prev = core
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if core is not None:
            start = prev = core
    return "+".join(runs)
