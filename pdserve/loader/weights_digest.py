"""A digest of what a model folder computes KV with: its config.json and every weight file (for a converted GGUF,
the file's digest), by content.

The disk KV tier keys its folder by it (kv/disk_store.py), so KV written under one set of weights is never read
under another, whatever the model is called. Hashing gigabytes on every start would cost seconds, so each file's
digest is kept in the pdserve cache, keyed by the file's path, size and modification time.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from pdserve.loader.gguf_convert import cache_root, file_digest

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
NAMED_FILES = ("config.json", "gguf-source.json")  # a GGUF's folder: the file's own digest (its weights stay there)


def weights_digest(folder: Path) -> str:
    if (Path(folder) / "gguf-source.json").is_file():  # the file's digest stands for its weights (dequantized or not)
        files = [Path(folder) / name for name in NAMED_FILES]
    else:
        files = sorted(p for p in Path(folder).iterdir() if p.name in NAMED_FILES or p.suffix in WEIGHT_SUFFIXES)
    if not files:
        raise FileNotFoundError(f"{folder} has no config.json or weight files to digest")
    h = hashlib.sha256()
    for path in files:
        h.update(f"{path.name}={_cached_file_digest(path)};".encode())
    return h.hexdigest()[:32]


def _cached_file_digest(path: Path) -> str:
    stat = path.stat()
    identity = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    record = cache_root() / "digests" / (hashlib.sha256(identity.encode()).hexdigest()[:32] + ".json")
    try:
        return json.loads(record.read_text())["sha256"]
    except (OSError, ValueError, KeyError):
        pass
    digest = file_digest(path)
    record.parent.mkdir(parents=True, exist_ok=True)
    tmp = record.with_name(f"{record.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"file": identity, "sha256": digest}))
    os.replace(tmp, record)
    return digest
