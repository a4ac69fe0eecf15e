"""The answer's shape: choices assembled from the jobs' events (OpenAI's numbering,
best_of selection, usage over every job), whole or as SSE chunks."""
from __future__ import annotations

from app import sse
from dispatcher.common import protocol as P


class Result:
    """Choices assembled from the jobs' events: OpenAI's numbering (prompt × n), best_of
    selection by mean token logprob, usage over every job."""

    def __init__(self, request_id: str, created: int, model: str, req: dict, plans):
        self.request_id, self.created, self.model = request_id, created, model
        self.plans = plans
        self.n = req["n"]
        self.want_logprobs = req.get("logprobs") is not None
        self.streaming = bool(req.get("stream"))
        self.include_usage = bool((req.get("stream_options") or {}).get("include_usage"))
        self.texts = [[] for _ in plans]
        self.logprobs = [None] * len(plans)
        self.finish = [None] * len(plans)
        self.scores = [0.0] * len(plans)
        self.prompt_tokens = [0] * len(plans)
        self.cached_tokens = [0] * len(plans)
        self.completion_tokens = [0] * len(plans)
        self.fingerprint = None

    def index(self, job_index: int) -> int:
        plan = self.plans[job_index]
        return plan.prompt_index * self.n + plan.candidate

    def add(self, job_index: int, event: P.AnyEvent) -> None:
        if isinstance(event, P.Start):
            self.prompt_tokens[job_index] = event.prompt_tokens
            self.cached_tokens[job_index] = event.cached_tokens
            self.fingerprint = self.fingerprint or event.fingerprint
        elif isinstance(event, P.Text):
            if not self.streaming:     # (a stream's text went out: kept, n × max_tokens
                self.texts[job_index].append(event.text)  # of it would pile up here)
        elif isinstance(event, P.End):
            self.finish[job_index] = event.finish_reason
            self.completion_tokens[job_index] = event.usage.completion_tokens \
                if event.usage else 0
            self.scores[job_index] = event.score or 0.0
        logprobs = getattr(event, "logprobs", None)
        if self.want_logprobs and logprobs and not self.streaming:
            self.logprobs[job_index] = merge_logprobs(self.logprobs[job_index], logprobs)

    def usage(self) -> dict:
        prompts, cached = {}, {}
        for plan, tokens, hit in zip(self.plans, self.prompt_tokens, self.cached_tokens):
            prompts.setdefault(plan.prompt_index, tokens)
            cached.setdefault(plan.prompt_index, hit)
        usage = sse.usage(sum(prompts.values()), sum(self.completion_tokens))
        usage["prompt_tokens_details"] = {"cached_tokens": sum(cached.values())}
        return usage

    def body(self) -> dict:
        by_prompt: dict[int, list[int]] = {}
        for i, plan in enumerate(self.plans):
            by_prompt.setdefault(plan.prompt_index, []).append(i)
        choices = []
        for prompt_index, jobs in sorted(by_prompt.items()):
            if len(jobs) > self.n:        # best_of: the n with the best mean logprob
                jobs = sorted(jobs, key=lambda i: -self.scores[i])[:self.n]
            for rank, i in enumerate(jobs):
                choice = sse.choice("".join(self.texts[i]), self.finish[i],
                                    prompt_index * self.n + rank)
                choice["logprobs"] = self._logprobs(i)
                choices.append(choice)
        return sse.completion(self.request_id, self.created, self.model, choices,
                              self.usage(), system_fingerprint=self.fingerprint)

    def _logprobs(self, i: int) -> dict | None:
        if not self.want_logprobs:
            return None
        return self.logprobs[i] or no_logprobs()

    def trailer(self, error: bool) -> list[bytes]:
        """What ends a stream: the usage chunk if asked (not after an error), [DONE]."""
        if self.include_usage and not error:
            return [sse.event(sse.completion(self.request_id, self.created, self.model, [],
                                             self.usage(),
                                             system_fingerprint=self.fingerprint)),
                    sse.DONE]
        return [sse.DONE]

    def chunk(self, job_index: int, event: P.AnyEvent) -> bytes | None:
        include_usage = self.include_usage
        if isinstance(event, P.Text):
            choice = sse.choice(event.text, None, self.index(job_index))
        elif isinstance(event, P.End):
            choice = sse.choice("", event.finish_reason, self.index(job_index))
        else:
            return None
        if self.want_logprobs:
            # a chunk with no token of its own (the finish, text held back for a possible
            # stop string and sent at the end) says so with empty lists, not null: a
            # client reading chunk.choices[0].logprobs.tokens met None at the end
            choice["logprobs"] = event.logprobs or no_logprobs()
        obj = sse.completion(self.request_id, self.created, self.model, [choice], None,
                             system_fingerprint=self.fingerprint)
        if not include_usage:
            del obj["usage"]
        return sse.event(obj)


def no_logprobs() -> dict:
    """OpenAI's logprobs object of no tokens."""
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def merge_logprobs(into: dict | None, more: dict) -> dict:
    if into is None:
        return {key: list(values) for key, values in more.items()}
    for key, values in more.items():
        into[key].extend(values)
    return into
