"""A validated request → the jobs the dispatcher runs: one per prompt × candidate."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "typical_p", "seed",
                   "presence_penalty", "frequency_penalty", "repetition_penalty",
                   "repeat_last_n", "mirostat", "mirostat_tau", "mirostat_eta", "logit_bias",
                   "grammar", "json_schema", "min_tokens", "ignore_eos", "dry_multiplier",
                   "dry_base", "dry_allowed_length", "dry_penalty_last_n",
                   "dry_sequence_breakers", "xtc_probability", "xtc_threshold", "top_n_sigma",
                   "dynatemp_range", "dynatemp_exponent", "samplers")


@dataclass(frozen=True)
class JobPlan:
    job: dict
    prompt_index: int
    candidate: int          # 0 .. best_of-1 within its prompt


def route_of(req: dict, profile: str | None) -> dict:
    """Worker requirements: geniex's nctx/ngl/compute and SIE's machine profile."""
    route = {"nctx": req.get("nctx"), "ngl": req.get("ngl"), "compute": req.get("compute"),
             "profile": profile}
    return {k: v for k, v in route.items() if v is not None}


def plan_jobs(request_id: str, model: str, req: dict, profile: str | None = None,
              session: str | None = None, timeout: float | None = None,
              extra: dict | None = None, session_order: int = 0) -> list[JobPlan]:
    """One job per prompt and candidate. Candidates of one prompt get seeds seed, seed+1,
    ... so that n > 1 gives different texts and the same request gives the same ones."""
    max_tokens = req["max_tokens"]
    candidates = req["best_of"] or req["n"]
    scoring = candidates > req["n"]
    route = route_of(req, profile)
    plans = []
    for p, prompt in enumerate(req["prompt"]):
        for c in range(candidates):
            sampling = {name: req.get(name) for name in SAMPLING_FIELDS}
            if sampling["seed"] is not None:
                sampling["seed"] += c
            sub_id = request_id if len(req["prompt"]) * candidates == 1 \
                else f"{request_id}.{p}.{c}"
            job = {
                "id": sub_id, "model": model, "prompt": prompt, "suffix": req.get("suffix"),
                "max_tokens": None if max_tokens is None or max_tokens < 0 else max_tokens,
                "stop": req["stop"], "echo": req["echo"], "logprobs": req.get("logprobs"),
                "score": scoring, "sampling": sampling, "nctx": req.get("nctx"),
                "route": route, "cache_prompt": req["cache_prompt"],
                "session": session, "session_order": session_order,
                "parent": request_id, "timeout": timeout,
                "fanout": len(req["prompt"]) * candidates,
                "n_indent": req.get("n_indent"), "t_max_predict_ms": req.get("t_max_predict_ms"),
                "t_max_prompt_ms": req.get("t_max_prompt_ms"),
                "n_probs": req.get("n_probs"), "return_tokens": req.get("return_tokens"),
                "draft_max": req.get("draft_max"),
                **(extra or {}),
            }
            job["adopt_key"] = adopt_key(job)
            plans.append(JobPlan(job, p, c))
    return plans


# What may differ between a running request and the one that adopts its generation.
ADOPT_FREE = {"id", "prompt", "max_tokens", "session_order", "parent", "timeout",
              "t_max_predict_ms", "t_max_prompt_ms"}


def adopt_key(job: dict) -> str | None:
    """Type-along adoption (dispatcher/admission.py, workers/adoption.py): requests of a
    session with equal keys differ only in their prompt (and limits), so a newer one may
    take over an older one's running generation. None where it never may: no session,
    several jobs, token-id prompts, per-token output (logprobs, echo, n_probs), grammars."""
    if not job.get("session") or job["fanout"] != 1 or not isinstance(job["prompt"], str) \
            or job["echo"] or job["logprobs"] is not None or job["score"] \
            or job.get("n_probs") or job.get("return_tokens") \
            or job["sampling"].get("grammar") or job["sampling"].get("json_schema") \
            or (job.get("infill") or {}).get("middle"):
        # (a grammar's output minus the typed text no longer matches it; infill's
        # `middle` lies between the prompt and the generation)
        return None
    rest = {k: v for k, v in job.items() if k not in ADOPT_FREE}
    return hashlib.sha1(json.dumps(rest, sort_keys=True, default=str).encode()).hexdigest()
