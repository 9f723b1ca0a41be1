import msgspec
import pytest
import torch

from pdserve.sampling import Sampler, SamplingParams, SamplingRow, check_stop
from pdserve.sampling.sampler import make_generator

EOS = 3


def row(prompt: list[int] | None = None, output: list[int] | None = None, seed: int | None = None,
        eos: tuple[int, ...] = (EOS,), **kw: object) -> SamplingRow:
    params = SamplingParams(seed=seed, **kw)
    return SamplingRow(params, prompt or [], output or [], eos, make_generator(seed, "cpu"))


@pytest.fixture
def sampler() -> Sampler:
    return Sampler()


@pytest.fixture(autouse=True)
def _fixed_global_seed() -> None:
    torch.manual_seed(1234)


def test_greedy_is_argmax_and_fast_path_has_no_logprobs(sampler: Sampler) -> None:
    logits = torch.randn(5, 50)
    before = logits.clone()
    out = sampler(logits, [row(temperature=0.0) for _ in range(5)])
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.logprobs is None and out.top_token_ids is None
    assert torch.equal(logits, before)


@pytest.mark.parametrize(
    "kw",
    [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0), dict(top_k=3, top_p=1e-6), dict(top_k=2, min_p=1.0)],
)
def test_degenerate_filters_equal_greedy(sampler: Sampler, kw: dict) -> None:
    logits = torch.randn(64, 30)
    out = sampler(logits, [row(temperature=1.0, **kw) for _ in range(64)])
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_seeded_reproducible_and_independent_of_batch(sampler: Sampler) -> None:
    logits = torch.randn(1, 40)
    steps = 30

    def draws_alone() -> list[int]:
        r = row(seed=42, temperature=0.8)
        return [sampler(logits, [r]).token_ids[0].item() for _ in range(steps)]

    def draws_in_batch() -> list[int]:
        target = row(seed=42, temperature=0.8)
        rows = [row(top_p=0.5), row(seed=7, top_k=5, min_p=0.1), target,
                row(temperature=0.0, repetition_penalty=1.3, output=[1, 2])]
        batch = torch.cat([torch.randn(2, 40), logits, torch.randn(1, 40)])
        return [sampler(batch, rows).token_ids[2].item() for _ in range(steps)]

    alone = draws_alone()
    assert alone == draws_alone()
    assert alone == draws_in_batch()
    assert len(set(alone)) > 3  # it really sampled


def test_different_seeds_differ(sampler: Sampler) -> None:
    logits = torch.zeros(1, 100)
    a, b = row(seed=1), row(seed=2)
    seq_a = [sampler(logits, [a]).token_ids.item() for _ in range(50)]
    seq_b = [sampler(logits, [b]).token_ids.item() for _ in range(50)]
    assert sum(x != y for x, y in zip(seq_a, seq_b, strict=True)) > 40


def test_empirical_distribution_matches_softmax(sampler: Sampler) -> None:
    base = torch.tensor([1.0, 0.0, -0.5, 2.0])
    n = 4000
    out = sampler(base.expand(n, 4).clone(), [row() for _ in range(n)])
    freq = torch.bincount(out.token_ids, minlength=4).float() / n
    assert torch.allclose(freq, base.softmax(-1), atol=0.03), freq


def test_temperature_sharpens(sampler: Sampler) -> None:
    base = torch.tensor([1.0, 0.0, -0.5, 2.0])
    n = 4000
    out = sampler(base.expand(n, 4).clone(), [row(temperature=0.5) for _ in range(n)])
    freq = torch.bincount(out.token_ids, minlength=4).float() / n
    assert torch.allclose(freq, (base / 0.5).softmax(-1), atol=0.03), freq


def test_top_k_two_stays_in_top_two(sampler: Sampler) -> None:
    base = torch.tensor([0.5, 2.0, 0.3, 1.9, 0.0, 1.0, -1.0, 0.1])
    n = 2000
    out = sampler(base.expand(n, 8).clone(), [row(top_k=2) for _ in range(n)])
    assert set(out.token_ids.tolist()) == {1, 3}


def test_top_p_keeps_nucleus(sampler: Sampler) -> None:
    # probs ~ [0.5, 0.3, 0.2 (split over two)]: top_p=0.7 keeps tokens 0 and 1.
    base = torch.tensor([0.5, 0.3, 0.1, 0.1]).log()
    n = 2000
    out = sampler(base.expand(n, 4).clone(), [row(top_p=0.7) for _ in range(n)])
    freq = torch.bincount(out.token_ids, minlength=4).float() / n
    assert set(out.token_ids.tolist()) == {0, 1}
    assert abs(freq[0].item() - 0.625) < 0.04


