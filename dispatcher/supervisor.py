"""Child processes of `serve`: spawn, watch, respawn with backoff, stop without orphans.

Children are fresh interpreters (`python -m workers ...`, `python -m gunicorn ...`), the
equivalent of multiprocessing's spawn start method: nothing (no ZeroMQ context, no model)
is inherited across a fork. Each child also asks the kernel to kill it if this process
dies (`die_with_parent`), so even `kill -9` of the launcher leaves no orphans.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

from dispatcher.common import config
from dispatcher.common.process import flag_value

log = logging.getLogger(__name__)

STABLE_AFTER = 60.0     # s a child (a worker: since READY) stays up to be no crash loop
# Front ends that exited this many times in a row, each within STABLE_AFTER of its start,
# are given up (a port another process holds, a setting gunicorn refuses: respawned for
# ever while `serve` said it served); once every front end has, `serve` stops, exit 1
FRONTEND_TRIES = 3
NOTE_CHARS = 1000       # of a worker's exit note read (config.EXIT_NOTE_ENV)


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    kind: str = "worker"                 # worker or frontend
    process: subprocess.Popen | None = None
    restarts: int = 0
    backoff: float = config.RESPAWN_BACKOFF[0]
    respawn_at: float | None = None
    started_at: float = 0.0
    last_exit: int | None = None
    exited_as_asked: bool = False        # its last exit followed a stop or restart asked for
    stopping: bool = False
    restart_now: bool = False            # an asked-for restart: no backoff
    kill_at: float | None = None         # SIGTERMed for a restart: SIGKILL after this
    gave_up: bool = False                # it cannot load its model: not respawned
    exit_note: str | None = None         # ... its one line why (config.EXIT_NOTE_ENV)
    ever_ready: bool = False             # it has served (so a later failure is not startup)
    ready_at: float | None = None        # when its process last said READY (a worker)
    load_seconds: float | None = None    # ... how long after its start (its model's load)
    died_loading: int = 0                # processes in a row that died before READY
                                         # (a crash loop is no load to wait for)
    died_young: int = 0                  # (a front end) exits in a row soon after start
    extra: dict = field(default_factory=dict)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None


def _model_of(argv: list[str]) -> str | None:
    """A worker command line's --model (None: none there)."""
    return flag_value(argv, "--model")


