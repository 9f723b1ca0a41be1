"""The engine waits on its worker through ChildProcess: while a step runs, the engine's own duties
(P's lease renewals) go on through `while_waiting`."""

from __future__ import annotations

import time

import pytest
import zmq

from pdserve.utils.child_process import ChildProcess


@pytest.fixture
def slow_child(tmp_path):
    ctx = zmq.Context()
    child = ChildProcess("slow child", "tests.slow_child", ["0.6"], ctx, f"ipc://{tmp_path}/sock", str)
    yield child
    child.send("bye")
    child.receive(10, what="say goodbye")
    child.proc.wait(10)
    child.sock.close()
    ctx.term()


def test_while_waiting_runs_every_poll_until_the_answer_comes(slow_child):
    calls: list[float] = []
    start = time.monotonic()
    slow_child.send("step")
    assert slow_child.receive(10, "answer", while_waiting=lambda: calls.append(time.monotonic()), poll_ms=50) == "step"
    assert time.monotonic() - start >= 0.6
    assert len(calls) >= 6  # 0.6 s of waiting, 50 ms apart (minus start-up jitter)
    assert max(b - a for a, b in zip(calls, calls[1:], strict=False)) < 0.3  # never a long gap


def test_without_while_waiting_the_answer_still_comes(slow_child):
    slow_child.send("step")
    assert slow_child.receive(10, "answer") == "step"
