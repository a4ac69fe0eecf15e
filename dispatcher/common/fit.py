"""Whether a worker can run a job: the one route-fit rule, used by the front end (before
submitting), the dispatcher's admission and its routing. A job's `Route` names each
requirement as the worker's `Capabilities` name what it offers (protocol.Route)."""
from __future__ import annotations

from dispatcher.common.protocol import Capabilities, Route

REQUIREMENTS = ("n_ctx", "compute", "n_gpu_layers", "profile", "fim")
# ... as the request names each
MAX_SHOWN = 8          # kinds of worker a refusal lists at most
PARAMS = {"n_ctx": "nctx", "compute": "compute", "n_gpu_layers": "ngl",
          "profile": "X-SIE-MACHINE-PROFILE", "fim": "suffix"}


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


def _asks(route: Route, name: str) -> bool:
    value = getattr(route, name)
    return value is not None if name == "n_gpu_layers" else bool(value)


def _only(route: Route, name: str) -> Route:
    """`route` with only its requirement `name`."""
    return Route(**{name: getattr(route, name)})


def explain_unfit(model: str, route: Route,
                  workers: list[Capabilities]) -> tuple[str, str, str]:
    """(param, code, message) saying why no worker of the job's model can run it and
    what is available instead; `param` is the request's name for the requirement."""
    candidates = [w for w in workers if w.model == model]
    asked = [n for n in REQUIREMENTS if _asks(route, n)]
    # the first requirement no worker meets even alone; where each is met by some worker
    # and none meets them all, that is said (one of them named with every worker's
    # values read as if it were the only one missing)
    alone = [n for n in asked if not any(unmet(_only(route, n), w) is None
                                         for w in candidates)]
    if candidates and asked and not alone:
        kinds = sorted({", ".join(f"{PARAMS[n]} {getattr(w, n)}" for n in asked)
                        for w in candidates})
        shown = "; ".join(kinds[:MAX_SHOWN]) + (f"; and {len(kinds) - MAX_SHOWN} more"
                                                if len(kinds) > MAX_SHOWN else "")
        return PARAMS[asked[0]], "route_unavailable", (
            f"no worker of '{model}' meets all of {', '.join(PARAMS[n] for n in asked)} "
            f"at once (each is met by some worker); its workers: {shown}")
    name = (alone or asked or ["fim"])[0]
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
            f"no worker of '{model}' has the machine profile '{route.profile}'; its "
            "profiles: " + (", ".join(profiles) or "none configured"))
    return "suffix", "fim_unsupported", (
        f"the model '{model}' has no fill-in-the-middle tokens (fim_pre, fim_suf, fim_mid "
        "in its GGUF metadata), so 'suffix' cannot be used")
