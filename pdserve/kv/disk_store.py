"""Full KV blocks as files: the disk tier's storage, bytes in and bytes out (torch-free; the layout is the caller's).

A block lives in `ROOT/<fingerprint>/<hash>.kvb`, named by its chained block hash (which already covers the
tokens before it and the LoRA adapter: kv/block_hash.py). The fingerprint (`fingerprint()`) covers what produced
the bytes: the weights' digest, the KV dtype and layout, the block size. An instance started with other weights,
dtype or layout looks in another folder and never reads these.

A file is written whole to a temporary name and renamed (a block is visible only once complete) and carries a
checksum of its bytes: a file that is truncated, corrupt or vanished is a miss (and removed), never served.
Least recently used files go first when the store is over its size. A store opened on a folder that exists
comes back with its blocks (a warm restart): its index is rebuilt from the files, least recently used first by
modification time (each write and read stamps its file).
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import time
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger("pdserve.kv.disk")

MAGIC = b"PDKVBLK1"
_HEADER = struct.Struct("<8s32sQ")  # magic, blake2b-256 of the payload, payload length
SUFFIX = ".kvb"
_TMP = ".tmp"


def fingerprint(weights_digest: str, kv_dtype: str, layout: Iterable[int], block_size: int) -> str:
    """The folder of one producer of KV bytes. `layout`: the numbers that place a block's bytes (layers, K/V,
    KV heads, head size, ...), in the order the cache lays them."""
    text = f"weights={weights_digest};dtype={kv_dtype};layout={','.join(map(str, layout))};block={block_size}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class DiskStore:
    def __init__(self, root: Path, fingerprint: str, capacity_bytes: int, block_bytes: int) -> None:
        if block_bytes <= 0 or capacity_bytes < block_bytes + _HEADER.size:
            raise ValueError(f"a disk tier of {capacity_bytes} bytes holds no {block_bytes}-byte block")
        self.folder = Path(root) / fingerprint
        self.folder.mkdir(parents=True, exist_ok=True)
        self.block_bytes = block_bytes
        self.file_bytes = block_bytes + _HEADER.size
        self.capacity_blocks = capacity_bytes // self.file_bytes
        self._lru: OrderedDict[bytes, None] = OrderedDict()  # least recently used first
        self.corrupt = 0  # files found damaged on read (each removed)
        self._clock = 0  # the last modification time given a file (ns): strictly increasing, so order survives
        self._rebuild()

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: bytes) -> bool:
        return key in self._lru

    def keys(self) -> list[bytes]:
        """Least recently used first."""
        return list(self._lru)

    def put(self, key: bytes, data: bytes | memoryview) -> list[bytes]:
        """Store one block (replacing a copy of the same key); returns the keys evicted to make room."""
        if len(data) != self.block_bytes:
            raise ValueError(f"a block is {self.block_bytes} bytes, got {len(data)}")
        path = self._path(key)
        tmp = path.with_name(path.name + _TMP)
        with open(tmp, "wb") as f:
            f.write(_HEADER.pack(MAGIC, hashlib.blake2b(data, digest_size=32).digest(), len(data)))
            f.write(data)
        os.replace(tmp, path)
        self._touch(path)
        self._lru[key] = None
        self._lru.move_to_end(key)
        return self._evict_over(self.capacity_blocks)

    def get(self, key: bytes, out: memoryview) -> bool:
        """Read a block into `out` (block_bytes long); False (a miss) when it is absent, vanished or damaged."""
        if key not in self._lru:
            return False
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                header = f.read(_HEADER.size)
                n = f.readinto(out) if len(header) == _HEADER.size else 0
                extra = f.read(1)
        except FileNotFoundError:
            self._lru.pop(key, None)
            return False
        if not self._intact(header, out, n, extra):
            self._drop_corrupt(key, path)
            return False
        self._lru.move_to_end(key)
        self._touch(path)
        return True

    def remove(self, key: bytes) -> None:
        self._lru.pop(key, None)
        self._path(key).unlink(missing_ok=True)

    def resize(self, capacity_bytes: int) -> list[bytes]:
        self.capacity_blocks = capacity_bytes // self.file_bytes
        return self._evict_over(self.capacity_blocks)

    def _touch(self, path: Path) -> None:
        """Stamp the file as used now (the file system's own clock may give two files the same time)."""
        self._clock = max(time.time_ns(), self._clock + 1)
        os.utime(path, ns=(self._clock, self._clock))

    def _intact(self, header: bytes, payload: memoryview, n: int, extra: bytes) -> bool:
        if len(header) != _HEADER.size or n != self.block_bytes or extra:
            return False
        magic, digest, length = _HEADER.unpack(header)
        return (magic == MAGIC and length == self.block_bytes
                and hashlib.blake2b(payload, digest_size=32).digest() == digest)

    def _drop_corrupt(self, key: bytes, path: Path) -> None:
        self.corrupt += 1
        log.warning("disk KV block %s is damaged (truncated or corrupt): removed, counted as a miss", path.name)
        self.remove(key)

    def _evict_over(self, capacity: int) -> list[bytes]:
        evicted = []
        while len(self._lru) > capacity:
            key, _ = self._lru.popitem(last=False)
            self._path(key).unlink(missing_ok=True)
            evicted.append(key)
        return evicted

    def _path(self, key: bytes) -> Path:
        return self.folder / (key.hex() + SUFFIX)

    def _rebuild(self) -> None:
        """The index from the folder: whole-sized block files by age; leftovers of interrupted writes removed."""
        found = []
        for entry in os.scandir(self.folder):
            if entry.name.endswith(_TMP):
                Path(entry.path).unlink(missing_ok=True)
                continue
            if not entry.name.endswith(SUFFIX):
                continue
            stat = entry.stat()
            try:
                key = bytes.fromhex(entry.name[: -len(SUFFIX)])
            except ValueError:
                continue
            if stat.st_size != self.file_bytes:  # a block of another size cannot be this layout's
                Path(entry.path).unlink(missing_ok=True)
                continue
            found.append((stat.st_mtime_ns, key))
        self._clock = max((t for t, _ in found), default=0)
        for _, key in sorted(found):
            self._lru[key] = None
        evicted = self._evict_over(self.capacity_blocks)
        if self._lru or evicted:
            log.info("disk KV tier %s: %d blocks found (%d over the size removed)", self.folder, len(self._lru),
                     len(evicted))
