"""Whether a worker can run a job: the one route-fit rule, used by the front end (before
submitting), the dispatcher's admission and its routing. A job's `Route` names each
requirement as the worker's `Capabilities` name what it offers (protocol.Route)."""
from __future__ import annotations

from dispatcher.common.protocol import Capabilities, Route

REQUIREMENTS = ("n_ctx", "compute", "n_gpu_layers", "profile", "fim")


def fits(model: str, route: Route, worker: Capabilities) -> bool:
    return worker.model == model and unmet(route, worker) is None


def unmet(route: Route, worker: Capabilities) -> str | None:
    """The first requirement of `route` that the worker does not meet, by name."""
    if route.n_ctx and worker.n_ctx < route.n_ctx:
        return "n_ctx"
    if route.compute and worker.compute != route.compute:
        return "compute"
    if route.n_gpu_layers is not None:
        ngl = worker.n_gpu_layers
        if (route.n_gpu_layers == 0 and ngl != 0) or ngl < route.n_gpu_layers:
            return "n_gpu_layers"
    if route.profile and worker.profile != route.profile:
        return "profile"
    if route.fim and not worker.fim:
        return "fim"
    return None


def explain_unfit(model: str, route: Route,
                  workers: list[Capabilities]) -> tuple[str, str, str]:
    """(param, code, message) saying why no worker of the job's model can run it and
    what is available instead; `param` is the request's name for the requirement."""
    candidates = [w for w in workers if w.model == model]
    reasons = {unmet(route, w) for w in candidates}
    name = next((n for n in REQUIREMENTS if n in reasons), "fim")
    values = lambda key: sorted({str(getattr(w, key)) for w in candidates})  # noqa: E731
    if name == "n_ctx":
        return "nctx", "context_length_unavailable", (
            f"no worker of '{model}' has a context of {route.n_ctx} tokens; available: "
            + ", ".join(values("n_ctx")))
    if name == "compute":
        return "compute", "compute_unavailable", (
            f"no worker of '{model}' computes on '{route.compute}'; served kinds: "
            + ", ".join(values("compute")))
    if name == "n_gpu_layers":
        return "ngl", "ngl_unavailable", (
            f"no worker of '{model}' offloads {route.n_gpu_layers} layers; available: "
            + ", ".join(values("n_gpu_layers")))
    if name == "profile":
        profiles = [p for p in values("profile") if p != "None"]
        return "X-SIE-MACHINE-PROFILE", "unknown_profile", (
            f"unknown machine profile '{route.profile}'; profiles: "
            + (", ".join(profiles) or "none configured"))
    return "suffix", "fim_unsupported", (
        f"the model '{model}' has no fill-in-the-middle tokens (fim_pre, fim_suf, fim_mid "
        "in its GGUF metadata), so 'suffix' cannot be used")
