"""`python -m dispatcher selftest`: every configured device checked alone, one at a time.

Same flags and config file as `serve`. For each planned worker a fresh process
(`python -m workers.selftest`) is pinned exactly as that worker would be
(CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES, CPU affinity), loads the model the
worker's way and reports the placement llama.cpp chose and prefill / decode speed at one
sequence and at `--slots`. One at a time, so CPU devices sharing cores do not slow each
other's figures. A device that fails gets one line saying why; the exit status is 1 if
any failed.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from dispatcher.common import configfile
from dispatcher.common.config import non_negative_seconds
from dispatcher.common.process import python_module_argv


def add_arguments(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")
    parser.add_argument("--prompt-tokens", type=int, default=256,
                        help="prompt length for the prefill figure [default 256]")
    parser.add_argument("--tokens", type=int, default=64,
                        help="tokens generated per sequence for the decode figure [64]")
    parser.add_argument("--timeout", type=non_negative_seconds, default=600.0,
                        help="seconds one device may take, loading included [600]")


def child_argv(worker, args) -> list[str]:
    return python_module_argv(
        "workers.selftest", "--device", str(worker.device), "--model", str(worker.model.path),
        "--nctx", str(worker.nctx), "--ngl", str(worker.ngl), "--slots", str(worker.slots),
        "--kv-type", worker.kv_type, "--batch", str(worker.batch), "--ubatch", str(worker.ubatch),
        "--deterministic", str(worker.model.deterministic),
        "--prompt-tokens", str(args.prompt_tokens), "--tokens", str(args.tokens))


def check_worker(worker, args) -> dict:
    env = {**os.environ, **worker.device.visible_devices(),
           "COMPLETIONS_PARENT_PID": str(os.getpid())}
    try:
        done = subprocess.run(child_argv(worker, args), env=env, capture_output=True,
                              text=True, errors="replace", timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "device": str(worker.device),
                "error": f"no result within {args.timeout:.0f}s (--timeout)"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                break
    # It died without a word: a signal (the kernel's OOM killer sends SIGKILL), or a crash
    # inside llama.cpp; its last lines of stderr say more.
    if done.returncode < 0:
        try:
            how = f"killed by {signal.Signals(-done.returncode).name}"
        except ValueError:
            how = f"killed by signal {-done.returncode}"
        if done.returncode == -signal.SIGKILL:
            how += " (out of memory? lower --nctx or --slots)"
    else:
        how = f"exited with status {done.returncode}"
    tail = [line for line in done.stderr.splitlines() if line.strip()][-2:]
    return {"ok": False, "device": str(worker.device),
            "error": how + (f": {' | '.join(tail)}" if tail else "")}


def _row(result: dict) -> str:
    if not result["ok"]:
        return f"  {result['device']:<12} FAILED  {result['error']}"
    where = result["placement"]
    buffers = where["buffers_mib"]
    places = ", ".join(f"{name} {mib:.0f}" for name, mib in buffers.get("model", {}).items())
    kv = sum(buffers.get("kv", {}).values())
    one, many = result["single"], result.get("concurrent")
    line = (f"  {result['device']:<12} ok      layers {where['layers_offloaded']}/"
            f"{where['n_layer']} offloaded, weights MiB: {places or '?'}, KV {kv:.0f} MiB; "
            f"prefill {one['prefill_tok_s']:.0f} tok/s, decode {one['decode_tok_s']:.1f} tok/s")
    if many:
        line += (f", {many['sequences']} streams {many['decode_tok_s']:.1f} tok/s "
                 f"({many['per_stream_tok_s']:.1f} each)")
    apart = result.get("scattered")
    if apart:
        line += (f"; {apart['sequences']} in every other slot {apart['every_other_tok_s']:.1f} "
                 f"tok/s ({apart['ratio']:.2f}x side by side)")
    return line


def run(args) -> int:
    try:
        plan = configfile.plan_for(args)
    except configfile.ConfigError as exc:
        raise SystemExit(exc.report())
    results = []
    for worker in plan.workers:
        if not args.json:
            print(f"{worker.name}: {worker.device}, {worker.model.id}, nctx {worker.nctx} × "
                  f"{worker.slots} slots ...", file=sys.stderr, flush=True)
        results.append({"worker": worker.name, **check_worker(worker, args)})
    if args.json:
        print(json.dumps({"ok": all(r["ok"] for r in results), "devices": results}, indent=2))
    else:
        for result in results:
            print(_row(result))
        failed = sum(not r["ok"] for r in results)
        print(f"{len(results) - failed} of {len(results)} device(s) ok")
    return 0 if all(r["ok"] for r in results) else 1
