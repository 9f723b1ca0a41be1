"""`pdserve launch` supervises its deployment: a killed instance (or one whose worker died) is restarted
on its address and ports and rejoins the router's pool while the others keep serving; Ctrl-C still
stops everything and leaves nothing behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.servers import REPO, free_port, segments, wait_for


class Launch:
    def __init__(self, tmp: Path, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.tmp = tmp
        self.log_path = tmp / "launch.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "launch", "--port", str(self.port),
                                          *flags], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, "TMPDIR": str(tmp)}, start_new_session=True)
        wait_for(lambda: "ready on" in self.log() or self.proc.poll() is not None, 300,
                 "the deployment was not ready")
        assert self.proc.poll() is None, self.log()

    def kill(self) -> None:
        """A test that failed half-way: its own session would outlive it (SIGKILL to the whole group)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def instances(self) -> dict[str, dict]:
        """By role and index in url order: prefill-0, decode-0, decode-1, ..."""
        found = httpx.get(f"{self.url}/registered", timeout=5).json()["instances"]
        out: dict[str, dict] = {}
        for role in ("prefill", "decode", "mixed"):
            for i, inst in enumerate(sorted((x for x in found if x["role"] == role), key=lambda x: x["url"])):
                out[f"{role}-{i}"] = inst
        return out

    def own_ports(self) -> list[str]:
        """The routers' own ports (launch runs two on the shared one), in router order."""
        routers = [p.cmdline() for p in psutil.Process(self.proc.pid).children() if "router" in p.cmdline()[3:5]]
        return sorted(c[c.index("--own-port") + 1] for c in routers)

    def router_serves(self, own_port: str) -> bool:
        try:
            found = httpx.get(f"http://127.0.0.1:{own_port}/registered", timeout=5).json()["instances"]
        except httpx.HTTPError:
            return False
        return sum(i["healthy"] for i in found) == 3

    def rejoined(self, url: str, restarts: int) -> bool:
        return any(i["url"] == url and i["healthy"] and i["restarts"] == restarts
                   for i in self.instances().values())


