"""Structured outputs and tool calls below the HTTP layer: grammar specs, the worker's matchers and
masks, the sampler's constraints, the tool prompt, the Hermes parser, and request fields."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.api.protocol import IGNORED, ChatCompletionRequest, CompletionRequest
from pdserve.engine.request import Request
from pdserve.sampling import SamplingParams
from pdserve.sampling.sampler import Sampler, SamplingRow
from pdserve.structured.matcher import GrammarCompiler, SequenceGrammar, allowed_tokens, unpack_on_device
from pdserve.structured.spec import StructuredOutput, check, json_schema, tool_call_spec
from pdserve.tool_calling.parsers import HermesParser
from pdserve.tool_calling.prompt import render_messages, template_supports_tools
from pdserve.worker.protocol import TokenLogprobs

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": {"enum": ["x"]}}},
          "required": ["a", "b"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def compiler(embedded_folder) -> GrammarCompiler:
    return GrammarCompiler(embedded_folder / "tokenizer.json", 49152)


def _accepts(compiler: GrammarCompiler, tokenizer, spec: StructuredOutput, text: str) -> bool:
    matcher = compiler.matcher(spec, tokenizer.eos_token_ids)
    return all(not matcher.is_stopped() and matcher.consume_token(t)
               for t in tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()


def test_compact_json_by_default(compiler, embedded_tokenizer):
    spec = json_schema(SCHEMA)
    assert _accepts(compiler, embedded_tokenizer, spec, '{"a":1,"b":["x"]}')
    assert not _accepts(compiler, embedded_tokenizer, spec, '{"a": 1, "b": ["x"]}')
    assert not _accepts(compiler, embedded_tokenizer, spec, '{"a":1,"b":["y"]}')
    assert not _accepts(compiler, embedded_tokenizer, spec, '{"a":1,"b":[],"c":2}')
    assert _accepts(compiler, embedded_tokenizer, json_schema(SCHEMA, whitespace_flexible=True), '{"a": 1, "b": ["x"]}')


def test_a_complete_grammar_allows_only_eos(compiler, embedded_tokenizer):
    seq = SequenceGrammar(json_schema(SCHEMA), embedded_tokenizer.eos_token_ids,
                          embedded_tokenizer.encode('{"a":7,"b":[]}', add_special_tokens=False))
    allowed = allowed_tokens(compiler.fill_async([seq, None]).result(), 49152)
    assert allowed[0].nonzero().flatten().tolist() == list(embedded_tokenizer.eos_token_ids)
    assert allowed[1].all()  # a row without a grammar is not constrained


def test_mask_unpacking_on_a_gpu_equals_the_cpu_path():
    bits = torch.randint(-2**31, 2**31 - 1, (3, 1536), dtype=torch.int32)
    assert torch.equal(allowed_tokens(bits, 49150), unpack_on_device(bits, 49150))


def test_grammar_failures_are_the_requests_own(compiler, embedded_tokenizer, embedded_folder):
    """What only the vocabulary can refuse is caught by the API's check with the tokenizer; in the
    worker such a spec, or a token that does not fit, marks its sequence alone and leaves the rest."""
    from pdserve.structured.spec import grammar_tokenizer

    bad = StructuredOutput(kind="lark", value='start: "a" <[999999]>')
    check(bad)  # without the vocabulary it looks fine
    with pytest.raises(ValueError):
        check(bad, grammar_tokenizer(embedded_folder / "tokenizer.json", None, embedded_tokenizer.eos_token_ids))
    broken = SequenceGrammar(bad, embedded_tokenizer.eos_token_ids, [])
    misfit = SequenceGrammar(json_schema(SCHEMA), embedded_tokenizer.eos_token_ids,
                             embedded_tokenizer.encode("hello", add_special_tokens=False))
    fine = SequenceGrammar(json_schema(SCHEMA), embedded_tokenizer.eos_token_ids, [])
    bits = compiler.fill_async([broken, misfit, fine]).result()
    assert "does not compile" in broken.error and "does not fit" in misfit.error and fine.error is None
    allowed = allowed_tokens(bits, 49152)
    assert allowed[0].all() and allowed[1].all() and not allowed[2].all()


@pytest.mark.parametrize(("spec", "reason"), [
    (StructuredOutput(kind="regex", value="[a-z"), "regex"),
    (json_schema({"type": "object", "properties": {"a": {"$ref": "#/$defs/none"}}}), "none"),
    (StructuredOutput(kind="grammar", value="root ::= ("), "."),
    (StructuredOutput(kind="choice", value="[]"), "non-empty"),
])
def test_uncompilable_specs_say_why(spec, reason):
    with pytest.raises(ValueError, match=reason):
        check(spec)


def test_sampler_applies_bias_allowed_ids_and_masks():
    logits = torch.zeros(3, 10)
    logits[:, 0] = 5.0
    rows = [SamplingRow(SamplingParams(temperature=0, logit_bias={7: 100}), [1], []),
            SamplingRow(SamplingParams(temperature=0, allowed_token_ids=[3, 4]), [1], []),
            SamplingRow(SamplingParams(temperature=1.0, seed=1), [1], [])]
    mask = torch.zeros(3, 10, dtype=torch.bool)
    mask[:2] = True
    mask[2, 9] = True
    out = Sampler()(logits.clone(), rows, mask)
    assert out.token_ids.tolist()[0] == 7 and out.token_ids.tolist()[1] in (3, 4) and out.token_ids.tolist()[2] == 9


def test_tool_parameters_with_defs(compiler, embedded_tokenizer):
    nested = {"type": "function", "function": {"name": "book", "parameters": {
        "type": "object", "properties": {"guest": {"$ref": "#/$defs/Guest"}}, "required": ["guest"],
        "$defs": {"Guest": {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"],
                            "additionalProperties": False}}}}}
    spec = tool_call_spec([nested, TOOL], "book", parallel=False)
    check(spec)
    assert _accepts(compiler, embedded_tokenizer, spec,
                    '<tool_call>\n{"name":"book","arguments":{"guest":{"age":40}}}\n</tool_call>')
    assert not _accepts(compiler, embedded_tokenizer, spec,
                        '<tool_call>\n{"name":"book","arguments":{"guest":{"age":"x"}}}\n</tool_call>')


def test_min_tokens_yields_to_a_complete_grammar():
    """A grammar that allows only EOS and min_tokens that bans it: EOS, never an all -inf row (token 0)."""
    logits = torch.zeros(2, 10)
    rows = [SamplingRow(SamplingParams(temperature=t, min_tokens=5, seed=1), [1], [3], eos_token_ids=(2,))
            for t in (0.0, 1.0)]
    mask = torch.zeros(2, 10, dtype=torch.bool)
    mask[:, 2] = True
    assert Sampler()(logits, rows, mask).token_ids.tolist() == [2, 2]
    mask[:, 5] = True  # with another token allowed, min_tokens holds
    assert Sampler()(logits, rows, mask).token_ids.tolist() == [5, 5]


def test_tool_call_grammar_holds_name_and_arguments(compiler, embedded_tokenizer):
    other = {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}}
    required = tool_call_spec([TOOL, other], None, parallel=True)
    named = tool_call_spec([TOOL, other], "f", parallel=True)
    call = '<tool_call>\n{"name":"f","arguments":{"q":"hi"}}\n</tool_call>'
    assert _accepts(compiler, embedded_tokenizer, required, call)
    assert _accepts(compiler, embedded_tokenizer, required, call + "\n" + call)
    assert _accepts(compiler, embedded_tokenizer, named, call)
    assert not _accepts(compiler, embedded_tokenizer, named, call + "\n" + call)
    assert not _accepts(compiler, embedded_tokenizer, named, '<tool_call>\n{"name":"g","arguments":{}}\n</tool_call>')
    no_args = '<tool_call>\n{"name":"f","arguments":{}}\n</tool_call>'
    assert not _accepts(compiler, embedded_tokenizer, required, no_args)
    assert not _accepts(compiler, embedded_tokenizer, required, "Sure! " + call)


def test_hermes_parser_whole_and_streamed():
    text = 'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"q": "a<b"}}\n</tool_call>\n' \
           '<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    content, calls = HermesParser().parse(text)
    assert content == "Let me check." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("f", {"q": "a<b"}), ("g", {})]
    for size in (1, 3, 7, len(text)):
        parser, shown, streamed = HermesParser(), "", []
        for i in range(0, len(text), size):
            piece, got = parser.feed(text[i:i + size])
            shown += piece
            streamed += got
        shown += parser.finish()
        assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls], size
        assert shown.strip() == "Let me check."
    assert HermesParser().parse("no calls <tool_call>not json</tool_call>") == (
        "no calls <tool_call>not json</tool_call>", [])
    parser = HermesParser()
    assert parser.feed("cut <tool_call>{\"name\"") == ("cut ", []) and parser.finish() == '<tool_call>{"name"'


def test_tool_histories_render_for_templates_with_and_without_tools():
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                     "function": {"name": "f", "arguments": '{"q": "x"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    msgs, extra = render_messages(history, [TOOL], native=False)
    assert extra == {} and msgs[0]["role"] == "system" and '"name": "f"' in msgs[0]["content"]
    assert msgs[2]["content"] == '<tool_call>\n{"name": "f", "arguments": {"q": "x"}}\n</tool_call>'
    assert msgs[3] == {"role": "user", "content": "<tool_response>\n42\n</tool_response>"}
    msgs, extra = render_messages(history, [TOOL], native=True)
    assert extra == {"tools": [TOOL]} and msgs[1]["content"] == ""
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"q": "x"}
    assert template_supports_tools("{% if tools %}...{% endif %}") and not template_supports_tools("{{ messages }}")


def test_request_fields():
    base = {"messages": [{"role": "user", "content": "x"}]}
    spec = ChatCompletionRequest(**base, response_format={"type": "json_schema", "json_schema": {
        "name": "s", "schema": SCHEMA, "strict": True}}).structured_spec()
    assert spec.kind == "json" and json.loads(spec.value) == SCHEMA and not spec.whitespace_flexible
    flexible = ChatCompletionRequest(**base, structured_outputs={"json": SCHEMA, "disable_any_whitespace": False})
    assert flexible.structured_spec().whitespace_flexible
    with pytest.raises(ValueError, match="more than one"):
        ChatCompletionRequest(**base, guided_regex="a", guided_choice=["a"]).structured_spec()
    with pytest.raises(ValueError, match="best_of"):
        CompletionRequest(prompt="x", best_of=3)
    CompletionRequest(prompt="x", best_of=1, bad_words=[], suffix="")  # neutral values are accepted
    CompletionRequest(prompt="x", **{name: "v" for name in IGNORED})  # fields that change nothing too
    with pytest.raises(ValueError, match="allowed_token_ids cannot be combined"):
        ChatCompletionRequest(**base, allowed_token_ids=[1], guided_choice=["a"])
    with pytest.raises(ValueError, match="allowed only with echo"):
        CompletionRequest(prompt="x", max_tokens=0)
    with pytest.raises(ValueError, match="token ids"):
        CompletionRequest(prompt="x", logit_bias={"abc": 1})
    with pytest.raises(ValueError, match="not in tools"):
        ChatCompletionRequest(**base, tools=[TOOL], tool_choice={"type": "function", "function": {"name": "g"}})
    with pytest.raises(ValueError, match="vocabulary"):
        SamplingParams(logit_bias={70000: 1.0}).check_vocab(49152)


def test_prompt_logprobs_gathered_once_across_a_recompute():
    r = Request("r", [1, 2, 3, 4, 5], SamplingParams(prompt_logprobs=0))
    lp = [TokenLogprobs(-float(i), [], []) for i in range(1, 5)]
    r.add_prompt_logprobs(1, lp[:2])
    r.add_prompt_logprobs(1, lp[:3])  # after a preemption the first chunk comes again, a token longer
    r.add_prompt_logprobs(4, lp[3:])
    assert [e.logprob for e in r.prompt_logprobs] == [-1.0, -2.0, -3.0, -4.0]
