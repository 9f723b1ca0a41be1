"""N-gram (prompt lookup) proposals, vLLM's rule: find the longest n-gram (prompt_lookup_min ..
prompt_lookup_max tokens) that ends the sequence and occurred earlier in it (the earliest occurrence
among the longest), and propose the tokens that followed it, up to num_speculative_tokens.

Pure Python on the engine's token lists: the search uses list.index (C speed) over the sequence's
occurrences of its last token, so a 2,000-token context costs tens of microseconds.
"""

from __future__ import annotations

from pdserve.config.speculative import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, tokens: list[int], limit: int | None = None) -> list[int]:
        """Up to min(k, limit) tokens to try after `tokens`; [] when no n-gram matches."""
        k = self.k if limit is None else min(self.k, limit)
        total = len(tokens)
        if k <= 0 or total <= self.min_n:
            return []
        end = longest_match_end(tokens, self.min_n, self.max_n)
        if end is None:
            return []
        return tokens[end + 1:end + 1 + k]


def longest_match_end(tokens: list[int], min_n: int, max_n: int) -> int | None:
    """The index where the earliest of the longest earlier occurrences of the sequence's suffix ends."""
    total = len(tokens)
    last = tokens[-1]
    best_len, best_end = 0, None
    j = -1
    while True:
        try:
            j = tokens.index(last, j + 1, total - 1)
        except ValueError:
            break
        n = 1
        while n < max_n and n <= j and tokens[j - n] == tokens[total - 1 - n]:
            n += 1
        if n > best_len:
            best_len, best_end = n, j
            if n == max_n:
                break
    return best_end if best_len >= min_n else None
