"""`kvserve replay`: trace reading, expansion, the driver's accounting, Belady, the request log, the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams
from kvserve.cli import main
from kvserve.prefix.policies import EVICTION_POLICIES
from kvserve.replay.driver import NextUseOracle, Replay, ReplayConfig, distinct_blocks
from kvserve.replay.expand import expand, trace_id_of
from kvserve.replay.oracles import ORACLE_POLICIES
from kvserve.replay.request_log import RequestLog
from kvserve.replay.trace import parse_trace, read_trace

MOONCAKE = Path(__file__).resolve().parent.parent / "benchmarks" / "data" / "mooncake_conversation_first6000.jsonl"


def line(t: int, ids: list[int], length: int | None = None, out: int = 10, **extra: object) -> str:
    length = length if length is not None else 64 * len(ids)
    return json.dumps({"timestamp": t, "input_length": length, "output_length": out, "hash_ids": ids, **extra})


def test_parse_sorts_interns_and_rejects_bad_records() -> None:
    requests = parse_trace([line(5, [7, 8], block_size=64), line(0, [7], 30, block_size=64)])
    assert [r.timestamp_ms for r in requests] == [0, 5]
    assert requests[0].hash_ids == (0,) and requests[1].hash_ids == (0, 1)  # interned in file order
    with pytest.raises(ValueError, match="trace:1: bad trace record: 1 hash_ids for 100 tokens"):
        parse_trace([line(0, [1], 100, block_size=64)])
    with pytest.raises(ValueError, match="trace:2"):
        parse_trace([line(0, [1], block_size=64), "{not json"])


def test_expand_shares_exactly_the_trace_prefix() -> None:
    a, b = parse_trace([line(0, [1, 2, 3], 150, block_size=64), line(1, [1, 2, 4], 150, block_size=64)])
    ea, eb = expand(a, 16), expand(b, 16)
    assert len(ea.tokens) == 150 and len(ea.hashes) == 9  # 150 // 16 full blocks
    assert ea.hashes[:8] == eb.hashes[:8] and ea.hashes[8] != eb.hashes[8]  # ids 1, 2 shared; 3 != 4
    assert ea.tokens[:128] == eb.tokens[:128] and ea.tokens[128:144] != eb.tokens[128:144]
    assert [trace_id_of(h, 64) for h in ea.hashes] == [0] * 4 + [1] * 4 + [2]
    c = parse_trace([line(0, [1, 2, 3], 150, block_size=64)])[0]  # block size not dividing: slow path agrees
    assert expand(c, 32).hashes == [ea.hashes[i] for i in (1, 3, 5, 7)]


def small_trace(n: int = 120) -> list:
    """Conversations that come back after a while, between one-off prompts."""
    lines, next_id = [], 1000
    for i in range(n):
        if i % 3 == 0:
            lines.append(line(i * 500, [0, i % 7 + 1, i % 7 + 100], block_size=64))
        else:
            lines.append(line(i * 500, [0, next_id, next_id + 1, next_id + 2], block_size=64))
            next_id += 3
    return parse_trace(lines)


@pytest.mark.parametrize("prefix_cache", ["radix", "hash"])
@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_replay_returns_every_block_and_belady_is_best(prefix_cache: str, policy: str) -> None:
    requests = small_trace()
    runs = {}
    for name in (policy, "belady"):
        replay = Replay(requests, ReplayConfig(40, 16, name, prefix_cache))
        result = replay.run()
        replay.cache.check_invariants()
        alloc = replay.allocator
        assert alloc.num_referenced() == 0 and alloc.num_free + replay.cache.num_evictable_blocks == 40
        assert result.requests == len(requests) and result.evictions > 0
        runs[name] = result
    assert 0 < runs[policy].hit_tokens <= runs["belady"].hit_tokens
    assert runs["belady"].hit_blocks * 16 == runs["belady"].hit_tokens


def test_unbounded_cache_hits_every_repeated_block() -> None:
    requests = small_trace()
    result = Replay(requests, ReplayConfig(10_000, 16, "lru")).run()
    seen: set[bytes] = set()
    expected = 0
    for request in requests:
        prompt = expand(request, 16)
        usable = prompt.hashes[: (request.input_length - 1) // 16]
        k = 0
        while k < len(usable) and usable[k] in seen:
            k += 1
        expected += k
        seen.update(prompt.hashes)
    assert result.hit_blocks == expected and result.evictions == 0
    assert distinct_blocks(requests, 16) == len(seen)


def test_request_log_round_trips_through_replay(tiny_model_dir, tmp_path: Path) -> None:
    llm = LLM(str(tiny_model_dir), progress=False, num_blocks=64, block_size=16)
    path = tmp_path / "requests.jsonl"
    log = RequestLog(path, 16)
    llm.engine.finish_listeners.append(log)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    prompt = list(range(100, 150))
    llm.generate([prompt], params)
    llm.generate([prompt[:40] + [7, 8, 9]], params)
    llm.generate([prompt], params, cache_salt="tenant-a")
    log.close()
    records = [json.loads(text) for text in path.read_text().splitlines()]
    assert set(records[0]) == {"timestamp", "input_length", "output_length", "hash_ids", "block_size", "namespace"}
    assert [r["input_length"] for r in records] == [50, 43, 50] and records[0]["output_length"] == 3
    assert len(records[0]["hash_ids"]) == 4  # 3 full blocks and the partial one
    assert records[0]["hash_ids"][:2] == records[1]["hash_ids"][:2] != records[2]["hash_ids"][:2]
    assert records[0]["namespace"] != records[2]["namespace"]
    assert "100, 101" not in path.read_text()  # no token ids
    requests = read_trace(path)
    result = Replay(requests, ReplayConfig(64, 16, "lru")).run()
    assert result.hit_blocks == 2  # the second request reuses the first two blocks; the salted one nothing


def test_cli_replay_prints_a_table_and_writes_plot_and_json(tmp_path: Path, capsys) -> None:
    plot, out = tmp_path / "hits.png", tmp_path / "hits.json"
    code = main(["replay", str(MOONCAKE), "--limit", "60", "--block-size", "128", "--cache-fraction", "0.1", "0.4",
                 "--eviction", "lru", "s2lru", "--plot", str(plot), "--json", str(out), "--no-progress"])
    assert code == 0
    text = capsys.readouterr().out
    assert "60 requests" in text and "belady" in text and "s2lru" in text
    assert plot.stat().st_size > 0
    results = json.loads(out.read_text())["results"]
    assert len(results) == 6
    best = {r["cache_blocks"]: r["hit_tokens"] for r in results if r["eviction"] == "belady"}
    assert all(r["hit_tokens"] <= best[r["cache_blocks"]] for r in results)
    assert main(["replay", str(MOONCAKE), "--limit", "5", "--cache-blocks", "0", "--no-progress"]) == 2


def test_belady_next_use_skips_requests_that_cannot_match_the_block() -> None:
    """A request ending inside a trace block uses only the replay blocks it can match; a request too big
    for the cache is no use at all. A stale next use would keep a dead block cached forever."""
    a, short, big, full = parse_trace([
        line(0, [5], 64, block_size=64),  # 4 replay blocks of trace block 5
        line(1, [5], 20, block_size=64),  # matches 1 block (capped so one token is computed)
        line(2, [5, 6, 7], 192, out=1000, block_size=64),  # too big for 40 blocks: dropped
        line(3, [5, 6], 80, block_size=64),  # matches all 4 blocks of trace block 5
    ])
    requests = [a, short, big, full]
    oracle = NextUseOracle(requests, 16, cache_blocks=40)
    hashes = expand(a, 16).hashes
    assert [oracle(h) for h in hashes] == [1, 3, 3, 3]
    oracle.current = 1
    assert [oracle(h) for h in hashes] == [3, 3, 3, 3]
    oracle.current = 3
    assert oracle(hashes[0]) == math.inf
    assert NextUseOracle(requests, 16, cache_blocks=10_000)(hashes[1]) == 2  # fits: a use


@pytest.mark.parametrize("policy", ["lru", "glru", "belady"])
def test_sequential_replay_holds_nothing_across_requests(policy: str) -> None:
    requests = small_trace()
    overlapped = Replay(requests, ReplayConfig(40, 16, policy, decode_ms_per_token=2000.0)).run()
    sequential = Replay(requests, ReplayConfig(40, 16, policy, overlap=False)).run()
    assert overlapped.mean_pinned > 0 and sequential.mean_pinned == 0
    assert sequential.requests == overlapped.requests == len(requests)
    best = Replay(requests, ReplayConfig(40, 16, "belady", overlap=False)).run()
    assert sequential.hit_tokens <= best.hit_tokens


@pytest.mark.parametrize("prefix_cache", ["radix", "hash"])
@pytest.mark.parametrize("oracle", ORACLE_POLICIES)
def test_oracle_replays_return_every_block_and_beat_lru(prefix_cache: str, oracle: str) -> None:
    """The diagnostic oracles run through the same caches; knowing reuse (in any horizon) beats LRU
    on conversations mixed with one-off prompts."""
    requests = small_trace()
    results = {}
    for name in ("lru", oracle):
        replay = Replay(requests, ReplayConfig(40, 16, name, prefix_cache))
        results[name] = replay.run()
        replay.cache.check_invariants()
        assert replay.allocator.num_free + replay.cache.num_evictable_blocks == 40
    assert results[oracle].evictions > 0 and results[oracle].hit_tokens > results["lru"].hit_tokens
