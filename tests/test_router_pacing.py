"""benchmarks/router.py --rate: the open-loop schedule. Poisson sends, the same for every policy; a chat turn
is sent when due, never before the same user's previous answer, and nothing bounds requests in flight (the
closed loop's gate hid the queue from the TTFT)."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import router as bench  # noqa: E402


def test_paced_dues_are_a_seeded_poisson_stream():
    dues = bench.paced_dues(2.0, 4000, seed=3)
    assert dues == bench.paced_dues(2.0, 4000, seed=3) and dues != bench.paced_dues(2.0, 4000, seed=4)
    assert all(later > earlier for earlier, later in zip(dues, dues[1:], strict=False))
    assert dues[-1] / len(dues) == pytest.approx(0.5, rel=0.05)  # mean gap 1 / rate
    assert bench.paced_dues(4.0, 10, seed=3) == pytest.approx([due / 2 for due in bench.paced_dues(2.0, 10, seed=3)])


def test_chat_turns_go_when_due_after_the_previous_answer_with_nothing_in_flight_bounding_them(monkeypatch):
    sends: list[tuple[tuple[int, ...], float]] = []  # (the user's first question, seconds since the run began)
    in_flight, most = 0, 0
    began = time.perf_counter()

    async def answer(client, url, model, prompt, max_tokens, stats) -> None:
        nonlocal in_flight, most
        sends.append((tuple(prompt[8:10]), time.perf_counter() - began))
        in_flight += 1
        most = max(most, in_flight)
        await asyncio.sleep(0.05)  # every answer takes 50 ms: longer than the mean gap of 10 ms
        in_flight -= 1

    monkeypatch.setattr(bench, "one_request", answer)
    args = argparse.Namespace(users=4, turns=3, system=8, user=2, reply=3, ramp=4.0, think=1.0, concurrency=1,
                              max_tokens=1, rate=100.0, rate_seed=3)
    asyncio.run(bench.chat_workload("http://unused", "m", args))
    assert len(sends) == 12 and most > 1  # --concurrency 1 is ignored when paced
    by_user: dict[tuple[int, ...], list[float]] = {}
    for user, sent in sends:
        by_user.setdefault(user, []).append(sent)
    assert sorted(len(times) for times in by_user.values()) == [3, 3, 3, 3]
    for times in by_user.values():  # a user's next turn waits for the previous answer
        assert all(later >= earlier + 0.045 for earlier, later in zip(times, times[1:], strict=False))
    first_due = bench.paced_dues(100.0, 12, seed=3)[0]
    assert min(sent for _, sent in sends) >= first_due - 0.005  # nothing before its due time
