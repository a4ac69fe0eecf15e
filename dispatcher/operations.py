"""The dispatcher's control socket: status, drain, resume, restart, reload, metrics.

Restart and reload are graceful: the worker takes no new work, finishes what it runs
(up to a grace period), then its process is replaced, at once, with the same or a new
model; every other worker keeps serving meanwhile.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import msgspec

from dispatcher.common.process import flag_value, with_flag

log = logging.getLogger(__name__)
RATE_WINDOW = 10.0          # seconds over which status reports tokens/s


class Operations:
    """The control channel's commands, over the core's state and the launcher's
    children (`supervisor`, None for a dispatcher run alone)."""

    def __init__(self, core, supervisor=None):
        self.core = core
        self.supervisor = supervisor
        self.pending: dict[str, dict] = {}     # worker name -> {"deadline", "argv"}

    # -- commands ----------------------------------------------------------------------
    def handle(self, request: dict) -> dict:
        command = request.get("cmd")
        handlers = {"status": self.status, "drain": self.drain,
                    "resume": self.resume, "restart": self.restart, "reload": self.reload,
                    "metrics": lambda: self.metrics_snapshot(), "usage": self.usage}
        if command not in handlers:
            return {"error": f"unknown command {command!r}: use "
                             + ", ".join(sorted(handlers))}
        if command in ("status", "metrics", "usage"):
            return handlers[command]()
        return handlers[command](request)

    def usage(self) -> dict:
        """Requests, tokens and errors per API key name since the dispatcher started."""
        return {"keys": [{"key": key, "requests": requests, "prompt_tokens": prompt,
                          "completion_tokens": completion, "errors": errors}
                         for key, (requests, prompt, completion, errors)
                         in sorted(self.core.metrics.usage.items())]}

    def _record(self, name: str):
        return self.core.registry.get(str(name).encode())

    def drain(self, request: dict) -> dict:
        record = self._record(request.get("worker"))
        if record is None:
            return {"error": f"no ready worker named {request.get('worker')!r}"}
        record.draining = True
        self.core.paused.add(record.name)       # (kept if it registers again)
        self.core.broadcast_state()             # (/health: every worker drained is a 503)
        return {"ok": True, "worker": record.name, "running": len(record.running)}

    def resume(self, request: dict) -> dict:
        record = self._record(request.get("worker"))
        if record is None:
            return {"error": f"no ready worker named {request.get('worker')!r}"}
        if record.name in self.pending:     # (its model may be renamed already: reload)
            return {"error": f"{record.name} is waiting to restart; it takes work again "
                             "once it is back" + (", drained: resume it then"
                                                  if record.name in self.core.paused
                                                  else "")}
        record.draining = False
        self.core.paused.discard(record.name)
        self.core.broadcast_state()
        self.core.dispatch()
        return {"ok": True, "worker": record.name}

    def restart(self, request: dict) -> dict:
        name = str(request.get("worker"))
        supervisor = self.supervisor
        child = supervisor.children.get(name) if supervisor else None
        if child is None or child.kind != "worker":
            return {"error": f"{name!r} is not a worker this dispatcher started (a remote "
                             "worker is restarted on its own host)"}
        try:                                       # (checked before anything changes)
            grace = float(request.get("grace", 30.0))
        except (TypeError, ValueError):
            grace = -1.0
        if not 0 <= grace < float("inf"):          # NaN would never expire
            return {"error": "grace must be a finite number of seconds, at least 0"}
        plan = self.pending.get(name)            # (a reload not done yet: its command)
        argv = list(plan["argv"] if plan else child.argv)
        if request.get("model_id") is not None and not str(request["model_id"]).strip():
            return {"error": "an empty model id names nothing"}   # (not a plain restart)
        model_id = request.get("model_id") or None
        if model_id is not None and any(ord(c) < 32 or ord(c) == 127 for c in str(model_id)):
            return {"error": "a model id has no control characters"}   # (nor NUL: exec)
        current = flag_value(argv, "--model")
        path = Path(current) if current else None
        if request.get("model"):
            path = Path(request["model"]).expanduser()
            if not path.is_file():
                return {"error": f"model file not found: {path}"}
            # an id given to the model stays unless a new one is given (it became the
            # file's name: a reload of `coder`'s file made `coder` a 404); one that was
            # the file's name follows the new file's, as `serve` would name it
            served = flag_value(argv, "--model-id") or child.extra.get("model")
            named = served and not (current and served == _model_id(Path(current)))
            model_id = model_id or (served if named else _model_id(path))
            argv = with_flag(argv, "--model", str(path.resolve()))
        alias_of = next((m for m, known in self.core.known_models.items()
                         if str(model_id) in (known.get("aliases") or ())), None)
        if model_id and alias_of is not None:
            # (requests for it went to that model: the reloaded one answered to no name)
            return {"error": f"'{model_id}' is an alias of the model '{alias_of}': give "
                             "the reloaded model another id"}
        if model_id and path is not None and path.is_file():
            clash = self._served_otherwise(name, str(model_id), path)
            if clash:
                return {"error": clash}
        if model_id:                               # (a new id alone renames the model)
            argv = with_flag(argv, "--model-id", str(model_id))
            self.core.known_models.setdefault(str(model_id), {"n_ctx": 0})
            child.extra["model"] = str(model_id)
        child.extra["operated"] = True          # (its failure no longer stops `serve`)
        record = self._record(name)
        if record is not None:
            record.draining = True
        self.core.paused.discard(name)          # (on its way back: queued work waits for
                                                # it, and it serves once back)
        self.pending[name] = {"deadline": time.monotonic() + grace, "argv": argv}
        log.info("restarting %s once its %d request(s) finish (at most %.0fs)", name,
                 len(record.running) if record else 0, grace)
        return {"ok": True, "worker": name, "model": child.extra.get("model"),
                "waiting_for": len(record.running) if record else 0}

    def reload(self, request: dict) -> dict:
        return self.restart(request)

    def _served_otherwise(self, name: str, model_id: str, path: Path) -> str | None:
        """Why `name` may not serve `path` as `model_id` (None: it may): another worker
        serves that id from a different file, registered now, or about to (a reload not
        run yet, a new process loading). Its new process would be refused when it
        registers (one id, two models' text) and stay failed, after the reload said ok."""
        from dispatcher.common.models import model_file_digest
        digest = model_file_digest(path)
        others = [(record.name, record.info.model, record.info.model_digest,
                   record.info.model_path) for record in self.core.registry.workers.values()]
        coming = [(other, plan["argv"]) for other, plan in self.pending.items()]
        coming += [(child.name, child.argv) for child in self._children()
                   if (getattr(child, "process", None) is not None and child.ready_at is None
                       or getattr(child, "respawn_at", None) is not None)
                   and not child.gave_up]
        # (loading: not registered yet; or crashed, waiting out its respawn backoff)
        for other, argv in coming:
            model = flag_value(argv, "--model")
            if model and Path(model).is_file():
                others.append((other, flag_value(argv, "--model-id") or _model_id(Path(model)),
                               model_file_digest(Path(model)), model))
        for other, served, their_digest, their_path in others:
            if other != name and served == model_id and their_digest is not None \
                    and their_digest != digest:
                return (f"worker {other} serves '{model_id}' from another file "
                        f"({their_path}): give this one another --model-id, or the same "
                        "file (one id is one model's text; to change the file of an id "
                        "several workers serve, reload them onto a new id)")
        return None

    def _children(self) -> list:
        children = getattr(self.supervisor, "children", None) or {}
        return [child for child in children.values() if child.kind == "worker"]

    def tick(self, now: float) -> None:
        for name, plan in list(self.pending.items()):
            record = self._record(name)
            # (its tokenize/detokenize too: a restart drops their answers, a 503 each)
            if record is None or not (record.running or record.ops) or \
                    now >= plan["deadline"]:
                del self.pending[name]
                self.supervisor.restart(name, plan["argv"])

    # -- views -------------------------------------------------------------------------
    def _fleet(self):
        """(name, ready record or None, launcher's child or None) for every worker: the
        ready ones, then those the launcher runs that are not (yet) ready."""
        children = self.supervisor.children if self.supervisor else {}
        for record in self.core.registry.workers.values():
            yield record.name, record, children.get(record.name)
        for name, child in children.items():
            if child.kind == "worker" and name.encode() not in self.core.registry:
                yield name, None, child

    def status(self) -> dict:
        core, now = self.core, time.monotonic()
        workers = []
        for name, record, child in self._fleet():
            state = worker_state(record, child)
            if record is None:
                workers.append({"name": name, "state": state, "restarts": child.restarts,
                                "pid": child.pid, "device": child.extra.get("device"),
                                "model": child.extra.get("model"),
                                "last_lost": self._loss(name, now)})
                continue
            workers.append({
                "name": name, "state": state,
                "tokens_per_s": tokens_per_second(record.history, now),
                "device": record.info.device, "model": record.model,
                "pid": record.info.pid, "n_ctx": record.info.n_ctx,
                "slots": record.slots, "busy_slots": record.busy,
                "running": sorted(record.running),
                "started": sorted(i for i, j in record.running.items() if j.started),
                "generating": sorted(i for i, j in record.running.items() if j.first_token),
                "completed": record.completed,
                "cancelled": record.cancelled, "tokens": record.tokens,
                "uptime_s": round(now - record.ready_at, 1),
                "restarts": child.restarts if child else 0,
                "placement": record.info.placement, "last_done": record.last_done,
                "step_ms": step_ms(record.steps),
                "last_lost": self._loss(name, now)})
        return {"workers": sorted(workers, key=lambda w: w["name"]),
                "queue": core.queue.depth_by_model(), "stats": dict(core.stats),
                "frontends": [{"id": k.decode(errors="replace"), "open": v.get("open"),
                               "served": v.get("served"), "pid": v.get("pid")}
                              for k, v in core.frontends.items()],
                "limits": {"max_queue": core.max_queue,
                           "max_queue_per_key": core.shares.max_queue_per_key,
                           "key_slot_share": core.shares.key_slot_share},
                "known_models": core.known_models}

    def _loss(self, name: str, now: float) -> dict | None:
        loss = self.core.losses.get(name)
        return None if loss is None else {"reason": loss["reason"], "code": loss["code"],
                                          "ago_s": round(now - loss["at"], 1)}

    def metrics_snapshot(self) -> dict:
        core = self.core
        snapshot = core.metrics.snapshot()
        workers, now = [], time.monotonic()
        for name, record, child in self._fleet():
            # (state and last loss: for the status page, /v1/status; no request content)
            common = {"worker": name, "state": worker_state(record, child),
                      "last_lost": self._loss(name, now)}
            if record is None:
                workers.append({**common, "device": child.extra.get("device"),
                                "model": child.extra.get("model"), "up": 0, "slots": 0,
                                "busy": 0, "layers_offloaded": 0,
                                "restarts": child.restarts})
            else:
                workers.append({**common, "device": record.info.device,
                                "model": record.model, "up": 1, "slots": record.slots,
                                "busy": record.busy, "layers_offloaded":
                                    record.info.placement.get("layers_offloaded", 0),
                                "restarts": child.restarts if child else 0,
                                "steps": msgspec.structs.asdict(record.steps)
                                if record.steps is not None else None,
                                "heartbeats": record.heartbeats})
        depth = core.queue.depth_by_model()
        snapshot.update(workers=workers,
                        queue={m: depth.get(m, 0) for m in set(core.models()) | set(depth)},
                        dispatcher=dict(core.stats), frontends=len(core.frontends))
        return snapshot


def worker_state(record, child) -> str:
    """A worker's state as the ops tool and the status page name it: idle, busy,
    draining, drained (ready); starting, restarting, failed (not ready: its process)."""
    if record is None:
        return "failed" if child.gave_up else "starting" if child.process else "restarting"
    if record.draining:
        return "draining" if record.running else "drained"
    return "busy" if record.running else "idle"


def step_ms(steps) -> dict | None:
    """A worker's mean step since it started, split into the host's work (planning the
    batch, sampling and verifying) and the device's (the decode, to its end, and the
    draft model's decodes)."""
    if steps is None or not steps.steps:
        return None
    return {"host": round(1000 * (steps.plan_seconds + steps.sample_seconds) / steps.steps, 2),
            "device": round(1000 * (steps.decode_seconds + steps.draft_seconds) / steps.steps,
                            2),
            "steps": steps.steps}


def tokens_per_second(history, now: float) -> float:
    """Generated tokens per second over the last RATE_WINDOW seconds."""
    recent = sum(n for t, n in history if t >= now - RATE_WINDOW)
    return round(recent / RATE_WINDOW, 1)




def _model_id(path: Path) -> str:
    from dispatcher.common.models import default_model_id
    return default_model_id(path)
