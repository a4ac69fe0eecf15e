"""Whether a worker can run a job: the one route-fit rule, used by the front end (before
submitting), the dispatcher's admission and its routing."""
from __future__ import annotations


REQUIREMENTS = ("nctx", "compute", "ngl", "profile", "suffix")


def fits(job: dict, info: dict) -> bool:
    return info.get("model") == job.get("model") and _unmet(job, info) is None


def _unmet(job: dict, info: dict) -> str | None:
    """The first requirement of `job` that the worker does not meet, by name."""
    route = job.get("route") or {}
    if route.get("nctx") and int(info.get("n_ctx") or 0) < route["nctx"]:
        return "nctx"
    if route.get("compute") and info.get("compute") != route["compute"]:
        return "compute"
    if route.get("ngl") is not None:
        ngl = int(info.get("n_gpu_layers") or 0)
        if (route["ngl"] == 0 and ngl != 0) or ngl < route["ngl"]:
            return "ngl"
    if route.get("profile") and info.get("profile") != route["profile"]:
        return "profile"
    if job.get("suffix") is not None and not info.get("fim"):
        return "suffix"
    return None


def explain_unfit(job: dict, infos: list[dict]) -> tuple[str, str, str]:
    """(param, code, message) saying why no worker of the job's model can run it and
    what is available instead."""
    model = job.get("model")
    candidates = [i for i in infos if i.get("model") == model]
    reasons = {_unmet(job, i) for i in candidates}
    name = next((n for n in REQUIREMENTS if n in reasons), "suffix")
    route = job.get("route") or {}
    values = lambda key: sorted({str(i.get(key)) for i in candidates})  # noqa: E731
    if name == "nctx":
        return "nctx", "context_length_unavailable", (
            f"no worker of '{model}' has a context of {route['nctx']} tokens; available: "
            + ", ".join(values("n_ctx")))
    if name == "compute":
        return "compute", "compute_unavailable", (
            f"no worker of '{model}' computes on '{route['compute']}'; served kinds: "
            + ", ".join(values("compute")))
    if name == "ngl":
        return "ngl", "ngl_unavailable", (
            f"no worker of '{model}' offloads {route['ngl']} layers; available: "
            + ", ".join(values("n_gpu_layers")))
    if name == "profile":
        profiles = [p for p in values("profile") if p != "None"]
        return "X-SIE-MACHINE-PROFILE", "unknown_profile", (
            f"unknown machine profile '{route['profile']}'; profiles: "
            + (", ".join(profiles) or "none configured"))
    return "suffix", "fim_unsupported", (
        f"the model '{model}' has no fill-in-the-middle tokens (fim_pre, fim_suf, fim_mid "
        "in its GGUF metadata), so 'suffix' cannot be used")
