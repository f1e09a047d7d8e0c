"""The tiers inside the engine: outputs never change, hits are reported where the blocks really were,
the disk tier survives a restart, replicas share Redis, and tenants never hit each other on any tier."""

from __future__ import annotations

import pytest
import torch

from conftest import hf_greedy, random_prompts
from kvserve import LLM, SamplingParams
from kvserve.prefix.hashing import block_hashes
from kvserve.prefix.namespace import make_namespace

BLOCK = 4
MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
TIERS = {
    "off": dict(host_cache=0),
    "host": dict(host_cache="64KiB"),  # ~40 blocks of the tiny model: overflows in the chat below
    "host+disk": dict(host_cache="16KiB", disk="disk"),
    "host+disk+redis": dict(host_cache="16KiB", disk="disk", redis=True),
}


def make_llm(model_dir, tmp_path, request, prefix_cache="radix", num_blocks=24, host_cache=0, disk=None,
             redis=False, **extra) -> LLM:
    if disk is not None:
        extra["disk_cache"] = str(tmp_path / disk)
    if redis:
        extra["remote_cache"] = request.getfixturevalue("redis_url")
    return LLM(str(model_dir), progress=False, num_blocks=num_blocks, block_size=BLOCK, prefix_cache=prefix_cache,
               host_cache=host_cache, **extra)


@pytest.fixture(scope="module")
def chat(tiny_hf_model) -> list[tuple[list[int], list[int]]]:
    """3 users x 3 turns, turn-major (so each user's history is evicted by the others'): (prompt, expected)."""
    messages = random_prompts(9, 8, 13, seed=7)
    histories: list[list[int]] = [[], [], []]
    turns = []
    for turn in range(3):
        for user in range(3):
            prompt = histories[user] + messages[turn * 3 + user]
            expected = hf_greedy(tiny_hf_model, prompt, MAX_TOKENS)
            histories[user] = prompt + expected
            turns.append((prompt, expected))
    return turns


def where_blocks_are(llm: LLM, prompt: list[int], salt: str | None = None) -> dict[str, int]:
    """Tokens of `prompt`'s usable prefix by where they are now: device match, then the tiers' lookup."""
    namespace = make_namespace(salt)
    if llm.engine.tiers is not None:
        llm.engine.tiers.policy.flush()
    usable = (len(prompt) - 1) // BLOCK
    hashes = block_hashes(prompt[: usable * BLOCK], BLOCK, namespace)
    engine = llm.engine
    device = len(engine.block_manager.prefix_cache.match(prompt[: usable * BLOCK], hashes, namespace))
    found = {"device": device * BLOCK}
    if engine.tiers is not None:  # as the engine asks: host and disk first, then the remote for the rest
        policy = engine.tiers.policy
        local = policy.lookup(hashes[device:], local_only=True).sources
        remote = policy.remote.longest_prefix(policy.fingerprint.keys(hashes[device + len(local) :])) \
            if policy.remote is not None else 0
        for source in local + ["remote"] * remote:
            found[source] = found.get(source, 0) + BLOCK
    return {k: v for k, v in found.items() if v}


def run(llm: LLM, prompt: list[int], salt: str | None = None):
    if llm.engine.tiers is not None:
        llm.engine.tiers.policy.flush()  # background disk/remote writes land first: sources are deterministic
    return llm.generate([prompt], GREEDY, cache_salt=salt)[0]


def nonzero(by_source: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in by_source.items() if v}


@pytest.mark.parametrize("prefix_cache", ["radix", "hash"])
@pytest.mark.parametrize("tiers", list(TIERS))
def test_multi_turn_outputs_unchanged_and_hits_where_blocks_were(
    tiny_model_dir, tmp_path, request, chat, prefix_cache, tiers
):
    llm = make_llm(tiny_model_dir, tmp_path, request, prefix_cache, **TIERS[tiers])
    totals: dict[str, int] = {}
    for prompt, expected in chat:
        where = where_blocks_are(llm, prompt)
        output = run(llm, prompt)
        assert output.token_ids == expected
        assert nonzero(output.cached_tokens_by_source) == where
        assert output.num_cached_tokens == sum(where.values())
        for source, tokens in where.items():
            totals[source] = totals.get(source, 0) + tokens
    stats = llm.stats()
    assert stats["evictions"] > 0, "the chat must outgrow the pool"
    if tiers == "off":
        assert set(totals) <= {"device"}
    else:
        assert totals.get("host", 0) > 0
    if "disk" in tiers:
        assert totals.get("disk", 0) > 0 and stats["tiers"]["disk"]["load"]["blocks"] > 0
    for source in ("device", "host", "disk", "remote"):
        assert stats[f"prefix_cache_hits_{source}"] == totals.get(source, 0)
    llm.engine.close()


