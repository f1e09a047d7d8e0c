"""Fairness under a long prefill and under a pool-hungry group (issue 8), wall-clock, real model.

Drives the engine through `AsyncEngine` (the server's way in, without HTTP) on its own thread:

1. **Long prefill.** A 4-token request sent while a --long-tokens prompt (8,191 by default) prefills:
   its TTFT against its solo TTFT, with the default `--long-prefill-token-threshold` and with it off
   (0, the behaviour before). The bound checked is "2 x solo TTFT + the step in flight when it arrived".
2. **Hostage group.** `n=16, best_of=16, max_tokens=700, temperature=1, ignore_eos` on a small pool
   (--hostage-blocks) with the cap lifted, while 4-token requests are sent one after another: their
   latency against solo. With the default cap the group is refused (reported too).

    python benchmarks/fairness.py                      # full size
    python benchmarks/fairness.py --long-tokens 2048   # reduced (say so in the notes)
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, write_result  # noqa: E402
from kvserve.config import EngineConfig  # noqa: E402
from kvserve.engine.engine import LLMEngine  # noqa: E402
from kvserve.engine.params import SamplingParams  # noqa: E402
from kvserve.serving.async_engine import AsyncEngine  # noqa: E402

SHORT = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
HOSTAGE = SamplingParams(n=16, best_of=16, max_tokens=700, temperature=1.0, seed=0, ignore_eos=True)


class StepClock:
    """Wraps `LLMEngine.step` to record (start, end) of every step (read after the run)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.spans: list[tuple[float, float]] = []
        step = engine.step

        def timed() -> list:
            start = time.monotonic()
            try:
                return step()
            finally:
                self.spans.append((start, time.monotonic()))
        engine.step = timed  # type: ignore[method-assign]

    def step_at(self, moment: float) -> float:
        """Duration of the step running at `moment` (0 if none was)."""
        return next((end - start for start, end in self.spans if start <= moment < end), 0.0)


async def timed_request(engine: AsyncEngine, prompt: list[int], params: SamplingParams, request_id: str,
                        ) -> tuple[float, float, float]:
    """(sent at, TTFT, total latency) in seconds, measured by the caller."""
    sent = time.monotonic()
    first = None
    async for output in engine.generate(prompt, params, request_id):
        if first is None and output.token_ids:
            first = time.monotonic()
    return sent, (first or time.monotonic()) - sent, time.monotonic() - sent


def start(config: EngineConfig) -> tuple[AsyncEngine, StepClock]:
    llm_engine = LLMEngine(config, progress=False)
    clock = StepClock(llm_engine)
    engine = AsyncEngine(llm_engine)
    engine.start()
    return engine, clock


async def solo_ttft(engine: AsyncEngine, repeats: int = 3) -> float:
    results = [await timed_request(engine, [100, 200 + i, 300, 400], SHORT, f"solo-{i}") for i in range(repeats)]
    return statistics.median(ttft for _, ttft, _ in results)


async def long_prefill(config: EngineConfig, long_tokens: int, delay: float) -> list[object]:
    engine, clock = start(config)
    try:
        solo = await solo_ttft(engine)
        long_prompt = [1000 + i % 20000 for i in range(long_tokens)]
        long_task = asyncio.create_task(timed_request(engine, long_prompt, SamplingParams(max_tokens=1), "long"))
        await asyncio.sleep(delay)
        sent, ttft, total = await timed_request(engine, [100, 201, 301, 401], SHORT, "short")
        _, long_ttft, _ = await long_task
        in_flight = clock.step_at(sent)
    finally:
        engine.shutdown()
    bound = 2 * solo + in_flight
    return [engine_label(config), f"{solo * 1000:.0f}", f"{in_flight * 1000:.0f}", f"{ttft * 1000:.0f}",
            f"{bound * 1000:.0f}", "yes" if ttft <= bound else "**no**", f"{total * 1000:.0f}", f"{long_ttft:.1f}"]


async def hostage(config: EngineConfig, num_short: int) -> list[object]:
    engine, _ = start(config)
    try:
        await solo_ttft(engine)  # warm-up
        solo_total = (await timed_request(engine, [100, 250, 300, 400], SHORT, "solo-total"))[2]
        try:
            hog = asyncio.create_task(timed_request(engine, [100, 101, 102], HOSTAGE, "hog"))
            deadline = time.monotonic() + 120
            while not hog.done() and engine.stats()["num_preemptions"] == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.2)  # until its members fill the pool and preempt each other
            if hog.done():
                hog.result()  # raises the refusal
            latencies = [(await timed_request(engine, [100, 260 + i, 300, 400], SHORT, f"short-{i}"))[2]
                         for i in range(num_short)]
            preemptions = engine.stats()["num_preemptions"]
            hog.cancel()
            outcome = f"admitted ({preemptions} preemptions so far)"
        except ValueError as err:
            return [engine_label(config), f"refused: {err}"[:90], f"{solo_total * 1000:.0f}", "-", "-"]
    finally:
        engine.shutdown()
    return [engine_label(config), outcome, f"{solo_total * 1000:.0f}",
            f"{statistics.median(latencies) * 1000:.0f}", f"{max(latencies) * 1000:.0f}"]


def engine_label(config: EngineConfig) -> str:
    threshold = config.long_prefill_token_threshold
    cap = config.max_blocks_per_request
    return (f"threshold {'default' if threshold is None else threshold}, "
            f"cap {'default' if cap is None else cap}, {config.num_blocks or 'default'} blocks")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--long-tokens", type=int, default=8191)
    parser.add_argument("--delay", type=float, default=0.5, help="seconds between the long and the short request")
    parser.add_argument("--hostage-blocks", type=int, default=96)
    parser.add_argument("--num-short", type=int, default=5)
    parser.add_argument("--num-threads", type=int, default=None)
    args = parser.parse_args()
    base = {"model": args.model, "num_threads": args.num_threads}
    long_rows, hostage_rows = [], []
    for threshold in (None, 0):
        config = EngineConfig(**base, long_prefill_token_threshold=threshold)
        long_rows.append(asyncio.run(long_prefill(config, args.long_tokens, args.delay)))
        print(long_rows[-1], flush=True)
    for cap in (None, 100_000):
        config = EngineConfig(**base, num_blocks=args.hostage_blocks, max_blocks_per_request=cap)
        hostage_rows.append(asyncio.run(hostage(config, args.num_short)))
        print(hostage_rows[-1], flush=True)
    table = (
        f"Short 4-token request sent {args.delay} s after a {args.long_tokens}-token prompt (ms):\n\n"
        + markdown_table(["engine", "solo TTFT", "step in flight", "TTFT beside", "2x solo + step",
                          "within", "short total", "long TTFT (s)"], long_rows)
        + f"\n\n{args.num_short} short 4-token requests, one after another, while n=16 best_of=16 "
        "max_tokens=700 runs (ms):\n\n"
        + markdown_table(["engine", "hostage group", "solo total", "short total p50", "short total max"],
                         hostage_rows)
    )
    path = write_result("fairness", "Fairness: long prefill and pool hostage", table)
    print(path.read_text())


if __name__ == "__main__":
    main()
