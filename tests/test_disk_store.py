"""The disk tier's storage and index: blocks come back byte for byte, damaged or vanished files are misses (never
served), least recently used blocks go first, a folder scanned again gives its blocks in their order, and another
producer's fingerprint never sees them."""

from __future__ import annotations

import hashlib
import logging
import os

import pytest
import torch

from pdserve.engine.disk_tier import DiskTier
from pdserve.kv.disk_store import DiskFiles, fingerprint

BLOCK = 4096


def key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def block(i: int) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(BLOCK))


def files(tmp_path, fp: str = "fp") -> DiskFiles:
    return DiskFiles(tmp_path / fp, BLOCK)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_bytes_come_back_equal(tmp_path, dtype):
    kv = torch.randn(2, 16, 3, 64).to(dtype)  # one layer of a block: K/V, tokens, KV heads, head size
    raw = kv.contiguous().view(torch.uint8).numpy().tobytes()
    f = DiskFiles(tmp_path, len(raw))
    f.write(key(1), raw)
    out = bytearray(len(raw))
    assert f.read(key(1), memoryview(out))
    assert torch.equal(torch.frombuffer(out, dtype=torch.uint8).view(dtype).view(kv.shape), kv)


def test_a_corrupt_or_truncated_file_is_a_miss_and_is_removed(tmp_path, caplog):
    f = files(tmp_path)
    for i in range(3):
        f.write(key(i), block(i))
    path = f._path(key(0))
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # one flipped byte of the payload
    path.write_bytes(bytes(data))
    f._path(key(1)).write_bytes(f._path(key(1)).read_bytes()[:-10])  # a write cut short
    out = memoryview(bytearray(BLOCK))
    with caplog.at_level(logging.WARNING, logger="pdserve.kv.disk"):
        assert not f.read(key(0), out) and not f.read(key(1), out)
    assert "damaged" in caplog.text and f.damaged == 2
    assert not path.exists() and f.scan() == [key(2)]
    assert f.read(key(2), out) and bytes(out) == block(2)


def test_a_vanished_file_is_a_miss_not_a_crash(tmp_path):
    f = files(tmp_path)
    f.write(key(1), block(1))
    f._path(key(1)).unlink()
    assert not f.read(key(1), memoryview(bytearray(BLOCK)))


def test_a_scan_gives_blocks_least_recently_used_first(tmp_path):
    f = files(tmp_path)
    for i in range(4):
        f.write(key(i), block(i))
    f.read(key(1), memoryview(bytearray(BLOCK)))
    stale = f.folder / (key(9).hex() + ".kvb.123.tmp")
    stale.write_bytes(b"half a write")  # a write cut off a while ago
    os.utime(stale, (1, 1))
    live = f.folder / (key(7).hex() + ".kvb.456.tmp")
    live.write_bytes(b"another process is writing this")
    (f.folder / (key(8).hex() + ".kvb")).write_bytes(b"another layout's block")
    assert files(tmp_path).scan() == [key(0), key(2), key(3), key(1)]
    assert sorted(p.name for p in f.folder.iterdir()) == sorted([key(i).hex() + ".kvb" for i in range(4)] + [live.name])


def test_another_producer_never_reads_these_blocks(tmp_path):
    mine = fingerprint("w1", "bfloat16", [30, 2, 3, 64], 16)
    files(tmp_path, mine).write(key(1), block(1))
    for other in (fingerprint("w2", "bfloat16", [30, 2, 3, 64], 16), fingerprint("w1", "float32", [30, 2, 3, 64], 16),
                  fingerprint("w1", "bfloat16", [30, 2, 1, 64], 16), fingerprint("w1", "bfloat16", [30, 2, 3, 64], 32)):
        assert files(tmp_path, other).scan() == []
    assert files(tmp_path, mine).scan() == [key(1)]


def test_a_block_of_the_wrong_size_is_refused(tmp_path):
    with pytest.raises(ValueError, match="a block is 4096 bytes"):
        files(tmp_path).write(key(1), b"short")


def test_the_index_drops_least_recently_used_blocks_first():
    tier = DiskTier(3, [key(0), key(1)])
    assert tier.reserve(key(2)) == [] and not tier.readable(key(2)) and key(2) in tier
    tier.written(key(2), ok=True)
    tier.used(key(0))
    assert tier.reserve(key(3)) == [key(1)]  # 1 is the least recently used
    tier.written(key(3), ok=False)  # a failed write is not listed
    assert tier.saved_hashes() == [key(2), key(0)]
    tier.lost(key(2))
    assert tier.saved_hashes() == [key(0)] and tier.stats.misses == 1
    assert tier.clear() == [key(0)] and len(tier) == 0


def test_the_weights_digest_follows_content_not_name(tmp_path, monkeypatch):
    from pdserve.loader import weights_digest as wd

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    a, b = tmp_path / "a", tmp_path / "b"
    for folder in (a, b):
        folder.mkdir()
        (folder / "config.json").write_text('{"rope_theta": 10000}')
        (folder / "model.safetensors").write_bytes(b"weights" * 1000)
        (folder / "tokenizer.json").write_text("not part of it")
    assert wd.weights_digest(a) == wd.weights_digest(b)  # same content, other folder (another name)
    (b / "tokenizer.json").write_text("changed")
    assert wd.weights_digest(a) == wd.weights_digest(b)
    (b / "config.json").write_text('{"rope_theta": 500000}')  # other RoPE: other K
    assert wd.weights_digest(a) != wd.weights_digest(b)
    (a / "model.safetensors").write_bytes(b"weights" * 999 + b"WEIGHTS")
    before = wd.weights_digest(a)
    reads = []
    monkeypatch.setattr(wd, "file_digest", lambda path: reads.append(path) or "x")
    assert wd.weights_digest(a) == before and reads == []  # known files are not read again


def test_the_writer_writes_private_copies_off_the_caller_and_reports_each(tmp_path):
    from pdserve.kv.disk_writer import DiskWriter

    f = files(tmp_path)
    writer = DiskWriter(f, max_queued_bytes=2 * BLOCK)
    source = bytearray(block(1))
    writer.put(key(1), memoryview(source))
    source[:] = block(9)  # the host block is reused at once: the queued copy is what gets written
    writer.put(key(2), memoryview(bytearray(block(2))))
    assert writer.wait_idle(10)
    assert sorted(writer.results()) == sorted([(key(1), True), (key(2), True)])
    out = bytearray(BLOCK)
    assert f.read(key(1), memoryview(out)) and bytes(out) == block(1)
    assert writer.close(5) == 0


def test_a_full_queue_drops_the_write_and_says_so(tmp_path, caplog):
    import threading

    from pdserve.kv.disk_writer import DiskWriter

    f = files(tmp_path)
    gate = threading.Event()
    real_write = f.write
    f.write = lambda k, d: (gate.wait(10), real_write(k, d))  # a slow disk
    writer = DiskWriter(f, max_queued_bytes=BLOCK)  # one block queued at most
    with caplog.at_level(logging.WARNING, logger="pdserve.kv.disk"):
        writer.put(key(1), memoryview(block(1)))
        writer.put(key(2), memoryview(block(2)))
    assert writer.results() == [(key(2), False)] and writer.dropped == 1
    assert "1 more stay in memory only" in caplog.text
    gate.set()
    assert writer.close(10) == 0  # a stop finishes what was queued
    assert writer.results() == [(key(1), True)]
    assert not f.read(key(2), memoryview(bytearray(BLOCK)))