def _flood(llm: LLM, seed: int) -> None:
    """Push everything cached out of the device pool (each prompt fills most of it)."""
    for prompt in random_prompts(3, 70, 80, seed=seed):
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))


def test_disk_cache_survives_engine_restart(tiny_model_dir, tiny_hf_model, tmp_path, request):
    prompt = random_prompts(1, 41, 41, seed=11)[0]
    expected = hf_greedy(tiny_hf_model, prompt, MAX_TOKENS)
    first = make_llm(tiny_model_dir, tmp_path, request, disk="disk")
    assert run(first, prompt).token_ids == expected
    _flood(first, seed=12)
    first.engine.close()
    second = make_llm(tiny_model_dir, tmp_path, request, disk="disk")
    output = run(second, prompt)
    assert output.token_ids == expected
    assert nonzero(output.cached_tokens_by_source) == {"disk": 40}
    second.engine.close()


def test_disk_blocks_not_shared_across_kernel_arithmetic(tiny_model_dir, tiny_hf_model, tmp_path, request):
    """Blocks written under one arithmetic (native kernels) are not loaded by an engine computing with
    another (torch kernels): the floats differ by summation order, and a tier must never change an output."""
    prompt = random_prompts(1, 41, 41, seed=11)[0]
    expected = hf_greedy(tiny_hf_model, prompt, MAX_TOKENS)
    first = make_llm(tiny_model_dir, tmp_path, request, disk="disk", kernels="native")
    assert run(first, prompt).token_ids == expected
    _flood(first, seed=12)
    first.engine.close()
    second = make_llm(tiny_model_dir, tmp_path, request, disk="disk", kernels="torch")
    output = run(second, prompt)
    assert output.token_ids == expected
    assert nonzero(output.cached_tokens_by_source) == {}
    second.engine.close()


def test_replica_serves_another_replicas_prefix_from_redis(tiny_model_dir, tiny_hf_model, tmp_path, request):
    prompt = random_prompts(1, 41, 41, seed=13)[0]
    expected = hf_greedy(tiny_hf_model, prompt, MAX_TOKENS)
    replica_a = make_llm(tiny_model_dir, tmp_path, request, redis=True)
    assert run(replica_a, prompt).token_ids == expected
    replica_a.engine.tiers.policy.flush()  # the write-through is in the background
    replica_b = make_llm(tiny_model_dir, tmp_path, request, redis=True)
    output = run(replica_b, prompt)
    assert output.token_ids == expected
    assert nonzero(output.cached_tokens_by_source) == {"remote": 40}
    assert replica_b.stats()["tiers"]["remote"]["hits"] == 10
    for llm in (replica_a, replica_b):
        llm.engine.close()


@pytest.mark.parametrize("tier", ["host", "disk", "remote"])
def test_tenants_never_hit_each_other_on_any_tier(tiny_model_dir, tiny_hf_model, tmp_path, request, tier):
    """Paired: tenant A's prompt is cached in `tier` only; B's identical prompt finds nothing anywhere,
    A's finds it in `tier` (the control)."""
    prompt = random_prompts(1, 41, 41, seed=17)[0]
    expected = hf_greedy(tiny_hf_model, prompt, MAX_TOKENS)
    settings = {"host": dict(host_cache="1MiB"), "disk": dict(disk="disk"), "remote": dict(redis=True)}[tier]
    writer = make_llm(tiny_model_dir, tmp_path, request, **settings)
    assert run(writer, prompt, salt="tenant-a").token_ids == expected
    writer.engine.tiers.policy.flush()
    if tier == "remote":
        reader = make_llm(tiny_model_dir, tmp_path, request, **settings)  # a fresh replica: device empty
    else:
        _flood(writer, seed=18)
        reader = writer
    other = run(reader, prompt, salt="tenant-b")
    assert other.token_ids == expected and other.num_cached_tokens == 0
    same = run(reader, prompt, salt="tenant-a")
    assert same.token_ids == expected and nonzero(same.cached_tokens_by_source) == {tier: 40}
    for llm in {id(writer): writer, id(reader): reader}.values():
        llm.engine.close()


