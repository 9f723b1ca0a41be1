"""Core lending between a co-located prefill and decode instance: the pairing `pdserve launch` plans, and the
flag a prefill worker raises while it computes, which moves a decode worker between its own cores and both."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from pdserve.deploy.launch import lend_cores
from pdserve.deploy.plan import InstanceSpec
from pdserve.worker import core_loan


def _spec(name: str, role: str) -> InstanceSpec:
    return InstanceSpec(name, role, "127.0.0.1", 1, 2, None)


def test_launch_pairs_each_prefill_with_one_decode(tmp_path: Path) -> None:
    specs = [_spec("prefill-0", "prefill"), _spec("decode-0", "decode"), _spec("decode-1", "decode"),
             _spec("mixed-0", "mixed")]
    cpus, envs = lend_cores(specs, [{0}, {1}, {2}, {3}], tmp_path)
    assert cpus == [{0}, {0, 1}, {2}, {3}]  # decode-1 has no prefill to borrow from
    assert envs[0] == {core_loan.LEND_ENV: str(tmp_path / "prefill-0.flag")}
    assert envs[1] == {core_loan.BORROW_ENV: f"{tmp_path / 'prefill-0.flag'}:1:0"}
    assert envs[2] == envs[3] == {}
    assert (tmp_path / "prefill-0.flag").read_bytes() == b"\0" * core_loan.FLAG_BYTES
    # more instances than cores share them: nothing to lend
    assert lend_cores(specs[:2], [{0}, {0}], tmp_path)[0] == [{0}, {0}]


def _lender_and_borrower_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                             ) -> tuple[core_loan.Lender, Path, int]:
    """A prefill worker's lender on a fresh flag file, and the environment a decode worker borrows its core with:
    (the lender, the flag file, the decode worker's own core)."""
    own, lent = sorted(os.sched_getaffinity(0))[:2]
    flag = core_loan.create_flag(tmp_path / "p.flag")
    monkeypatch.setenv(core_loan.LEND_ENV, str(flag))
    lender = core_loan.from_env()
    monkeypatch.delenv(core_loan.LEND_ENV)
    monkeypatch.setenv(core_loan.BORROW_ENV, core_loan.borrow_spec(flag, {own}, {lent}))
    return lender, flag, own


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_decode_worker_uses_the_lent_cores_only_while_the_prefill_worker_is_idle(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lender, flag, own = _lender_and_borrower_env(tmp_path, monkeypatch)
    threads_before, mask_before = torch.get_num_threads(), os.sched_getaffinity(0)
    result: dict = {}

    def decode_side() -> None:  # its own thread: the borrower pins the thread it runs on
        borrower = core_loan.from_env()
        result["mask"] = os.sched_getaffinity(0)
        result["idle"] = borrower.run(torch.get_num_threads)
        result["busy"] = lender.run(lambda: borrower.run(torch.get_num_threads))
        result["after"] = borrower.run(torch.get_num_threads)

    try:
        t = threading.Thread(target=decode_side)
        t.start()
        t.join(30)
    finally:
        torch.set_num_threads(threads_before)
    assert result == {"mask": {own}, "idle": 2, "busy": 1, "after": 2}
    assert flag.read_bytes()[0] == 0  # lowered after the step
    assert os.sched_getaffinity(0) == mask_before  # only the borrowing thread was pinned


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_a_prefill_step_waits_for_the_decode_step_on_its_cores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    """A prompt arriving mid-step starts once the decode step that borrowed its core has ended, not beside it."""
    lender, flag, _ = _lender_and_borrower_env(tmp_path, monkeypatch)
    threads_before = torch.get_num_threads()
    events: list[str] = []
    decoding = threading.Event()

    def decode_step() -> None:
        events.append("decode starts")
        decoding.set()
        time.sleep(0.1)
        events.append("decode ends")

    def decode_side() -> None:
        borrower = core_loan.from_env()
        borrower.run(decode_step)

    try:
        t = threading.Thread(target=decode_side)
        t.start()
        decoding.wait(10)
        lender.run(lambda: events.append("prefill starts") or time.sleep(0.05))
        t.join(30)
    finally:
        torch.set_num_threads(threads_before)
    assert events[:3] == ["decode starts", "decode ends", "prefill starts"]
    assert flag.read_bytes()[:2] == b"\0\0"
