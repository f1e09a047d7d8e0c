"""Structured output, tool calls and the new sampling fields over HTTP, through the official `openai` client.

On the tiny chat model (random weights, so any valid structure comes from the mask): response_format
json_schema, vLLM's structured_outputs (regex, choice, grammar) and guided_* names, tool_choice
"required" / named (OpenAI `tool_calls`), a tool round trip, "auto" refused without a tools-capable
template and honoured with one, logit_bias forcing and banning tokens, and penalties / min_tokens /
stop_token_ids giving exactly what the offline engine gives. The real model answers 20 JSON schemas
(`@pytest.mark.model`).
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from tokenizers import Tokenizer

from kvserve import LLM, SamplingParams
from kvserve.server.launcher import launch_server
from test_server_support import wait_until_drained

MODEL = "tiny-chat"
USER = [{"role": "user", "content": "Hello, how are you today?"}]
SCHEMA = {
    "type": "object",
    "properties": {
        "mood": {"enum": ["good", "bad"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 9},
        "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    },
    "required": ["mood", "score", "flags"],
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"]}},
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
TOOLS_TEMPLATE = (
    "{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def server(vllm_chat_server):
    return vllm_chat_server[0]


@pytest.fixture(scope="module")
def chat_model_dir(vllm_chat_server):
    return vllm_chat_server[1]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(chat_model_dir) -> Tokenizer:
    return Tokenizer.from_file(str(Path(chat_model_dir) / "tokenizer.json"))


def chat(client, **fields):
    fields.setdefault("max_tokens", 150)
    return client.chat.completions.create(model=MODEL, messages=fields.pop("messages", USER), **fields)


def test_json_schema_response_format(client):
    for seed in range(3):
        response = chat(client, temperature=1.0, seed=seed, response_format={
            "type": "json_schema", "json_schema": {"name": "mood", "schema": SCHEMA, "strict": True}})
        choice = response.choices[0]
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        assert choice.finish_reason == "stop"


def test_structured_outputs_extra_field(client):
    regex = chat(client, max_tokens=40, extra_body={"structured_outputs": {"regex": r"[0-9]{2}-(ab|cd)"}})
    assert re.fullmatch(r"[0-9]{2}-(ab|cd)", regex.choices[0].message.content)
    choice = chat(client, extra_body={"structured_outputs": {"choice": ["left", "right"]}}, n=3, temperature=1.0)
    assert {c.message.content for c in choice.choices} <= {"left", "right"}
    grammar = client.completions.create(model=MODEL, prompt="Sum:", max_tokens=30, extra_body={
        "structured_outputs": {"grammar": 'root ::= [0-9] ("+" [0-9])* "="'}})
    assert re.fullmatch(r"[0-9](\+[0-9])*=", grammar.choices[0].text)
    guided = chat(client, extra_body={"guided_choice": ["yes", "no"]})
    assert guided.choices[0].message.content in ("yes", "no")


def test_two_constraints_are_refused(client):
    with pytest.raises(openai.BadRequestError) as error:
        chat(client, response_format={"type": "json_object"}, extra_body={"guided_regex": "a+"})
    assert error.value.body["param"] in ("guided_regex", "response_format")


def test_tool_choice_required_returns_tool_calls(client):
    response = chat(client, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    assert call.id and call.type == "function"


def test_named_tool_and_round_trip(client):
    named = chat(client, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), TIME["function"]["parameters"])
    messages = USER + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"time": "12:00"}'},
    ]
    reply = chat(client, messages=messages, tools=[WEATHER, TIME], tool_choice="none", max_tokens=5)
    assert reply.choices[0].message.content is not None and not reply.choices[0].message.tool_calls


def streamed_calls(client, **fields) -> tuple[list[dict], str, str]:
    """A streamed chat's tool-call deltas assembled as the openai client's users do: calls by index."""
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in chat(client, stream=True, **fields):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": delta.id, "name": None, "arguments": ""})
                call["name"] = delta.function.name or call["name"]
                call["arguments"] += delta.function.arguments or ""
    return [calls[i] for i in sorted(calls)], content, finish


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_calls_equal_the_whole_answer(client, tool_choice):
    fields = {"tools": [WEATHER, TIME], "tool_choice": tool_choice, "temperature": 1.0, "seed": 4}
    whole = chat(client, **fields).choices[0]
    calls, content, finish = streamed_calls(client, **fields)
    assert finish == whole.finish_reason == "tool_calls" and content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
    assert all(c["id"].startswith("call_") for c in calls)


def test_auto_tools_need_a_tools_template(client):
    with pytest.raises(openai.BadRequestError) as error:
        chat(client, tools=[WEATHER])
    assert error.value.body["param"] == "tools" and "template" in error.value.body["message"]
    response = chat(client, tools=[WEATHER], tool_choice="auto", max_tokens=8,
                    extra_body={"chat_template": TOOLS_TEMPLATE})
    assert response.choices[0].message.content or response.choices[0].message.tool_calls
    assert response.usage.prompt_tokens > 40  # the tools were rendered into the prompt


def test_logit_bias_forces_and_bans(client, tokenizer):
    words = [t for t in range(3, tokenizer.get_vocab_size()) if tokenizer.decode([t]).strip().isalpha()]
    forced = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=1.0, seed=1,
                                       logit_bias={str(words[0]): 100})
    assert forced.choices[0].text == tokenizer.decode([words[0]] * 4)
    allowed = {words[1], words[2]}
    banned = {str(t): -100 for t in range(tokenizer.get_vocab_size()) if t not in allowed}
    for seed in range(2):
        out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=1.0, seed=seed,
                                        logit_bias=banned)
        texts = "|".join(re.escape(tokenizer.decode([t])) for t in allowed)
        assert re.fullmatch(f"({texts})+", out.choices[0].text)


def test_sampling_fields_equal_the_engine(client, chat_model_dir):
    fields = dict(repetition_penalty=1.5, presence_penalty=0.8, frequency_penalty=0.4, min_tokens=3,
                  stop_token_ids=[5], include_stop_str_in_output=True, skip_special_tokens=False)
    prompt = [10, 20, 30, 40, 50, 60]
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0.0,
                                         stop=["the"], extra_body=fields)
    llm = LLM(str(chat_model_dir), progress=False, num_blocks=64)
    expected = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, stop=["the"], **fields),
                            use_tqdm=False)[0].outputs[0]
    plain = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)[0].outputs[0]
    assert response.choices[0].text == expected.text and expected.text != plain.text
    assert response.choices[0].finish_reason == expected.finish_reason


def test_blocks_drain(server, client):
    chat(client, max_tokens=2)
    wait_until_drained(server.url)


@pytest.mark.model
def test_twenty_json_schemas_real_model():
    schemas = _twenty_schemas()
    with launch_server(["smollm2-135m", "--kv-cache-memory", "64MiB", "--max-num-seqs", "20"],
                       startup_timeout=240) as process:
        client = openai.OpenAI(base_url=process.base_url, api_key="unused", max_retries=0, timeout=120)

        def ask(item):
            name, schema = item
            response = client.chat.completions.create(
                model="smollm2-135m", max_tokens=80, temperature=0.0,
                messages=[{"role": "user", "content": f"Give a {name} as JSON."}],
                response_format={"type": "json_schema",
                                 "json_schema": {"name": name, "schema": schema, "strict": True}})
            return schema, response.choices[0]

        with ThreadPoolExecutor(max_workers=10) as pool:
            results = list(pool.map(ask, schemas.items()))
        for schema, choice in results:
            jsonschema.validate(json.loads(choice.message.content), schema)
            assert choice.finish_reason == "stop"
        assert httpx.get(process.url + "/health", timeout=10).status_code == 200


def _twenty_schemas() -> dict[str, dict]:
    text = {"type": "string", "maxLength": 12}
    small = {"type": "integer", "minimum": 0, "maximum": 999}

    def obj(**props):
        return {"type": "object", "properties": props, "required": list(props)}

    return {
        "person": obj(name=text, age=small),
        "city": obj(name=text, country=text, population=small),
        "colour": obj(colour={"enum": ["red", "green", "blue"]}),
        "book": obj(title=text, year=small, genre={"enum": ["fiction", "science", "history"]}),
        "point": obj(x=small, y=small),
        "flag": obj(enabled={"type": "boolean"}),
        "tags": obj(tags={"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}),
        "address": obj(street=text, city=text, zip={"type": "string", "pattern": "^[0-9]{5}$"}),
        "order": obj(id=small, items={"type": "array", "items": obj(sku=text, qty=small), "maxItems": 2}),
        "employee": obj(name=text, manager=obj(name=text, level=small)),
        "weather": obj(city=text, temp=small, unit={"enum": ["C", "F"]}),
        "rating": obj(stars={"type": "integer", "minimum": 1, "maximum": 5}, comment=text),
        "pair": obj(first=text, second=text),
        "status": obj(code={"enum": [200, 404, 500]}, ok={"type": "boolean"}),
        "matrix": obj(rows={"type": "array", "items": {"type": "array", "items": small, "maxItems": 2},
                            "maxItems": 2}),
        "pet": obj(kind={"enum": ["cat", "dog"]}, name=text, age=small),
        "event": obj(title=text, day={"enum": ["mon", "tue", "wed"]}, hour=small),
        "nested": obj(a=obj(b=obj(c=small))),
        "answer": obj(answer={"enum": ["yes", "no"]}, confidence={"type": "number", "minimum": 0, "maximum": 1}),
        "product": obj(name=text, price=small, stock={"type": "boolean"}, category={"enum": ["food", "toy"]}),
    }
