"""Full KV blocks as files: the disk tier's bytes, in and out (torch-free; the layout is the caller's).

A block lives in `ROOT/<fingerprint>/<hash>.kvb`, named by its chained block hash (which already covers the
tokens before it and the LoRA adapter: kv/block_hash.py). The fingerprint (`fingerprint()`) covers what produced
the bytes: the weights' digest, the KV dtype and layout, the block size. An instance started with other weights,
dtype or layout looks in another folder and never reads these.

A file is written whole to a temporary name and renamed (a block is visible only once complete) and carries a
checksum of its bytes: a file that is truncated, corrupt or vanished is a miss (and is removed), never served.
Which blocks to keep is the engine's index (engine/disk_tier.py); `scan()` gives it the folder's blocks, least
recently used first by the modification time each write and read stamps.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import time
from pathlib import Path

log = logging.getLogger("pdserve.kv.disk")

MAGIC = b"PDKVBLK1"
_HEADER = struct.Struct("<8s32sQ")  # magic, blake2b-256 of the payload, payload length
HEADER_BYTES = _HEADER.size
SUFFIX = ".kvb"
_TMP = ".tmp"
STALE_TMP_S = 60.0  # a temporary file this old is a write that was cut off (another live writer's is younger)


def fingerprint(weights_digest: str, kv_dtype: str, layout: tuple[int, ...] | list[int], block_size: int) -> str:
    """The folder of one producer of KV bytes. `layout`: the numbers that place a block's bytes (layers, K/V,
    KV heads, head size, ...), in the order the cache lays them."""
    text = f"weights={weights_digest};dtype={kv_dtype};layout={','.join(map(str, layout))};block={block_size}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class DiskFiles:
    """One fingerprint's folder of block files."""

    def __init__(self, folder: Path, block_bytes: int) -> None:
        if block_bytes <= 0:
            raise ValueError("a KV block has bytes")
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.block_bytes = block_bytes
        self.file_bytes = block_bytes + HEADER_BYTES
        self.damaged = 0  # files found truncated or corrupt on read (each removed)
        self._clock = 0  # the last modification time given a file (ns): strictly increasing, so order survives

    def write(self, key: bytes, data: bytes | memoryview) -> None:
        if len(data) != self.block_bytes:
            raise ValueError(f"a block is {self.block_bytes} bytes, got {len(data)}")
        path = self._path(key)
        tmp = path.with_name(f"{path.name}.{os.getpid()}{_TMP}")  # instances sharing a folder write their own
        with open(tmp, "wb") as f:
            f.write(_HEADER.pack(MAGIC, hashlib.blake2b(data, digest_size=32).digest(), len(data)))
            f.write(data)
        os.replace(tmp, path)
        self._touch(path)

    def read(self, key: bytes, out: memoryview) -> bool:
        """The block into `out` (block_bytes long); False (a miss) when the file is absent, vanished or damaged."""
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                header = f.read(HEADER_BYTES)
                n = f.readinto(out) if len(header) == HEADER_BYTES else 0
                extra = f.read(1)
        except FileNotFoundError:
            return False
        if not self._intact(header, out, n, extra):
            self.damaged += 1
            log.warning("disk KV block %s is damaged (truncated or corrupt): removed, a miss", path.name)
            self.remove(key)
            return False
        self._touch(path)
        return True

    def remove(self, key: bytes) -> None:
        self._path(key).unlink(missing_ok=True)

    def scan(self) -> list[bytes]:
        """The folder's whole-sized block files, least recently used first; files of another size and leftovers
        of writes cut off over a minute ago are removed (instances sharing the folder write their own
        temporaries)."""
        found = []
        for entry in os.scandir(self.folder):
            if entry.name.endswith(_TMP):
                if time.time() - entry.stat().st_mtime > STALE_TMP_S:
                    Path(entry.path).unlink(missing_ok=True)
                continue
            if not entry.name.endswith(SUFFIX):
                continue
            try:
                key = bytes.fromhex(entry.name[: -len(SUFFIX)])
            except ValueError:
                continue
            stat = entry.stat()
            if stat.st_size != self.file_bytes:
                Path(entry.path).unlink(missing_ok=True)
                continue
            found.append((stat.st_mtime_ns, key))
        self._clock = max((t for t, _ in found), default=self._clock)
        return [key for _, key in sorted(found)]

    def _touch(self, path: Path) -> None:
        """Stamp the file as used now (the file system's own clock may give two files the same time)."""
        self._clock = max(time.time_ns(), self._clock + 1)
        os.utime(path, ns=(self._clock, self._clock))

    def _intact(self, header: bytes, payload: memoryview, n: int, extra: bytes) -> bool:
        if len(header) != HEADER_BYTES or n != self.block_bytes or extra:
            return False
        magic, digest, length = _HEADER.unpack(header)
        return (magic == MAGIC and length == self.block_bytes
                and hashlib.blake2b(payload, digest_size=32).digest() == digest)

    def _path(self, key: bytes) -> Path:
        return self.folder / (key.hex() + SUFFIX)
