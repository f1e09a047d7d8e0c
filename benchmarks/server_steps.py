"""A decode step's cost in the server against the same step offline, by rows (the OpenMP-teams check).

The server's steps cost what `LLMEngine.step` costs offline only while one thread runs all of the
engine's OpenMP work (kvserve/openmp.py): a model built on one thread and stepped on another made the
server's 7-row decode step 2x slower on 2 cores. This measures, for each row count N:
- server: N streaming completions of --tokens tokens at once against `python -m kvserve.server`, the
  median duration of its N-row decode steps (its step trace, KVSERVE_STEP_TRACE);
- offline, main thread: N requests through `LLMEngine.step` on the thread that built the engine;
- offline, other thread: the same engine stepped from a second thread (what the server did before);
- offline, built there: an engine built and stepped on a second thread (what `AsyncEngine.spawn` does).

    python benchmarks/server_steps.py                 # rows 1, 4, 7, 16
    python benchmarks/server_steps.py --rows 7 --no-write
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, write_result  # noqa: E402
from kvserve.config import EngineConfig  # noqa: E402
from kvserve.engine.engine import LLMEngine  # noqa: E402
from kvserve.engine.params import SamplingParams  # noqa: E402
from kvserve.server.launcher import launch_server  # noqa: E402


def server_steps(model: str, kv_memory: str, rows: list[int], tokens: int) -> dict[int, float]:
    """Median ms of the server's decode steps with exactly N rows, for each N (N streams at once)."""
    trace = Path(tempfile.mkdtemp()) / "steps.jsonl"
    server = launch_server(["--model", model, "--kv-cache-memory", kv_memory], env={"KVSERVE_STEP_TRACE": str(trace)})
    medians = {}
    try:
        for n in rows:
            start = len(trace.read_text().splitlines()) if trace.exists() else 0
            asyncio.run(_streams(server.url, model, n, tokens))
            lines = trace.read_text().splitlines()[start:]
            steps = [json.loads(line) for line in lines if '"step"' in line]
            spans = [b["t"] - a["t"] for a, b in zip(steps, steps[1:], strict=False)
                     if a["decode"] == n and a["prefill"] == 0 and b["decode"] == n]
            medians[n] = 1000 * statistics.median(spans)
            print(f"server, {n} rows: {medians[n]:.1f} ms ({len(spans)} steps)", file=sys.stderr)
    finally:
        server.terminate()
    return medians


async def _streams(url: str, model: str, n: int, tokens: int) -> None:
    body = {"model": model, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        async def one(i: int) -> None:
            async with http.stream("POST", "/v1/completions", json={**body, "prompt": f"Story {n}-{i}:"}) as r:
                async for _ in r.aiter_lines():
                    pass

        await asyncio.gather(*(one(i) for i in range(n)))


def offline_steps(engine: LLMEngine, n: int, tokens: int, tag: str) -> float:
    """Median ms of `engine.step()` over N decoding requests (after their prefill)."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i in range(n):
        engine.add(engine.make_request(f"Story {tag}-{n}-{i}:", params, request_id=f"{tag}-{n}-{i}"))
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[3:])


def on_thread(fn):
    """fn() on a new thread (each call its own, ended before this returns)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn).result()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--kv-cache-memory", default="256MiB")
    parser.add_argument("--rows", default="1,4,7,16", help="comma-separated row counts")
    parser.add_argument("--tokens", type=int, default=120, help="tokens each request decodes")
    parser.add_argument("--no-write", action="store_true", help="print only; leave results/ untouched")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    server = server_steps(args.model, args.kv_cache_memory, rows, args.tokens)
    config = EngineConfig(model=args.model, kv_cache_memory=args.kv_cache_memory)
    # First, while this (main) thread has run no parallel region: an engine built and stepped on a second
    # thread, as the server's is. Then one built here, stepped here and from a second thread.
    elsewhere = on_thread(lambda: (engine := LLMEngine(config, progress=False),
                                   {n: offline_steps(engine, n, args.tokens, "built") for n in rows})[1])
    here = LLMEngine(config, progress=False)
    table_rows = []
    for n in rows:
        main_ms = offline_steps(here, n, args.tokens, "main")
        other_ms = on_thread(lambda n=n: offline_steps(here, n, args.tokens, "other"))
        table_rows.append([n, server[n], main_ms, other_ms, elsewhere[n]])
        print(f"offline, {n} rows: main {main_ms:.1f}, other thread {other_ms:.1f}, built there {elsewhere[n]:.1f} ms",
              file=sys.stderr)
    table = markdown_table(["rows", "server (ms)", "offline, main thread (ms)", "offline, stepped from another "
                            "thread (ms)", "offline, built and stepped there (ms)"], table_rows)
    notes = (f"Model `{args.model}`, greedy, {args.tokens} tokens per request, medians over each run's steps. "
             f"The server builds its engine on the thread that steps it (`AsyncEngine.spawn`); an engine stepped "
             f"from a thread other than the one that built it gives libgomp a second team of threads "
             f"(kvserve/openmp.py). OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}.")
    print(table)
    if not args.no_write:
        title = "Decode step in the server against offline, by rows"
        print(f"wrote {write_result('server_steps', title, table, notes)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
