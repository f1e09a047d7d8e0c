"""benchmarks/soak_bound.py: the step-cost fit, the simulated engine's bookkeeping and its policies."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import soak_bound as sb  # noqa: E402

COST = sb.StepCost(a=0.004, per_decode=0.003, per_prefill=0.002, per_new=0.001)
OVER = sb.Overheads(front=0.003, back=0.002)


def synthetic_steps(cost: sb.StepCost, n: int, seed: int = 0, stalls: int = 0) -> list[dict]:
    """Back-to-back steps whose gaps are `cost` exactly, but for `stalls` of them 50 ms longer."""
    rng = np.random.default_rng(seed)
    steps, t = [], 100.0
    for i in range(n):
        decode, prefill, new = int(rng.integers(1, 30)), int(rng.integers(0, 5)), int(rng.integers(0, 3))
        steps.append({"k": "step", "t": t, "decode": decode, "prefill": prefill, "chunks": new,
                      "new": [f"r{i}-{j}-0" for j in range(new)]})
        t += cost.of(decode, prefill, new) + (0.05 if i < stalls else 0.0)
    return steps


def test_the_fit_recovers_a_linear_step_cost_and_ignores_stalls():
    fitted = sb.StepCost.fit(synthetic_steps(COST, 400, stalls=20))  # 5% of the steps stalled
    for field in ("a", "per_decode", "per_prefill", "per_new"):
        assert getattr(fitted, field) == pytest.approx(getattr(COST, field), rel=0.02, abs=2e-5)
    with pytest.raises(ValueError, match="too few"):
        sb.StepCost.fit(synthetic_steps(COST, 5))


def sparse(n: int = 20, outputs: int = 4) -> list[sb.Request]:
    return [sb.Request(send=10.0 + i, prefill=1 + i % 3, outputs=outputs, short=True) for i in range(n)]


@pytest.mark.parametrize("name", ["every", "cap", "budget", "alone", "interrupted"])
def test_a_lone_request_gets_its_solo_ttft_under_every_policy(name):
    requests = sparse()
    if name == "interrupted":
        out = sb.simulate_interrupted(requests, COST, OVER, points=6)
    else:
        policy = {"every": sb.every_row, "cap": sb.row_cap(2), "budget": sb.step_budget(0.02, COST),
                  "alone": sb.newcomers_alone()}[name]
        out = sb.simulate(requests, COST, OVER, policy)
    solo = np.array([OVER.front + COST.of(0, r.prefill, 1) + OVER.back for r in requests])
    np.testing.assert_allclose(out.ttft, solo, rtol=1e-9)
    np.testing.assert_allclose(out.e2e, solo + 3 * COST.of(1, 0, 0), rtol=1e-9)  # then 3 lone decode steps
    assert out.peak_running == 1


def dense(n: int = 400, seed: int = 1) -> list[sb.Request]:
    rng = np.random.default_rng(seed)
    sends = np.sort(rng.uniform(0, 4.0, n))
    return [sb.Request(float(s), 1, int(rng.integers(1, 8)), bool(i % 4)) for i, s in enumerate(sends)]


def test_every_request_finishes_and_a_row_cap_holds():
    requests, seen = dense(), []
    capped = sb.row_cap(5)

    def recording(waiting, running, step):
        rows = capped(waiting, running, step)
        seen.append(len(rows))
        return rows

    out = sb.simulate(requests, COST, OVER, recording)
    shorts = sum(r.short for r in requests)
    assert len(out.ttft) == len(out.e2e) == shorts
    assert max(seen) == 5  # the cap binds under this load, and is never exceeded
    assert np.all(np.sort(out.e2e) >= np.sort(out.ttft))  # each e2e >= its TTFT, so every order statistic
    every = sb.simulate(requests, COST, OVER, sb.every_row)
    assert len(every.ttft) == shorts and every.peak_running < out.peak_running


def test_an_interrupted_step_serves_a_newcomer_before_it_ends():
    """30 running requests make a long decode step; a newcomer arriving in its first sixth is answered at
    the first boundary, long before the step would have ended."""
    running = [sb.Request(0.0, 1, 50, False) for _ in range(30)]
    newcomer = sb.Request(0.2, 1, 2, True)
    long_step = COST.of(30, 0, 0)
    out = sb.simulate_interrupted([*running, newcomer], COST, OVER, points=6)
    plain = sb.simulate([*running, newcomer], COST, OVER, sb.every_row)
    assert out.ttft[0] < long_step / 6 + COST.of(0, 1, 1) + OVER.front + OVER.back + 1e-9
    assert out.ttft[0] < plain.ttft[0]


def test_calibration_finds_the_factor_that_made_the_tail():
    requests = dense(600)
    target = float(np.percentile(sb.simulate(requests, COST.scaled(0.8), OVER, sb.every_row).ttft, 99))
    factor = sb.calibrate(requests, COST, OVER, target)
    assert factor == pytest.approx(0.8, abs=0.03)


def test_from_trace_reads_what_soak_writes(tmp_path):
    steps = synthetic_steps(COST, 60)
    sends, records = [], []
    for step in steps:
        for rid in step["new"]:
            sent = step["t"] - 0.004
            sends.append([rid.removesuffix("-0"), sent, 0.02])
            records.append({"k": "req", "id": rid, "arrival": step["t"] - 0.001, "scheduled": step["t"],
                            "first": sent + 0.018, "finished": sent + 0.05, "prompt": 33, "output": 4})
    (tmp_path / "steps.jsonl").write_text("\n".join(json.dumps(x) for x in [*steps, *records]))
    capacity = [["c", 100.0 + i * 0.01, 0.1] for i in range(101)]  # 100 requests a second
    (tmp_path / "clients.json").write_text(json.dumps({"capacity": capacity, "control": [], "soak": sends}))
    requests, cost, over, facts = sb.from_trace(tmp_path)
    assert len(requests) == facts["short"] == len(sends) and facts["others"] == 0
    assert all(r.short and r.outputs == 4 and r.prefill >= 1 for r in requests)
    assert over.front == pytest.approx(0.003, abs=1e-6) and over.back == pytest.approx(0.002, abs=1e-6)
    assert cost.per_decode == pytest.approx(COST.per_decode, rel=0.02)
