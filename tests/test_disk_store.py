"""The disk tier's storage: blocks come back byte for byte, damaged or vanished files are misses (never served),
least recently used files go first, a store reopened on its folder has its blocks in their order, and another
producer's fingerprint never sees them."""

from __future__ import annotations

import hashlib
import logging

import pytest
import torch

from pdserve.kv.disk_store import DiskStore, fingerprint

BLOCK = 4096


def key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def block(i: int) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(BLOCK))


def store(tmp_path, blocks: int = 8, fp: str = "fp") -> DiskStore:
    return DiskStore(tmp_path, fp, blocks * (BLOCK + 64), BLOCK)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_bytes_come_back_equal(tmp_path, dtype):
    kv = torch.randn(2, 16, 3, 64).to(dtype)  # one layer of a block: K/V, tokens, KV heads, head size
    raw = kv.contiguous().view(torch.uint8).numpy().tobytes()
    s = DiskStore(tmp_path, "fp", 10 * len(raw), len(raw))
    s.put(key(1), raw)
    out = bytearray(len(raw))
    assert s.get(key(1), memoryview(out))
    assert torch.equal(torch.frombuffer(out, dtype=torch.uint8).view(dtype).view(kv.shape), kv)


def test_a_corrupt_or_truncated_file_is_a_miss_and_is_removed(tmp_path, caplog):
    s = store(tmp_path)
    for i in range(3):
        s.put(key(i), block(i))
    path = s._path(key(0))
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # one flipped byte of the payload
    path.write_bytes(bytes(data))
    s._path(key(1)).write_bytes(s._path(key(1)).read_bytes()[:-10])  # a write cut short
    out = memoryview(bytearray(BLOCK))
    with caplog.at_level(logging.WARNING, logger="pdserve.kv.disk"):
        assert not s.get(key(0), out) and not s.get(key(1), out)
    assert "damaged" in caplog.text and s.corrupt == 2
    assert key(0) not in s and not path.exists()
    assert s.get(key(2), out) and bytes(out) == block(2)


def test_a_vanished_file_is_a_miss_not_a_crash(tmp_path):
    s = store(tmp_path)
    s.put(key(1), block(1))
    s._path(key(1)).unlink()
    assert not s.get(key(1), memoryview(bytearray(BLOCK)))
    assert key(1) not in s


def test_least_recently_used_go_first(tmp_path):
    s = store(tmp_path, blocks=3)
    for i in range(3):
        assert s.put(key(i), block(i)) == []
    assert s.get(key(0), memoryview(bytearray(BLOCK)))  # 0 is now the most recent
    assert s.put(key(3), block(3)) == [key(1)]
    assert s.keys() == [key(2), key(0), key(3)]
    assert len(list(s.folder.iterdir())) == 3


def test_reopened_store_has_its_blocks_in_their_order(tmp_path):
    s = store(tmp_path, blocks=4)
    for i in range(4):
        s.put(key(i), block(i))
    s.get(key(1), memoryview(bytearray(BLOCK)))
    (s.folder / (key(9).hex() + ".kvb.tmp")).write_bytes(b"half a write")  # an interrupted write
    again = store(tmp_path, blocks=4)
    assert again.keys() == [key(0), key(2), key(3), key(1)]
    out = memoryview(bytearray(BLOCK))
    assert again.get(key(3), out) and bytes(out) == block(3)
    assert not any(p.name.endswith(".tmp") for p in again.folder.iterdir())
    smaller = store(tmp_path, blocks=2)  # reopened with less room: the oldest go
    assert smaller.keys() == [key(1), key(3)]


def test_another_producer_never_reads_these_blocks(tmp_path):
    store(tmp_path, fp=fingerprint("w1", "bfloat16", [30, 2, 3, 64], 16)).put(key(1), block(1))
    for other in (fingerprint("w2", "bfloat16", [30, 2, 3, 64], 16), fingerprint("w1", "float32", [30, 2, 3, 64], 16),
                  fingerprint("w1", "bfloat16", [30, 2, 1, 64], 16), fingerprint("w1", "bfloat16", [30, 2, 3, 64], 32)):
        assert key(1) not in store(tmp_path, fp=other)
    assert key(1) in store(tmp_path, fp=fingerprint("w1", "bfloat16", [30, 2, 3, 64], 16))


def test_a_block_of_the_wrong_size_is_refused(tmp_path):
    with pytest.raises(ValueError, match="a block is 4096 bytes"):
        store(tmp_path).put(key(1), b"short")
    with pytest.raises(ValueError, match="holds no"):
        DiskStore(tmp_path, "fp", 100, BLOCK)


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
