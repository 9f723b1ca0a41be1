"""What applications send, against `pdserve serve` (mixed role, fp32): structured outputs, tool calls,
logit bias, prompt scoring, tokenize/detokenize, ids, and honest streams, through the `openai` client
and LangChain as their users call them. tests/test_pd.py checks the same requests through a PD pair.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
import torch
from pydantic import BaseModel, Field

from tests.servers import Server

pytestmark = pytest.mark.e2e  # starts pdserve processes or loads the model: not in `make test-fast`

MODEL = "SmolLM2-135M-Instruct"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
ASK_PERSON = [{"role": "user", "content": "Describe a user of our website as JSON."}]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    s = Server(tmp_path_factory.mktemp("apps"), "--num-gpu-blocks-override", "400", "--max-model-len", "2048",
               "--dtype", "float32", "--quantization", "none")
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


def _person(client: openai.OpenAI, **kw) -> list[str]:
    out = client.chat.completions.create(
        model=MODEL, messages=ASK_PERSON, max_tokens=150, temperature=kw.pop("temperature", 0),
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
        **kw)
    assert all(c.finish_reason == "stop" for c in out.choices), [c.finish_reason for c in out.choices]
    return [c.message.content for c in out.choices]


# ---- structured outputs ------------------------------------------------------------------------

@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 7}, {"temperature": 1.2}])
def test_json_schema_answers_validate(client, sampling):
    for text in _person(client, **sampling):
        jsonschema.validate(json.loads(text), PERSON)
        assert not _whitespace_outside_strings(text), f"compact JSON is the default: {text!r}"


def _whitespace_outside_strings(text: str) -> bool:
    """JSON with free whitespace between tokens (a string value may hold any, e.g. "a: b")."""
    in_string = escaped = False
    for ch in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            in_string = True
        elif ch.isspace():
            return True
    return False


def test_json_schema_n2_and_streamed(client):
    texts = _person(client, n=2, temperature=1.0, seed=3)
    assert len(texts) == 2
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    stream = list(client.chat.completions.create(
        model=MODEL, messages=ASK_PERSON, max_tokens=150, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}))
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == _person(client)[0]
    counts = [c.usage.completion_tokens for c in stream]  # vLLM's continuous usage: a running count
    assert counts == sorted(counts) and counts[-1] > counts[0] >= 1


def test_json_object_and_vllm_parameters(client):
    def ask(**extra) -> str:
        out = client.chat.completions.create(model=MODEL, messages=ASK_PERSON, max_tokens=80, temperature=0, **extra)
        return out.choices[0].message.content

    describe = [{"role": "user", "content": "Write a JSON object describing a cat."}]
    cat = client.chat.completions.create(model=MODEL, max_tokens=120, temperature=0, messages=describe,
                                         response_format={"type": "json_object"}).choices[0].message.content
    assert isinstance(json.loads(cat), dict)
    assert ask(extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}}) in ("yes", "no", "maybe")
    assert ask(extra_body={"guided_choice": ["red", "green"]}) in ("red", "green")
    phone = ask(extra_body={"structured_outputs": {"regex": r"\+1-[0-9]{3}-[0-9]{4}"}})
    assert phone.startswith("+1-") and len(phone) == 11 and phone[3:6].isdigit(), phone
    assert ask(extra_body={"guided_regex": "(cat|dog)s?"}) in ("cat", "cats", "dog", "dogs")
    gbnf = 'root ::= "Answer: " ("A" | "B" | "C")'
    assert ask(extra_body={"structured_outputs": {"grammar": gbnf}}) in ("Answer: A", "Answer: B", "Answer: C")
    jsonschema.validate(json.loads(ask(extra_body={"guided_json": PERSON})), PERSON)


def test_json_cut_by_max_tokens_says_length(client):
    out = client.chat.completions.create(
        model=MODEL, messages=ASK_PERSON, max_tokens=5, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 5


def test_uncompilable_schema_and_conflicts_are_400(client):
    bad = [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}},
        {"extra_body": {"guided_regex": "[a-z"}},
        {"extra_body": {"structured_outputs": {"grammar": "root ::= ("}}},
        {"extra_body": {"structured_outputs": {"grammar": 'start: "a" <|no_such_token|>'}}},  # the vocabulary says
        {"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a+"}},
        {"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}},
    ]
    for kw in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=ASK_PERSON, max_tokens=8, **kw)
        assert e.value.status_code == 400, kw
    with pytest.raises(openai.BadRequestError, match="missing"):
        client.chat.completions.create(model=MODEL, messages=ASK_PERSON, max_tokens=8, extra_body={
            "guided_json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}})


def test_pydantic_parse(client):
    class City(BaseModel):
        name: str = Field(max_length=30)
        country: str = Field(max_length=30)
        population: int = Field(ge=0, le=100_000_000)  # unbounded, this model writes digits until max_tokens

    out = client.chat.completions.parse(model=MODEL, max_tokens=80, temperature=0, response_format=City,
                                        messages=[{"role": "user", "content": "Tell me about Paris as JSON."}])
    city = out.choices[0].message.parsed
    assert isinstance(city, City) and city.name


# ---- tool calls --------------------------------------------------------------------------------

def _arguments_valid(call, tool: dict) -> dict:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    assert call.id.startswith("call_") and call.type == "function"
    return args


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls(client, choice):
    out = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=100, temperature=0,
                                         tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=choice,
                                         parallel_tool_calls=False)
    msg = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls"
    assert msg.content is None and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    wanted = "get_time" if isinstance(choice, dict) else call.function.name
    assert call.function.name == wanted in ("get_weather", "get_time")
    _arguments_valid(call, WEATHER_TOOL if wanted == "get_weather" else TIME_TOOL)


ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}


def closed(tool: dict) -> dict:
    """The tool's parameters with additionalProperties false: what its calls must validate against."""
    return {"function": {"parameters": {**tool["function"]["parameters"], "additionalProperties": False}}}


