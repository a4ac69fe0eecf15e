"""Stop requests that signal handlers make: safe whenever the signal arrives."""
import faulthandler
import logging
import os
import signal
import sys
import threading
import time

from dispatcher.common.addresses import Endpoints
from dispatcher.broker import Broker
from dispatcher.cli import signal_handler
from dispatcher.common.process import StopFlag


def interrupted_inside(function, handler) -> None:
    """Call `function`, with a signal arriving at every line it (and what it calls) runs;
    the signal's handler calls `handler`. A second SIGTERM landing just as the
    dispatcher stops itself is one of these."""
    state = {"in_handler": False, "sent": 0}

    def on_signal(signum, frame):
        state["in_handler"] = True
        try:
            handler()
        finally:
            state["in_handler"] = False

    def trace(frame, event, arg):
        if event == "line" and not state["in_handler"]:
            state["sent"] += 1
            os.kill(os.getpid(), signal.SIGUSR1)     # handled before this line runs
        return trace

    previous, tracer = signal.signal(signal.SIGUSR1, on_signal), sys.gettrace()
    # a handler that waits for a lock its own thread holds never returns: end the run
    # with the stacks rather than hang the suite
    faulthandler.dump_traceback_later(120, exit=True)     # (a traced run is slow)
    sys.settrace(trace)
    try:
        function()
    finally:
        sys.settrace(tracer)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGUSR1, previous)
    assert state["sent"] >= 1


def test_a_stop_flag_can_be_set_by_a_signal_that_interrupts_setting_it():
    flag = StopFlag()
    interrupted_inside(flag.set, flag.set)
    assert flag.is_set()


def test_the_dispatcher_stops_when_a_signal_asks_while_it_is_stopping_itself(tmp_path,
                                                                           caplog):
    broker = Broker(Endpoints.from_base(f"ipc://{tmp_path}"))
    on_signal = signal_handler(broker, grace=30)           # serve's own handler
    try:
        interrupted_inside(lambda: broker.drain(30), lambda: on_signal(signal.SIGTERM, None))
        interrupted_inside(broker.stop, lambda: on_signal(signal.SIGINT, None))
        with caplog.at_level(logging.INFO, logger="dispatcher.broker"):
            broker.run()                 # returns at once: the stop was recorded
    finally:
        broker.close()
    # the handler only asked; the loop said what it was asked
    assert "SIGINT: stopping" in caplog.text


def test_a_wake_up_is_consumed_not_left_to_spin_the_dispatcher(tmp_path):
    """stop() and drain() wake the loop through a socket; left unread, it would keep the
    poll returning at once and the dispatcher would burn a core (starving the workers)."""
    broker = Broker(Endpoints.from_base(f"ipc://{tmp_path}"))
    loop = threading.Thread(target=broker.run)
    loop.start()
    try:
        broker._wake()                          # what stop() and drain() do
        time.sleep(0.2)
        cpu = time.process_time()
        time.sleep(0.6)                         # a measurement window, not a wait
        assert time.process_time() - cpu < 0.3  # spinning: about 0.6 s of CPU
    finally:
        broker.stop()
        loop.join(timeout=10)
        broker.close()
    assert not loop.is_alive()
