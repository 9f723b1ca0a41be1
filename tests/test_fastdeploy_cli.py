"""FastDeploy's command line (seed 000's usage block) against `pdserve serve`: every flag parses; what
pdserve lacks is refused with one line per flag; with those values swapped for ones it has, it serves."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.servers import REPO, Server, free_port


def seed_command(pd_port: int, **swap: str) -> list[str]:
    """The seed's usage block, flag for flag (the model left to the default), with `swap` replacing values."""
    flags = {
        "--port": str(free_port()), "--metrics-port": str(free_port()),
        "--engine-worker-queue-port": "1477,1478,1479,1480,1481,1482,1483,1484",
        "--pd-comm-port": ",".join(str(pd_port + i) for i in range(8)),
        "--tensor-parallel-size": "4", "--data-parallel-size": "16", "--max-model-len": "65536",
        "--enable-expert-parallel": None, "--enable-chunked-prefill": None, "--max-num-seqs": "5",
        "--workers": "1", "--scheduler-ttl": "9000", "--scheduler-topic": "test", "--scheduler-host": "XXXX",
        "--scheduler-port": "6379", "--scheduler-password": "XXXX", "--disable-custom-all-reduce": None,
        "--splitwise-role": "prefill", "--scheduler-name": "dp", "--gpu-memory-utilization": "0.9",
        "--quantization": "block_wise_fp8", "--max-num-batched-tokens": "2048", "--cache-transfer-protocol": "rdma",
        "--rdma-comm-ports": "8501,8502,8503,8504,8505,8506,8507,8508", "--cache-queue-port": "9978",
        "--ips": "10.0.0.1,10.0.0.2",  # not contacted
        "--graph-optimization-config": '{"use_cudagraph":false,"use_unique_memory_pool":true,'
                                       '"cudagraph_capture_sizes":[1]}',
    }
    for flag, value in swap.items():
        name = "--" + flag.replace("_", "-")
        if value == "":
            del flags[name]
        else:
            flags[name] = value
    return [arg for flag, value in flags.items() for arg in ((flag,) if value is None else (flag, value))]


def test_the_seed_command_line_names_each_flag_pdserve_lacks():
    cmd = [sys.executable, "-m", "pdserve.cli", "serve", *seed_command(free_port())]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("pdserve: error:")]
    refused = ["--enable-expert-parallel", "--scheduler-name dp", "--ips",
               "--quantization block_wise_fp8", "--tensor-parallel-size 4"]  # rdma is served (NIXL)
    assert len(errors) == len(refused), proc.stderr
    for flag, line in zip(refused, errors, strict=True):
        assert line.startswith(f"pdserve: error: {flag}"), line
    assert "w8a8" in proc.stderr  # what it offers instead
    assert "unrecognized arguments" not in proc.stderr and "usage:" not in proc.stderr


@pytest.mark.e2e
def test_the_seed_command_line_serves_with_what_pdserve_has(tmp_path: Path):
    pd_port = free_port()
    server = Server(tmp_path, *seed_command(  # Server gives --port and --metrics-port
        pd_port, tensor_parallel_size="1", data_parallel_size="1",
        enable_expert_parallel="", scheduler_name="local", quantization="", cache_transfer_protocol="tcp",
        ips="127.0.0.1", max_model_len="2048", gpu_memory_utilization="", num_gpu_blocks_override="128",
        port="", metrics_port=""))
    try:
        r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                       json={"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
        log = server.log()
        assert f"pd-comm-port {pd_port}" in log  # rank 0's port of the per-rank list
        assert "--engine-worker-queue-port accepted, not needed" in log
    finally:
        server.stop()


def test_router_without_a_scheme_means_http():
    from pdserve.cli import build_parser

    args = build_parser().parse_args(["serve", "--router", "10.0.0.5:8000"])  # not contacted
    assert args.router == ["http://10.0.0.5:8000"]  # not contacted
    no_port = "https://r:1"  # not contacted
    assert build_parser().parse_args(["serve", "--router", no_port]).router == [no_port]
    # several routers of one deployment (pdserve launch --routers): register with each
    two = "10.0.0.5:8001,http://10.0.0.5:8002"  # not contacted
    both = build_parser().parse_args(["serve", "--router", two]).router
    assert both == ["http://10.0.0.5:8001", "http://10.0.0.5:8002"]  # not contacted
