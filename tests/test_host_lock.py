"""Instances of one host calibrate in turn (utils/host_lock.py): a second taker waits for the first, and a hung
holder delays a start by at most the timeout."""

from __future__ import annotations

import threading
import time

import pytest

from pdserve.utils.host_lock import host_lock


def test_takers_go_in_turn_and_a_hung_holder_is_waited_for_only_so_long(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    held = threading.Event()

    def holder() -> None:
        with host_lock("calibration", 5):
            held.set()
            time.sleep(0.5)

    t = threading.Thread(target=holder)
    t.start()
    held.wait(5)
    with host_lock("calibration", 5) as waited:
        assert waited >= 0.3
    t.join()
    with host_lock("calibration", 5) as waited:
        assert waited < 0.1  # free again: the first holder's exit released it
        with host_lock("calibration", 0.2) as second:
            assert second == pytest.approx(0.2, abs=0.15)  # gave up waiting, runs anyway