class Load(threading.Thread):
    """Requests one after another from two client threads; records (start time, ok, error, end time)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.results, self.stop = url, [], threading.Event()

    def run(self) -> None:
        def client() -> None:  # a connection per request: a kept-alive one to a router that died breaks
            with httpx.Client(timeout=60, limits=httpx.Limits(max_keepalive_connections=0)) as http:
                while not self.stop.is_set():
                    start = time.monotonic()
                    try:
                        r = http.post(f"{self.url}/v1/completions", json={
                            "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
                        self.results.append((start, r.status_code == 200, r.text[:300], time.monotonic()))
                    except httpx.HTTPError as e:
                        self.results.append((start, False, repr(e), time.monotonic()))

        threads = [threading.Thread(target=client) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def failures_after(self, t: float) -> list:
        return [r for r in self.results if r[0] > t and not r[1]]


@pytest.mark.e2e
def test_launch_restarts_killed_instances_and_ctrl_c_stops_all(tmp_path: Path, tiny_model: list[str]):
    before = segments()
    # Admission off: on a slow box the TPOT objective refuses some of this steady load while an instance is
    # down, and this test counts every answer that is not a 200 (tests/test_admission.py tests admission).
    launch = Launch(tmp_path, *tiny_model, "--prefill", "1", "--decode", "2", "--num-gpu-blocks-override", "200",
                    "--max-model-len", "1024", "--ttft-slo-ms", "0", "--tpot-slo-ms", "0")
    try:
        _restarts_and_ctrl_c(launch, tmp_path, before)
    finally:
        launch.kill()


def _exited(pid: int) -> bool:
    """Every thread of the process has exited. Its leader turns zombie before the other threads are done
    closing the files they share (a socket a connection can still be hashed to)."""
    try:
        return os.listdir(f"/proc/{pid}/task") == [str(pid)] and psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except (FileNotFoundError, psutil.NoSuchProcess):
        return True


def _restarts_and_ctrl_c(launch: Launch, tmp_path: Path, before: set[str]) -> None:
    pids = {p.pid for p in psutil.Process(launch.proc.pid).children(recursive=True)}
    # Only the workers compute, so only they load torch: launch, the router, the API servers, engines
    # and cache services stay small.
    with_torch = {" ".join(p.cmdline()[2:4]) for p in psutil.Process(launch.proc.pid).children(recursive=True)
                  if any("libtorch" in m.path for m in p.memory_maps())}
    assert with_torch == {"pdserve.worker --address"}, with_torch
    assert not any("libtorch" in m.path for m in psutil.Process(launch.proc.pid).memory_maps())
    load = Load(launch.url)
    load.start()
    try:
        time.sleep(2)
        victim = launch.instances()["decode-0"]
        psutil.Process(victim["pid"]).kill()  # the instance's server process, as a crash would
        killed_at = time.monotonic()
        wait_for(lambda: launch.rejoined(victim["url"], 1), 90, "the killed decode instance did not rejoin")
        assert "decode-0 exited (code -9); restarting it" in launch.log()

        # a worker dies: its instance exits (code 1) and launch restarts it too
        other = launch.instances()["decode-1"]
        (worker,) = [p for p in psutil.Process(other["pid"]).children(recursive=True)
                     if "pdserve.worker" in " ".join(p.cmdline())]
        worker.kill()
        wait_for(lambda: launch.rejoined(other["url"], 1), 90, "the decode instance whose worker died did not rejoin")
        assert "decode-1 exited (code 1); restarting it" in launch.log()

        # one of the two routers on the port dies: the other takes every new connection at once
        own = launch.own_ports()[0]
        (router,) = [p for p in psutil.Process(launch.proc.pid).children() if own in p.cmdline()]
        router_kill_sent = time.monotonic()
        router.kill()
        wait_for(lambda: _exited(router.pid), 5, "SIGKILL")
        router_killed_at = time.monotonic()  # its sockets are closed: new connections go to the other
        wait_for(lambda: re.search(r"router-\d restarted", launch.log()), 30, "the killed router was not restarted")
        wait_for(lambda: launch.router_serves(own), 30, "the restarted router has no pool")
        time.sleep(2)
    finally:
        load.stop.set()
        load.join(90)
    ok = [r for r in load.results if r[1]]
    late = [r for r in load.results if r[0] > killed_at + 1]
    assert len(ok) > 20 and late, "too little load went through"
    # A request that had reached a killed instance may fail; none started a second after the kill did,
    # but those the dead router was carrying: their connection drops, as do connections made while its
    # process was exiting (the kernel had hashed them to its socket). No connection was refused.
    assert [r for r in load.results if r[0] > router_killed_at + 1], "no load after the router's death"
    carried = [r for r in load.failures_after(killed_at + 1) if r[0] <= router_killed_at
               and r[3] >= router_kill_sent and ("RemoteProtocolError" in r[2] or "ReadError" in r[2])]
    others = [(r[0] - router_kill_sent, r[3] - router_kill_sent, r[2])
              for r in load.failures_after(killed_at + 1) if r not in carried]
    assert not others, (others[:3], f"the router took {router_killed_at - router_kill_sent:.2f} s to die")

    pids |= {p.pid for p in psutil.Process(launch.proc.pid).children(recursive=True)}
    os.killpg(launch.proc.pid, signal.SIGINT)  # Ctrl-C in its terminal: every process gets it
    assert launch.proc.wait(60) == 130, launch.log()[-3000:]
    assert "Traceback" not in launch.log(), launch.log()[-5000:]
    wait_for(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                             for p in pids), 20, "processes of the deployment outlived Ctrl-C")
    wait_for(lambda: segments() <= before, 10, "KV segments were left behind")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("pdserve-")], "IPC folders were left behind"


def test_a_crash_looping_instance_stops_the_deployment_naming_it(tmp_path: Path):
    from pdserve.deploy.supervisor import Supervisor

    sup = Supervisor({}, max_restarts=3, window=60, backoff=(0.1,))
    sup.start("flaky", [sys.executable, "-c", "import sys; sys.exit(3)"])
    sup.start("steady", [sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        message = None
        deadline = time.monotonic() + 30
        while message is None and time.monotonic() < deadline:
            message = sup.tend()
            time.sleep(0.05)
        assert message and message.startswith("flaky exited 3 times") and "exit code 3" in message
        assert sup.members["flaky"].restarts == 2 and sup.members["steady"].restarts == 0
    finally:
        sup.stop()
    assert all(p.poll() is not None for p in sup.procs.values())


def test_launch_on_a_gpu_machine_plans_prefill_and_decode_instances(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 17 made launch refuse PD instances on a GPU machine (their cache had to be in host shared
    memory); issue 28 keeps a device cache in every role, so a GPU machine plans them like any other."""
    import argparse

    from pdserve.deploy.plan import plan

    def args(*instance_args: str) -> argparse.Namespace:
        return argparse.Namespace(prefill=1, decode=1, mixed=0, host="127.0.0.1", separate_hosts=False,
                                  prefill_tensor_parallel_size=None, decode_tensor_parallel_size=None)

    monkeypatch.setenv("PDSERVE_GPU_PRESENT", "1")
    assert [s.role for s in plan(args())] == ["prefill", "decode"]
    assert [s.role for s in plan(args(), ["--device", "cpu"])] == ["prefill", "decode"]


