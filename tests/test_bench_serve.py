"""`pdserve bench serve`: against a stub OpenAI server with known timings, a server that is down, and a live
pdserve instance (the seed 003 table, the JSON records and the plot)."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pdserve.cli import main as cli_main
from tests.servers import REPO, Server, free_port

pytestmark = pytest.mark.e2e  # starts pdserve processes or loads the model: not in `make test-fast`

FIRST, GAP, TOKENS = 0.2, 0.1, 6  # the stub: first token after 200 ms, then one every 100 ms


CHATS: list[dict] = []  # what the stub's chat endpoint was sent


def _stub_app() -> FastAPI:
    app = FastAPI()
    calls = {"n": 0}

    @app.post("/v1/chat/completions")
    async def chat(raw: Request) -> object:
        body = await raw.json()
        CHATS.append(body)
        answer = f"answer {len(body['messages']) // 2}"  # the turn's number, from 0
        usage = {"prompt_tokens": 100 * len(body["messages"]), "completion_tokens": 2,
                 "prompt_tokens_details": {"cached_tokens": 50 * (len(body["messages"]) - 1)}}

        async def events() -> Iterator[str]:
            for piece in answer.split(" "):
                yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'content': piece + ' '}}]})}\n\n"
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"data": [{"id": "stub"}]}

    @app.post("/v1/completions")
    async def completions(raw: Request) -> object:
        calls["n"] += 1
        if calls["n"] == 3:
            return JSONResponse({"error": {"message": "stub failure", "type": "x", "code": 500}}, status_code=500)

        async def events() -> Iterator[str]:
            for i in range(TOKENS):
                await asyncio.sleep(FIRST if i == 0 else GAP)
                data = {"choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}],
                        "metrics": {"arrival_time": FIRST + GAP * i}}  # what a server's clock would say
                yield f"data: {json.dumps(data)}\n\n"
            yield f"data: {json.dumps({'choices': [], 'usage': {'prompt_tokens': 8, 'completion_tokens': TOKENS}})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def stub_url() -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(_stub_app(), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def test_known_timings_and_a_failure(stub_url: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "result.json"
    code = cli_main(["bench", "serve", "--base-url", stub_url, "--num-prompts", "5", "--random-input-len", "8",
                     "--random-output-len", str(TOKENS), "--max-concurrency", "1", "--no-progress",
                     "--save-result", str(out)])
    table = capsys.readouterr().out
    assert code == 0
    result = json.loads(out.read_text())
    s = result["summary"]
    assert s["completed"] == 4 and s["failed"] == 1 and len(result["requests"]) == 5
    assert "first error: HTTP 500: stub failure" in table
    assert s["ttft"]["median"] == pytest.approx(FIRST * 1000, abs=10)
    assert s["itl"]["median"] == pytest.approx(GAP * 1000, abs=10)
    assert s["tpot"]["median"] == pytest.approx(GAP * 1000, abs=10)
    assert s["decode"]["median"] == pytest.approx((TOKENS - 1) / (GAP * (TOKENS - 1)), rel=1e-6)  # server clock
    assert s["output_tokens"] == 4 * TOKENS and s["input_tokens"] == 4 * 8
    # the stub sends no per-request server timings beyond arrival_time: S_TTFT is n/a, not 0
    assert s["s_ttft"]["mean"] is None
    assert re.search(r"Mean S_TTFT \(ms\):\s+n/a", table)


def test_server_down_is_one_clear_line(capsys: pytest.CaptureFixture) -> None:
    code = cli_main(["bench", "serve", "--base-url", f"http://127.0.0.1:{free_port()}", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code != 0
    assert len(err.splitlines()) == 1 and "not reachable" in err


def test_live_pdserve_table_records_and_plot(tmp_path: Path) -> None:
    server = Server(tmp_path / "server", "--num-gpu-blocks-override", "128", "--max-model-len", "512")
    try:
        result, png = tmp_path / "r.json", tmp_path / "p.png"
        run = subprocess.run(
            [sys.executable, "-m", "pdserve.cli", "bench", "serve", "--base-url", server.url, "--num-prompts", "20",
             "--random-input-len", "64", "--random-output-len", "12", "--random-range-ratio", "0.25",
             "--ignore-eos", "--request-rate", "20", "--goodput", "ttft:5000", "--save-result", str(result),
             "--plot", str(png), "--no-progress", "--metrics-url", f"http://127.0.0.1:{server.metrics_port}/metrics"],
            cwd=REPO, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        table = run.stdout
        assert re.search(r"Successful requests:\s+20\b", table) and re.search(r"Failed requests:\s+0\b", table)
        data = json.loads(result.read_text())
        records = data["requests"]
        assert len(records) == 20 and all(r["ok"] for r in records)
        max_tokens = [int(12 * 0.75), int(12 * 1.25)]
        assert all(max_tokens[0] <= r["output_tokens"] <= max_tokens[1] for r in records)
        generated = int(re.search(r"Total generated tokens:\s+(\d+)", table).group(1))
        assert generated == sum(r["output_tokens"] for r in records)
        assert int(re.search(r"Total input tokens:\s+(\d+)", table).group(1)) == sum(r["prompt_tokens"]
                                                                                     for r in records)
        for name in ("TTFT", "S_TTFT", "TPOT", "ITL", "E2EL"):
            values = [float(v) for v in re.findall(rf"^(?:Median|P[\d.]+) {name} \(ms\):\s+([\d.]+)", table, re.M)]
            assert len(values) == 7 and values == sorted(values), (name, values)
        assert "TTFT breakdown" in table  # pdserve sends its per-request timings
        # --metrics-url: the run's own prompt tokens, as the instance counted them, and its hits by tier
        assert "Prefix hits by tier" in table
        assert data["tiers"]["queried_tokens"] == sum(r["prompt_tokens"] for r in records)
        assert sum(data["tiers"]["hit_tokens"].values()) == sum(r.get("cached_tokens") or 0 for r in records)
        from PIL import Image

        with Image.open(png) as image:
            image.verify()
            assert image.size[0] > 100
    finally:
        server.stop()


def test_jsonl_dataset_takes_chat_and_prompt_lines(tmp_path: Path, stub_url: str,
                                                   capsys: pytest.CaptureFixture) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}\n\n'
                    '{"prompt": "Once upon a time"}\n')
    from pdserve.bench_serve.datasets import jsonl_requests
    from pdserve.loader import resolve_model_folder
    from pdserve.tokenization.tokenizer import Tokenizer

    reqs = jsonl_requests(data, 4, 7, seed=0, tokenizer=Tokenizer(resolve_model_folder(None)))
    assert len(reqs) == 4  # cycles through the file
    chat = [r for r in reqs if r.messages is not None]
    plain = [r for r in reqs if r.prompt is not None]
    assert chat and plain and all(r.max_tokens == 3 for r in chat) and all(r.max_tokens == 7 for r in plain)
    assert all(r.prompt_len > 0 for r in reqs)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt here"}\n')
    code = cli_main(["bench", "serve", "--base-url", stub_url, "--dataset", "jsonl", str(bad), "--no-progress"])
    assert code == 2 and "needs \"messages\" or \"prompt\"" in capsys.readouterr().err


def test_multiturn_users_send_the_history_with_the_answers_and_report_by_turn(stub_url: str, tmp_path: Path,
                                                                             capsys: pytest.CaptureFixture) -> None:
    CHATS.clear()
    out = tmp_path / "multiturn.json"
    code = cli_main(["bench", "serve", "--base-url", stub_url, "--dataset", "sharegpt-multiturn", "--num-users", "3",
                     "--max-turns", "3", "--think-time", "0", "--sharegpt-output-len", "8", "--no-progress",
                     "--save-result", str(out)])
    table = capsys.readouterr().out
    assert code == 0 and "By turn" in table
    firsts = [c for c in CHATS if len(c["messages"]) == 1]
    assert len(firsts) == 3 and all(c["max_tokens"] == 8 and c["stream"] for c in CHATS)
    for chat in CHATS:  # each later turn: the history, the stub's own answers in it, then the next user turn
        history = chat["messages"]
        assert [m["role"] for m in history] == ["user", "assistant"] * (len(history) // 2) + ["user"]
        assert [m["content"] for m in history[1::2]] == [f"answer {i} " for i in range(len(history) // 2)]
    result = json.loads(out.read_text())
    turns = {t["turn"]: t for t in result["by_turn"]}
    assert turns[0]["requests"] == 3 and turns[0]["cached_tokens"] == 0
    assert turns[1]["hit_share"] == pytest.approx(100 / 300)  # 3 messages: 300 prompt tokens, 100 cached
    assert result["later_turns"]["requests"] == len(CHATS) - 3
