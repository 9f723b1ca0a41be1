"""How a deployment's launcher waits and stops, local or on Ray: until every router has every instance, and on
SIGINT / SIGTERM."""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable

import httpx

from pdserve.utils.stop_flag import StopFlag


def stop_on_signals() -> tuple[StopFlag, list[int]]:
    """SIGINT and SIGTERM set the flag (the deployment then stops in order); the list says which came."""
    stop = StopFlag()
    stopped_by: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        stopped_by.append(signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return stop, stopped_by


SIGINT_GRACE_S = 5.0  # after Ctrl-C, the deployment's processes (which got it too) stop on their own first


def stopped(signals: list[int]) -> int:
    """The exit code of a deployment stopped by a signal (130 SIGINT, 143 SIGTERM), said once."""
    signum = signals[0] if signals else signal.SIGINT
    print(f"pdserve launch: stopped ({signal.Signals(signum).name}); stopping every process", file=sys.stderr,
          flush=True)
    return 128 + signum


def wait_ready(failure: Callable[[], str | None], router_urls: list[str], expected: int, timeout: float,
               stop: StopFlag, names: list[str]) -> str | None:
    """Until every router has every instance in its pool and can serve; what went wrong, if something did
    (`failure`: a member that failed while starting)."""
    deadline = time.monotonic() + timeout
    fewest = 0
    with httpx.Client(timeout=2.0) as client:
        while not stop.is_set():
            if error := failure():
                return error
            try:
                fewest = min(sum(i["healthy"] for i in client.get(f"{url}/registered").json()["instances"])
                             for url in router_urls)
                if fewest >= expected and all(client.get(f"{url}/health").status_code == 200 for url in router_urls):
                    return None
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            if time.monotonic() > deadline:
                return (f"not ready within {timeout:.0f} s: {fewest} of {expected} instances in the pool "
                        f"({', '.join(names)} were started)")
            stop.wait(0.5)
    return None
