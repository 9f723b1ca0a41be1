"""Batched next-token sampling: logit bias, allowed tokens, grammar masks, min_tokens, penalties,
greedy / temperature / top-k / top-p / min-p."""

from dataclasses import dataclass, field
from typing import Any

import torch

from pdserve.sampling.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """One sequence's inputs for one sampling step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: tuple[int, ...] = ()
    # Created once per request (see make_generator) and reused every step.
    generator: torch.Generator | None = None
    grammar: Any = None  # structured.matcher.SequenceGrammar of a constrained request
    bias: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)  # logit_bias ids, values
    allowed: torch.Tensor | None = field(default=None, repr=False)  # allowed_token_ids
    prompt_scored: int = 0  # prompt_logprobs: positions 0 .. prompt_scored - 1 have scored their next token

    def __post_init__(self) -> None:
        p = self.params
        if p.logit_bias and self.bias is None:
            ids = torch.tensor([int(t) for t in p.logit_bias], dtype=torch.long)
            self.bias = ids, torch.tensor(list(p.logit_bias.values()), dtype=torch.float32)
        if p.allowed_token_ids and self.allowed is None:
            self.allowed = torch.tensor(sorted(set(p.allowed_token_ids)), dtype=torch.long)

    @property
    def constrained(self) -> bool:
        return self.bias is not None or self.allowed is not None


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [N] long
    # log_softmax of the raw logits at the chosen token; None when no row asked for logprobs.
    logprobs: torch.Tensor | None = None  # [N] float
    # K = max logprobs requested in the batch; None when K == 0.
    top_token_ids: torch.Tensor | None = None  # [N, K] long
    top_logprobs: torch.Tensor | None = None  # [N, K] float


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """Per-request generator for a seeded request; None when the request has no seed."""
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


class Sampler:
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow],
                 grammar_mask: torch.Tensor | None = None) -> SamplerOutput:
        """`grammar_mask` [N, V] bool (True: allowed), for the rows of constrained requests."""
        n, vocab = logits.shape
        if len(rows) != n:
            raise ValueError(f"got {n} logits rows but {len(rows)} sampling rows")
        params = [r.params for r in rows]
        want_logprobs = any(p.logprobs is not None for p in params)
        blocked = _min_tokens_blocked(rows, vocab)
        penalised = any(_has_penalty(p) for p in params)
        constrained = grammar_mask is not None or any(r.constrained for r in rows)
        if (not want_logprobs and not blocked and not penalised and not constrained
                and all(p.greedy for p in params)):
            return SamplerOutput(token_ids=logits.argmax(dim=-1))

        device = logits.device
        raw_logprobs = torch.log_softmax(logits.float(), dim=-1) if want_logprobs else None
        x = logits.to(torch.float32, copy=True)
        if constrained:
            _apply_constraints(x, rows, grammar_mask)
        if blocked:
            _ban_until_min_tokens(x, blocked)
        if penalised:
            _apply_penalties(x, rows)

        token_ids = x.argmax(dim=-1)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:
            idx = torch.tensor(sampled, device=device)
            token_ids[idx] = _sample(x[idx], [rows[i] for i in sampled])

        out = SamplerOutput(token_ids=token_ids)
        if raw_logprobs is not None:
            out.logprobs = raw_logprobs.gather(1, token_ids[:, None]).squeeze(1)
            k = max(p.logprobs or 0 for p in params)
            if k > 0:
                out.top_logprobs, out.top_token_ids = raw_logprobs.topk(k, dim=-1)
        return out


def _apply_constraints(x: torch.Tensor, rows: list[SamplingRow], grammar_mask: torch.Tensor | None) -> None:
    """In place: logit_bias added, tokens outside allowed_token_ids or the grammar set to -inf."""
    device = x.device
    for i, r in enumerate(rows):
        if r.bias is not None:
            ids, values = r.bias
            x[i].index_add_(0, ids.to(device), values.to(device))
        if r.allowed is not None:
            keep = x[i].index_select(0, r.allowed.to(device))
            x[i].fill_(-torch.inf).index_copy_(0, r.allowed.to(device), keep)
    if grammar_mask is not None:
        x.masked_fill_(~grammar_mask.to(device), -torch.inf)


def _ban_until_min_tokens(x: torch.Tensor, blocked: list[tuple[int, int]]) -> None:
    """Ban EOS / stop tokens of rows short of min_tokens, except where nothing else is allowed (a
    complete grammar allows only EOS: the grammar wins, the answer ends)."""
    device = x.device
    row_idx, tok_idx = (torch.tensor(v, device=device) for v in zip(*blocked, strict=True))
    saved = x[row_idx, tok_idx].clone()
    x[row_idx, tok_idx] = -torch.inf
    dead = torch.isneginf(x).all(dim=-1)
    if dead.any():
        back = dead[row_idx]
        x[row_idx[back], tok_idx[back]] = saved[back]


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _min_tokens_blocked(rows: list[SamplingRow], vocab: int) -> list[tuple[int, int]]:
    """(row, token) pairs to mask while a row is still short of min_tokens."""
    pairs: list[tuple[int, int]] = []
    for i, r in enumerate(rows):
        p = r.params
        if len(r.output_token_ids) >= p.min_tokens:
            continue
        banned = set(p.stop_token_ids or ())
        if not p.ignore_eos:
            banned.update(r.eos_token_ids)
        pairs.extend((i, t) for t in banned if 0 <= t < vocab)
    return pairs


def _token_counts(seqs: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(seqs), vocab] occurrence counts, built with one scatter_add over a padded id matrix."""
    width = max((len(s) for s in seqs), default=0)
    ids = torch.full((len(seqs), width), vocab, dtype=torch.long)  # pad id = vocab, dropped below
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    ids = ids.to(device)
    counts = torch.zeros(len(seqs), vocab + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab]


