"""The SLA planner against fixed splits on a phased workload: goodput with the planner moving roles, beside every
fixed assignment of the same two instances (the best of which a user would have had to guess).

    .venv/bin/python bench/planner.py [--phase-seconds 60] [--rate-a 1] [--rate-b 3.5] [--ttft-slo-ms 2000]
        [--tpot-slo-ms 50] [--interval 5] [--pd-policy always] [--out bench-results/planner]

Each configuration is one `pdserve launch --prefill 1 --decode 1 --planner` (instances with --enable-role-switch,
calibrated before ready); the fixed ones run the planner with --planner-dry-run and set their roles with POST /role
before the load: 1P1D, P + mixed, mixed + D, two mixed. Phase A sends 1,500-token prompts for 16-token answers
(greedy), phase B 50-token prompts for 300-token answers (sampled, temperature 0.8), each a Poisson stream from
`pdserve bench serve --dataset random` at its rate. Goodput is vLLM's: requests per second that met both SLOs.

Prints the `pdserve bench serve` figures per phase and configuration, the whole run's goodput and the planner's
ratio to the best and the worst fixed split, with the planner's role changes; writes a plot of the planner run's
target and actual roles over time beside the phases (planner.png) and every phase's JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from pdserve.api.serve import free_port
from pdserve.planner.observe import total

MODEL = "SmolLM2-135M-Instruct"
FIXED = {"1P1D": ("prefill", "decode"), "P+M": ("prefill", "mixed"), "M+D": ("mixed", "decode"),
         "2M": ("mixed", "mixed")}
ROLES = ("prefill", "decode", "mixed")


def cpu_name() -> str:
    flags = Path("/proc/cpuinfo").read_text()
    model = next((line.split(":", 1)[1].strip() for line in flags.splitlines() if line.startswith("model name")), "?")
    isa = "AMX" if "amx_bf16" in flags else "AVX512_BF16" if "avx512_bf16" in flags else (
        "AVX-512" if "avx512f" in flags else "AVX2")
    return f"{model}, {os.cpu_count()} cores, {isa}"


class Deployment:
    def __init__(self, out: Path, name: str, args: argparse.Namespace, dry_run: bool) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = out / f"{name}.launch.log"
        flags = ["--prefill", "1", "--decode", "1", "--routers", "1", "--planner", "--planner-interval",
                 str(args.interval), "--planner-ttft-slo-ms", str(args.ttft_slo_ms), "--planner-tpot-slo-ms",
                 str(args.tpot_slo_ms), *(["--planner-dry-run"] if dry_run else []),
                 "--pd-policy", args.pd_policy,
                 "--max-model-len", "2048", "--max-num-seqs", "64", "--num-gpu-blocks-override", "1200"]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "launch", "--port", str(self.port),
                                          *flags], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 300
        while "ready on" not in self.log() or "pdserve planner: watching" not in self.log():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the deployment did not start:\n{self.log()[-3000:]}")
            time.sleep(0.5)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def members(self) -> list[dict]:
        return sorted(httpx.get(f"{self.url}/registered", timeout=5).json()["instances"], key=lambda i: i["role"])

    def set_roles(self, roles: tuple[str, str]) -> None:
        """The prefill instance takes roles[0], the decode one roles[1]."""
        import asyncio

        from pdserve.http.members import post_signed

        by_role = {m["role"]: m["url"] for m in self.members()}

        async def change() -> None:
            async with httpx.AsyncClient(timeout=60) as client:
                for url, role in ((by_role["prefill"], roles[0]), (by_role["decode"], roles[1])):
                    r = await post_signed(client, url, "/role", {"role": role})
                    r.raise_for_status()

        asyncio.run(change())

    def planner_metrics_url(self) -> str:
        line = next(li for li in self.log().splitlines() if "pdserve planner: watching" in li)
        return line.split("metrics on ")[1].split(")")[0].split(";")[0]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


class RoleSampler(threading.Thread):
    """Every second: the phase, the actual roles (/registered) and the planner's targets (its /metrics)."""

    def __init__(self, deployment: Deployment) -> None:
        super().__init__(daemon=True)
        self.deployment, self.metrics_url = deployment, deployment.planner_metrics_url()
        self.phase, self.rows, self.stopped = "", [], threading.Event()
        self.start_time = time.monotonic()

    def run(self) -> None:
        while not self.stopped.wait(1.0):
            try:
                roles = [m["role"] for m in self.deployment.members()]
                text = httpx.get(self.metrics_url, timeout=5).text
            except httpx.HTTPError:
                continue
            self.rows.append({"t": time.monotonic() - self.start_time, "phase": self.phase,
                              **{r: roles.count(r) for r in ROLES},
                              **{f"target_{r}": total(text, "pdserve_planner_target_instances", role=r) for r in ROLES},
                              "need_prefill": total(text, "pdserve_planner_need_instances", side="prefill"),
                              "need_decode": total(text, "pdserve_planner_need_instances", side="decode")})


def phase(url: str, out: Path, name: str, input_len: int, output_len: int, rate: float, seconds: float,
          temperature: float, args: argparse.Namespace, seed: int) -> dict:
    result = out / f"{name}.json"
    cmd = [sys.executable, "-m", "pdserve.cli", "bench", "serve", "--base-url", url, "--model", MODEL,
           "--dataset", "random", "--random-input-len", str(input_len), "--random-output-len", str(output_len),
           "--random-range-ratio", "0.1", "--num-prompts", str(max(1, round(rate * seconds))), "--request-rate",
           str(rate), "--ignore-eos", "--temperature", str(temperature), "--seed", str(seed), "--goodput",
           f"ttft:{args.ttft_slo_ms}", f"tpot:{args.tpot_slo_ms}", "--save-result", str(result), "--no-progress"]
    subprocess.run(cmd, check=False, stdout=subprocess.DEVNULL)
    return json.loads(result.read_text())["summary"]


