"""Token ids -> text as they arrive, with stop strings that never leak into the output."""

from __future__ import annotations

from pdserve.sampling import SamplingParams
from pdserve.tokenization.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special = params.skip_special_tokens
        self.stops = [s for s in (params.stop or []) if s]
        self.token_ids: list[int] = []
        self.text = ""  # settled text: safe to show, never part of a stop string
        self.stopped = False  # a stop string was found; `text` ends right before it
        self._emitted = 0
        self.num_used = 0  # of the tokens the last add() got, how many the answer keeps (a stop ends it)
        # Decoding only a window keeps each step O(new tokens), not O(all tokens) (as vLLM does):
        # _decoded is the text of token_ids[:_read]; _prefix starts the window that re-decodes context.
        self._decoded = ""
        self._prefix = 0
        self._read = 0

    def _tail(self) -> tuple[str, bool]:
        """Text of the tokens after _read, and whether it ends inside an unfinished UTF-8 character."""
        decode = self.tokenizer.decode
        prefix_text = decode(self.token_ids[self._prefix:self._read], skip_special_tokens=self.skip_special)
        new_text = decode(self.token_ids[self._prefix:], skip_special_tokens=self.skip_special)
        return new_text[len(prefix_text):], new_text.endswith("\ufffd")

    def _full_text(self) -> str:
        tail, incomplete = self._tail()
        if tail and not incomplete:
            self._decoded += tail
            self._prefix, self._read = self._read, len(self.token_ids)
        return self._decoded

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the newly settled text (held back while it may start a stop string).

        Several tokens at once (speculative decoding accepts a few per step) go in one at a time when
        there are stop strings, so that the answer ends with the token that completed one, as it does
        when tokens come singly; `num_used` says how many were kept."""
        if self.stopped:
            self.num_used = 0
            return ""
        if len(token_ids) > 1 and self.stops:
            deltas = []
            for token in token_ids:
                deltas.append(self._add([token]))
                if self.stopped:
                    break
            self.num_used = len(deltas)
            return "".join(deltas)
        self.num_used = len(token_ids)
        return self._add(token_ids)

    def _add(self, token_ids: list[int]) -> str:
        self.token_ids.extend(token_ids)
        full = self._full_text()  # without a multi-byte character that is not complete yet
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
        full = self._decoded + self._tail()[0]
        delta = full[self._emitted:]
        self.text = full
        self._emitted = len(full)
        return delta