def _apply_penalties(x: torch.Tensor, rows: list[SamplingRow]) -> None:
    """In place on x [N, V]; only rows that use a penalty are touched."""
    vocab, device = x.shape[1], x.device
    rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if rep:
        idx = torch.tensor(rep, device=device)
        seqs = [rows[i].prompt_token_ids + rows[i].output_token_ids for i in rep]
        seen = _token_counts(seqs, vocab, device) > 0
        pen = torch.tensor([rows[i].params.repetition_penalty for i in rep], device=device)[:, None]
        sub = x[idx]
        x[idx] = torch.where(seen, torch.where(sub > 0, sub / pen, sub * pen), sub)

    pf = [i for i, r in enumerate(rows) if r.params.presence_penalty or r.params.frequency_penalty]
    if pf:
        idx = torch.tensor(pf, device=device)
        counts = _token_counts([rows[i].output_token_ids for i in pf], vocab, device)
        freq = torch.tensor([rows[i].params.frequency_penalty for i in pf], device=device)[:, None]
        pres = torch.tensor([rows[i].params.presence_penalty for i in pf], device=device)[:, None]
        x[idx] -= freq * counts + pres * (counts > 0)


def _sample(x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Random draw for non-greedy rows; x [M, V] float32 is modified in place."""
    m, vocab = x.shape
    device = x.device
    params = [r.params for r in rows]

    temps = [p.temperature for p in params]
    if any(t != 1.0 for t in temps):
        x.div_(torch.tensor(temps, device=device)[:, None])

    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]  # vocab = off
    if any(p.top_p < 1.0 for p in params):
        x = _top_k_top_p(x, ks, [p.top_p for p in params])
    elif any(k < vocab for k in ks):
        _top_k(x, ks)
    if any(p.min_p > 0.0 for p in params):
        probs = x.softmax(dim=-1)
        min_p = torch.tensor([p.min_p for p in params], device=device)[:, None]
        x.masked_fill_(probs < probs.amax(dim=-1, keepdim=True) * min_p, -torch.inf)

    probs = x.softmax(dim=-1)
    # Exponential race: argmax(p / q) with q ~ Exp(1) is a draw from p.
    q = torch.empty_like(probs)
    unseeded = [j for j, r in enumerate(rows) if r.generator is None]
    if len(unseeded) == m:
        q.exponential_()
    else:
        for j, r in enumerate(rows):
            if r.generator is not None:
                q[j].exponential_(generator=r.generator)
        if unseeded:
            batch_q = torch.empty(len(unseeded), vocab, device=device).exponential_()
            q[torch.tensor(unseeded, device=device)] = batch_q
    # A q of exactly 0 would turn a filtered 0-probability token into 0/0 = nan, which argmax picks.
    q.clamp_min_(torch.finfo(q.dtype).tiny)
    return probs.div_(q).argmax(dim=-1)


def _top_k(x: torch.Tensor, ks: list[int]) -> None:
    """In place; rows with k == vocab are left alone. Ties with the k-th value are kept."""
    vocab = x.shape[1]
    k_t = torch.tensor(ks, device=x.device)
    max_k = max(k for k in ks if k < vocab)
    top = x.topk(max_k, dim=-1).values
    kth = top.gather(1, (k_t.clamp(max=max_k) - 1)[:, None])
    kth.masked_fill_((k_t >= vocab)[:, None], -torch.inf)
    x.masked_fill_(x < kth, -torch.inf)


def _top_k_top_p(x: torch.Tensor, ks: list[int], ps: list[float]) -> torch.Tensor:
    """Sort-based top-k then top-p; returns the filtered logits."""
    vocab, device = x.shape[1], x.device
    sorted_x, order = x.sort(dim=-1)  # ascending
    k_t = torch.tensor(ks, device=device)
    kth = sorted_x.gather(1, (vocab - k_t)[:, None])
    sorted_x.masked_fill_(sorted_x < kth, -torch.inf)

    p_t = torch.tensor(ps, device=device)
    cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= (1 - p_t)[:, None]
    drop[:, -1] = False  # always keep the most likely token
    drop &= (p_t < 1.0)[:, None]  # rows with top_p off stay bit-identical
    sorted_x.masked_fill_(drop, -torch.inf)
    return torch.empty_like(x).scatter_(1, order, sorted_x)