class Supervisor:
    """Owns the child processes; `poll()` reports those that exited since the last call."""

    def __init__(self) -> None:
        self.children: dict[str, Child] = {}
        self.stopping = False
        self._notes: str | None = None    # a private directory for the workers' exit notes

    def _note_path(self, child: Child) -> str:
        if self._notes is None:
            self._notes = tempfile.mkdtemp(prefix="completions-exit-notes-")   # (0700)
        # (named by a digest: a worker's name is the operator's text, "a/../b" too)
        digest = hashlib.sha256(child.name.encode("utf-8", "surrogateescape")).hexdigest()
        return os.path.join(self._notes, f"{digest[:24]}.exit")

    def _read_note(self, child: Child) -> str | None:
        """The line a worker that gave up wrote for its status (then removed)."""
        path = self._note_path(child)
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                note = f.read(NOTE_CHARS).strip()
            os.unlink(path)
        except OSError:
            return None
        return note or None

    def add(self, child: Child) -> None:
        self.children[child.name] = child
        self._start(child)

    def _start(self, child: Child) -> None:
        env = {**os.environ, **child.env, "COMPLETIONS_PARENT_PID": str(os.getpid())}
        # a child's settings are all on its command line or in `child.env`: a config file
        # named in the launcher's environment would be read again by each, as its own
        # (a worker looks for its device's [[workers]] entry there)
        env.pop("COMPLETIONS_CONFIG", None)
        if child.kind == "worker":      # (where it says why it gives up: `status` shows it)
            env[config.EXIT_NOTE_ENV] = self._note_path(child)
            self._read_note(child)      # (none left from an earlier process)
        # each child in a session of its own: a signal to the launcher's process group
        # (a terminal's Ctrl-C or hangup, `kill -TERM -PGID`, GNU timeout) reaches the
        # launcher alone, which drains before it stops them (they stopped at once, every
        # stream cut); the launcher's death still ends them (die_with_parent)
        child.process = subprocess.Popen(child.argv, env=env, stdin=subprocess.DEVNULL,
                                         start_new_session=True)      # (see _restart)
        child.started_at = time.monotonic()
        child.respawn_at, child.ready_at = None, None
        log.info("started %s %s (pid %d)", child.kind, child.name, child.process.pid)

    def _restart(self, child: Child, now: float) -> None:
        """Start a child again (a respawn, a restart): where the process cannot be made
        (fork or exec failing: EAGAIN at the service's pids limit, the interpreter
        replaced mid-deploy), it is tried again after the backoff, as after a crash. The
        error reached the launcher's loop and stopped the whole server, every stream cut,
        for one worker that could not be started again."""
        try:
            self._start(child)
        except OSError as exc:
            child.process = None
            child.respawn_at = now + child.backoff
            log.error("%s %s could not be started (%s); trying again in %.1fs", child.kind,
                      child.name, exc, child.backoff)
            child.backoff = min(child.backoff * 2, config.RESPAWN_BACKOFF[1])
        except ValueError as exc:         # a command line no exec takes (a NUL in it)
            child.process, child.gave_up = None, True
            child.exit_note = f"cannot be started: {exc}"
            log.error("%s %s cannot be started (%s): not retried", child.kind, child.name,
                      exc)

    def poll(self, respawn: bool = True) -> list[tuple[Child, int]]:
        """Reap exited children and schedule their respawn; start those whose time came.
        Without `respawn` (the server is draining to stop) none is started again."""
        now = time.monotonic()
        exited = []
        for child in self.children.values():
            proc = child.process
            if proc is not None and proc.poll() is not None:
                exited.append((child, proc.pid))
                child.last_exit = proc.returncode
                child.exited_as_asked = bool(self.stopping or child.stopping or
                                             child.restart_now)
                child.died_loading = child.died_loading + 1 \
                    if child.ready_at is None and not child.restart_now else 0
                child.kill_at = None
                child.process = None
                if self.stopping or child.stopping or not respawn:
                    continue
                if child.kind == "frontend" and not child.restart_now:
                    young = now - child.started_at < STABLE_AFTER
                    child.died_young = child.died_young + 1 if young else 0
                    if child.died_young >= FRONTEND_TRIES:
                        child.gave_up = True
                        child.exit_note = (f"exited ({_describe_exit(proc.returncode)}) "
                                           f"{child.died_young} times in a row within "
                                           f"{STABLE_AFTER:.0f} s of its start (its error "
                                           "is in the log above)")
                        log.error("front end %s %s: not restarting it", child.name,
                                  child.exit_note)
                        continue
                if child.kind == "worker" and proc.returncode == config.EXIT_CANNOT_LOAD \
                        and not child.restart_now:
                    child.gave_up = True
                    child.exit_note = self._read_note(child)
                    log.error("worker %s cannot load its model: not restarting it",
                              child.name)
                    continue
                if child.restart_now:
                    child.restart_now = False
                    child.restarts += 1
                    log.info("%s %s (pid %d) stopped for a restart", child.kind, child.name,
                             proc.pid)
                    self._restart(child, now)
                    continue
                # up for a while (a worker: since its READY) before it died: not a crash
                # loop, so the shortest backoff again; one that dies soon after, each
                # time (the OOM killer at its first requests), waits longer each time
                up_since = child.ready_at if child.kind == "worker" else child.started_at
                if up_since is not None and now - up_since > STABLE_AFTER:
                    child.backoff = config.RESPAWN_BACKOFF[0]
                child.respawn_at = now + child.backoff
                log.error("%s %s (pid %d) exited with %s; respawning in %.1fs", child.kind,
                          child.name, proc.pid, _describe_exit(proc.returncode), child.backoff)
                child.backoff = min(child.backoff * 2, config.RESPAWN_BACKOFF[1])
            elif proc is not None and child.kill_at is not None and now >= child.kill_at:
                # asked to stop and still there (a thread stuck in C never sees SIGTERM)
                log.warning("%s %s (pid %d) did not stop in %.0fs: killing it", child.kind,
                            child.name, proc.pid, config.RESTART_KILL_AFTER)
                child.kill_at = None
                _signal(proc, signal.SIGKILL)
            elif proc is None and child.respawn_at is not None and now >= child.respawn_at \
                    and not self.stopping and respawn:
                child.restarts += 1
                self._restart(child, now)
        return exited

    def mark_healthy(self, name: str) -> None:
        """The worker said READY: it has served (`ever_ready`), and a crash STABLE_AFTER s
        from now or later is respawned after the shortest backoff again. One that dies
        before, or soon after READY each time, waits longer each time (a crash loop: a
        bad model, a missing GPU, a worker killed at its first requests)."""
        child = self.children.get(name)
        if child is not None:
            first = child.ready_at is None       # (a live one says READY again on each
            child.ever_ready = True              # reconnection: its uptime is no load)
            child.ready_at = time.monotonic()
            child.died_loading = 0
            if first and child.process is not None:
                child.load_seconds = child.ready_at - child.started_at

    def restart(self, name: str, argv: list[str] | None = None) -> None:
        """Replace a child's process now (SIGTERM, then start again at once), with a new
        command line if given."""
        child = self.children[name]
        child.gave_up, child.died_loading, child.died_young = False, 0, 0
        if argv is not None and argv != child.argv:
            if _model_of(argv) != _model_of(child.argv):
                child.load_seconds = None   # (another model's load: not the last one's)
            child.argv = argv
        if child.process is None:
            child.restarts += 1
            self._restart(child, time.monotonic())
            return
        child.restart_now = True
        child.kill_at = time.monotonic() + config.RESTART_KILL_AFTER
        _signal(child.process, signal.SIGTERM)

    def kill(self, name: str, pid: int) -> None:
        """SIGKILL the child `name` if it is still the process `pid` (it is respawned as
        after any crash)."""
        child = self.children.get(name)
        if child is not None and child.process is not None and child.process.pid == pid:
            log.error("%s %s (pid %d) stopped answering: killing it", child.kind, name, pid)
            _signal(child.process, signal.SIGKILL)

    def stop_all(self, grace: float = config.STOP_GRACE) -> None:
        """SIGTERM every child, wait up to `grace`, then SIGKILL what is left."""
        self.stopping = True
        running = [c.process for c in self.children.values() if c.process is not None]
        for proc in running:
            _signal(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in running:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("pid %d did not stop in %.0fs: killing it", proc.pid, grace)
                _signal(proc, signal.SIGKILL)
                proc.wait()
        for child in self.children.values():
            child.process = None
        if self._notes is not None:
            shutil.rmtree(self._notes, ignore_errors=True)


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass


def _describe_exit(code: int | None) -> str:
    if code == config.EXIT_STUCK:
        return f"code {code} (stuck past --step-timeout)"
    if code is not None and code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            pass
    return f"code {code}"
