"""Child-process lifecycle helpers: no orphan is left behind when a parent dies or is stopped."""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    import zmq

_PR_SET_PDEATHSIG = 1
_parent_pid: int | None = None  # set by die_with_parent: the process we must not outlive
_stop_signal: int | None = None  # set by exit_on_sigterm's handler
STOP_CHECK_MS = 500  # how long a blocking wait may go before it calls raise_if_stopping()
PARENT_GONE_GRACE_S = 4.0  # a process whose parent is gone gets this long to stop in order
_parent_gone_hooks: list[Callable[[], None]] = []  # set by when_parent_gone: run by the parent-watch thread


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent dies (a no-op elsewhere).

    A parent that died before this call sends no signal, so that case is checked by hand: we were
    reparented, and exit.
    """
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        except OSError:
            pass
    global _parent_pid
    expected = os.environ.get("PDSERVE_PARENT_PID")
    if expected is not None:
        _parent_pid = int(expected)
        if _parent_pid != os.getppid():  # checked after prctl: no gap
            sys.exit(1)
        _watch_parent(_parent_pid)


def _watch_parent(parent: int, period: float = 0.5, grace: float = PARENT_GONE_GRACE_S) -> None:
    """The backstop of die_with_parent: a process can miss or ignore its SIGTERM (it arrived while the
    interpreter was already exiting, or a cleanup hangs), and would then outlive its parent
    indefinitely. When the parent is gone, this thread asks for the orderly stop, and `grace`
    seconds later ends the process; its own children then get their parent-death signal."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(period)
        for hook in _parent_gone_hooks:
            try:
                hook()
            except Exception:  # noqa: BLE001 - a cleanup that fails must not keep the process alive
                pass
        if _stop_signal is None:  # a second SIGTERM would cut the orderly stop short
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace)
        os._exit(128 + signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def child_env() -> dict[str, str]:
    """The environment for a child that calls die_with_parent()."""
    return {**os.environ, "PDSERVE_PARENT_PID": str(os.getpid())}


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit so `finally` blocks (shared-memory unlink) run.

    Python ignores (prints and drops) an exception raised inside a finalizer, and a signal handler runs
    wherever the main thread is, `__del__` included (a garbage-collected ZMQ socket, say). So the
    handler also records the signal, does not raise inside a finalizer, and every blocking loop of ours
    waits at most STOP_CHECK_MS before it calls raise_if_stopping(), which also notices a dead parent
    whatever became of its signal.

    Once the interpreter starts shutting down, SIGTERM is ignored: the process is exiting anyway, and a
    SystemExit raised inside an atexit hook (torch has some) only prints a traceback. Hooks registered
    with threading's (private, but stable and used by concurrent.futures) `_register_atexit` run before
    every `atexit` hook, whatever the order they were registered in.
    """

    def handler(signum: int, frame: FrameType | None) -> None:
        global _stop_signal
        _stop_signal = signum
        if not _in_finalizer(frame):
            raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
    threading._register_atexit(signal.signal, signal.SIGTERM, signal.SIG_IGN)


def when_parent_gone(hook: Callable[[], None]) -> None:
    """Run `hook` (in the parent-watch thread) as soon as the parent is seen gone: cleanup that must
    happen even if this process never reaches its `finally` blocks."""
    _parent_gone_hooks.append(hook)


def parent_gone() -> bool:
    """The parent this process must not outlive (die_with_parent) has exited. Its death signal can
    arrive while getppid() still names it, so a parent that is a zombie counts as gone."""
    return _parent_pid is not None and (os.getppid() != _parent_pid or _is_zombie(_parent_pid))


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except OSError:  # with /proc, no entry means no such process any more; without one, cannot tell
        return os.path.exists("/proc/self")
    except IndexError:
        return False


def raise_if_stopping() -> None:
    """Raise the SystemExit of a stop signal that could not be raised where it arrived, or of a parent
    (see die_with_parent) that is gone."""
    if _stop_signal is not None:
        raise SystemExit(128 + _stop_signal)
    if _parent_pid is not None and os.getppid() != _parent_pid:  # cheap: this runs every step
        raise SystemExit(128 + signal.SIGTERM)  # what PR_SET_PDEATHSIG would have made of it


def _in_finalizer(frame: FrameType | None) -> bool:
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def recv_until_stopped(sock: zmq.Socket) -> bytes:
    """`sock.recv()` that a stop signal always ends (see exit_on_sigterm)."""
    raise_if_stopping()
    while not sock.poll(STOP_CHECK_MS):
        raise_if_stopping()
    return sock.recv()


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


def exit_now(code: int) -> NoReturn:
    """End a child whose orderly stop is done (its segments released, its sockets closed) without the interpreter's
    teardown: with torch loaded that is ~0.45 s of finalizing objects that the OS frees anyway, paid at every stop
    and restart. Logs and the standard streams are flushed first."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def child_entry(name: str, parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The common start of an engine-side child process: parse `--config B64` (plus the parser's own
    flags), ignore SIGINT, die with the parent, turn SIGTERM into SystemExit, log as `name`. Returns the
    arguments; `args.config` is the encoded EngineConfig."""
    parser.add_argument("--config", required=True)
    args = parser.parse_args(argv)
    # Ctrl-C reaches the whole process group; the instance's server stops its children in order
    # (and their parent-death signal covers a server that is gone), so here it would only print tracebacks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()
    exit_on_sigterm()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s {name}: %(message)s")
    return args
