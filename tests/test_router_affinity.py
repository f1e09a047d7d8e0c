"""The router's side of /v1/responses: a new response is keyed exactly as the chat request it amounts to
(so cache-aware routing treats both alike), a continuation is not keyed (its history is on a worker),
and the affinity table learns response ids from bodies and streams, bounded."""

from __future__ import annotations

import json

from kvserve.router.affinity import ResponseAffinity
from kvserve.router.keys import CHAT_PATH, RESPONSES_PATH, RequestKeyer, load_tokenizer
from kvserve.router.workers import Worker
from test_server_support import chat_model_dir  # noqa: F401

ID = "resp_" + "ab" * 16


def test_a_response_keys_as_its_chat_request(chat_model_dir):  # noqa: F811
    keyer = RequestKeyer(load_tokenizer(str(chat_model_dir)), None)
    response = keyer.key(RESPONSES_PATH, {"model": "m", "input": "Hi there", "instructions": "Be brief."}, None)
    chat = keyer.key(CHAT_PATH, {"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                                            {"role": "user", "content": "Hi there"}]}, None)
    assert response.usable and response.exact and response.tokens == chat.tokens
    continued = keyer.key(RESPONSES_PATH, {"model": "m", "input": "More", "previous_response_id": ID}, None)
    assert not continued.usable
    assert not keyer.key(RESPONSES_PATH, {"model": "m", "input": 5}, None).usable  # the worker answers the 400


def test_affinity_learns_ids_from_bodies_and_streams_and_stays_bounded():
    a, b = Worker(url="http://a", healthy=True), Worker(url="http://b", healthy=True)
    affinity = ResponseAffinity(max_ids=2)
    affinity.learn(a, json.dumps({"id": ID, "object": "response"}).encode())
    first_event = (b'event: response.created\ndata: {"type": "response.created", "response": {"id": "resp_'
                   + b"cd" * 16 + b'", "object": "response"')
    affinity.learn(b, first_event)
    assert affinity.worker(ID, [a, b]) is a and affinity.worker("resp_" + "cd" * 16, [a, b]) is b
    assert affinity.worker(ID, [b]) is None  # its worker left the pool: the policy decides
    affinity.learn(a, b'{"error": {"message": "no id here"}}')
    affinity.learn(a, json.dumps({"id": "resp_" + "ef" * 16}).encode())
    assert len(affinity) == 2 and affinity.worker("resp_" + "cd" * 16, [a, b]) is None  # least recent went
    assert affinity.worker(None, [a, b]) is None
