"""What a request's output must match, as it travels in SamplingParams; its llguidance grammar.

torch-free: the API server checks a spec against the model's tokenizer (an uncompilable one is the
client's 400) and the worker compiles it. The grammar library is llguidance (vLLM's `guidance`
backend, also in SGLang): it has no dependencies, where xgrammar pulls triton and an unpinned torch.

JSON is compact by default (no free whitespace between tokens: `{"a":1,"b":[2]}`). With free
whitespace a small model, once it has written the last value, may write newlines until max_tokens;
`whitespace_flexible` (vLLM's `disable_any_whitespace: false`) or a `whitespace_pattern` allows them.
JSON schemas compile closed unless `open_objects` (strict_schema.py), and their numbers are bounded
(json_guard.py). `tool_calls` is the Hermes tool-call grammar (tool_call_grammar.py) over the request's
functions, its value their JSON.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import msgspec

from pdserve.structured.strict_schema import close_schema
from pdserve.structured.tool_call_grammar import tool_call_lark

KINDS = ("json", "json_object", "regex", "choice", "grammar", "lark", "tool_calls")


class StructuredOutput(msgspec.Struct, kw_only=True, omit_defaults=True, frozen=True):
    kind: str  # one of KINDS
    value: str = ""  # JSON schema text, regex, JSON list of choices, grammar text (Lark or GBNF), tool calls' JSON
    whitespace_flexible: bool = False
    whitespace_pattern: str | None = None
    open_objects: bool = False  # json: objects admit undeclared keys where the schema is silent (JSON Schema's own)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}, got {self.kind!r}")


def json_schema(schema: dict | bool, whitespace_flexible: bool = False,
                whitespace_pattern: str | None = None, open_objects: bool = False) -> StructuredOutput:
    """The spec for a JSON schema (offline use: `SamplingParams(structured=json_schema(schema))`)."""
    return StructuredOutput(kind="json", value=json.dumps(schema), whitespace_flexible=whitespace_flexible,
                            whitespace_pattern=whitespace_pattern, open_objects=open_objects)


def tool_call_spec(tools: list[dict[str, Any]], only: str | None, parallel: bool,
                   forced: bool = True) -> StructuredOutput:
    """`only`: the one function to call (a named tool_choice); None: any of `tools`. `forced`: the answer is
    calls only (required, named); otherwise text may come instead or before (auto)."""
    functions = [{"name": t["function"]["name"], "parameters": t["function"].get("parameters"),
                  "strict": t["function"].get("strict")}
                 for t in tools if only is None or t["function"]["name"] == only]
    value = {"functions": functions, "parallel": parallel and only is None, "forced": forced}
    return StructuredOutput(kind="tool_calls", value=json.dumps(value))


def is_parallel(spec: StructuredOutput) -> bool:
    return spec.kind == "tool_calls" and bool(json.loads(spec.value)["parallel"])


@lru_cache(maxsize=256)
def grammar_of(spec: StructuredOutput) -> str:
    """The llguidance grammar (JSON text) for `spec`; ValueError when it cannot be built."""
    from llguidance import LLMatcher, grammar_from

    if spec.kind == "tool_calls":
        return grammar_from("lark", tool_call_lark(json.loads(spec.value)))
    if spec.kind in ("json", "json_object"):
        schema = spec.value if spec.kind == "json" else '{"type": "object"}'
        if spec.kind == "json" and not spec.open_objects:
            schema = json.dumps(close_schema(json.loads(schema)))
        options: dict = {"whitespace_flexible": spec.whitespace_flexible or spec.whitespace_pattern is not None}
        if spec.whitespace_pattern is not None:
            options["whitespace_pattern"] = spec.whitespace_pattern
        return LLMatcher.grammar_from_json_schema(schema, overrides=options)
    if spec.kind == "choice" and not json.loads(spec.value):
        raise ValueError("choice needs a non-empty list of strings")
    return grammar_from(spec.kind, spec.value)


@lru_cache(maxsize=4)
def grammar_tokenizer(tokenizer_json: Path, vocab_size: int | None = None,
                      eos_token_ids: tuple[int, ...] = ()) -> object:
    """llguidance's view of the model's tokenizer (~0.3 s to build: once per process)."""
    from llguidance import LLTokenizer

    return LLTokenizer(tokenizer_json.read_text(), n_vocab=vocab_size, eos_token=list(eos_token_ids) or None)


def check(spec: StructuredOutput, tokenizer: object | None = None) -> None:
    """Raise ValueError (the reason, for a 400) if `spec` does not compile. With the model's tokenizer
    (grammar_tokenizer) this catches what only the vocabulary decides (special tokens, token ranges)."""
    from llguidance import LLMatcher

    try:
        error = LLMatcher.validate_grammar(grammar_of(spec), tokenizer)
    except ValueError:
        raise
    except Exception as e:  # llguidance raises plain exceptions for some malformed inputs
        raise ValueError(str(e)) from None
    if error:
        raise ValueError(error.strip())
