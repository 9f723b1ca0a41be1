"""N-gram speculative decoding: proposals, rollback of rejected ones, the rejection sampler's law, and
whole answers that equal plain decoding (greedy token for token in fp32, seeded sampling too)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from pdserve.config.speculative import SpeculativeConfig, speculative_config
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request
from pdserve.engine.scheduler import Scheduler, SchedulerConfig
from pdserve.sampling import SamplingParams
from pdserve.sampling.sampler import Sampler, SamplingRow, make_generator, skip_draws
from pdserve.spec_decode.ngram_proposer import NgramProposer
from pdserve.spec_decode.verifier import accepted_tokens, position_rows, rewind
from tests.greedy import assert_same_greedy

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


# ---- configuration and proposals ----------------------------------------------------------------

def test_speculative_config_takes_vllms_json_and_names_what_it_refuses() -> None:
    config = speculative_config(json.dumps(NGRAM))
    assert (config.num_speculative_tokens, config.prompt_lookup_max, config.prompt_lookup_min) == (4, 4, 2)
    one = speculative_config({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (3, 3)  # vLLM's rule: the one given stands for both
    with pytest.raises(ValueError, match="eagle"):
        speculative_config({"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="draft_tensor_parallel_size"):
        speculative_config({**NGRAM, "draft_tensor_parallel_size": 1})
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        speculative_config({**NGRAM, "prompt_lookup_min": 5})
    with pytest.raises(ValueError, match="not JSON"):
        speculative_config("{ngram")


def test_ngram_proposer_takes_the_longest_then_earliest_match() -> None:
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=2))
    assert proposer.propose([1, 2, 3, 4, 2, 3]) == [4, 2, 3]  # vLLM's docstring example: [2, 3] matched
    # [5, 2, 3] (3 tokens) at index 4 beats [2, 3] at index 0; k tokens follow it
    assert proposer.propose([2, 3, 9, 9, 5, 2, 3, 7, 8, 6, 1, 5, 2, 3]) == [7, 8, 6, 1]
    assert proposer.propose([1, 2, 3, 1, 2, 3, 1, 2]) == [3, 1, 2]  # [3, 1, 2] ends at 4: what follows, to the end
    bigram = NgramProposer(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=2, prompt_lookup_min=2))
    assert bigram.propose([1, 2, 3, 1, 2, 3, 1, 2]) == [3, 1, 2, 3]  # the earliest of two equal matches
    assert proposer.propose([1, 2, 3, 4, 5, 3]) == []  # only a 1-gram matches: under prompt_lookup_min
    assert proposer.propose([1, 2, 3, 4, 1, 2], limit=1) == [3]
    assert proposer.propose([1, 2, 3, 4, 1, 2], limit=0) == []


# ---- the scheduler: proposals scheduled, rejected ones rolled back --------------------------------

BS = 4


def _speculating_scheduler(num_blocks: int = 16, up_to: int | None = 64) -> Scheduler:
    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=2, prompt_lookup_min=1,
                             disable_by_batch_size=up_to)
    return Scheduler(SchedulerConfig(max_model_len=num_blocks * BS, speculative=spec),
                     KVCacheManager(num_blocks, BS, enable_prefix_caching=True))


def test_rejected_proposals_free_their_blocks_and_never_enter_the_prefix_cache() -> None:
    sched = _speculating_scheduler()
    request = Request("r", [10, 11, 12, 13, 10, 11], SamplingParams(max_tokens=20), eos_token_ids=(2,))
    sched.add_request(request)
    out = sched.schedule()
    sched.update(out, {"r": [12]})  # the prompt, then token 12: [.. 10 11 12] matched at index 0
    assert request.spec_token_ids == [13, 10, 11, 12]

    out = sched.schedule()
    (chunk,) = out.chunks
    assert chunk.draft_token_ids == [13, 10, 11, 12] and chunk.num_new_tokens == 5
    assert len(request.blocks) == 3  # positions 0 .. 10: the last token at 6 and proposals at 7 .. 10
    free_before = sched.kv.pool.num_free_blocks
    sched.update(out, {"r": [99]})  # the model wanted 99 where 13 was proposed: nothing accepted
    assert request.token_ids[-2:] == [12, 99] and request.num_computed_tokens == 7
    assert len(request.blocks) == 2 and sched.kv.pool.num_free_blocks == free_before + 1
    assert sched.kv.pool.num_cached_blocks == 1  # only block 0 is full of computed tokens
    assert sched.spec_stats.num_accepted_tokens == 0

    request.spec_token_ids = [5, 6, 7]
    out = sched.schedule()
    sched.update(out, {"r": [5, 6, 8]})  # two accepted, then the model's own token
    assert request.output_token_ids == [12, 99, 5, 6, 8]
    assert request.num_computed_tokens == request.num_tokens - 1 == 10
    hashed = request.block_hashes[:2]
    assert [sched.kv.pool.lookup(h) is not None for h in hashed] == [True, True]
    stats = sched.spec_stats
    assert stats.num_draft_tokens == 7
    assert stats.accepted_per_pos == [1, 1, 0, 0]

    while sched.num_unfinished:
        out = sched.schedule()
        sched.update(out, {c.request.request_id: [2] for c in out.chunks if c.completes_known_tokens})
    sched.kv.pool.check_all_free()


def test_a_stop_among_accepted_proposals_ends_the_answer_there() -> None:
    sched = _speculating_scheduler()
    request = Request("r", [10, 11, 12], SamplingParams(max_tokens=20), eos_token_ids=(2,))
    sched.add_request(request)
    sched.update(sched.schedule(), {"r": [7]})
    request.spec_token_ids = [8, 2, 9]
    changed = sched.update(sched.schedule(), {"r": [8, 2, 9, 4]})
    assert changed == [(request, 2)] and request.output_token_ids == [7, 8, 2]
    assert request.finish_reason == "stop"
    sched.kv.pool.check_all_free()


def test_proposals_stop_at_max_tokens_and_at_large_batches() -> None:
    sched = _speculating_scheduler(num_blocks=64)
    request = Request("r", [1, 2, 3, 1, 2], SamplingParams(max_tokens=3), eos_token_ids=(0,))
    sched.add_request(request)
    sched.update(sched.schedule(), {"r": [3]})
    assert request.spec_token_ids == [1]  # 3 tokens at most: the last is never a proposal
    busy = _speculating_scheduler(num_blocks=64, up_to=3)
    for i in range(4):  # prompts of their own: one prefix would be computed once, the others waiting a step
        busy.add_request(Request(f"r{i}", [5 + i, 2, 3, 5 + i, 2], SamplingParams(max_tokens=10),
                                 eos_token_ids=(0,)))
    out = busy.schedule()
    assert len(out.chunks) == 4
    busy.update(out, {c.request.request_id: [3] for c in out.chunks})
    assert all(not r.spec_token_ids for r in busy.running)


def test_the_controller_speculates_where_it_measured_a_gain() -> None:
    """Per batch-size bucket: one speculating step emits 3 tokens a sequence in 1.1 plain steps' time at
    batch 1, and at batch 16 one token more in 2 steps' time; the controller keeps the faster kind of
    step in each bucket, trying the other on one step in EXPLORE_EVERY."""
    from pdserve.spec_decode.controller import EXPLORE_EVERY, SpeculationController

    controller = SpeculationController()
    step = {1: 0.020, 16: 0.030}
    for _ in range(200):
        for b in (1, 16):
            if controller.decide(b):
                tokens, seconds = (3 * b, 1.1 * step[b]) if b == 1 else (b + 1, 2 * step[b])
                controller.observe(b, True, tokens, seconds)
            controller.observe(b, False, b, step[b])  # steps without proposals come anyway
    decisions = {b: [controller.decide(b) for _ in range(4 * EXPLORE_EVERY)] for b in (1, 16)}
    assert sum(decisions[1]) == len(decisions[1]) - 4 and sum(decisions[16]) == 4


def test_a_scheduler_without_a_fixed_limit_drops_proposals_the_controller_refuses() -> None:
    sched = _speculating_scheduler(up_to=None)
    for _ in range(10):  # plain steps at batch 1 emit 100 tokens/s, speculative ones 50
        sched.controller.observe(1, False, 1, 0.01)
        sched.controller.observe(1, True, 1, 0.02)
    request = Request("r", [10, 11, 12, 13, 10, 11], SamplingParams(max_tokens=40), eos_token_ids=(2,))
    sched.add_request(request)
    speculated = []
    for _ in range(20):  # the answer goes on repeating 12, 13, 10, 11: every step has proposals
        out = sched.schedule()
        speculated.append(bool(out.chunks[0].draft_token_ids))
        sched.update(out, {"r": [request.token_ids[-4]]})
    assert sum(speculated) == 1  # the one exploring step among the controller's decisions


# ---- the worker's verification ------------------------------------------------------------------

def _chi_square(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs, strict=True))


def test_verification_keeps_the_target_distribution() -> None:
    """On a 5-token vocabulary, 40,000 sequences each propose [1, 3]: the first emitted token follows the
    target's softmax, and after an accepted proposal so does the second (chi-square, 4 degrees of freedom,
    p = 0.001 critical value 18.47); the proposal is accepted as often as the target draws it."""
    torch.manual_seed(0)
    n, temperature = 40_000, 0.7
    first, second = torch.tensor([1.0, 2.0, 0.5, 1.5, 0.0]), torch.tensor([0.2, 0.1, 1.8, 1.0, 0.4])
    rows = []
    for _ in range(n):
        rows.extend(position_rows(SamplingRow(SamplingParams(temperature=temperature), [4], []), [1, 3]))
    logits = torch.stack([first, second, first] * n)  # position 2 (after both proposals) is not examined
    drawn = Sampler()(logits, rows).token_ids.view(n, 3).tolist()
    emitted = [accepted_tokens(d, [1, 3]) for d in drawn]
    p1, p2 = (torch.softmax(x / temperature, dim=0).tolist() for x in (first, second))
    counts1 = [sum(e[0] == t for e in emitted) for t in range(5)]
    after = [e[1] for e in emitted if len(e) > 1]
    counts2 = [after.count(t) for t in range(5)]
    assert _chi_square(counts1, p1) < 18.47, (counts1, p1)
    assert _chi_square(counts2, p2) < 18.47, (counts2, p2)
    assert abs(len(after) / n - p1[1]) < 4 * math.sqrt(p1[1] * (1 - p1[1]) / n)


def test_a_seeded_sequence_spends_one_draw_per_emitted_token() -> None:
    params = SamplingParams(temperature=1.0, seed=7)
    logits = torch.tensor([[0.0, 1.0, 2.0, 0.5]] * 3)
    row = SamplingRow(params, [0], [], generator=make_generator(7))
    state = row.generator.get_state()
    drawn = Sampler()(logits, position_rows(row, [2, 2])).token_ids.tolist()
    emitted = accepted_tokens(drawn, [2, 2])
    rewind(row.generator, state, len(emitted))
    plain = make_generator(7)
    skip_draws(plain, len(emitted))
    assert torch.equal(row.generator.get_state(), plain.get_state())
    # and what was drawn is what plain decoding draws token by token
    replay = make_generator(7)
    alone = [Sampler()(logits[:1], [SamplingRow(params, [0], [], generator=replay)]).token_ids.item()
             for _ in emitted]
    assert alone == emitted


# ---- whole answers ---------------------------------------------------------------------------------

PROMPTS = [
    "Repeat this list exactly, one item per line: apple, banana, cherry, date, elderberry, fig, grape, kiwi.",
    "Rename the function foo to bar and print the whole code:\n\ndef foo(x, y):\n    total = x + y\n"
    "    return foo_helper(total)\n\nprint(foo(1, 2))\n",
    "Write a short poem about the sea.",
]


@pytest.fixture(scope="module")
def engines():
    from pdserve.offline.llm import LLM

    # the exact path: with int8 activations (the packed default) a verification pass rounds its rows otherwise than
    # one-by-one decoding does, and a seeded draw at a near tie may then fall the other way
    flags = dict(dtype="float32", quantization="none", num_gpu_blocks_override=256, block_size=16, max_model_len=1024)
    with LLM(**flags) as plain, LLM(speculative_config=NGRAM, **flags) as spec:
        yield plain, spec


def _chat(llm, prompts: list[str], **params) -> list:  # noqa: ANN001
    conversations = [[{"role": "user", "content": p}] for p in prompts]
    return [o.outputs[0] for o in llm.chat(conversations, SamplingParams(**params), use_tqdm=False)]


@pytest.mark.e2e
def test_greedy_speculation_equals_plain_greedy_alone_and_batched(engines) -> None:
    plain, spec = engines
    before = spec.stats().spec_decode.num_accepted_tokens
    want = _chat(plain, PROMPTS, temperature=0, max_tokens=80, logprobs=2)
    for got, reference in zip(_chat(spec, PROMPTS, temperature=0, max_tokens=80, logprobs=2), want, strict=True):
        assert_same_greedy(reference, got)
        assert len(got.logprobs) == len(got.token_ids)
    for prompt, reference in zip(PROMPTS, want, strict=True):
        (got,) = _chat(spec, [prompt], temperature=0, max_tokens=80)
        assert_same_greedy(reference, got)
    stats = spec.stats()
    assert stats.spec_decode.num_accepted_tokens - before > 40, stats  # the repeating answers speculated
    spec.check_idle()  # every block freed


@pytest.mark.e2e
def test_seeded_sampling_is_the_same_with_and_without_speculation(engines) -> None:
    plain, spec = engines
    params = dict(temperature=0.8, top_p=0.95, max_tokens=60, seed=11)
    want = [o.token_ids for o in _chat(plain, PROMPTS, **params)]
    assert [o.token_ids for o in _chat(spec, PROMPTS, **params)] == want
    assert [o.token_ids for o in _chat(spec, PROMPTS[:1], **params)] == want[:1]


@pytest.mark.e2e
def test_structured_output_stop_strings_and_penalties_with_speculation(engines) -> None:
    import jsonschema

    from pdserve.structured.spec import json_schema

    plain, spec = engines
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    ask = ['Give this person as JSON with "name" and "age": the person is Alice Smith, age 30. '
           "Alice Smith is 30 years old."]
    cases = [dict(structured=json_schema(schema)), dict(stop=["cherry"]), dict(repetition_penalty=1.3),
             dict(frequency_penalty=0.5, min_tokens=30)]
    for case in cases:
        prompts = ask if "structured" in case else PROMPTS[:2]
        want = _chat(plain, prompts, temperature=0, max_tokens=60, **case)
        got = _chat(spec, prompts, temperature=0, max_tokens=60, **case)
        assert [o.token_ids for o in got] == [o.token_ids for o in want], case
    answer = _chat(spec, ask, temperature=0, max_tokens=60, structured=json_schema(schema))[0]
    jsonschema.validate(json.loads(answer.text), schema)
    listed = _chat(spec, PROMPTS[:1], temperature=0, max_tokens=60, stop=["cherry"])[0]
    assert "cherry" not in listed.text and "banana" in listed.text
    spec.check_idle()


@pytest.mark.e2e
def test_speculation_under_block_pressure_keeps_outputs(engines) -> None:
    from pdserve.offline.llm import LLM

    plain, _ = engines
    want = _chat(plain, PROMPTS * 2, temperature=0, max_tokens=70, logprobs=2)
    with LLM(dtype="float32", quantization="none", num_gpu_blocks_override=14, block_size=16, max_model_len=224,
             speculative_config=NGRAM) as small:
        got = _chat(small, PROMPTS * 2, temperature=0, max_tokens=70)
        assert small.stats().num_preemptions > 0
        small.check_idle()
    for reference, out in zip(want, got, strict=True):
        assert_same_greedy(reference, out)
