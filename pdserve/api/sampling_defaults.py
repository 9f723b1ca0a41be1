"""Default sampling from the model's `generation_config.json`, as vLLM's `--generation-config auto`.

A request that leaves temperature, top_p, top_k, min_p or repetition_penalty out gets the model
author's value where the model folder has one, and OpenAI's default otherwise (temperature 1, no
top-p/top-k/min-p cut, no repetition penalty). `--generation-config none` ignores the file; a folder
path reads that folder's file instead.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("pdserve.serve")

FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def load_sampling_defaults(mode: str, model_folder: Path) -> dict[str, Any]:
    if mode in ("none", "vllm"):
        return {}
    folder = model_folder if mode == "auto" else Path(mode)
    path = folder / "generation_config.json"
    if mode != "auto" and not path.is_file():
        raise ValueError(f"--generation-config {mode}: no generation_config.json there")
    try:
        config = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not readable JSON ({e})") from None
    defaults = {k: config[k] for k in FIELDS if isinstance(config.get(k), int | float)
                and not isinstance(config.get(k), bool)}
    if not config.get("do_sample", True):  # the author asked for greedy decoding
        defaults["temperature"] = 0.0
    if defaults:
        log.info("default sampling from %s: %s (a request's own values win)", path, defaults)
    return defaults
