"""The launcher's supervisor (dispatcher/supervisor.py) on tiny real child processes:
respawn backoff, no respawn while the server drains to stop, the environment children get.
"""
import sys
import time

from dispatcher.common import config
from dispatcher.supervisor import STABLE_AFTER, Child, Supervisor


def exited(supervisor, child, timeout=20.0):
    """Poll until `child`'s process has exited and been reaped."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(c is child for c, _ in supervisor.poll()):
            return
        time.sleep(0.02)
    raise AssertionError(f"{child.name} did not exit")


def dies_at_once(name="w0", code=3, script=None):
    return Child(name, [sys.executable, "-c", script or f"raise SystemExit({code})"], {})


def test_a_worker_dying_soon_after_ready_each_time_backs_off_longer_each_time():
    """A worker killed at its first requests (the OOM killer) says READY and dies: that is
    a crash loop too (READY once reset the backoff, so it was reloaded every 0.5 s for
    ever). One that served for STABLE_AFTER s before it died starts from the shortest."""
    supervisor, child = Supervisor(), dies_at_once()
    supervisor.add(child)
    waits = []
    for _ in range(3):
        supervisor.mark_healthy("w0")                 # READY, then it dies
        exited(supervisor, child)
        waits.append(child.respawn_at - time.monotonic())
        child.respawn_at = time.monotonic()           # (respawn now, not after the wait)
        supervisor.poll()
    assert waits[0] < waits[1] < waits[2] and waits[2] > 1.5, waits
    supervisor.mark_healthy("w0")
    child.ready_at -= STABLE_AFTER + 1                # ... it served a while this time
    exited(supervisor, child)
    assert child.respawn_at - time.monotonic() <= config.RESPAWN_BACKOFF[0]
    supervisor.stop_all(grace=1)


def test_nothing_is_respawned_while_the_server_drains_to_stop():
    supervisor, child = Supervisor(), dies_at_once()
    supervisor.add(child)
    deadline = time.monotonic() + 20
    while child.process is not None and time.monotonic() < deadline:
        supervisor.poll(respawn=False)
        time.sleep(0.02)
    assert child.process is None and child.respawn_at is None
    supervisor.stop_all(grace=1)


def test_children_do_not_read_the_launchers_config_file_again(monkeypatch):
    """Each child gets its settings on its command line: a config file named by
    COMPLETIONS_CONFIG in the launcher's environment made every worker read it as its
    own and exit 2 where it had no [[workers]] entry for the worker's device."""
    monkeypatch.setenv("COMPLETIONS_CONFIG", "/nonexistent/config.toml")
    supervisor = Supervisor()
    child = dies_at_once(script="import os; raise SystemExit(5 if 'COMPLETIONS_CONFIG' in "
                                "os.environ else 0)")
    supervisor.add(child)
    exited(supervisor, child)
    assert child.last_exit == 0
    supervisor.stop_all(grace=1)


def test_a_workers_exit_note_stays_in_the_launchers_own_directory(tmp_path):
    """A worker that gives up writes its one line why where the launcher reads it; the
    file is named by a digest of the worker's name (an operator's text: "../x" wrote,
    and the launcher removed, a file outside its directory)."""
    import os
    from dispatcher.supervisor import Child, Supervisor
    supervisor = Supervisor()
    for name in ("w0-cpu", "../../evil", "a/b"):
        path = supervisor._note_path(Child(name=name, argv=[], env={}))
        assert os.path.dirname(path) == supervisor._notes and path.endswith(".exit")
        with open(path, "w") as f:
            f.write(f"cannot load {name}")
        assert supervisor._read_note(Child(name=name, argv=[], env={})) == f"cannot load {name}"
        assert not os.path.exists(path)
    assert oct(os.stat(supervisor._notes).st_mode & 0o777) == "0o700"
    supervisor.stop_all(grace=0)
    assert not os.path.exists(supervisor._notes)


def test_a_child_that_cannot_be_started_again_is_tried_after_the_backoff(tmp_path):
    """fork or exec failing at a respawn or a restart (a pids limit, the interpreter
    replaced mid-deploy) raised out of the launcher's loop and stopped the whole server;
    it is now tried again after the backoff, as after a crash, and starts once it can.
    A restart on another command line (a reload's model) forgets the last load's time:
    the queue waited three times the old model's load for the new one, then refused."""
    supervisor, child = Supervisor(), dies_at_once()
    supervisor.add(child)
    exited(supervisor, child)
    good = child.argv
    child.argv = [str(tmp_path / "gone" / "python")]          # (what exec cannot find)
    child.respawn_at = time.monotonic()
    supervisor.poll()                                        # no exception
    assert child.process is None and child.respawn_at > time.monotonic()
    supervisor.restart("w0", [str(tmp_path / "still-gone")])  # nor from a restart
    assert child.process is None and child.respawn_at is not None
    child.load_seconds = 3.0          # the last model's load; another's is not known
    supervisor.restart("w0", good + ["--model", "a.gguf"])
    assert child.process is not None and child.load_seconds is None
    exited(supervisor, child)
    child.load_seconds = 3.0          # the same model under a new id: the same load
    supervisor.restart("w0", good + ["--model", "a.gguf", "--model-id", "renamed"])
    assert child.process is not None and child.load_seconds == 3.0
    exited(supervisor, child)
    supervisor.restart("w0", good + ["x\x00y"])    # no exec takes it: not retried
    assert child.process is None and child.gave_up and "null" in child.exit_note
    supervisor.stop_all(grace=1)


def test_a_front_end_exiting_soon_after_its_start_each_time_is_given_up():
    """A front end that can never start (a port another process took after the check,
    a setting gunicorn refuses) was respawned for ever while `serve` said it served: three
    exits in a row, each within STABLE_AFTER of its start, give it up; one that ran a
    while before it died starts the count again."""
    from dispatcher.supervisor import FRONTEND_TRIES
    supervisor, child = Supervisor(), dies_at_once("frontend", code=1)
    child.kind = "frontend"
    supervisor.add(child)
    for _ in range(FRONTEND_TRIES - 1):
        exited(supervisor, child)
        assert not child.gave_up and child.respawn_at is not None
        child.respawn_at = time.monotonic()           # (respawn now, not after the wait)
        supervisor.poll()
    child.started_at -= STABLE_AFTER + 1              # ... this one ran a while
    exited(supervisor, child)
    assert not child.gave_up and child.died_young == 0
    for _ in range(FRONTEND_TRIES):
        child.respawn_at = time.monotonic()
        supervisor.poll()
        exited(supervisor, child)
    time.sleep(0.05)
    supervisor.poll()                                 # (not respawned)
    assert child.gave_up and child.process is None and "3 times in a row" in child.exit_note
    supervisor.stop_all(grace=1)


def test_serve_stops_with_exit_1_once_every_front_end_is_given_up():
    """Nothing serves HTTP once every front end has been given up: `serve` stops, exit 1,
    where it went on as if it served (workers given up alone leave it running)."""
    from types import SimpleNamespace

    from dispatcher.broker import Broker
    stopped = []
    front = [Child(f"frontend{i}", [], {}, kind="frontend") for i in range(2)]
    broker = SimpleNamespace(supervisor=SimpleNamespace(children={
        c.name: c for c in front + [Child("w0", [], {})]}), exit_code=0,
        stop=lambda: stopped.append(True))
    front[0].gave_up = True
    Broker._check_frontends_alive(broker)
    assert not stopped and broker.exit_code == 0     # one still serves
    front[1].gave_up = True
    Broker._check_frontends_alive(broker)
    assert stopped and broker.exit_code == 1
