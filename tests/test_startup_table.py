"""The startup truth table (DESIGN section 2), row by row, on real instances: each row starts in the
order the table gives, the table's process creates the KV cache (the other attaches after cache-ready),
and the instance then serves a request as transformers answers it (PD rows: a prefill and a decode instance
serve one together). The model is the tiny random llama (tests/tiny_models.py): the rows test the start
order, not the model.
The rows of a cache in device memory run on CPU under PDSERVE_PRIVATE_KV_CACHE=1: the worker creates
its cache only after the cache service made the host memory it copies through, and nothing attaches."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from pdserve.instance.startup import CACHE_SERVICE, PRIVATE_CACHE_ENV, TRUTH_TABLE, Step, cache_owner, processes
from tests.servers import Server
from tests.tiny_models import NEW_TOKENS

pytestmark = pytest.mark.e2e  # starts pdserve processes or loads the model: not in `make test-fast`

PROFILE = ["--kv-cache-memory", "1G", "--max-model-len", "512", "--max-num-batched-tokens", "128",
           "--max-num-seqs", "4"]
NO_PROFILE = ["--num-gpu-blocks-override", "64", "--max-model-len", "512", "--max-num-batched-tokens", "128"]

ROWS = sorted(TRUTH_TABLE.items(), reverse=True)  # the rules the table follows: test_kv_transfer.py


@pytest.fixture(scope="module")
def model(tiny) -> tuple[list[str], list[int], str]:  # noqa: ANN001
    """The flags that serve the tiny model exactly, a prompt, and transformers' greedy answer to it."""
    from tests.tiny_models import greedy_texts

    folder, prompts, answers = tiny
    return ["--model", str(folder), "--dtype", "float32"], prompts[1], greedy_texts(folder, answers)[1]


def _flags(model: tuple, profile: bool, prefix: bool, log: Path) -> list[str]:
    prefix_flag = "--enable-prefix-caching" if prefix else "--no-enable-prefix-caching"
    return [*model[0], *(PROFILE if profile else NO_PROFILE), prefix_flag, "--startup-log", str(log)]


def _check_log(path: Path, steps: tuple[Step, ...], device: bool = False) -> None:
    """The instance ran its row's steps, in order, and each did what it says."""
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "step"] == [s.name for s in steps]
    assert [e["process"] for e in events if e["event"] == "cache_created"] == [cache_owner(steps)]
    kinds = [e["event"] for e in events]
    assert kinds[-1] == "ready"
    if device:
        assert "cache_attached" not in kinds
        assert [e for e in events if e["event"] == "cache_created"][0]["segment"] is None  # private memory
        host = [e["process"] for e in events if e["event"] == "host_memory_created"]
        assert host == ([CACHE_SERVICE] if Step.START_CACHE_SERVICE in steps else [])
        if host:  # the worker maps it as it creates the cache
            assert kinds.index("host_memory_created") < kinds.index("cache_created")
        return
    attached = [e["process"] for e in events if e["event"] == "cache_attached"]
    assert attached == [p for p in processes(steps) if p != cache_owner(steps)]
    kinds = [e["event"] for e in events]
    for i, e in enumerate(events):  # the other process attaches only after the cache exists
        if e["event"] == "cache_attached":
            assert "cache_created" in kinds[:i]


def _complete(server: Server, model: tuple, **extra: object) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", timeout=120,
                      json={"prompt": model[1], "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
                            **extra})


def _answers(response: httpx.Response, model: tuple) -> bool:
    return response.status_code == 200 and response.json()["choices"][0]["text"] == model[2]


ROW_IDS = ["".join(f"{c}{int(v)}" for c, v in zip("pmcd", k, strict=True)) for k, _ in ROWS]  # p1m0c1d0: short


