"""`--schedule-policy priority` (vLLM's `--scheduling-policy priority`): lower `priority` first, FCFS among
equals; a queued request that outranks running ones and does not fit preempts the lowest-priority ones; no
priority changes a token (greedy equals transformers) or leaves a block behind."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import assert_pool_drained, hf_greedy, random_prompts
from kvserve import LLM
from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.engine.params import SamplingParams
from test_server_support import chat_model_dir, start_server  # noqa: F401


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def make_engine(model_dir, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), schedule_policy="priority", **kwargs), progress=False)


def run(engine: LLMEngine) -> tuple[dict[str, list[int]], list[str]]:
    """Every request to the end: tokens by request id, and the order in which they got their first token."""
    tokens: dict[str, list[int]] = {}
    started: list[str] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.token_ids and output.request_id not in started:
                started.append(output.request_id)
            if output.finished:
                tokens[output.request_id] = list(output.token_ids)
        engine.scheduler.check_invariants()
    return tokens, started


def test_lower_priority_first_fcfs_among_equals(tiny_model_dir):
    engine = make_engine(tiny_model_dir, max_num_seqs=1, num_blocks=64)
    for name, priority in (("a", 5), ("b", 0), ("c", 5), ("d", -1), ("e", 0)):
        engine.add(engine.make_request([3, 4, 5, 6], greedy(3), request_id=name, priority=priority))
    _, started = run(engine)
    assert started == ["d", "b", "e", "a", "c"]
    assert_pool_drained(engine)


def test_an_outranking_request_preempts_the_lowest_and_no_token_changes(tiny_model_dir, tiny_hf_model):
    """A low-priority request holds most of a small pool; a high-priority one arrives that does not fit:
    the low one is preempted, the high one finishes first, and both outputs are transformers' greedy."""
    engine = make_engine(tiny_model_dir, num_blocks=12, block_size=4, max_num_batched_tokens=64)
    low_prompt, high_prompt = random_prompts(1, 36, 36, seed=3)[0], random_prompts(1, 20, 20, seed=4)[0]
    engine.add(engine.make_request(low_prompt, greedy(8), request_id="low", priority=10))
    for _ in range(3):
        engine.step()
    assert len(engine.scheduler.running[0].block_table) == 10  # of 12: the high one's 5 prompt blocks do not fit
    engine.add(engine.make_request(high_prompt, greedy(12), request_id="high", priority=0))
    engine.step()  # room is made: the low one is preempted (and the high one admitted at the next step)
    assert engine.scheduler.num_preemptions == 1 and not engine.scheduler.running
    finished: list[str] = []
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished.append(output.request_id)
                tokens[output.request_id] = list(output.token_ids)
        engine.scheduler.check_invariants()
    assert finished == ["high", "low"]
    assert tokens["low"] == hf_greedy(tiny_hf_model, low_prompt, 8)
    assert tokens["high"] == hf_greedy(tiny_hf_model, high_prompt, 12)
    assert_pool_drained(engine)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(-2, 2), st.integers(1, 12)), min_size=2, max_size=7),
       st.integers(0, 10_000))
def test_priorities_never_change_tokens_nor_leak_blocks(tiny_model_dir, requests, seed):
    """Random priorities, lengths and arrival over a pool that forces preemption: every request's tokens
    equal its solo greedy run, the invariants hold after every step, and the pool drains."""
    engine = make_engine(tiny_model_dir, num_blocks=16, block_size=4, max_num_seqs=3, max_num_batched_tokens=32)
    solo = make_engine(tiny_model_dir, num_blocks=64, block_size=4)
    prompts = random_prompts(len(requests), 1, 30, seed=seed)
    expected = {}
    for i, ((_, new), prompt) in enumerate(zip(requests, prompts, strict=True)):
        solo.add(solo.make_request(prompt, greedy(new), request_id=f"s{i}"))
        expected[f"r{i}"] = run(solo)[0][f"s{i}"]
    early: dict[str, list[int]] = {}
    for i, ((priority, new), prompt) in enumerate(zip(requests, prompts, strict=True)):
        engine.add(engine.make_request(prompt, greedy(new), request_id=f"r{i}", priority=priority))
        if i % 2:  # arrivals spread over steps
            early |= {o.request_id: list(o.token_ids) for o in engine.step() if o.finished}
    tokens, _ = run(engine)
    assert early | tokens == expected
    assert_pool_drained(engine)


def test_priority_needs_the_policy(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), progress=False, num_blocks=32)
    with pytest.raises(ValueError, match="priority 3 needs priority scheduling"):
        llm.generate([[3, 4, 5]], greedy(2), priority=[3], use_tqdm=False)
    with pytest.raises(ValueError, match="got 2 priorities for 1 prompts"):
        llm.generate([[3, 4, 5]], greedy(2), priority=[0, 0], use_tqdm=False)
    assert llm.generate([[3, 4, 5]], greedy(2), priority=[0], use_tqdm=False)[0].outputs[0].token_ids
    ranked = LLM(str(tiny_model_dir), progress=False, num_blocks=32, schedule_policy="priority")
    with pytest.raises(ValueError, match="priority must be an integer"):
        ranked.generate([[3, 4, 5]], greedy(2), priority=[True], use_tqdm=False)


def test_server_takes_priority_under_the_policy(chat_model_dir):  # noqa: F811
    with start_server(chat_model_dir, "--scheduling-policy", "priority", num_blocks=128) as server:
        body = {"model": "tiny-chat", "prompt": "hello", "max_tokens": 3, "temperature": 0}
        first = httpx.post(server.url + "/v1/completions", json={**body, "priority": -5}, timeout=60)
        assert first.status_code == 200, first.text
        again = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
        bad = httpx.post(server.url + "/v1/completions", json={**body, "priority": 2**40}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"