def test_corrupted_disk_block_is_recomputed(tiny_model_dir, tiny_hf_model, tmp_path, request):
    prompt = random_prompts(1, 41, 41, seed=19)[0]
    expected = hf_greedy(tiny_hf_model, prompt, MAX_TOKENS)
    first = make_llm(tiny_model_dir, tmp_path, request, disk="disk")
    run(first, prompt)
    _flood(first, seed=20)
    first.engine.close()
    second = make_llm(tiny_model_dir, tmp_path, request, disk="disk")
    disk, policy = second.engine.tiers.policy.disk, second.engine.tiers.policy
    third_block_key = policy.fingerprint.key(block_hashes(prompt[:40], BLOCK, ())[2])
    path = disk.path_of(third_block_key)
    data = bytearray(path.read_bytes())
    data[-7] ^= 0xFF
    path.write_bytes(bytes(data))
    output = run(second, prompt)
    assert output.token_ids == expected
    assert nonzero(output.cached_tokens_by_source) == {"disk": 8}  # the two blocks before the damaged one
    assert second.stats()["tiers"]["disk"]["extra"]["corrupt"] == 1
    second.engine.close()


def test_tiers_off_when_prefix_cache_off(tiny_model_dir, tmp_path, request):
    llm = make_llm(tiny_model_dir, tmp_path, request, prefix_cache="off", host_cache="1MiB")
    assert llm.engine.tiers is None and llm.stats()["tiers"] == {}
    with pytest.raises(ValueError, match="remote_cache"):
        make_llm(tiny_model_dir, tmp_path, request, remote_cache="http://nope")
    with pytest.raises(ValueError, match="host_cache"):
        make_llm(tiny_model_dir, tmp_path, request, host_cache="lots")


def test_pool_tensor_layout_is_what_the_codec_assumes(tiny_model_dir, tmp_path, request):
    llm = make_llm(tiny_model_dir, tmp_path, request, host_cache="1MiB")
    pool = llm.engine.kv_pool.tensor
    assert pool.shape[2] == llm.engine.kv_pool.num_blocks and pool.shape[3] == BLOCK
    assert llm.engine.tiers.policy.codec.shape == (pool.shape[0], 2, BLOCK, pool.shape[4], pool.shape[5])
    assert llm.engine.tiers.policy.codec.dtype == torch.float32


def test_usage_and_metrics_split_cached_tokens_by_source(tiny_model_dir, tmp_path, request, chat):
    from kvserve.server.metrics import ServerMetrics
    from kvserve.server.responses import ResponseContext, usage_of

    llm = make_llm(tiny_model_dir, tmp_path, request, host_cache="64KiB", disk="disk")
    outputs = [run(llm, prompt) for prompt, _ in chat]
    latest = dict(enumerate(outputs))
    usage = usage_of(ResponseContext("x", "m", 1, [len(p) for p, _ in chat], None), latest)
    details = usage.prompt_tokens_details
    assert details.cached_tokens == sum(o.num_cached_tokens for o in outputs) > 0
    assert sum(details.cached_tokens_by_source.values()) == details.cached_tokens
    assert details.cached_tokens_by_source["host"] > 0
    text = ServerMetrics(llm.stats, "m", 1024).render().decode()
    stats = llm.stats()
    for source in ("device", "host", "disk", "remote"):
        value = float(stats[f"prefix_cache_hits_{source}"])
        assert f'kvserve_prompt_tokens_cached_total{{model_name="m",source="{source}"}} {value}' in text
    assert f'kvserve_kv_tier_blocks{{model_name="m",tier="host"}} {float(stats["tiers"]["host"]["blocks"])}' in text
    assert 'kvserve_kv_tier_loaded_blocks_total{model_name="m",tier="disk"}' in text
    llm.engine.close()


def test_a_probe_that_finds_nothing_does_not_cost_the_request_a_step(tiny_model_dir, tiny_hf_model, tmp_path,
                                                                      request, monkeypatch):
    """With a remote tier every admission with uncached blocks asks the store (a background job). When the
    answer comes back within the schedule's short wait (an empty local Redis: one round trip) the request
    is admitted in the same step; with no wait (QUICK_LAND_S 0, the behaviour before) it sat the step out.
    The test's wait is generous (0.5 s, not the default 3 ms) so a loaded CI machine cannot make it flaky.
    Outputs are the oracle's either way, and a prefix another replica wrote is still loaded."""
    import redis

    import kvserve.engine.kv_tiers as kv_tiers

    prompt = random_prompts(1, 41, 41, seed=29)[0]
    expected = hf_greedy(tiny_hf_model, prompt, MAX_TOKENS)
    store = redis.Redis.from_url(request.getfixturevalue("redis_url"))
    for quick, first_step_runs in ((0.5, True), (0.0, False)):  # 0.5 s: the mechanism, not the 3 ms budget
        store.flushdb()  # the store has none of the prompt's blocks
        monkeypatch.setattr(kv_tiers, "QUICK_LAND_S", quick)
        llm = make_llm(tiny_model_dir, tmp_path, request, redis=True)
        engine = llm.engine
        request_id = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
        engine.step()
        runs = [r.request_id for r in engine.scheduler.running] == [request_id]
        assert runs == first_step_runs, quick
        while engine.has_unfinished_requests():
            engine.step()
        assert run(llm, prompt).token_ids == expected
        llm.engine.close()
    store.flushdb()
    writer = make_llm(tiny_model_dir, tmp_path, request, redis=True)
    run(writer, prompt)
    writer.engine.tiers.policy.flush()
    reader = make_llm(tiny_model_dir, tmp_path, request, redis=True)
    output = run(reader, prompt)
    assert output.token_ids == expected and nonzero(output.cached_tokens_by_source) == {"remote": 40}
    for llm in (writer, reader):
        llm.engine.close()


