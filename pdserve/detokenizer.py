"""Token ids -> text as they arrive, with stop strings that never leak into the output."""

from __future__ import annotations

from pdserve.sampling import SamplingParams
from pdserve.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special = params.skip_special_tokens
        self.stops = [s for s in (params.stop or []) if s]
        self.token_ids: list[int] = []
        self.text = ""  # settled text: safe to show, never part of a stop string
        self.stopped = False  # a stop string was found; `text` ends right before it
        self._emitted = 0

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the newly settled text (held back while it may start a stop string)."""
        if self.stopped:
            return ""
        self.token_ids.extend(token_ids)
        full = self.tokenizer.decode(self.token_ids, skip_special_tokens=self.skip_special)
        if full.endswith("\ufffd"):  # a multi-byte character is not complete yet
            full = full.rstrip("\ufffd")
        hold = 0
        if self.stops:
            search_from = max(self._emitted - max(map(len, self.stops)) + 1, 0)
            hits = [i for s in self.stops if (i := full.find(s, search_from)) != -1]
            if hits:
                full = full[:min(hits)]
                self.stopped = True
            else:
                hold = max(len(s) - 1 for s in self.stops)
        settled = full[:max(len(full) - hold, self._emitted)] if hold else full
        delta = settled[self._emitted:]
        self.text = settled
        self._emitted = len(settled)
        return delta

    def finish(self) -> str:
        """At the end of generation the held-back tail is settled too."""
        if self.stopped:
            return ""
        full = self.tokenizer.decode(self.token_ids, skip_special_tokens=self.skip_special)
        delta = full[self._emitted:]
        self.text = full
        self._emitted = len(full)
        return delta
