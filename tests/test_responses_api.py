"""`/v1/responses` through the official `openai` client, on the tiny chat model: every answer equals the
chat endpoint's for the same conversation (greedy), streamed events assemble to the whole response,
`previous_response_id` continues a conversation (and reuses its cached prefix), function tools round-trip,
stored responses can be read and deleted, and bad requests are 4xx naming the field."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from kvserve.server.responses_api.store import ResponseStore
from test_server_support import metric_value, wait_until_drained
from test_structured_server import TIME, WEATHER

MODEL = "tiny-chat"
GREEDY = {"temperature": 0.0, "max_output_tokens": 12}


@pytest.fixture(scope="module")
def server(vllm_chat_server):
    return vllm_chat_server[0]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def chat_text(client, messages, max_tokens=12) -> str:
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0.0)
    return reply.choices[0].message.content


def test_a_response_equals_the_chat_answer(client):
    response = client.responses.create(model=MODEL, input="Hello there, how are you?", **GREEDY)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status in ("completed", "incomplete")
    assert response.output_text == chat_text(client, [{"role": "user", "content": "Hello there, how are you?"}])
    assert response.usage.input_tokens > 0 and response.usage.output_tokens > 0
    with_instructions = client.responses.create(model=MODEL, input="Tell me a fact.", instructions="Be terse.",
                                                **GREEDY)
    assert with_instructions.output_text == chat_text(client, [{"role": "system", "content": "Be terse."},
                                                               {"role": "user", "content": "Tell me a fact."}])


def test_max_output_tokens_makes_it_incomplete(client):
    messages = [{"role": "user", "content": "Count to one hundred."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0.0)
    response = client.responses.create(model=MODEL, input=messages, temperature=0.0, max_output_tokens=2)
    assert chat.choices[0].finish_reason == "length"  # the tiny model's greedy answer is longer
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 2 and response.output_text == chat.choices[0].message.content


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(model=MODEL, input="My name is Ada. Remember it.", **GREEDY)
    second = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id, **GREEDY)
    assert second.previous_response_id == first.id
    history = [{"role": "user", "content": "My name is Ada. Remember it."},
               {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "What is my name?"}]
    assert second.output_text == chat_text(client, history)
    # the second turn's prompt starts with the first's: its whole blocks come from the prefix cache
    assert second.usage.input_tokens_details.cached_tokens >= 16
    third = client.responses.create(model=MODEL, input=[{"role": "user", "content": "Say it again."}],
                                    previous_response_id=second.id, **GREEDY)
    assert third.output_text == chat_text(client, history + [{"role": "assistant", "content": second.output_text},
                                                             {"role": "user", "content": "Say it again."}])


def test_streamed_events_assemble_to_the_whole_response(client):
    whole = client.responses.create(model=MODEL, input="Write a short greeting.", **GREEDY)
    events = list(client.responses.create(model=MODEL, input="Write a short greeting.", stream=True, **GREEDY))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == whole.output_text
    done = next(event for event in events if event.type == "response.output_text.done")
    assert done.text == deltas and done.item_id == final.output[0].id
    assert client.responses.retrieve(final.id).output_text == deltas  # stored at the end of the stream


@pytest.mark.parametrize("stream", [False, True])
def test_function_tools_round_trip(client, stream):
    tools = [{"type": "function", "name": f["function"]["name"], "parameters": f["function"]["parameters"]}
             for f in (WEATHER, TIME)]
    fields = {"model": MODEL, "input": "What time is it?", "tools": tools, "temperature": 1.0,
              "extra_body": {"seed": 3}, "max_output_tokens": 150,
              "tool_choice": {"type": "function", "name": "get_time"}}
    if stream:
        events = list(client.responses.create(stream=True, **fields))
        assert events[-1].type == "response.completed"
        response = events[-1].response
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert [e.arguments for e in done] == [response.output[0].arguments]
    else:
        response = client.responses.create(**fields)
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_time" and json.loads(call.arguments)["zone"] in ("UTC", "CET")
    answer = client.responses.create(
        model=MODEL, previous_response_id=response.id, tools=tools, tool_choice="none", max_output_tokens=5,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"time": "12:00"}'}])
    assert answer.status in ("completed", "incomplete") and answer.output[0].type == "message"


def test_stored_responses_are_read_deleted_or_not_kept(client, server):
    response = client.responses.create(model=MODEL, input="Hi", **GREEDY)
    assert client.responses.retrieve(response.id).output_text == response.output_text
    deleted = httpx.delete(f"{server.url}/v1/responses/{response.id}")
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    unstored = client.responses.create(model=MODEL, input="Hi", store=False, **GREEDY)
    for response_id in (response.id, unstored.id):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(response_id)
        with pytest.raises(openai.NotFoundError) as info:
            client.responses.create(model=MODEL, input="again", previous_response_id=response_id)
        assert info.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize(("fields", "param"), [
    ({"input": "x", "frobnicate": 1}, "frobnicate"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": 5}, "input"),
    ({"input": [{"role": "user", "content": 7}]}, "input"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "temperature": -1}, "temperature"),
    ({"input": "x", "cache_salt": "a/b"}, "cache_salt"),
])
def test_bad_requests_name_the_field(server, fields, param):
    answer = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, **fields}, timeout=30)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert param in (error["param"] or "") or param in error["message"]


def test_every_block_comes_back_and_the_store_is_measured(client, server):
    before = metric_value(server.url, "kvserve_responses_stored")
    for store in (True, False):
        client.responses.create(model=MODEL, input="One more thing.", store=store, **GREEDY)
    wait_until_drained(server.url)
    assert metric_value(server.url, "kvserve_responses_stored") == before + 1
    assert metric_value(server.url, "kvserve_responses_stored_chars") >= len("One more thing.")


def test_the_store_is_bounded_and_keyed_by_tenant():
    store = ResponseStore(max_responses=2, max_chars=1000)
    for name in ("a", "b", "c"):
        store.put("alice", {"id": name}, [{"role": "user", "content": name}])
    assert store.get("alice", "a") is None and store.get("alice", "c") is not None  # least recent went first
    assert store.get("bob", "c") is None and not store.delete("bob", "c")  # another tenant: not found
    store.put("alice", {"id": "big"}, [{"role": "user", "content": "x" * 2000}])
    assert len(store) == 1 and store.get("alice", "big") is not None  # over the char budget: only itself kept


def test_refused_fields_pass_at_their_neutral_values(server):
    neutral = {"reasoning": None, "include": [], "background": False, "truncation": "disabled", "top_logprobs": 0,
               "service_tier": "auto"}
    answer = httpx.post(f"{server.url}/v1/responses", timeout=30,
                        json={"model": MODEL, "input": "x", "max_output_tokens": 2, **neutral})
    assert answer.status_code == 200, answer.text