@pytest.mark.parametrize(("key", "steps"), ROWS, ids=ROW_IDS)
def test_startup_row(tmp_path: Path, model: tuple, key: tuple[bool, bool, bool, bool], steps: tuple[Step, ...]) -> None:
    profile, mixed, prefix, device = key
    env = {PRIVATE_CACHE_ENV: "1"} if device else None
    if mixed:
        # a device cache's mixed instance starts its cache service only for a host tier
        tier = ["--swap-space", "0.05"] if device and prefix else []
        server = Server(tmp_path / "mixed", *_flags(model, profile, prefix, tmp_path / "mixed.jsonl"), *tier,
                        env=env, wait=False)
        try:
            server.wait_ready(240)
            _check_log(tmp_path / "mixed.jsonl", steps, device)
            r = _complete(server, model)
            assert _answers(r, model), r.text
        finally:
            server.stop()
        return
    logs = {role: tmp_path / f"{role}.jsonl" for role in ("prefill", "decode")}
    with ThreadPoolExecutor(2) as pool:
        servers = dict(zip(logs, pool.map(
            lambda role: Server(tmp_path / role, "--splitwise-role", role,
                                *_flags(model, profile, prefix, logs[role]), env=env, wait=False), logs), strict=True))
    try:
        for s in servers.values():
            s.wait_ready(240)
        for log in logs.values():
            _check_log(log, steps, device)
        p, d = servers["prefill"], servers["decode"]
        ready = json.loads(logs["prefill"].read_text().splitlines()[0])
        assert ready["event"] == "plan" and ready["mixed_role"] is False
        pd_port = _pd_port(p)
        with ThreadPoolExecutor(2) as pool:
            p_res = pool.submit(_complete, p, model, pd={"transfer_id": "row", "role": "prefill"})
            d_res = pool.submit(_complete, d, model, pd={"transfer_id": "row", "role": "decode",
                                                         "prefill_addr": f"127.0.0.1:{pd_port}"})
            assert p_res.result().status_code == 200
            answer = d_res.result()
        assert _answers(answer, model), answer.text
    finally:
        for s in servers.values():
            s.stop()


def _pd_port(server: Server) -> int:
    """The prefill instance's control-plane port (a free one was picked; the announcement says which,
    a moment after /health turns 200)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for line in server.log().splitlines():
            if "role prefill" in line and "pd-comm-port" in line:
                return int(line.rsplit("pd-comm-port ", 1)[1].split(")")[0])
        time.sleep(0.1)
    raise AssertionError(f"no pd-comm-port in the log:\n{server.log()}")


def test_a_cache_without_a_segment_starts_a_mixed_instance_without_its_cache_service(tmp_path: Path,
                                                                                    model: tuple) -> None:
    """A CUDA cache has no shared-memory segment for the cache service to attach to (issue 17: the
    default CUDA config died on it); without a host tier the service has nothing to keep and is not
    started. PDSERVE_PRIVATE_KV_CACHE=1 gives a CPU cache the same property."""
    log = tmp_path / "mixed.jsonl"
    server = Server(tmp_path / "mixed", *_flags(model, False, True, log), wait=False, env={PRIVATE_CACHE_ENV: "1"})
    try:
        server.wait_ready(240)
        events = [json.loads(line) for line in log.read_text().splitlines()]
        assert [e["step"] for e in events if e["event"] == "step"] == [Step.START_WORKER.name,
                                                                        Step.WORKER_CREATES_CACHE.name]
        assert [e for e in events if e["event"] == "plan"][0]["device_cache"] is True
        assert [e for e in events if e["event"] == "cache_created"][0]["segment"] is None
        assert any(e["event"] == "cache_service_not_started" for e in events)
        assert not server.children("pdserve.disagg.cache_service")
        assert not server.own_segments()
        assert _answers(_complete(server, model), model)
        # weights out and in again: the path that sent the cache service a segment of None
        assert httpx.post(f"{server.url}/clear_load_weight", timeout=60).status_code == 200
        assert httpx.post(f"{server.url}/update_model_weight", timeout=300).status_code == 200
        assert _answers(_complete(server, model), model)
    finally:
        server.stop()
