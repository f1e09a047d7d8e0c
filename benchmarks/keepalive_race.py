"""Keep-alive race probe: does a pooled client connection reused right after an idle gap fail?

httpx (and so the OpenAI SDK) drops an idle pooled connection after 5 s. When the server closes idle
keep-alive connections after the same 5 s, a request sent at that moment goes out on a socket the server is
closing and fails with a read error, though the server did nothing wrong (the soak's one client-side
error in 24,935 requests). Each of `--connections` tasks sends a one-token completion, waits
`--idle` seconds (spread over ±20 ms across tasks), and repeats `--rounds` times on its pooled
connection; the transport errors are counted.

    python benchmarks/keepalive_race.py --idle 5.0 --rounds 12 -- --keep-alive-timeout 5
"""

from __future__ import annotations

import argparse
import asyncio

import httpx

from kvserve.server.launcher import launch_server


async def _task(http: httpx.AsyncClient, index: int, model: str, args: argparse.Namespace, counts: dict) -> None:
    for _ in range(args.rounds):
        try:
            response = await http.post("/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 1})
            counts["ok" if response.status_code == 200 else "http_errors"] += 1
        except httpx.TransportError:
            counts["transport_errors"] += 1
        await asyncio.sleep(args.idle + (index % 21 - 10) * 0.002)


async def _probe(url: str, args: argparse.Namespace) -> dict:
    counts = {"ok": 0, "http_errors": 0, "transport_errors": 0}
    limits = httpx.Limits(max_connections=args.connections, max_keepalive_connections=args.connections)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        await asyncio.gather(*(_task(http, i, model, args, counts) for i in range(args.connections)))
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--idle", type=float, default=5.0, help="seconds between a task's requests")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--connections", type=int, default=42)
    parser.add_argument("server_args", nargs="*", help="extra `kvserve serve` flags (after --)")
    args = parser.parse_args()
    server = launch_server(["--model", "smollm2-135m", "--kv-cache-memory", "64MiB", *args.server_args])
    try:
        counts = asyncio.run(_probe(server.url, args))
    finally:
        server.terminate()
    print(f"idle {args.idle} s x {args.rounds} rounds x {args.connections} connections, server flags "
          f"{args.server_args or 'default'}: {counts}")


if __name__ == "__main__":
    main()