def run_config(name: str, args: argparse.Namespace, out: Path) -> dict:
    deployment = Deployment(out, name, args, dry_run=name != "planner")
    try:
        if name in FIXED:
            deployment.set_roles(FIXED[name])
        sampler = RoleSampler(deployment)
        sampler.start()
        phases = {}
        for i, (label, input_len, output_len, rate, temp) in enumerate((
                ("A", 1500, 16, args.rate_a, 0.0), ("B", 50, 300, args.rate_b, 0.8))):
            sampler.phase = label
            phases[label] = phase(deployment.url, out, f"{name}.{label}", input_len, output_len, rate,
                                  args.phase_seconds, temp, args, seed=1 + i)
        sampler.stopped.set()
        changes = [line.split("planner: ", 1)[1] for line in deployment.log().splitlines()
                   if "[planner]" in line and " changed from " in line]
        return {"phases": phases, "roles": sampler.rows, "changes": changes}
    finally:
        deployment.stop()


def goodput(result: dict) -> float:
    good = sum((p["goodput"] or 0.0) * p["duration"] for p in result["phases"].values())
    return good / sum(p["duration"] for p in result["phases"].values())


def report(results: dict[str, dict], args: argparse.Namespace) -> None:
    print(f"\nmachine: {cpu_name()}; --pd-policy {args.pd_policy}; SLOs TTFT {args.ttft_slo_ms:g} ms, TPOT "
          f"{args.tpot_slo_ms:g} ms; phase A "
          f"{args.rate_a:g} req/s of 1,500 -> 16 tokens, phase B {args.rate_b:g} req/s of 50 -> 300 tokens, "
          f"{args.phase_seconds:g} s each")
    print(f"{'config':8} {'phase':5} {'done':>5} {'failed':>6} {'goodput':>8} {'attain':>7} {'TTFT p50':>9} "
          f"{'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'tok/s':>7}")
    for name, result in results.items():
        for label, s in result["phases"].items():
            print(f"{name:8} {label:5} {s['completed']:5d} {s['failed']:6d} {s['goodput'] or 0:8.2f} "
                  f"{s['slo_attainment'] or 0:7.0%} {s['ttft']['median'] or 0:9.0f} "
                  f"{s['ttft']['percentiles'].get('P99') or 0:9.0f} {s['itl']['median'] or 0:8.1f} "
                  f"{s['itl']['percentiles'].get('P99') or 0:8.1f} {s['output_throughput']:7.0f}")
    fixed = {n: goodput(r) for n, r in results.items() if n != "planner"}
    print("\nwhole-run goodput (req/s meeting both SLOs): " + ", ".join(f"{n} {g:.2f}" for n, g in
                                                                        {**{"planner": goodput(results["planner"])},
                                                                         **fixed}.items()))
    if fixed and "planner" in results:
        mine, best, worst = goodput(results["planner"]), max(fixed.values()), min(fixed.values())
        print(f"planner / best fixed ({max(fixed, key=fixed.get)}): {mine / best:.2f}x; planner / worst fixed "
              f"({min(fixed, key=fixed.get)}): {mine / worst if worst else float('inf'):.2f}x")
    for line in results.get("planner", {}).get("changes", []):
        print(f"  planner: {line}")


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["planner"]["roles"]
    if not rows:
        return
    t = [r["t"] for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for role, style in zip(ROLES, ("-", "--", ":"), strict=True):
        top.step(t, [r[role] for r in rows], style, where="post", label=f"{role} (actual)")
        top.step(t, [r[f"target_{role}"] for r in rows], style, where="post", alpha=0.4, label=f"{role} (target)")
    top.set_ylabel("instances")
    top.legend(fontsize=7, ncol=3)
    bottom.plot(t, [r["need_prefill"] for r in rows], label="prefill need")
    bottom.plot(t, [r["need_decode"] for r in rows], label="decode need")
    for ax in (top, bottom):
        for r0, r1 in zip(rows, rows[1:], strict=False):
            if r1["phase"] != r0["phase"]:
                ax.axvline(r1["t"], color="grey", lw=0.8)
    bottom.set_ylabel("instance-equivalents")
    bottom.set_xlabel("seconds (phase A, then B)")
    bottom.legend(fontsize=7)
    fig.suptitle(f"pdserve planner on {cpu_name()}")
    fig.savefig(path, dpi=110, bbox_inches="tight")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phase-seconds", type=float, default=60)
    parser.add_argument("--rate-a", type=float, default=1.0, help="phase A's requests/s (1,500 -> 16 tokens)")
    parser.add_argument("--rate-b", type=float, default=3.5, help="phase B's requests/s (50 -> 300 tokens)")
    parser.add_argument("--ttft-slo-ms", type=float, default=2000)
    parser.add_argument("--tpot-slo-ms", type=float, default=50)
    parser.add_argument("--interval", type=float, default=5)
    parser.add_argument("--pd-policy", default="always", choices=("always", "conditional"),
                        help="the routers' (launch's default is conditional: a decode instance computes short "
                             "prompts, and any prompt while it has few streams, which blurs the splits)")
    parser.add_argument("--configs", default="planner," + ",".join(FIXED))
    parser.add_argument("--out", type=Path, default=Path("bench-results/planner"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PDSERVE_CLUSTER_SECRET", secrets.token_hex(16))  # launch and this script share it
    results = {}
    for name in args.configs.split(","):
        print(f"pdserve bench planner: {name} ...", flush=True)
        results[name] = run_config(name, args, args.out)
    (args.out / "planner.json").write_text(json.dumps(results, indent=1))
    report(results, args)
    if "planner" in results:
        plot(results, args.out / "planner.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
