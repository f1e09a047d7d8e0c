"""The engine with a remote tier that dies, hangs or crawls: serving goes on, outputs never change."""

from __future__ import annotations

import time

from conftest import hf_greedy, random_prompts
from kvserve import LLM, SamplingParams
from kvserve.engine.request import RequestStatus
from kvserve.server.metrics import ServerMetrics
from kvserve.tiers.breaker import CLOSED, OPEN
from kvserve.tiers.local_redis import LocalRedis
from test_tiers_redis import DelayProxy

BLOCK = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def make_llm(model_dir, url: str, **extra) -> LLM:
    return LLM(str(model_dir), progress=False, num_blocks=32, block_size=BLOCK, host_cache=0, remote_cache=url,
               **extra)


def behind_a_slow_redis(model_dir, redis_server, redis_url: str, prompt: list[int], delay_s: float,
                        **extra) -> tuple[LLM, DelayProxy]:
    """`prompt`'s blocks written to Redis by another engine, and an engine that reaches that Redis through a
    proxy holding every request `delay_s` (the caller closes both)."""
    writer = make_llm(model_dir, redis_url)
    writer.generate([prompt], GREEDY)
    writer.engine.tiers.policy.flush()
    writer.engine.close()
    proxy = DelayProxy(redis_server.port, delay_s=delay_s)
    return make_llm(model_dir, f"redis://127.0.0.1:{proxy.port}/0", **extra), proxy


def generate_timed(llm: LLM, prompt: list[int]):
    start = time.monotonic()
    output = llm.generate([prompt], GREEDY)[0]
    return output, time.monotonic() - start


def test_redis_killed_mid_run_serving_goes_on_and_comes_back(tiny_model_dir, tiny_hf_model):
    prompts = random_prompts(5, 21, 29, seed=31)
    expected = [hf_greedy(tiny_hf_model, p, 6) for p in prompts]
    server = LocalRedis().start()
    llm = make_llm(tiny_model_dir, server.url)
    try:
        assert llm.generate([prompts[0]], GREEDY)[0].token_ids == expected[0]
        llm.engine.tiers.policy.flush()
        server.kill()
        for prompt, want in zip(prompts[1:4], expected[1:4], strict=True):
            output, seconds = generate_timed(llm, prompt)
            assert output.token_ids == want and output.num_cached_tokens == 0
            assert seconds < 3.0, f"a request waited {seconds:.2f}s on a dead Redis (client timeout 0.5 s)"
        remote = llm.stats()["tiers"]["remote"]
        assert remote["extra"]["breaker_state"] == OPEN and remote["errors"] >= 2
        metrics = ServerMetrics(llm.stats, "m", 1024).render().decode()
        assert 'kvserve_kv_tier_breaker_state{model_name="m",tier="remote"} 2.0' in metrics
        server = LocalRedis(port=server.port).start()
        time.sleep(2.1)  # the breaker's cool-down: the next call probes the server
        assert llm.generate([prompts[4]], GREEDY)[0].token_ids == expected[4]
        llm.engine.tiers.policy.flush()
        assert llm.stats()["tiers"]["remote"]["extra"]["breaker_state"] == CLOSED
        replica = make_llm(tiny_model_dir, server.url)  # what was written after the return is shared again
        output = replica.generate([prompts[4]], GREEDY)[0]
        assert output.token_ids == expected[4] and output.cached_tokens_by_source["remote"] > 0
        replica.engine.close()
    finally:
        llm.engine.close()
        server.stop()


def test_slow_redis_does_not_stall_other_requests(tiny_model_dir, tiny_hf_model, redis_server, redis_url):
    """A request whose prefix is on the device is served while another waits on a Redis that takes 0.3 s
    per round trip (under the client's 0.5 s timeout, so the load succeeds, slowly)."""
    warm, cold = random_prompts(2, 33, 33, seed=37)
    llm, proxy = behind_a_slow_redis(tiny_model_dir, redis_server, redis_url, cold, 0.3, kv_load_timeout=10.0)
    try:
        llm.generate([warm], GREEDY)  # warm is now on the device
        engine = llm.engine
        cold_request = engine.make_request(cold, GREEDY)
        warm_request = engine.make_request(warm, GREEDY)
        engine.add(cold_request)
        engine.add(warm_request)
        start = time.monotonic()
        finished: dict[str, object] = {}
        warm_done_while_cold_loaded = False
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = (output, time.monotonic() - start)
                    if output.request_id == warm_request.request_id:
                        warm_done_while_cold_loaded = cold_request.status is RequestStatus.WAITING_FOR_KV
        warm_output, warm_seconds = finished[warm_request.request_id]
        cold_output, cold_seconds = finished[cold_request.request_id]
        assert warm_done_while_cold_loaded  # the warm request never waited on the cold one's load
        assert warm_seconds < 0.6 < cold_seconds, (warm_seconds, cold_seconds)  # probe + MGET: 2 trips
        assert warm_output.token_ids == hf_greedy(tiny_hf_model, warm, 6)
        assert cold_output.token_ids == hf_greedy(tiny_hf_model, cold, 6)
        assert cold_output.cached_tokens_by_source["remote"] == 32
    finally:
        llm.engine.close()
        proxy.close()


def test_late_load_falls_back_to_recompute(tiny_model_dir, tiny_hf_model, redis_server, redis_url):
    prompt = random_prompts(1, 33, 33, seed=41)[0]
    llm, proxy = behind_a_slow_redis(tiny_model_dir, redis_server, redis_url, prompt, 1.5, kv_load_timeout=0.2)
    try:
        output, seconds = generate_timed(llm, prompt)
        assert output.token_ids == hf_greedy(tiny_hf_model, prompt, 6)
        assert output.num_cached_tokens == 0 and seconds < 1.2
        assert llm.stats()["tiers"]["policy"]["timed_out_loads"] == 1
        assert llm.stats()["used_blocks"] == 0  # the abandoned load's blocks came back
    finally:
        llm.engine.close()
        proxy.close()


def test_a_queue_blocked_behind_a_load_waits_for_it_instead_of_spinning(tiny_model_dir, tiny_hf_model, redis_server,
                                                                        redis_url):
    """A request that cannot be admitted until a slow load gives its blocks back: each step that schedules
    nothing waits for the load (CI once spun 5,000 empty steps past a load still in flight)."""
    cold = random_prompts(1, 33, 33, seed=43)[0]
    big = random_prompts(1, 120, 120, seed=47)[0]  # 30 of the 32 blocks: only once the load is done
    llm, proxy = behind_a_slow_redis(tiny_model_dir, redis_server, redis_url, cold, 0.3, kv_load_timeout=10.0)
    try:
        engine = llm.engine
        cold_request, big_request = engine.make_request(cold, GREEDY), engine.make_request(big, GREEDY)
        engine.add(cold_request)
        engine.add(big_request)
        steps_while_loading = 0
        finished = {}
        while engine.has_unfinished_requests():
            loading = cold_request.status is RequestStatus.WAITING_FOR_KV
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output
            steps_while_loading += loading
        assert steps_while_loading > 0  # the load was slow (0.6 s: probe + MGET) ...
        assert steps_while_loading < 200, steps_while_loading  # ... and the steps waited on it (~10 ms each)
        assert finished[cold_request.request_id].token_ids == hf_greedy(tiny_hf_model, cold, 6)
        assert finished[big_request.request_id].token_ids == hf_greedy(tiny_hf_model, big, 6)
        assert finished[cold_request.request_id].cached_tokens_by_source["remote"] == 32
    finally:
        llm.engine.close()
        proxy.close()