def test_filters_do_not_leak_to_other_rows(sampler: Sampler) -> None:
    base = torch.tensor([0.0, 0.1, 0.2, 0.3])
    n = 1000
    rows = [row(top_k=2) if i % 2 else row(top_p=1.0, top_k=0) for i in range(n)]
    rows[0] = row(top_p=0.01)  # forces the sort path for the whole batch
    out = sampler(base.expand(n, 4).clone(), rows)
    assert set(out.token_ids[1::2].tolist()) == {2, 3}
    assert set(out.token_ids[2::2].tolist()) == {0, 1, 2, 3}


def test_repetition_penalty_switches_greedy(sampler: Sampler) -> None:
    pos = torch.tensor([[2.0, 1.8, 0.5, -1.0]])
    assert sampler(pos, [row(temperature=0.0, prompt=[0])]).token_ids.item() == 0
    # positive logit divided: 2.0 / 1.5 < 1.8
    assert sampler(pos, [row(temperature=0.0, prompt=[0], repetition_penalty=1.5)]).token_ids.item() == 1
    assert sampler(pos, [row(temperature=0.0, output=[0], repetition_penalty=1.5)]).token_ids.item() == 1
    # negative logit multiplied: -1.0 * 1.5 < -1.2
    neg = torch.tensor([[-1.0, -1.2, -3.0, -4.0]])
    assert sampler(neg, [row(temperature=0.0, output=[0], repetition_penalty=1.5)]).token_ids.item() == 1


def test_presence_and_frequency_penalties(sampler: Sampler) -> None:
    logits = torch.tensor([[1.0, 0.8, 0.0, -1.0]])

    def greedy(**kw: object) -> int:
        return sampler(logits, [row(temperature=0.0, **kw)]).token_ids.item()

    assert greedy(output=[0], presence_penalty=0.5) == 1
    assert greedy(prompt=[0], presence_penalty=0.5) == 0  # prompt tokens don't count
    assert greedy(output=[0], frequency_penalty=0.1) == 0  # 1.0 - 0.1 > 0.8
    assert greedy(output=[0, 0, 0], frequency_penalty=0.1) == 1  # 1.0 - 0.3 < 0.8
    assert greedy(output=[0, 0, 0], presence_penalty=0.1) == 0  # presence ignores counts
    # only the penalised row of a batch changes
    two = sampler(logits.repeat(2, 1), [row(temperature=0.0, output=[0], presence_penalty=0.5),
                                        row(temperature=0.0, output=[0])])
    assert two.token_ids.tolist() == [1, 0]


def test_min_tokens_blocks_eos_and_stop_ids(sampler: Sampler) -> None:
    logits = torch.tensor([[0.0, 0.5, 9.0, 10.0]])  # EOS=3 best, then stop id 2

    def greedy(**kw: object) -> int:
        return sampler(logits, [row(temperature=0.0, **kw)]).token_ids.item()

    assert greedy(output=[1], min_tokens=2, stop_token_ids=[2]) == 1
    assert greedy(output=[1], min_tokens=2) == 2
    assert greedy(output=[1, 1], min_tokens=2) == EOS
    assert greedy(output=[1], min_tokens=2, ignore_eos=True) == EOS  # ignore_eos: EOS isn't special
    # sampled rows too: EOS is never drawn while blocked
    n = 500
    out = sampler(logits.expand(n, 4).clone(), [row(output=[1], min_tokens=3) for _ in range(n)])
    assert EOS not in out.token_ids.tolist()


def test_logprobs_are_raw_log_softmax(sampler: Sampler) -> None:
    logits = torch.randn(3, 25)
    rows = [
        row(logprobs=0, temperature=0.0),
        row(logprobs=3, temperature=0.7, top_k=5, repetition_penalty=1.4, prompt=[1, 2, 3]),
        row(),
    ]
    out = sampler(logits, rows)
    raw = torch.log_softmax(logits, -1)
    assert out.logprobs is not None and out.top_token_ids is not None and out.top_logprobs is not None
    assert torch.allclose(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.top_token_ids.shape == (3, 3)
    assert torch.equal(out.top_token_ids, logits.topk(3, -1).indices)
    assert torch.allclose(out.top_logprobs, raw.topk(3, -1).values)
    assert out.token_ids[0].item() == logits[0].argmax().item()


def test_logprobs_zero_only_gives_chosen(sampler: Sampler) -> None:
    out = sampler(torch.randn(2, 10), [row(logprobs=0), row(logprobs=0, temperature=0.0)])
    assert out.logprobs is not None and out.logprobs.shape == (2,)
    assert out.top_token_ids is None and out.top_logprobs is None


def test_check_stop() -> None:
    eos = (EOS,)
    p = SamplingParams(max_tokens=5)
    assert check_stop(p, [], eos) is None
    assert check_stop(p, [1, 2], eos) is None
    assert check_stop(p, [1, EOS], eos) == "stop"
    assert check_stop(p, [1, 2], (2, EOS)) == "stop"  # any of several eos ids
    assert check_stop(SamplingParams(max_tokens=5, ignore_eos=True), [1, EOS], eos) is None
    assert check_stop(SamplingParams(max_tokens=5, ignore_eos=True, stop_token_ids=[7]), [7], eos) == "stop"
    assert check_stop(SamplingParams(stop_token_ids=[7]), [1, 7], eos) == "stop"
    assert check_stop(SamplingParams(min_tokens=3, stop_token_ids=[7]), [1, 7], eos) is None
    assert check_stop(SamplingParams(min_tokens=3), [1, EOS], eos) is None
    assert check_stop(SamplingParams(min_tokens=2), [1, EOS], eos) == "stop"
    assert check_stop(p, [1, 2, 4, 4], eos) is None
    assert check_stop(p, [1, 2, 4, 4, 5], eos) == "length"
    assert check_stop(p, [1, 2, 4, 4, EOS], eos) == "stop"  # natural stop wins over length
    assert check_stop(SamplingParams(max_tokens=None), [1] * 10_000, eos) is None
    assert check_stop(SamplingParams(max_tokens=None), [1], eos, max_model_len_left=0) == "length"
    assert check_stop(p, [1], eos, max_model_len_left=3) is None


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(n=0), "n"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.01), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(min_p=-0.1), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3.0), "frequency_penalty"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(max_tokens=4, min_tokens=5), "min_tokens"),
        (dict(logprobs=21), "logprobs"),
        (dict(logprobs=-1), "logprobs"),
    ],
)
def test_params_validation(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} must be"):
        SamplingParams(**kw)