def test_a_router_hint_skips_the_store_for_the_first_admission_only(tiny_model_dir, tiny_hf_model, tmp_path,
                                                                     request):
    """`Request.probe_remote` False (a store-aware router's `x-kvserve-store-probe: 0`): admission does not
    ask the store, even when it holds the prompt (the prompt is computed, outputs unchanged); the flag is
    the first admission's only."""
    prompt = random_prompts(1, 41, 41, seed=31)[0]
    expected = hf_greedy(tiny_hf_model, prompt, MAX_TOKENS)
    writer = make_llm(tiny_model_dir, tmp_path, request, redis=True)
    run(writer, prompt)
    writer.engine.tiers.policy.flush()
    reader = make_llm(tiny_model_dir, tmp_path, request, redis=True)
    engine = reader.engine
    hinted = engine.make_request(prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    hinted.probe_remote = False
    engine.add(hinted)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert outputs[0].token_ids == expected
    assert nonzero(outputs[0].cached_tokens_by_source) == {} and reader.stats()["tiers"]["remote"]["hits"] == 0
    assert hinted.probe_remote  # reset at admission
    for llm in (writer, reader):
        llm.engine.close()


def test_tier_events_follow_demotion_and_the_reset_of_tiers(tiny_model_dir, tmp_path, request):
    """A device eviction demotes to host RAM: the CPU events name exactly the evicted hashes, after their
    GPU removal; a plain reset keeps the host (and says nothing of it), `tiers=True` empties it and says so."""
    from kvserve.events.engine_hook import attach_kv_events, attach_tier_events
    from kvserve.events.format import MEDIUM_CPU, MEDIUM_GPU, BlockRemoved, BlockStored
    from kvserve.tiers.store import FINGERPRINT_BYTES

    class Collect:
        def publish(self, batch: list) -> None:
            events.extend(batch)

    events: list = []
    publisher = Collect()
    llm = make_llm(tiny_model_dir, tmp_path, request, host_cache="1MiB")  # never full: no host eviction
    attach_kv_events(llm.engine.block_manager, publisher)
    attach_tier_events(llm.engine.tiers.policy, publisher, BLOCK)

    def hashes(kind: type, medium: str) -> list[bytes]:
        return [h for e in events if isinstance(e, kind) and e.medium == medium for h in e.block_hashes]

    _flood(llm, seed=21)
    host = llm.engine.tiers.policy.host
    evicted = hashes(BlockRemoved, MEDIUM_GPU)
    demoted = hashes(BlockStored, MEDIUM_CPU)
    assert evicted and sorted(demoted) == sorted(set(evicted))
    assert set(demoted) == {key[FINGERPRINT_BYTES:] for key in host.keys_lru_first()}
    first_removed = {h: i for i, e in reversed(list(enumerate(events))) if isinstance(e, BlockRemoved)
                     and e.medium == MEDIUM_GPU
                     for h in e.block_hashes}
    stored_at = {h: i for i, e in enumerate(events) if isinstance(e, BlockStored) and e.medium == MEDIUM_CPU
                 for h in e.block_hashes}
    assert all(first_removed[h] < stored_at[h] for h in demoted)  # the device copy's removal comes first
    held = host.keys_lru_first()
    assert llm.reset_prefix_cache() and host.keys_lru_first() == held  # and the reset demoted nothing:
    assert hashes(BlockRemoved, MEDIUM_CPU) == [] and hashes(BlockStored, MEDIUM_CPU) == demoted
    assert llm.reset_prefix_cache(tiers=True) and host.keys_lru_first() == []
    assert sorted(hashes(BlockRemoved, MEDIUM_CPU)) == sorted(demoted)
    llm.engine.close()
