"""The worker's grammar state: one llguidance matcher per constrained sequence, and the token masks
the sampler applies.

All grammar work runs on one side thread while the forward pass runs (llguidance drops the GIL):
compiling a new request's spec, consuming the tokens sampled since a sequence's last mask, filling
the masks. The step's critical path only unpacks the finished masks. A spec is compiled once into a
template matcher (kept, least recently used first out); a sequence gets a copy. A sequence that
starts with output tokens (a decode instance continues from the prefill instance's first token; a
resumed request from what it had sent) has its matcher advanced over them first. JSON and tool-call
sequences also carry a JsonGuard (number bounds, distinct calls), whose mask is ANDed into the grammar's.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from pdserve.structured.json_guard import JsonGuard, TokenTexts
from pdserve.structured.spec import StructuredOutput, grammar_of, grammar_tokenizer, is_parallel

log = logging.getLogger("pdserve.structured")


class SequenceGrammar:
    """One sequence's grammar: built on the mask thread at its first mask, then advanced there by the
    tokens `advance` queued. `error` is set when the spec does not compile or a token does not fit."""

    def __init__(self, spec: StructuredOutput, eos_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> None:
        self.spec, self.eos_token_ids = spec, tuple(eos_token_ids)
        self.matcher: object | None = None
        self.guard: JsonGuard | None = None
        self.pending: list[int] = list(output_token_ids)
        self.error: str | None = None

    def advance(self, token_id: int) -> None:
        self.pending.append(token_id)

    def catch_up(self, compiler: GrammarCompiler) -> None:
        if self.error is not None:
            return
        if self.matcher is None:
            try:
                self.matcher = compiler.matcher(self.spec, self.eos_token_ids)
            except ValueError as e:
                self.error = f"the output constraint does not compile: {e}"
                return
            self.guard = compiler.guard(self.spec)
        tokens, self.pending = self.pending, []
        for token_id in tokens:
            if self.matcher.is_stopped():  # the grammar is complete: only EOS follows
                return
            if not self.matcher.consume_token(token_id):
                self.error = f"token {token_id} does not fit the output constraint ({self.matcher.get_error()})"
                return
            if self.guard is not None:
                self.guard.consume(token_id)


class GrammarCompiler:
    """Builds matchers for one tokenizer (the model's tokenizer.json), and fills batches of masks."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, cache_size: int = 64) -> None:
        self.tokenizer_json, self.vocab_size = tokenizer_json, vocab_size
        self.words = (vocab_size + 31) // 32
        self._templates: OrderedDict[tuple[StructuredOutput, tuple[int, ...]], object] = OrderedDict()
        self._cache_size = cache_size
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        self._texts: TokenTexts | None = None

    def matcher(self, spec: StructuredOutput, eos_token_ids: tuple[int, ...]) -> object:
        """A fresh matcher for `spec` (a copy of the cached template); ValueError if it does not compile."""
        from llguidance import LLMatcher

        key = (spec, eos_token_ids)
        template = self._templates.get(key)
        if template is None:
            tokenizer = grammar_tokenizer(self.tokenizer_json, self.vocab_size, eos_token_ids)
            template = LLMatcher(tokenizer, grammar_of(spec), log_level=0)
            if template.is_error():
                raise ValueError(template.get_error())
            self._templates[key] = template
            if len(self._templates) > self._cache_size:
                self._templates.popitem(last=False)
        else:
            self._templates.move_to_end(key)
        return template.deep_copy()

    def guard(self, spec: StructuredOutput) -> JsonGuard | None:
        """The bounds llguidance cannot express, for the JSON kinds and tool calls (None for the others)."""
        if spec.kind not in ("json", "json_object", "tool_calls"):
            return None
        if self._texts is None:
            self._texts = TokenTexts.of(grammar_tokenizer(self.tokenizer_json, self.vocab_size), self.vocab_size)
        if spec.kind == "tool_calls":
            return JsonGuard(self._texts, calls_only=True, distinct_calls=is_parallel(spec))
        return JsonGuard(self._texts)

    def fill_async(self, grammars: list[SequenceGrammar | None],
                   drafts: list[list[int]] | None = None) -> Future[torch.Tensor | None]:
        """Start filling the masks of `grammars` (None rows allow everything): one row each, or with
        speculative `drafts` 1 + len(drafts[i]) rows for sequence i, row j being the mask after its
        first j proposals (the matcher goes back to where it was after)."""
        return self._pool.submit(self._fill, grammars, drafts or [[] for _ in grammars])

    def _fill(self, grammars: list[SequenceGrammar | None], drafts: list[list[int]]) -> torch.Tensor | None:
        # Straight into the tensor's memory: llguidance.torch's helper would import torch.compile (~3.5 s).
        for g in grammars:
            if g is not None:
                g.catch_up(self)
        if not any(g is not None and g.error is None for g in grammars):
            return None
        bits = torch.full((sum(1 + len(d) for d in drafts), self.words), -1, dtype=torch.int32)
        rows, row = bits.numpy(), 0
        for g, proposed in zip(grammars, drafts, strict=True):
            if g is not None and g.error is None:
                self._fill_positions(g, proposed, rows[row:row + 1 + len(proposed)])
            row += 1 + len(proposed)
        return bits

    @staticmethod
    def _fill_positions(g: SequenceGrammar, proposed: list[int], rows: np.ndarray) -> None:
        """The mask now, then after each proposal the grammar accepts (rows after a refused one stay
        all-allowed: the verifier stops at the refused proposal, which its mask rules out)."""
        matcher, row_bytes = g.matcher, rows.shape[1] * 4
        matcher.unsafe_compute_mask_ptr(rows[0].ctypes.data, row_bytes)
        _apply_guard(g.guard, matcher, rows[0])
        valid = proposed[:matcher.validate_tokens(proposed)] if proposed else []  # a refused token would break it
        guard = g.guard.copy() if g.guard is not None and valid else None
        for consumed, token in enumerate(valid, 1):
            matcher.consume_token(token)
            matcher.unsafe_compute_mask_ptr(rows[consumed].ctypes.data, row_bytes)
            if guard is not None:
                guard.consume(token)
                _apply_guard(guard, matcher, rows[consumed])
        if valid:
            matcher.rollback(len(valid))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _apply_guard(guard: JsonGuard | None, matcher: object, row: np.ndarray) -> None:
    """AND the guard's mask into the grammar's row, unless together they would allow nothing."""
    words = guard.mask(matcher) if guard is not None else None
    if words is not None:
        both = row & words
        if both.any():
            row[:] = both


def allowed_tokens(bits: torch.Tensor, vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[N, words] int32 bit masks -> [N, vocab] bool on `device` (bit j of word w allows token 32 w + j).
    On a GPU the words travel (1/32 of the bools) and are unpacked there."""
    if torch.device(device).type == "cpu":
        as_bytes = bits.numpy().view(np.uint8)
        return torch.from_numpy(np.unpackbits(as_bytes, axis=1, bitorder="little")[:, :vocab].astype(bool))
    return unpack_on_device(bits.to(device, non_blocking=True), vocab)


def unpack_on_device(words: torch.Tensor, vocab: int) -> torch.Tensor:
    shifts = torch.arange(32, device=words.device, dtype=torch.int32)
    return ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]
