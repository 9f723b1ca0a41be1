"""Per-request sampling settings, shaped like vLLM's SamplingParams."""

import msgspec

from pdserve.structured.spec import StructuredOutput

MAX_LOGPROBS = 20


def _require(ok: bool, field: str, allowed: str, value: object) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{field} must be {allowed}, got {value!r}")


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to pick tokens for one request and when to stop it.

    top_k 0 or -1 disables top-k. logprobs None returns no logprobs, 0 only the chosen
    token's, k the chosen token's plus the top k; prompt_logprobs the same for every prompt
    token after the first (the request then computes its whole prompt: no prefix-cache hit).
    Stop strings are matched by the detokenizer; stop_token_ids and EOS by `check_stop`.
    logit_bias adds to the raw logits (OpenAI's -100..100); allowed_token_ids keeps only those
    tokens; structured constrains the output to a grammar (pdserve/structured).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    structured: StructuredOutput | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _require(self.n >= 1, "n", ">= 1", self.n)
        _require(self.temperature >= 0, "temperature", ">= 0", self.temperature)
        _require(0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        _require(self.top_k >= -1, "top_k", ">= -1 (0 or -1 disables it)", self.top_k)
        _require(0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        _require(self.repetition_penalty > 0, "repetition_penalty", "> 0", self.repetition_penalty)
        _require(-2 <= self.presence_penalty <= 2, "presence_penalty", "in [-2, 2]", self.presence_penalty)
        _require(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "in [-2, 2]", self.frequency_penalty)
        _require(
            self.max_tokens is None or self.max_tokens >= 1, "max_tokens", ">= 1 or None", self.max_tokens
        )
        span = ">= 0" if self.max_tokens is None else f"in [0, max_tokens={self.max_tokens}]"
        _require(
            0 <= self.min_tokens and (self.max_tokens is None or self.min_tokens <= self.max_tokens),
            "min_tokens",
            span,
            self.min_tokens,
        )
        _require(
            self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
            "logprobs",
            f"None or in [0, {MAX_LOGPROBS}]",
            self.logprobs,
        )
        _require(
            self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
            "prompt_logprobs",
            f"None or in [0, {MAX_LOGPROBS}]",
            self.prompt_logprobs,
        )
        _require(
            self.logit_bias is None or all(-100 <= v <= 100 for v in self.logit_bias.values()),
            "logit_bias", "a map of token id to a bias in [-100, 100]", self.logit_bias,
        )
        _require(self.allowed_token_ids is None or len(self.allowed_token_ids) > 0, "allowed_token_ids",
                 "None or a non-empty list", self.allowed_token_ids)

    def check_vocab(self, vocab_size: int) -> None:
        """ValueError when a token id named by these params is outside the vocabulary."""
        for name, ids in (("logit_bias", self.logit_bias or ()), ("allowed_token_ids", self.allowed_token_ids or ()),
                          ("stop_token_ids", self.stop_token_ids or ())):
            bad = [t for t in ids if not 0 <= int(t) < vocab_size]
            if bad:
                raise ValueError(f"{name} names token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
