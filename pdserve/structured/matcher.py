"""The worker's grammar state: one llguidance matcher per constrained sequence, and the token masks
the sampler applies.

A spec is compiled once into a template matcher (kept, least recently used first out); a sequence
gets a copy. A sequence that starts with output tokens (a decode instance continues from the prefill
instance's first token; a resumed request from what it had sent) has its matcher advanced over them.
Masks are filled on a side thread while the forward pass runs (llguidance drops the GIL), after the
matcher consumed the tokens sampled since its last mask, so neither costs the step's critical path.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from pdserve.structured.spec import StructuredOutput, grammar_of

log = logging.getLogger("pdserve.structured")


class SequenceGrammar:
    """One sequence's matcher. Sampled tokens are queued by `advance` and consumed on the mask thread
    just before the next mask is computed (`catch_up`), so neither costs the step's critical path."""

    def __init__(self, matcher: object) -> None:
        self.matcher = matcher
        self.pending: list[int] = []
        self.failed = False

    def advance(self, token_id: int) -> None:
        self.pending.append(token_id)

    def catch_up(self) -> None:
        tokens, self.pending = self.pending, []
        for token_id in tokens:
            if self.failed or self.matcher.is_stopped():  # stopped: the grammar is complete (EOS follows)
                return
            if not self.matcher.consume_token(token_id):
                self.failed = True
                log.warning("token %d does not fit the grammar (%s); the rest of this answer is unconstrained",
                            token_id, self.matcher.get_error())

    @property
    def active(self) -> bool:
        """Still masking: a complete grammar's mask allows only EOS."""
        return not self.failed


class GrammarCompiler:
    """Builds matchers for one tokenizer (the model's tokenizer.json), and fills batches of masks."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, cache_size: int = 64) -> None:
        self.tokenizer_json, self.vocab_size = tokenizer_json, vocab_size
        self.words = (vocab_size + 31) // 32
        self._tokenizer: object | None = None
        self._eos: tuple[int, ...] = ()
        self._templates: OrderedDict[StructuredOutput, object] = OrderedDict()
        self._cache_size = cache_size
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")

    def _tokenizer_for(self, eos_token_ids: Sequence[int]) -> object:
        from llguidance import LLTokenizer

        eos = tuple(eos_token_ids)
        if self._tokenizer is None or eos != self._eos:  # ~0.3 s: once per worker in practice
            self._tokenizer = LLTokenizer(self.tokenizer_json.read_text(), n_vocab=self.vocab_size,
                                          eos_token=list(eos) or None)
            self._eos = eos
            self._templates.clear()
        return self._tokenizer

    def sequence(self, spec: StructuredOutput, eos_token_ids: Sequence[int],
                 output_token_ids: Sequence[int] = ()) -> SequenceGrammar:
        from llguidance import LLMatcher

        tokenizer = self._tokenizer_for(eos_token_ids)
        template = self._templates.get(spec)
        if template is None:
            template = LLMatcher(tokenizer, grammar_of(spec), log_level=0)
            if template.is_error():
                raise ValueError(f"the grammar does not compile: {template.get_error()}")
            self._templates[spec] = template
            if len(self._templates) > self._cache_size:
                self._templates.popitem(last=False)
        else:
            self._templates.move_to_end(spec)
        seq = SequenceGrammar(template.deep_copy())
        for token in output_token_ids:
            seq.advance(token)
        return seq

    def fill_async(self, grammars: list[SequenceGrammar | None]) -> Future[torch.Tensor | None]:
        """Start filling the masks of `grammars` (one row each; None rows allow everything)."""
        return self._pool.submit(self._fill, grammars)

    def _fill(self, grammars: list[SequenceGrammar | None]) -> torch.Tensor | None:
        # Straight into the tensor's memory: llguidance.torch's helper would import torch.compile (~3.5 s).
        for g in grammars:
            if g is not None:
                g.catch_up()
        rows = [(i, g) for i, g in enumerate(grammars) if g is not None and g.active]
        if not rows:
            return None
        bits = torch.full((len(grammars), self.words), -1, dtype=torch.int32)
        row_bytes = self.words * 4
        for i, g in rows:
            g.matcher.unsafe_compute_mask_ptr(bits.data_ptr() + i * row_bytes, row_bytes)
        return bits

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def allowed_tokens(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, words] int32 bit masks -> [N, vocab] bool (bit j of word w allows token 32 w + j)."""
    as_bytes = bits.numpy().view(np.uint8)
    return torch.from_numpy(np.unpackbits(as_bytes, axis=1, bitorder="little")[:, :vocab].astype(bool))
