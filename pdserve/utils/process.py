"""Child-process lifecycle helpers: no orphan is left behind when a parent dies or is stopped."""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent dies (a no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit so `finally` blocks (shared-memory unlink) run."""

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def stop_process(proc: subprocess.Popen, ask: Callable[[], None], timeout: float) -> None:
    """Ask a child to stop (`ask` sends it a shutdown message), then SIGTERM, then SIGKILL; reaps it."""
    if proc.poll() is not None:
        return
    try:
        ask()
        proc.wait(timeout)
        return
    except Exception:  # the message could not be sent, or the child did not exit in time
        pass
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
