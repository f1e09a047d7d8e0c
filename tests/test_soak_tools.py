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
