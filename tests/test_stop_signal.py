"""SIGTERM always stops a pdserve process, even when it lands inside a finalizer.

Python drops an exception raised in `__del__` (it prints "Exception ignored" and goes on), and a
signal handler runs wherever the main thread happens to be: a garbage-collected ZMQ socket's
`__del__` is enough. A worker or cache service that lost its SIGTERM there kept waiting for an engine
that was gone, and kept the KV cache segment alive.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from tests.servers import REPO

pytestmark = pytest.mark.e2e  # starts pdserve processes or loads the model: not in `make test-fast`

SCRIPT = textwrap.dedent("""
    import os, signal, zmq
    from pdserve.utils.process import exit_on_sigterm, recv_until_stopped

    exit_on_sigterm()

    class Finalized:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(100_000):  # the handler runs in here, inside __del__
                pass

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.bind("inproc://nobody-sends")
    try:
        Finalized()
        print("waiting", flush=True)
        recv_until_stopped(sock)  # what the worker and the cache service wait in
    finally:
        print("cleaned up", flush=True)
        sock.close()
        ctx.term()
""")


def test_sigterm_inside_a_finalizer_still_stops_the_process() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 143, proc.stderr
    assert proc.stdout.split() == ["waiting", "cleaned", "up"], proc.stdout  # its `finally` ran
    assert "Exception ignored" not in proc.stderr, proc.stderr


CHILD = textwrap.dedent("""
    import signal, zmq
    from pdserve.utils.process import die_with_parent, exit_on_sigterm, recv_until_stopped

    die_with_parent()
    exit_on_sigterm()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as if the parent's death signal were lost
    sock = zmq.Context().socket(zmq.PAIR)
    sock.bind("inproc://nobody-sends")
    print("waiting", flush=True)
    recv_until_stopped(sock)
""")

PARENT = textwrap.dedent("""
    import subprocess, sys
    from pdserve.utils.process import child_env

    child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env=child_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
    assert child.stdout.readline() == "waiting\\n"
    print(child.pid, flush=True)
""")  # and exits, without stopping the child


def test_a_child_whose_parent_died_exits_even_without_the_death_signal() -> None:
    parent = subprocess.run([sys.executable, "-c", PARENT, CHILD], cwd=REPO, capture_output=True, text=True,
                            timeout=30)
    assert parent.returncode == 0, parent.stderr
    child = int(parent.stdout)
    deadline = time.monotonic() + 5
    while psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE:
        if time.monotonic() > deadline:
            psutil.Process(child).kill()
            pytest.fail("the child outlived its parent by 5 s")
        time.sleep(0.05)
