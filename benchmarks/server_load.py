"""Load test of the HTTP server: N concurrent streaming chat clients sharing one system prompt.

Starts `python -m kvserve.server` on a free loopback port (or uses --url), runs --clients async
OpenAI clients that each send --requests streaming chat completions one after another, then waits
for the server to drain and checks the pool accounting (no block referenced; free + cached = total).
Reports errors, requests/s, output tokens/s, TTFT p50/p99 (client-side: request sent → first
content token) and the prefix-cache reuse of the shared system prompt.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, write_result  # noqa: E402
from kvserve.server.launcher import launch_server  # noqa: E402

SYSTEM_PROMPT = (
    "You are the support assistant of a small bookshop. Answer in one or two short sentences, politely, "
    "without making up facts. The shop opens at nine and closes at six, Monday to Saturday. Orders ship "
    "within two working days; returns are accepted for thirty days with a receipt. Gift cards never expire. "
    "If a question is not about the shop, say that you can only help with the bookshop."
)
QUESTIONS = [
    "When do you open?", "Can I return a book?", "Do gift cards expire?", "How fast do you ship?",
    "Are you open on Sunday?", "What is the weather today?", "Do you sell e-books?", "Where are you?",
]


@dataclass(slots=True)
class Results:
    ttfts: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    errors: list[str] = field(default_factory=list)


async def one_request(
    client: openai.AsyncOpenAI, model: str, question: str, max_tokens: int, out: Results
) -> None:
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
    start = time.perf_counter()
    first_token_at = None
    stream = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0.7, stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in stream:
        choice = chunk.choices[0] if chunk.choices else None
        if first_token_at is None and choice is not None and (choice.delta.content or choice.finish_reason):
            first_token_at = time.perf_counter()
        if chunk.usage is not None:
            out.output_tokens += chunk.usage.completion_tokens
            out.prompt_tokens += chunk.usage.prompt_tokens
            out.cached_tokens += chunk.usage.prompt_tokens_details.cached_tokens
    if first_token_at is None:
        raise RuntimeError("stream ended without a token")
    out.ttfts.append(first_token_at - start)


async def run_client(client, model: str, client_id: int, args, out: Results, progress: tqdm) -> None:
    for i in range(args.requests):
        question = f"{QUESTIONS[(client_id + i) % len(QUESTIONS)]} (customer {client_id}-{i})"
        try:
            await one_request(client, model, question, args.max_tokens, out)
        except Exception as err:  # noqa: BLE001 - every failure is counted and reported
            out.errors.append(f"{type(err).__name__}: {err}")
        progress.update(1)


async def run_load(base_url: str, model: str, args) -> tuple[Results, float]:
    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=args.clients + 8), timeout=600)
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", http_client=http, max_retries=0)
    out = Results()
    with tqdm(total=args.clients * args.requests, desc="requests", unit="req") as progress:
        start = time.perf_counter()
        clients = [run_client(client, model, i, args, out, progress) for i in range(args.clients)]
        await asyncio.gather(*clients)
        elapsed = time.perf_counter() - start
    await http.aclose()
    return out, elapsed


def metric(text: str, name: str) -> float:
    """One sample of /metrics text, e.g. `kvserve_kv_cache_blocks{state="used"}`; the `model_name` label
    every series carries is left out of `name`."""
    text = re.sub(r'model_name="[^"]*",?', "", text).replace("{}", "").replace(",}", "}")
    return float(re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE).group(1))


def block_counts(url: str, timeout: float = 60.0) -> dict[str, float]:
    """Wait until nothing runs or waits, then read the pool's block counts from /metrics."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        busy = metric(text, "kvserve_num_requests_running") + metric(text, "kvserve_num_requests_waiting")
        counts = {state: metric(text, f'kvserve_kv_cache_blocks{{state="{state}"}}')
                  for state in ("free", "cached", "used")}
        counts["total"] = metric(text, "kvserve_kv_cache_num_blocks")
        if (busy == 0 and counts["used"] == 0) or time.monotonic() > deadline:
            return counts
        time.sleep(0.2)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def report(out: Results, elapsed: float, counts: dict[str, float], args) -> tuple[str, bool]:
    total = args.clients * args.requests
    drained = counts["used"] == 0 and counts["free"] + counts["cached"] == counts["total"]
    ok = not out.errors and drained and len(out.ttfts) == total
    rows = [
        ["clients × requests", f"{args.clients} × {args.requests} = {total}"],
        ["errors", len(out.errors)],
        ["wall time (s)", elapsed],
        ["requests/s", len(out.ttfts) / elapsed],
        ["output tokens/s", out.output_tokens / elapsed],
        ["TTFT p50 (s)", statistics.median(out.ttfts) if out.ttfts else float("nan")],
        ["TTFT p99 (s)", percentile(out.ttfts, 0.99) if out.ttfts else float("nan")],
        ["prompt tokens served from cache", f"{out.cached_tokens:,} of {out.prompt_tokens:,} "
                                            f"({out.cached_tokens / max(out.prompt_tokens, 1):.0%})"],
        ["pool after drain (free / cached / used of total)",
         f"{counts['free']:.0f} / {counts['cached']:.0f} / {counts['used']:.0f} of {counts['total']:.0f}"],
        ["verdict", "PASS (no errors, no leaked blocks)" if ok else "FAIL"],
    ]
    return markdown_table(["metric", "value"], rows), ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests", type=int, default=3, help="sequential requests per client")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--url", default=None, help="use a running server instead of starting one")
    parser.add_argument("--no-write", action="store_true", help="print only; leave results/ untouched")
    args = parser.parse_args()

    server = None
    if args.url is None:
        print(f"starting server with {args.model} ...", file=sys.stderr)
        server = launch_server(["--model", args.model, "--kv-cache-memory", args.kv_cache_memory,
                                "--max-queue", str(args.clients * 4)])
    url = args.url or server.url
    try:
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        out, elapsed = asyncio.run(run_load(f"{url}/v1", model, args))
        counts = block_counts(url)
    finally:
        exit_code = server.terminate() if server else 0
    table, ok = report(out, elapsed, counts, args)
    notes = (f"Model `{model}`, streaming chat completions, max_tokens={args.max_tokens}, temperature 0.7; "
             f"a {len(SYSTEM_PROMPT.split())}-word system prompt shared by every request; loopback only. "
             f"Server exit status after SIGTERM: {exit_code}.")
    if out.errors:
        notes += "\n\nFirst errors:\n" + "\n".join(f"- {e}" for e in out.errors[:5])
    print(table)
    print(notes)
    if not args.no_write:
        print(f"wrote {write_result('server_load', 'HTTP server under load', table, notes)}")
    return 0 if ok and exit_code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
