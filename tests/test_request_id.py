"""vLLM's caller-chosen request id: the `request_id` field or the `X-Request-Id` header (which wins) names the
response (`cmpl-<id>`, `chatcmpl-<id>`, every chunk too) and comes back as the X-Request-Id header; two callers
using one id at once do not collide in the engine."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

BODY = {"model": "tiny-chat", "prompt": "hi there", "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def url(vllm_chat_server) -> str:
    return vllm_chat_server[0].url


def test_the_callers_id_names_the_response(url):
    answer = httpx.post(url + "/v1/completions", json={**BODY, "request_id": "trace-42"}, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.json()["id"] == "cmpl-trace-42" and answer.headers["x-request-id"] == "cmpl-trace-42"
    chat = httpx.post(url + "/v1/chat/completions", headers={"X-Request-Id": "hdr.7"}, timeout=60, json={
        "model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
        "request_id": "body-loses"})
    assert chat.json()["id"] == "chatcmpl-hdr.7"
    with httpx.stream("POST", url + "/v1/completions", json={**BODY, "stream": True, "request_id": "s-1"},
                      timeout=60) as stream:
        ids = {json.loads(line[6:])["id"] for line in stream.iter_lines()
               if line.startswith("data: {")}
    assert ids == {"cmpl-s-1"}
    plain = httpx.post(url + "/v1/completions", json=BODY, timeout=60)
    assert plain.json()["id"].startswith("cmpl-") and plain.headers["x-request-id"] == plain.json()["id"]


def test_one_id_from_two_callers_at_once_does_not_collide(url):
    async def both() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            body = {**BODY, "max_tokens": 16, "ignore_eos": True, "request_id": "same"}
            return await asyncio.gather(*(client.post(url + "/v1/completions", json=body) for _ in range(2)))

    first, second = asyncio.run(both())
    assert first.status_code == second.status_code == 200, (first.text, second.text)
    assert first.json()["choices"][0]["text"] == second.json()["choices"][0]["text"]


@pytest.mark.parametrize("where", ["body", "header"])
def test_an_id_with_spaces_or_quotes_is_a_400_naming_it(url, where):
    kwargs = ({"json": {**BODY, "request_id": 'a "b"'}} if where == "body"
              else {"json": BODY, "headers": {"X-Request-Id": "a b"}})
    answer = httpx.post(url + "/v1/completions", timeout=60, **kwargs)
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == ("request_id" if where == "body" else "X-Request-Id")