def test_launch_gives_each_role_its_tensor_parallel_size_and_cores_in_proportion() -> None:
    import argparse

    from pdserve.deploy.launch import split_cpus
    from pdserve.deploy.plan import plan

    settings = argparse.Namespace(prefill=1, decode=1, mixed=0, host="127.0.0.1", separate_hosts=False,
                                  prefill_tensor_parallel_size=2, decode_tensor_parallel_size=None)
    specs = plan(settings, ["-tp", "3", "--dtype", "float32"])
    assert [s.tensor_parallel_size for s in specs] == [2, 3]
    router = "http://r"  # not contacted
    assert specs[0].command(router, ["-tp", "3"])[-2:] == ["--tensor-parallel-size", "2"]  # the role's wins
    assert [s.tensor_parallel_size for s in plan(settings, [])] == [2, 1]
    cores = split_cpus([3, 1])
    if cores[0] is not None and len(os.sched_getaffinity(0)) >= 4:
        assert len(cores[0]) > len(cores[1]) and not cores[0] & cores[1]


def test_mixed_given_alone_starts_only_mixed_instances() -> None:
    """`--mixed 4` alone used to start the default 1P1D beside them; P and D now default to 0 then."""
    import argparse

    from pdserve.config.flags import add_flags, from_args
    from pdserve.deploy.plan import instance_names
    from pdserve.deploy.settings import LaunchSettings

    parser = argparse.ArgumentParser()
    add_flags(parser, LaunchSettings)

    def names(*flags: str) -> list[str]:
        return [name for _, name in instance_names(from_args(LaunchSettings, parser.parse_args(list(flags))))]

    assert names("--mixed", "4") == ["mixed-0", "mixed-1", "mixed-2", "mixed-3"]
    assert names() == ["prefill-0", "decode-0"]
    assert names("--mixed", "1", "--prefill", "2") == ["prefill-0", "prefill-1", "decode-0", "mixed-0"]
    with pytest.raises(ValueError, match="needs at least one --prefill and one --decode"):
        names("--mixed", "2", "--decode", "0")


def test_each_launched_instance_keeps_its_own_disk_tier_folder() -> None:
    """`pdserve launch ... --kv-disk-path DIR`: instance NAME gets DIR/NAME, the same after each restart."""
    from pdserve.deploy.settings import own_disk_folder

    args = ["--swap-space", "1", "--kv-disk-path", "/var/kv", "--enable-kv-pull"]
    assert own_disk_folder(args, "mixed-1") == ["--swap-space", "1", "--kv-disk-path", "/var/kv/mixed-1",
                                                "--enable-kv-pull"]
    assert own_disk_folder(["--kv-disk-path=/var/kv"], "decode-0") == ["--kv-disk-path=/var/kv/decode-0"]
    assert own_disk_folder(args[:2], "mixed-0") == args[:2] and args[3] == "/var/kv"  # nothing else changes