def test_two_functions_required_end_in_calls_without_invented_keys(client):
    """Issue 41: with open objects this model called add with keys a to h (the second question) and repeated a
    call word for word (the first); closed, bounded and distinct, its calls validate and end."""
    for question in ("What is 1 + 2?", "Please add 7 and 8 for me."):
        out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                             max_tokens=200, temperature=0, tools=[ADD_TOOL, TIME_TOOL],
                                             tool_choice="required")
        assert out.choices[0].finish_reason == "tool_calls", out.choices[0]
        calls = out.choices[0].message.tool_calls
        for c in calls:
            _arguments_valid(c, closed(ADD_TOOL if c.function.name == "add" else TIME_TOOL))
        assert len({(c.function.name, c.function.arguments) for c in calls}) == len(calls), calls


def test_streamed_tool_call_equals_whole(client):
    kw = dict(model=MODEL, messages=ASK_WEATHER, max_tokens=100, temperature=0, tools=[WEATHER_TOOL],
              tool_choice="required", parallel_tool_calls=False)
    whole = client.chat.completions.create(**kw).choices[0]
    chunks = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    calls = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks)


def test_auto_tool_choice_parses_calls_the_model_writes(client):
    """In `auto` the model decides; a greedy answer whose text holds a <tool_call> block (forced here
    by a grammar on the same text format) comes back as tool_calls, else as content."""
    out = client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, max_tokens=100, temperature=0, tools=[WEATHER_TOOL], tool_choice="auto",
        extra_body={"structured_outputs": {"regex": r'<tool_call>\n\{"name":"get_weather","arguments":'
                                                    r'\{"city":"Paris","unit":"celsius"\}\}\n</tool_call>'}})
    msg = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls"
    assert msg.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})]
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                                           max_tokens=20, temperature=0, tools=[WEATHER_TOOL], tool_choice="auto")
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content


def test_tool_result_turn_is_answered(client):
    history = [*ASK_WEATHER,
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "sunny"}'}]
    out = client.chat.completions.create(model=MODEL, messages=history, max_tokens=30, temperature=0,
                                         tools=[WEATHER_TOOL])
    assert out.choices[0].message.content


def test_tools_rejected_cleanly(client):
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=8, tools=[WEATHER_TOOL],
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="functions"):
        client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=8,
                                       functions=[WEATHER_TOOL["function"]])


def test_langchain_structured_output_and_tools(server):
    from langchain_openai import ChatOpenAI

    class Weather(BaseModel):
        city: str
        temperature_celsius: int

    llm = ChatOpenAI(base_url=f"{server.url}/v1", api_key="x", model=MODEL, temperature=0, max_tokens=80,
                     max_retries=0)
    got = llm.with_structured_output(Weather, method="json_schema").invoke("The weather in Rome: 24 degrees.")
    assert isinstance(got, Weather) and got.city

    class Product(BaseModel):
        name: str
        quantity: int
        price: float

    class Constant(BaseModel):
        name: str
        digits: int
        value: float

    # As a function call, both floats ran to max_tokens (1.99999..., 1.618181818...) before numbers were bounded
    for model, text in ((Product, "The laptop costs 999.99, we have 3."), (Constant, "What is the golden ratio?")):
        answer = llm.model_copy(update={"max_tokens": 200}).with_structured_output(
            model, method="function_calling", include_raw=True).invoke(text)
        assert isinstance(answer["parsed"], model), answer
        assert answer["raw"].response_metadata["finish_reason"] == "tool_calls"
    bound = llm.bind_tools([WEATHER_TOOL], tool_choice="get_weather")
    msg = bound.invoke("What is the weather like in Oslo?")
    assert [c["name"] for c in msg.tool_calls] == ["get_weather"]
    jsonschema.validate(msg.tool_calls[0]["args"], WEATHER_TOOL["function"]["parameters"])


# ---- logit bias, prompt scoring ----------------------------------------------------------------

