"""The soak's diagnostics: the step trace (engine/step_trace.py) and the heap statistics (server/heap.py)."""

from __future__ import annotations

import json

from conftest import assert_pool_drained
from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.engine.params import SamplingParams
from kvserve.engine.step_trace import StepTrace
from kvserve.server.heap import heap_stats, trim_heap


def test_step_trace_explains_a_request(tiny_model_dir, tmp_path):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_blocks=64), progress=False)
    trace = StepTrace(tmp_path / "steps.jsonl")
    engine.scheduler.trace = trace
    engine.finish_listeners.append(trace)
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True), request_id="a")
    engine.step()
    engine.add_request([5, 6, 8], SamplingParams(max_tokens=2, ignore_eos=True), request_id="b")
    while engine.has_unfinished_requests():
        engine.step()
    trace.close()
    records = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["k"] == "step"]
    requests = {r["id"]: r for r in records if r["k"] == "req"}
    assert steps[0]["new"] == ["a"] and steps[0]["chunks"] == 1 and steps[0]["prefill"] == 3
    b_step = next(s for s in steps if "b" in s["new"])
    assert b_step["decode"] == 1 and b_step["chunks"] == 1  # a's decode row shares b's first step
    assert [s["t"] for s in steps] == sorted(s["t"] for s in steps)
    for request_id, outputs in (("a", 3), ("b", 2)):
        record = requests[request_id]
        assert record["arrival"] <= record["scheduled"] <= record["first"] <= record["finished"]
        assert record["output"] == outputs and record["prompt"] == 3
    assert_pool_drained(engine)


def test_heap_stats_and_trim_log(caplog):
    stats = heap_stats()
    if not stats:  # not glibc >= 2.33: nothing to report, and trimming is a no-op
        assert trim_heap() in (True, False)
        return
    assert stats["uordblks"] > 0 and stats["arena"] >= stats["uordblks"] - stats["hblkhd"]
    with caplog.at_level("INFO", logger="uvicorn.error"):
        assert trim_heap(log=True)
    assert any("heap (MiB, before -> after trim): arena" in message for message in caplog.messages)


def _soak_modules():
    """benchmarks/soak.py and soak_clients.py (scripts, not a package: imported from their folder)."""
    import importlib
    import sys
    from pathlib import Path

    folder = str(Path(__file__).resolve().parent.parent / "benchmarks")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module("soak"), importlib.import_module("soak_clients")


def test_soak_judges_rss_less_the_pool_and_the_host_tier():
    """The soak's unexplained growth was the host KV tier filling with evicted blocks (~40 MiB/min from
    the first eviction, up to --host-cache): RSS that grows exactly as the tier's bytes is flat once
    the caches are subtracted, while growth beyond the tier is still caught."""
    soak, clients = _soak_modules()
    minutes = range(11)
    tally = clients.Tally()
    tally.rss = [(60.0 * m, 700.0 + 40.0 * max(0, m - 4)) for m in minutes]  # evictions from minute 4
    tally.pool_rss = [256.0 for _ in minutes]
    tally.host_tier = [40.0 * max(0, m - 4) for m in minutes]
    assert soak.rss_trend(tally.rss, 120.0)[3] > 30  # raw RSS: not flat
    assert abs(soak.rest_slope(tally, 120.0)) < 1e-9
    tally.rss = [(t, m + 3.0 * i) for i, (t, m) in enumerate(tally.rss)]  # a real leak on top: 3 MiB/min
    assert abs(soak.rest_slope(tally, 120.0) - 3.0) < 1e-6
    tally.host_tier[5] = float("nan")  # /metrics did not answer: no verdict rather than a wrong one
    assert soak.rest_slope(tally, 120.0) is None


def test_soak_reads_the_host_tier_from_metrics():
    import httpx

    _, clients = _soak_modules()
    text = ('# HELP kvserve_kv_tier_bytes Bytes held by a KV tier.\n'
            'kvserve_kv_tier_bytes{model_name="m",tier="disk"} 5.0\n'
            'kvserve_kv_tier_bytes{model_name="m",tier="host"} 3.145728e+07\n')
    transport = httpx.MockTransport(lambda request: httpx.Response(200, text=text))
    with httpx.Client(transport=transport, base_url="http://server") as http:
        assert clients.host_tier_mib(http) == 30.0
    off = httpx.MockTransport(lambda request: httpx.Response(200, text="kvserve_up 1\n"))
    with httpx.Client(transport=off, base_url="http://server") as http:
        assert clients.host_tier_mib(http) == 0.0  # --host-cache 0: no host tier series


def test_object_census_logs_growth_and_threads(caplog):
    from kvserve.server.heap import ObjectCensus

    class Marker:
        pass

    census = ObjectCensus()
    census.log()  # the baseline
    kept = [Marker() for _ in range(5000)]
    with caplog.at_level("INFO", logger="uvicorn.error"):
        census.log()
    line = next(m for m in caplog.messages if m.startswith("python objects:"))
    assert f"{Marker.__qualname__} +5000" in line and " threads;" in line
    assert len(kept) == 5000
