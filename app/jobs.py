"""A validated request → the jobs the dispatcher runs: one per prompt × candidate, each a
typed `protocol.Job` (the envelope the dispatcher reads, the generation it forwards)."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import msgspec

from dispatcher.common import fields as F, protocol as P


@dataclass(frozen=True)
class JobPlan:
    job: P.WorkerJob
    prompt_index: int
    candidate: int          # 0 .. best_of-1 within its prompt


def route_of(req: dict, profile: str | None) -> P.Route:
    """Worker requirements: geniex's nctx/ngl/compute, SIE's machine profile, a suffix's
    FIM; each named as the worker names what it offers (fields.ROUTE)."""
    route = {key: req.get(name) for name, key in F.ROUTE.items()}
    return P.Route(**{k: v for k, v in route.items() if v is not None}, profile=profile,
                   fim=req.get("suffix") is not None)


def plan_jobs(request_id: str, model: str, req: dict, profile: str | None = None,
              session: str | None = None, timeout: float | None = None,
              native: bool = False, infill: P.Infill | None = None,
              session_order: int = 0, tenant: str | None = None,
              api_key: str | None = None, session_seq: bool = False,
              client: str | None = None) -> list[JobPlan]:
    """One job per prompt and candidate. Candidates of one prompt get seeds seed, seed+1,
    ... so that n > 1 gives different texts and the same request gives the same ones.
    A prompt's jobs share its objects (the fan-out sends them once)."""
    max_tokens = req["max_tokens"]
    client = inference_client(client, req)
    candidates = req.get("best_of") or req["n"]
    scoring = candidates > req["n"]
    route = route_of(req, profile)
    fanout = len(req["prompt"]) * candidates
    work = prompt_work(req, candidates, infill)
    plans = []
    for p, prompt in enumerate(req["prompt"]):
        for c in range(candidates):
            sampling = F.sampling_of(req)
            if sampling.get("seed") is not None:
                sampling["seed"] = choice_seed(sampling["seed"], c)
            generation = P.Generation(
                max_tokens=None if max_tokens is None or max_tokens < 0 else max_tokens,
                stop=req["stop"], echo=req["echo"], logprobs=req.get("logprobs"),
                score=scoring, sampling=P.Sampling(**sampling),
                cache_prompt=req["cache_prompt"],
                n_indent=req.get("n_indent"), t_max_predict_ms=req.get("t_max_predict_ms"),
                t_max_prompt_ms=req.get("t_max_prompt_ms"), n_probs=req.get("n_probs"),
                # (llama-server puts each streamed token's id in its chunk, asked or not)
                return_tokens=bool(req.get("return_tokens")) or
                native and bool(req.get("stream")), draft_max=req.get("draft_max"),
                timings_per_token=native and bool(req.get("stream")) and
                bool(req.get("timings_per_token")),
                warm=native, penalize_prompt=native,
                parse_special=req.get("parse_special"))
            job = P.WorkerJob(
                id=request_id if fanout == 1 else f"{request_id}.{p}.{c}", model=model,
                parent=request_id, fanout=fanout, tokens=generation.max_tokens,
                prompt_work=work, route=route, session=session,
                client=None if session else client,
                session_order=session_order, session_seq=session_seq, timeout=timeout,
                tenant=tenant, api_key=api_key,
                prompt=prompt,
                suffix=req.get("suffix"), infill=infill, generation=generation)
            plans.append(JobPlan(msgspec.structs.replace(job, adopt_key=adopt_key(job)),
                                 p, c))
    return plans


def choice_seed(seed: int, c: int) -> int:
    """Choice c's seed: the request's plus c, passing over the seeds llama.cpp's uint32
    reads as 'random' (4294967295 mod 2^32: the worker draws such a seed as the one
    before it, so two choices of one request, -2 and -1, drew the same text)."""
    while True:
        if not F.random_seed(seed):
            if c == 0:
                return seed
            c -= 1
        seed += 1


CHARS_PER_TOKEN = 4         # of text, about (code runs 3-4): a low estimate of its tokens


def prompt_work(req: dict, candidates: int, infill: P.Infill | None = None) -> int:
    """About how many prompt tokens the request's jobs prefill: each prompt's once (its
    other choices copy it), except where each choice computes the prompt's logprobs
    itself (echo with logprobs); an id is a token, text CHARS_PER_TOKEN characters; an
    /infill's chunks and text at the cursor too (a megabyte of `input_extra` beside an
    empty prefix was rated brief, and took slots past the key's share)."""
    each = candidates if req.get("echo") and req.get("logprobs") is not None else 1
    total = 0
    for prompt in req["prompt"]:
        parts = [prompt] if isinstance(prompt, str) else prompt
        total += sum(len(p) // CHARS_PER_TOKEN if isinstance(p, str) else 1 for p in parts)
    total += len(req.get("suffix") or "") // CHARS_PER_TOKEN * len(req["prompt"])
    if infill is not None:
        total += (len(infill.middle) + sum(len(str(chunk.get("text") or "")) for chunk in
                                           infill.extra)) // CHARS_PER_TOKEN
    return total * each


def inference_client(client: str | None, req: dict) -> str | None:
    """Whose requests the dispatcher may infer to be one editor's keystrokes
    (admission.InferredSessions), or None. Never a warm-up (`n_predict: 0`: llama.vim's
    ring-buffer updates, which it never cancels), and requests of one kind only: the same
    sender with the same generation limits, since an editor's prefetch of the
    suggestion after the one it shows asks for other limits than a keystroke's (llama.vim:
    t_max_predict_ms 1000 against 250) and must not replace it."""
    if client is None or req["max_tokens"] == 0:
        return None
    kind = f"{client}|{req['max_tokens']}|{req.get('t_max_predict_ms')}"
    return hashlib.sha256(kind.encode()).hexdigest()[:16]


# What may differ between a running request and the one that adopts its generation.
ADOPT_FREE = {"id", "prompt", "prompt_work", "session_order", "parent", "timeout",
              "adopt_key", "tokens"}      # (`tokens`: the job's max_tokens, for the queue)
ADOPT_FREE_GENERATION = {"max_tokens", "t_max_predict_ms", "t_max_prompt_ms"}


def adopt_key(job: P.WorkerJob) -> str | None:
    """Type-along adoption (dispatcher/core.py, workers/generation.py): requests of a
    session with equal keys differ only in their prompt (and limits), so a newer one may
    take over an older one's running generation. None where it never may: no session (nor
    a client to infer one from), several jobs, token-id prompts, per-token output
    (logprobs, echo, n_probs), grammars."""
    gen = job.generation
    if not (job.session or job.client) or job.fanout != 1 or not isinstance(job.prompt, str) \
            or gen.echo or gen.logprobs is not None or gen.score \
            or gen.n_probs \
            or gen.sampling.grammar or gen.sampling.json_schema \
            or (job.infill is not None and job.infill.middle):
        # (a grammar's output minus the typed text no longer matches it; infill's
        # `middle` lies between the prompt and the generation)
        return None
    rest = {k: v for k, v in P.to_dict(job).items() if k not in ADOPT_FREE}
    rest["generation"] = {k: v for k, v in rest["generation"].items()
                          if k not in ADOPT_FREE_GENERATION}
    return hashlib.sha1(msgspec.json.encode(rest, order="sorted")).hexdigest()
