"""The prompt tokens this server's engine will compute for a request: its whole prompt but the leading full
blocks it will find in the prefix cache.

What the cache holds is read from what this server handed its engine lately (an LRU of block hashes as large as
the cache; it sees no eviction, as a router without KV events does): a prompt that a request ahead of it is
still computing counts as cached too, since by the time this one is scheduled it is. Admission judges the time to
first token from these tokens, and the load this server reports counts them, so a burst on one prefix is
predicted as one prefix and many tails, not as many whole prompts.
"""

from __future__ import annotations

from pdserve.balancing.prefix_index import PrefixIndex
from pdserve.config.lora import lora_hash_root
from pdserve.kv.block_hash import chained_hashes

_SELF = ""  # the one target in the index: this server's engine


class PromptWork:
    def __init__(self, block_size: int, num_blocks: int, prefix_caching: bool = True) -> None:
        self.block_size, self.prefix_caching = block_size, prefix_caching
        self._recent = PrefixIndex(num_blocks)

    def tokens(self, prompt_ids: list[int], lora: str | None = None) -> int:
        """The prompt tokens it will compute (at least one: the last token's logits give the first new one)."""
        return self._tokens(prompt_ids, self._lookup_hashes(prompt_ids, lora))

    def handed_over(self, prompt_ids: list[int], lora: str | None = None) -> int:
        """The engine has the prompt: its full blocks will be cached. The prompt tokens it computes (as tokens())."""
        hashes = self._lookup_hashes(prompt_ids, lora)
        todo = self._tokens(prompt_ids, hashes)
        self._recent.remember(_SELF, hashes)
        return todo

    def _tokens(self, prompt_ids: list[int], hashes: list[bytes]) -> int:
        return len(prompt_ids) - self._recent.matched(_SELF, hashes) * self.block_size

    def _lookup_hashes(self, prompt_ids: list[int], lora: str | None) -> list[bytes]:
        """The engine's chained hashes of the full blocks a lookup may take: all but one that ends with the last
        token (kv_cache_manager.find_cached_prefix); none without prefix caching."""
        if not self.prefix_caching:
            return []
        return chained_hashes(prompt_ids[:len(prompt_ids) - 1], self.block_size, lora_hash_root(lora))