def test_params_defaults_and_normalisation() -> None:
    p = SamplingParams(stop="###", top_k=-1, max_tokens=None, min_tokens=100)
    assert p.stop == ["###"]
    assert not p.greedy
    assert SamplingParams(temperature=0).greedy and SamplingParams(top_k=1).greedy


def test_params_msgpack_round_trip() -> None:
    p = SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=40, seed=3, max_tokens=None, stop="END",
                       stop_token_ids=[5, 6], logprobs=2, ignore_eos=True)
    data = msgspec.msgpack.encode(p)
    assert msgspec.msgpack.decode(data, type=SamplingParams) == p
    default = msgspec.msgpack.encode(SamplingParams())
    assert msgspec.msgpack.decode(default) == {}  # omit_defaults keeps the wire small
    # ints sent for float fields are accepted; bad values are rejected on decode too
    as_int = msgspec.msgpack.encode({"temperature": 1})
    assert msgspec.msgpack.decode(as_int, type=SamplingParams).temperature == 1.0
    with pytest.raises(msgspec.ValidationError, match="top_p"):
        msgspec.msgpack.decode(msgspec.msgpack.encode({"top_p": 0.0}), type=SamplingParams)


@pytest.mark.parametrize("width", [1, 20, 50, 256, 1000])
def test_top_candidates_are_the_rows_top_k(width: int) -> None:
    """The chunked top-k the top-p / top-k / top_logprobs paths use returns what a topk over the whole row does,
    masked tokens (-inf) and peaked rows included, in descending order."""
    from pdserve.sampling.sampler import top_candidates

    g = torch.Generator().manual_seed(width)
    x = torch.randn(6, 49152, generator=g) * 3
    x[1, ::2] = -torch.inf  # a grammar's mask
    x[2, 777] = 40.0  # one sure token
    x[3, :40000] = -torch.inf
    vals, ids = top_candidates(x, width)
    want_vals, want_ids = x.topk(width, dim=-1)
    assert torch.equal(vals, want_vals)
    finite = torch.isfinite(want_vals)
    assert torch.equal(ids[finite], want_ids[finite])
    assert torch.equal(x.gather(1, ids), vals)
    odd = torch.randn(2, 1001, generator=g)  # not a whole number of chunks: the plain topk
    assert torch.equal(top_candidates(odd, width if width < 1001 else 1001)[1],
                       odd.topk(width if width < 1001 else 1001, dim=-1).indices)


@pytest.mark.parametrize("spread", [2_000, 30_000], ids=["within the wide candidates", "wider still"])
def test_a_wide_nucleus_draws_what_the_full_sort_draws(spread):
    """A flat distribution (a 262,144-token vocabulary at a high temperature) has a nucleus of thousands of tokens:
    it is found among the WIDE_CANDIDATES most likely, or past them by the full sort, and each uniform draws the
    token the full sort's draw gives (logits falling with the token id: one order for both)."""
    from pdserve.sampling.sampler import _draw, _top_k_top_p, _wide_nucleus

    vocab, rows = 262_144, 16
    logits = torch.full((rows, vocab), -60.0)
    logits[:, :spread] = -torch.arange(spread, dtype=torch.float32) * (4.0 / spread)
    u = (torch.arange(rows, dtype=torch.float32) + 0.5) / rows
    ps = [0.9] * rows
    got = _wide_nucleus(logits.clone(), u, ps, [0.0] * rows)
    want = _draw(_top_k_top_p(logits.clone(), [vocab] * rows, ps), u, [0.0] * rows)
    assert got.tolist() == want.tolist()
    assert int(got.max()) > 256  # the nucleus is wider than the first candidates
