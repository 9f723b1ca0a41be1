"""Keeps the processes of a `pdserve launch` deployment running.

A process that exits is started again with the same command (same address and ports) after a
backoff that doubles from 1 s to 16 s; each restart is logged and counted. One that exits
`max_restarts` times within `window` seconds is crash-looping: the supervisor reports it and the
deployment stops, naming it. Stopping (Ctrl-C, SIGTERM) sends SIGTERM to every process, then SIGKILL
to those still running after the timeout.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from pdserve.utils.process import child_env


@dataclass
class Supervised:
    name: str
    cmd: list[str]
    cpus: set[int] | None
    env: dict[str, str] = field(default_factory=dict)  # this member's own additions
    proc: subprocess.Popen | None = None
    exits: deque[float] = field(default_factory=deque)  # when it exited, within the crash-loop window
    restarts: int = 0
    restart_at: float | None = None  # a restart is due then


class Supervisor:
    def __init__(self, env: dict[str, str], max_restarts: int = 5, window: float = 120.0,
                 backoff: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0, 16.0), label_output: bool = True) -> None:
        self.env = env
        self.label_output = label_output  # each output line starts with [name] (Ray labels its actors' own)
        self.max_restarts, self.window, self.backoff = max_restarts, window, backoff
        self.members: dict[str, Supervised] = {}

    @property
    def procs(self) -> dict[str, subprocess.Popen]:
        return {n: m.proc for n, m in self.members.items() if m.proc is not None}

    def start(self, name: str, cmd: list[str], cpus: set[int] | None = None,
              env_extra: dict[str, str] | None = None) -> None:
        member = self.members.setdefault(name, Supervised(name, cmd, cpus, env_extra or {}))
        env = {**child_env(), **self.env}
        if cpus:
            env["OMP_NUM_THREADS"] = str(len(cpus))
        env.update(member.env)
        member.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                       preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
        member.restart_at = None
        threading.Thread(target=_pass_output, args=(name if self.label_output else "", member.proc),
                         daemon=True).start()

    def dead(self) -> list[tuple[str, int]]:
        return [(n, p.returncode) for n, p in self.procs.items() if p.poll() is not None]

    def tend(self) -> str | None:
        """Schedule restarts of the processes that exited and start those that are due; a message when
        one crash-loops (the deployment should stop)."""
        now = time.monotonic()
        for m in self.members.values():
            if m.proc is not None and m.proc.poll() is not None and m.restart_at is None:
                m.exits.append(now)
                while m.exits and now - m.exits[0] > self.window:
                    m.exits.popleft()
                if len(m.exits) >= self.max_restarts:
                    return (f"{m.name} exited {len(m.exits)} times within {self.window:.0f} s (last exit code "
                            f"{m.proc.returncode}): it is crash-looping; stopping the deployment")
                delay = self.backoff[min(len(m.exits), len(self.backoff)) - 1]
                m.restart_at = now + delay
                _say(f"{m.name} exited (code {m.proc.returncode}); restarting it in {delay:.0f} s")
            if m.restart_at is not None and now >= m.restart_at:
                m.restarts += 1
                self.start(m.name, m.cmd, m.cpus)
                _say(f"{m.name} restarted (restart {m.restarts}, pid {m.proc.pid})")
        return None

    def stop(self, timeout: float = 20.0, grace: float = 0.0) -> None:
        """SIGTERM to every process, then SIGKILL past `timeout`; after `grace` seconds in which they may
        stop on their own (Ctrl-C in a terminal reaches each of them: a second signal would cut their
        orderly stop short)."""
        procs = list(self.procs.values())
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.05)
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + timeout
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _say(text: str) -> None:
    print(f"pdserve launch: {text}", file=sys.stderr, flush=True)


def _pass_output(name: str, proc: subprocess.Popen) -> None:
    prefix = f"[{name}] " if name else ""
    for line in proc.stdout:
        sys.stdout.write(f"{prefix}{line.decode(errors='replace')}")
        sys.stdout.flush()
