"""Background requests (a router's idle copies, engine/background.py), counted in engine steps.

A background request must cost the server's own callers at most one short step: it waits behind every
foreground request, computes at most BACKGROUND_CHUNK_TOKENS a step, sits out while anyone else waits or
runs, never evicts a cached block, and its blocks serve a later foreground request as a hit. Each check
below fails if the corresponding rule is dropped (a plain request in its place breaks them).
"""

from __future__ import annotations

import pytest

from conftest import assert_pool_drained
from kvserve.config import EngineConfig
from kvserve.engine.background import BACKGROUND_CHUNK_TOKENS, BACKGROUND_DROPPED
from kvserve.engine.engine import LLMEngine
from kvserve.engine.params import SamplingParams
from kvserve.engine.request import Request
from test_server_support import make_chat_model_dir

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
COPY = SamplingParams(max_tokens=1, temperature=0.0)
PROMPT = [7 + i % 300 for i in range(600)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_chat_model_dir(tmp_path_factory.mktemp("bg") / "tiny", max_position_embeddings=2048)


def make_engine(model_dir, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), **kwargs), progress=False)


def add_background(engine: LLMEngine, prompt: list[int], request_id: str = "copy") -> Request:
    request = engine.make_request(prompt, COPY, request_id=request_id)
    request.background = True
    engine.add(request)
    return request


def run_to_end(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.token_ids)
    return tokens


def test_background_computes_small_chunks_when_idle_and_serves_a_later_hit(model_dir):
    engine = make_engine(model_dir, num_blocks=256)
    copy = add_background(engine, PROMPT)
    computed = []
    while engine.has_unfinished_requests():
        engine.step()
        computed.append(copy.num_computed_tokens)
    steps = [b - a for a, b in zip([0, *computed], computed, strict=False) if b > a]
    assert max(steps) <= BACKGROUND_CHUNK_TOKENS and len(steps) >= len(PROMPT) // BACKGROUND_CHUNK_TOKENS
    assert engine.stats()["prefix_cache_queries"] == 0  # a copy is not a caller's query
    engine.add_request(PROMPT + [11, 12], GREEDY, request_id="turn")
    run_to_end(engine)
    assert engine.stats()["prefix_cache_hits"] >= len(PROMPT) - engine.block_manager.block_size
    assert_pool_drained(engine)


def test_background_sits_out_while_a_foreground_request_runs(model_dir):
    engine = make_engine(model_dir, num_blocks=256)
    copy = add_background(engine, PROMPT)
    engine.step()  # the copy's first chunk
    done = copy.num_computed_tokens
    assert done == BACKGROUND_CHUNK_TOKENS
    engine.add_request([5, 6, 7, 8], GREEDY, request_id="caller")
    first_token_step = None
    for step in range(1, 20):
        outputs = engine.step()
        if first_token_step is None and any(o.request_id == "caller" and o.token_ids for o in outputs):
            first_token_step = step
        if engine.groups.get("caller") is None:
            break
        assert copy.num_computed_tokens == done, "the copy computed while a caller ran"
    assert first_token_step == 1  # the caller's first step is its own (the copy's chunk was the step before)
    assert engine.stats()["num_background"] == 1 and engine.stats()["num_running"] == 0
    assert len(run_to_end(engine)["copy"]) == 1  # then it finished, once the caller was done
    assert_pool_drained(engine)


def test_background_waits_behind_every_foreground_request(model_dir):
    engine = make_engine(model_dir, num_blocks=256)
    add_background(engine, PROMPT)
    engine.add_request([5, 6, 7, 8], GREEDY, request_id="a")
    engine.add_request([9, 6, 7, 8], GREEDY, request_id="b")
    order = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                order.append(output.request_id)
    assert order == ["a", "b", "copy"], order
    assert_pool_drained(engine)


def test_background_never_evicts_a_cached_block(model_dir):
    engine = make_engine(model_dir, num_blocks=48, long_prefill_token_threshold=0)
    engine.add_request(PROMPT[:500], GREEDY, request_id="cached")
    run_to_end(engine)
    cached = engine.stats()["cached_blocks"]
    assert cached > 0 and engine.block_manager.allocator.num_free < 600 // engine.block_manager.block_size
    add_background(engine, [3 + i % 200 for i in range(600)])
    outputs = engine.step()  # nothing runs that could free blocks for it: dropped at once, not left spinning
    assert [(o.request_id, o.finish_reason, o.error) for o in outputs] == [("copy", "error", BACKGROUND_DROPPED)]
    assert engine.stats()["cached_blocks"] == cached and not engine.has_unfinished_requests()  # nothing evicted
    assert_pool_drained(engine)


def test_a_foreground_request_takes_a_background_slot(model_dir):
    engine = make_engine(model_dir, num_blocks=256, max_num_seqs=1)
    copy = add_background(engine, PROMPT)
    engine.step()
    assert copy.num_computed_tokens > 0
    engine.add_request([5, 6, 7, 8], GREEDY, request_id="caller")
    outputs = engine.step()
    assert any(o.request_id == "caller" and o.token_ids for o in outputs)  # the slot was freed for it
    tokens = run_to_end(engine)
    assert tokens.get("copy") and tokens.get("caller")  # the copy resumed once the caller was done
    assert_pool_drained(engine)


def test_greedy_output_is_the_same_after_a_background_copy(model_dir):
    prompt = PROMPT[:300] + [21, 22, 23]
    plain = make_engine(model_dir, num_blocks=256)
    plain.add_request(prompt, GREEDY, request_id="turn")
    expected = run_to_end(plain)["turn"]
    engine = make_engine(model_dir, num_blocks=256)
    add_background(engine, PROMPT[:300])
    run_to_end(engine)
    engine.add_request(prompt, GREEDY, request_id="turn")
    assert run_to_end(engine)["turn"] == expected
