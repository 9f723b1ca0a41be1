"""Grammars that keep a model on track (issue 41), checked on the masks the sampler gets: closed objects for
JSON schemas and tool parameters, numbers bounded by what float64/int64 can mean, one call without parallel
tool calls, no call repeated with them, and tool_choice auto's text-or-calls grammar."""

from __future__ import annotations

import json

import pytest

from pdserve.api.protocol import ChatCompletionRequest
from pdserve.structured.json_guard import START, advance
from pdserve.structured.matcher import GrammarCompiler, SequenceGrammar, allowed_tokens
from pdserve.structured.spec import StructuredOutput, json_schema, tool_call_spec
from pdserve.structured.strict_schema import close_schema

VOCAB = 49152
POINT = {"type": "object", "properties": {"x": {"type": "number"}, "n": {"type": "integer"}}, "required": ["x"]}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
CITY = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def call(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name":"{name}","arguments":{args}}}\n</tool_call>'


@pytest.fixture(scope="module")
def compiler(embedded_folder) -> GrammarCompiler:
    return GrammarCompiler(embedded_folder / "tokenizer.json", VOCAB)


@pytest.fixture(scope="module")
def fits(compiler, embedded_tokenizer):
    """Whether the sampler may write `text` token by token under `spec` (the grammar's mask and the guard's,
    as the worker ANDs them), and the grammar accepts it whole."""
    def check(spec: StructuredOutput, text: str, complete: bool = True) -> bool:
        seq = SequenceGrammar(spec, embedded_tokenizer.eos_token_ids, [])
        for token in embedded_tokenizer.encode(text, add_special_tokens=False):
            bits = compiler.fill_async([seq]).result()
            if seq.error is not None or (bits is not None and not allowed_tokens(bits, VOCAB)[0, token]):
                return False
            seq.advance(token)
        compiler.fill_async([seq]).result()
        return seq.error is None and (not complete or seq.matcher.is_accepting())
    return check


def test_objects_close_where_the_schema_is_silent():
    schema = {"type": "object", "properties": {"inner": {"type": "object", "properties": {"a": {"type": "string"}}},
                                               "open": {"type": "object", "additionalProperties": True},
                                               "typed": {"type": "object", "additionalProperties": {"type": "integer"}},
                                               "pair": {"type": "array", "prefixItems": [{"type": "integer"}]},
                                               "list": {"type": "array", "items": {"properties": {"k": {}}}}},
              "$defs": {"A": {"properties": {"a": {}}}, "B": {"properties": {"b": {}}}, "C": {"type": "object"}},
              "anyOf": [{"$ref": "#/$defs/C"}, {"allOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}]}]}
    closed = close_schema(schema)
    props = closed["properties"]
    assert closed["additionalProperties"] is False and props["inner"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True
    assert props["typed"]["additionalProperties"] == {"type": "integer"}
    assert props["pair"]["items"] is False and props["list"]["items"]["additionalProperties"] is False
    # branches of an intersection stay open (each would refuse the other's keys); a lone object closes
    assert "additionalProperties" not in closed["$defs"]["A"] and "additionalProperties" not in closed["$defs"]["B"]
    assert closed["$defs"]["C"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the client's schema is not changed


def test_json_schema_refuses_undeclared_keys_unless_opened(fits):
    assert fits(json_schema(POINT), '{"x":1.5,"n":2}')
    assert not fits(json_schema(POINT), '{"x":1.5,"y":2}', complete=False)
    assert fits(json_schema({**POINT, "additionalProperties": True}), '{"x":1.5,"y":2}')
    assert fits(json_schema(POINT, open_objects=True), '{"x":1.5,"y":2}')
    assert fits(StructuredOutput(kind="json_object"), '{"any":{"key":[1]}}')


@pytest.mark.parametrize("number, ok", [
    ("1.2345678901234567", True), ("1.23456789012345678", False),  # 17 significant digits, 18
    ("123456789012345678.5", False), ("0.000000000000000001", True), ("0.0000000000000000001", False),
    ("1.5e308", True), ("1.5e-307", True), ("1.5e3080", False), ("12345678901234567e2", True),
    ("123456789012345678e2", False)])
def test_numbers_with_a_fraction_or_exponent_are_bounded(fits, number, ok):
    assert fits(json_schema(POINT), f'{{"x":{number}}}', complete=False) is ok


def test_integers_are_bounded_and_strings_are_not(fits):
    assert fits(json_schema(POINT), '{"x":1,"n":-1234567890123456789}')
    assert not fits(json_schema(POINT), '{"x":1,"n":12345678901234567890}', complete=False)
    assert fits(json_schema({"type": "string"}), '"' + "1234567890" * 10 + '"')
    assert not fits(json_schema({"type": "string", "maxLength": 5}), '"123456"', complete=False)
    assert fits(json_schema({"type": "array", "items": {"type": "string"}}), '["1.23456789012345678"]')


def test_the_lexer_follows_strings_and_escapes():
    assert advance(START, b'"a\\"1234567890123456789012"') == START  # digits inside a string, escaped quote
    assert advance(START, b"12345678901234567890") is None


def test_tool_calls_are_closed_bounded_and_one_without_parallel(fits):
    required = tool_call_spec([ADD, CITY], None, parallel=True)
    assert fits(required, call("add", '{"a":1,"b":2}') + "\n" + call("get_weather", '{"city":"Rome"}'))
    assert not fits(required, call("add", '{"a":1,"b":2,"c":3}'), complete=False)
    assert not fits(required, call("add", '{"a":1,"b":12345678901234567890}'), complete=False)
    one = tool_call_spec([ADD, CITY], None, parallel=False)
    assert fits(one, call("add", '{"a":1,"b":2}'))
    assert not fits(one, call("add", '{"a":1,"b":2}') + "\n" + call("add", '{"a":3,"b":4}'), complete=False)
    open_add = {"type": "function", "function": {**ADD["function"], "strict": False}}
    assert fits(tool_call_spec([open_add], None, parallel=True), call("add", '{"a":1,"b":2,"c":3}'))


def test_a_call_repeating_an_earlier_one_is_not_offered(fits):
    required = tool_call_spec([ADD, CITY], None, parallel=True)
    add = call("add", '{"a":1,"b":2}')
    assert fits(required, add + "\n" + call("add", '{"a":1,"b":23}'))
    assert not fits(required, add + "\n" + add, complete=False)
    # a closed object's last string: closing it would leave the grammar only the repeat, so the quote is refused
    paris = call("get_weather", '{"city":"Paris"}')
    assert not fits(required, paris + "\n" + paris, complete=False)
    assert fits(required, paris + "\n" + call("get_weather", '{"city":"Paris, France"}'))


def test_auto_is_text_or_text_then_calls(fits):
    auto = tool_call_spec([ADD], None, parallel=True, forced=False)
    assert fits(auto, "No tool needed: 12345678901234567890123 is just a number in text.")
    assert fits(auto, "Let me add them.\n" + call("add", '{"a":1,"b":2}'))
    assert not fits(auto, "Sure.\n" + call("add", '{"a":1,"b":2,"c":3}'), complete=False)
    assert not fits(auto, call("add", '{"a":1,"b":2}') + "\nand some text after", complete=False)


def test_draft_rows_carry_the_number_bound(compiler, embedded_tokenizer):
    """Speculative decoding: the mask after each accepted proposal also holds the bound."""
    tok = embedded_tokenizer
    written = tok.encode('{"x":1.234567890123456', add_special_tokens=False)  # 16 significant digits
    seq = SequenceGrammar(json_schema(POINT), tok.eos_token_ids, written)
    seven, eight = (tok.encode(d, add_special_tokens=False)[0] for d in "78")
    rows = allowed_tokens(compiler.fill_async([seq], [[seven]]).result(), VOCAB)
    assert rows[0, seven] and not rows[1, eight]  # the 17th digit may come; an 18th may not


def test_requests_opt_out_of_closed_objects():
    base = {"messages": [{"role": "user", "content": "x"}]}

    def spec(**kw) -> StructuredOutput:
        return ChatCompletionRequest(**base, **kw).structured_spec()

    def schema_format(**strict) -> dict:
        return {"type": "json_schema", "json_schema": {"name": "p", "schema": POINT, **strict}}

    assert not spec(response_format=schema_format()).open_objects
    assert not spec(response_format=schema_format(strict=True)).open_objects
    assert spec(response_format=schema_format(strict=False)).open_objects
    assert not spec(structured_outputs={"json": POINT}).open_objects
    assert spec(structured_outputs={"json": POINT, "disable_additional_properties": False}).open_objects
    assert not spec(guided_json=POINT).open_objects
    assert json.loads(spec(guided_json=POINT).value) == POINT  # the client's schema travels as sent