def test_logit_bias_and_allowed_token_ids_move_the_greedy_token(client, server):
    prompt = "The capital of France is"
    base = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=1)
    plain = base.choices[0].logprobs.tokens[0]
    target = httpx.post(f"{server.url}/tokenize", json={"prompt": " banana"}).json()["tokens"][0]
    biased = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                       logit_bias={str(target): 100})
    assert biased.choices[0].text == " banana" != plain
    banned = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                       extra_body={"allowed_token_ids": [target]})
    assert banned.choices[0].text == " banana"
    with pytest.raises(openai.BadRequestError, match="vocabulary"):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, logit_bias={"99999999": 5})


def test_echo_logprobs_equal_transformers(client, hf_gguf_model, hf_gguf_tokenizer):
    prompt = "The quick brown fox jumps over the lazy dog. Paris is the capital of"
    ids = hf_gguf_tokenizer(prompt, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = hf_gguf_model(torch.tensor([ids])).logits[0].float()
    want = torch.log_softmax(logits, dim=-1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
    for max_tokens in (0, 3):
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, echo=True, logprobs=1,
                                        temperature=0)
        lp = out.choices[0].logprobs
        assert out.choices[0].text.startswith(prompt)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        got = lp.token_logprobs[1:len(ids)]
        assert got == pytest.approx(want, abs=2e-3)
        assert len(lp.tokens) == len(ids) + max_tokens
        assert out.usage.completion_tokens == max_tokens
    scored = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                       extra_body={"prompt_logprobs": 2})
    entries = scored.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    assert [e[str(t)]["logprob"] for e, t in zip(entries[1:], ids[1:], strict=True)] == pytest.approx(want, abs=2e-3)


@pytest.mark.parametrize("logprobs", [None, 1])
def test_streamed_echo_equals_whole(client, logprobs):
    kw = dict(model=MODEL, prompt="The capital of France is", max_tokens=4, echo=True, logprobs=logprobs,
              temperature=0)
    whole = client.completions.create(**kw).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw) if c.choices]
    assert "".join(c.text for c in chunks) == whole.text
    assert whole.text.startswith("The capital of France is")
    if logprobs:
        streamed = [lp for c in chunks if c.logprobs for lp in c.logprobs.token_logprobs]
        assert streamed == whole.logprobs.token_logprobs


# ---- ids, streams, tokenize --------------------------------------------------------------------

def test_first_chat_chunk_leaves_with_the_first_token(client, server):
    """A ~900-token prompt: the stream's first chunk comes no sooner than the prompt is computed."""
    def prompt(i: int) -> list[dict]:
        text = " ".join(f"Note {j + 100 * i}: the meeting moved to room {j % 7}." for j in range(80))
        return [{"role": "user", "content": text + " Summarise."}]

    t0 = time.perf_counter()
    client.chat.completions.create(model=MODEL, messages=prompt(1), max_tokens=1, temperature=0)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    stream = client.chat.completions.create(model=MODEL, messages=prompt(2), max_tokens=4, temperature=0,
                                            stream=True)
    first = next(iter(stream))
    first_chunk = time.perf_counter() - t0
    assert first.choices[0].delta.role == "assistant"
    assert first_chunk > 0.5 * prefill, f"first chunk after {first_chunk:.3f} s, the prompt takes {prefill:.3f} s"
    list(stream)


def test_ids_are_unique(client):
    def ask(i: int) -> str:
        if i % 2:
            return client.completions.create(model=MODEL, prompt="Hi", max_tokens=1).id
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=1).id
    with ThreadPoolExecutor(16) as pool:  # (1,000 across two instances: tests/test_pd.py)
        ids = list(pool.map(ask, range(200)))
    assert len(set(ids)) == len(ids)
    assert all(len(i.split("-", 1)[1]) >= 24 for i in ids), ids[:3]


def test_tokenize_detokenize_round_trip(server):
    text = "Structured outputs, tools: ça marche!"
    tok = httpx.post(f"{server.url}/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"]) and tok["max_model_len"] == 2048
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": tok["tokens"]}).json() == {"prompt": text}
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": ASK_PERSON}).json()
    assert chat["count"] > tok["count"]
    bad = httpx.post(f"{server.url}/detokenize", json={"tokens": [-1]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


@pytest.mark.parametrize(("field", "value"), [("best_of", 2), ("use_beam_search", True), ("suffix", "x"),
                                             ("bad_words", ["a"]), ("include_stop_str_in_output", True)])
def test_unimplemented_fields_are_400_naming_them(server, field, value):
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "user": "u1",
                                                          "metadata": {"a": "b"}, "store": False})
    assert ok.status_code == 200, ok.text


# ---- the Responses API -------------------------------------------------------------------------

def test_responses_api_whole_streamed_and_json(client):
    kw = dict(model=MODEL, input="Name three colors.", instructions="Answer briefly.", max_output_tokens=20,
              temperature=0)
    whole = client.responses.create(**kw)
    assert whole.status in ("completed", "incomplete") and whole.output_text
    assert whole.id.startswith("resp_") and whole.usage.output_tokens > 0
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    as_json = client.responses.create(model=MODEL, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Describe a user of our website as JSON."}]}], max_output_tokens=150,
        temperature=0, text={"format": {"type": "json_schema", "name": "person", "schema": PERSON}})
    jsonschema.validate(json.loads(as_json.output_text), PERSON)
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_1")
