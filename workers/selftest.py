"""`python -m workers.selftest`: one device's check, run by `python -m dispatcher selftest`
in a process of its own, pinned exactly as that device's worker is.

It asks llama.cpp what it sees (ggml's device registry), refuses in one line what cannot
work (a build without the device's runtime, a device that is not visible, nctx × slots
that does not fit in the device's free memory, with the nctx that would), loads the model
through the worker's own `load_engine`, reads the placement llama.cpp chose from its load
log (layers offloaded, weight / KV / compute buffers per device), then times prefill and
greedy decode through the engine's own `step`, for one sequence and for every slot at
once. Prints one JSON object on stdout; exit status 0 only when the device works.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import re
import sys
import time

from dispatcher.common import config
from dispatcher.common.devices import parse_device
from dispatcher.common.models import resolve_model_path
from workers.engine.backends import check_placement
from workers.engine.contextshape import ContextShape
from workers.engine.llamalog import OFFLOADED
from workers.pinning import pin

TEXT = ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
        "    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n")
BUFFER = re.compile(r"(\S+)\s+(model|KV|compute) buffer size\s*=\s*([\d.]+) MiB")


class Failed(Exception):
    """This device cannot serve; the message is the one line the table shows."""


def placement_from_log(text: str) -> dict:
    buffers: dict[str, dict[str, float]] = {}
    for device, kind, mib in BUFFER.findall(text):
        per = buffers.setdefault(kind.lower(), {})
        per[device] = round(per.get(device, 0.0) + float(mib), 2)
    found = OFFLOADED.search(text)
    return {"buffers_mib": buffers,
            "layers_offloaded": int(found.group(1)) if found else 0,
            "layers_total": int(found.group(2)) if found else None}


def load_with_log(args, placement):
    """The worker's own load path, llama.cpp's log captured (it names the placement)."""
    from workers.worker import load_engine
    captured, saved = io.StringIO(), sys.stderr
    sys.stderr = captured
    try:
        engine = load_engine("llama", args.model, args.nctx, args.slots, placement.n_threads,
                             placement.n_gpu_layers, True, args.deterministic, 0, 0,
                             shape=ContextShape.of(args), measure_costs=False)
    except Exception as exc:
        tail = [line for line in captured.getvalue().splitlines() if line.strip()][-3:]
        quoted = "(llama.cpp: " in str(exc)          # the engine quoted llama.cpp's log
        raise Failed(f"llama.cpp could not load the model: {exc}" +
                     (f" ({' | '.join(tail)})" if tail and not quoted else "")) from None
    finally:
        sys.stderr = saved
    engine.log.verbose = False
    return engine, captured.getvalue()


def run_sequences(engine, prompts: list[list[int]], tokens: int,
                  slots: list[int] | None = None) -> dict:
    """Prefill every prompt, then decode `tokens` greedy tokens in each; timed. `slots`:
    where the prompts go (default the first ones, side by side)."""
    from workers.sampling import SamplingParams
    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    outputs: dict[int, list[int]] = {}
    slots = list(range(len(prompts))) if slots is None else slots
    started = time.perf_counter()
    for slot, prompt in zip(slots, prompts):
        engine.add(slot, prompt, greedy, reuse=False, draft_max=0)
    prefilled = None
    try:
        while any(len(outputs.get(s, [])) < tokens for s in slots):
            for slot, out in engine.step().items():
                for item in out if isinstance(out, list) else [out]:
                    if item.error is not None:
                        raise Failed(f"generation failed: {item.error}")
                    if len(outputs.setdefault(slot, [])) < tokens:
                        outputs[slot].append(item.token)
            if prefilled is None and len(outputs) == len(prompts):
                prefilled = time.perf_counter()
    finally:
        for slot in slots:
            engine.release(slot, keep_cache=False)
    ended = time.perf_counter()
    decoded = len(prompts) * (tokens - 1)
    return {"sequences": len(prompts), "prompt_tokens": len(prompts[0]),
            "prefill_tok_s": round(sum(map(len, prompts)) / (prefilled - started), 1),
            "decode_tok_s": round(decoded / max(ended - prefilled, 1e-9), 1),
            "outputs": outputs}


def scattered(engine, prompts: list[list[int]], tokens: int) -> dict:
    """Half the slots busy, side by side and then every other one, as traffic leaves
    them: with a KV stream per slot llama.cpp decodes each run of consecutive busy
    slots as a sub-batch of its own, so the second costs this device more."""
    half = engine.n_slots // 2
    side = run_sequences(engine, prompts[:half], tokens)
    apart = run_sequences(engine, prompts[:half], tokens,
                          slots=list(range(0, engine.n_slots, 2))[:half])
    return {"sequences": half, "side_by_side_tok_s": side["decode_tok_s"],
            "every_other_tok_s": apart["decode_tok_s"],
            "ratio": round(apart["decode_tok_s"] / max(side["decode_tok_s"], 1e-9), 2)}


def check(args, result: dict) -> None:
    """Fills `result` as it goes, so that a failure still shows what was seen."""
    spec = parse_device(args.device)
    try:
        placement = pin(spec, args.ngl)          # before llama.cpp is loaded
    except ValueError as exc:
        raise Failed(str(exc)) from None
    result.update({"device": str(spec), "cores": len(placement.cores),
                   "visible_devices": placement.visible_devices})
    fit = check_placement(spec, placement, args.model, args.nctx, args.slots,
                          ContextShape.of(args))
    result["backends"] = [d.to_dict() for d in fit.devices]
    if fit.memory:
        result["memory"] = fit.memory
    if fit.refusal:
        raise Failed(fit.refusal)
    started = time.perf_counter()
    engine, log_text = load_with_log(args, placement)
    result["load_s"] = round(time.perf_counter() - started, 2)
    result["placement"] = {"n_layer": engine.n_layer, "n_gpu_layers": placement.n_gpu_layers,
                           "threads": placement.n_threads, **placement_from_log(log_text)}
    try:
        text = engine.tokenize(TEXT * 64, add_special=True)
        if args.nctx < 32:
            raise Failed(f"nctx {args.nctx} is too small to check (at least 32)")
        tokens = max(2, min(args.tokens, args.nctx // 2))
        length = max(8, min(args.prompt_tokens, args.nctx - tokens - 2, len(text)))
        run_sequences(engine, [text[:8]], 4)                  # warm-up (kernels, caches)
        one = run_sequences(engine, [text[:length]], tokens)
        completion = b"".join(engine.piece(t) for t in one.pop("outputs")[0])
        result["completion"] = completion.decode("utf-8", "replace")
        result["single"] = one
        if engine.n_slots > 1:
            # distinct prompts (one leading token differs), so nothing is shared
            prompts = [engine.tokenize(f"# {i}\n" + TEXT * 64)[:length]
                       for i in range(engine.n_slots)]
            many = run_sequences(engine, prompts, tokens)
            many.pop("outputs")
            many["per_stream_tok_s"] = round(many["decode_tok_s"] / engine.n_slots, 1)
            result["concurrent"] = many
        if engine.n_slots >= 4:
            result["scattered"] = scattered(engine, prompts, tokens)
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.selftest", description=__doc__)
    config.add_options(parser, ["model", "nctx", "ngl", "kv_type", "batch", "ubatch",
                                "deterministic"])
    parser.add_argument("--device", required=True)
    parser.add_argument("--slots", type=int, required=True)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args(argv)
    config.refuse_env_problem(args)
    if os.environ.get("COMPLETIONS_PARENT_PID"):
        from dispatcher.common.process import die_with_parent
        die_with_parent(int(os.environ["COMPLETIONS_PARENT_PID"]))
    result = {"ok": False, "device": args.device}
    try:
        args.model = str(resolve_model_path(args.model))
        check(args, result)
        result["ok"] = True
    except Failed as exc:
        result["error"] = str(exc)
    except SystemExit as exc:            # resolve_model_path's one-line refusals
        result["error"] = str(exc)
    except Exception as exc:             # anything else: still one line, and the JSON
        result["error"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
