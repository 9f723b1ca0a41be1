"""`pdserve launch` stops on Ctrl-C wherever its main thread is: the flag its signal handler sets takes no lock
(a `threading.Event` set from a handler that interrupted the same thread's `Event.wait` left launch deaf to
SIGINT)."""

from __future__ import annotations

import os
import signal
import threading
import time

from pdserve.utils.stop_flag import StopFlag


def test_a_signal_stops_a_wait_in_progress() -> None:
    flag = StopFlag()
    old = signal.signal(signal.SIGUSR1, lambda *_: flag.set())
    try:
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        start = time.monotonic()
        assert flag.wait(10)
        assert time.monotonic() - start < 5
        assert flag.is_set() and flag.wait(0)
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_signals_landing_in_short_waits_neither_block_nor_get_lost() -> None:
    """Many signals while the main thread keeps entering and leaving waits, as launch's poll loop does."""
    flag, seen = StopFlag(), []

    def on_signal(signum: int, frame: object) -> None:
        seen.append(signum)
        flag.set()

    old = signal.signal(signal.SIGUSR1, on_signal)
    sender = threading.Thread(target=lambda: [os.kill(os.getpid(), signal.SIGUSR1) or time.sleep(0.001)
                                              for _ in range(200)])
    try:
        sender.start()
        while sender.is_alive():
            flag.wait(0.0005)
        sender.join()
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert flag.is_set() and len(seen) >= 1


def test_an_unset_flag_waits_out_its_timeout() -> None:
    flag = StopFlag()
    start = time.monotonic()
    assert not flag.wait(0.1) and not flag.is_set()
    assert time.monotonic() - start >= 0.09
