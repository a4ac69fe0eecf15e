"""The lock that lets parallel test processes share the machine (tests/machine_share.py).

flock(2) locks belong to an open file, so two MachineShare objects in one process
contend as two processes would; each side runs in a thread of its own here."""
import fcntl
import threading
import time

from machine_share import MachineShare


def in_thread(target) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def held_by_someone(path) -> bool:
    with open(path, "a+") as probe:
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(probe, fcntl.LOCK_UN)
        return False


def share_in_thread(holder: MachineShare) -> tuple[threading.Thread, threading.Event]:
    """A thread that takes a share and sets the event once it has it."""
    ran = threading.Event()

    def share():
        with holder.share():
            ran.set()

    return in_thread(share), ran


def test_a_share_waits_while_another_process_has_the_whole_machine(tmp_path):
    whole, other = MachineShare(tmp_path), MachineShare(tmp_path)
    with whole.whole_machine():
        thread, ran = share_in_thread(other)
        assert not ran.wait(0.3)               # blocked, however fast the machine
    thread.join(timeout=30)
    assert ran.is_set()


def test_the_whole_machine_waits_for_shares_and_is_not_starved_by_new_ones(tmp_path):
    first, whole, later = MachineShare(tmp_path), MachineShare(tmp_path), MachineShare(tmp_path)
    order = []

    def take_whole():
        with whole.whole_machine():
            order.append("whole")

    def take_share():
        with later.share():
            order.append("later share")

    with first.share():
        waiting = in_thread(take_whole)
        deadline = time.monotonic() + 30          # it waits in the turnstile for `first`
        while not held_by_someone(tmp_path / "turnstile.lock"):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        waiting.join(0.3)
        assert waiting.is_alive()
        with first.share():                                       # nested: no new lock
            pass
        queued = in_thread(take_share)
        queued.join(0.3)
        assert order == []                     # behind the turnstile, not beside `first`
    waiting.join(timeout=30)
    queued.join(timeout=30)
    assert order == ["whole", "later share"]


def test_a_share_upgraded_to_the_whole_machine_and_back(tmp_path):
    mine, other = MachineShare(tmp_path), MachineShare(tmp_path)
    with mine.share():
        with mine.whole_machine():
            thread, ran = share_in_thread(other)
            assert not ran.wait(0.3)
        thread.join(timeout=30)                # back to a share: shares run beside it
        assert ran.is_set()
