"""Timing side channel across tenants: can tenant B tell that tenant A cached a secret prefix?

Starts a two-tenant server (`--api-keys`) on a free loopback port with the real model. Tenant A warms
a secret prompt of --prefix-len random tokens. Then, in one randomly shuffled sequence:
  - B sends the secret --samples times,
  - B sends --samples cold prompts of the same length (fresh random tokens each),
  - A re-sends its secret --samples times (the positive control: its own cache must make it faster).
Every B request carries a fresh `cache_salt`, so B never hits its *own* earlier copies and each probe
is exactly the attacker's question "is this prefix cached anywhere?".

With `--tier host|disk|remote` the server runs that KV tier and an admin empties the device cache
(`POST /reset_prefix_cache`, which does not demote) before every probe, so the only copy of A's secret a
probe could hit is the one in that tier (A's control re-sends load it from there).

TTFT is measured by the client (request sent → first streamed token), as an attacker would. Pass:
B's cached_tokens are all 0, B's secret and cold TTFTs are indistinguishable (two-sample KS,
p > 0.01), and A's re-sends are clearly faster than B's cold prompts (KS p < 1e-6).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from scipy.stats import ks_2samp
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, write_result  # noqa: E402
from kvserve.server.launcher import launch_server  # noqa: E402
from kvserve.tiers.local_redis import LocalRedis  # noqa: E402

KEYS = {"sk-tenant-a": "tenant-a", "sk-tenant-b": "tenant-b", "sk-ops": {"tenant": "ops", "admin": True}}
A, B, ADMIN = "sk-tenant-a", "sk-tenant-b", "sk-ops"
TIER_FLAGS = {  # server flags per --tier; the device-only run keeps the host tier off too
    "device": ["--host-cache", "0"],
    "host": ["--host-cache", "1GiB"],
    "disk": ["--host-cache", "0", "--disk-cache", "{tmp}/disk"],
    "remote": ["--host-cache", "0", "--remote-cache", "{redis}"],
}
TOKEN_RANGE = (1000, 49000)  # ordinary vocabulary ids of SmolLM2 (its special tokens sit below 20)


@dataclass(slots=True)
class Sample:
    ttft: float
    cached_tokens: int


@dataclass(slots=True)
class Groups:
    b_secret: list[Sample] = field(default_factory=list)
    b_cold: list[Sample] = field(default_factory=list)
    a_secret: list[Sample] = field(default_factory=list)


def probe(http: httpx.Client, model: str, key: str, prompt: list[int], cache_salt: str | None) -> Sample:
    """One streamed one-token completion; TTFT from sending to the first token chunk."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    headers = {"Authorization": f"Bearer {key}"}
    ttft, cached = None, None
    start = time.perf_counter()
    with http.stream("POST", "/v1/completions", json=body, headers=headers) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    if ttft is None or cached is None:
        raise RuntimeError("stream ended without a token or usage")
    return Sample(ttft, cached)


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(*TOKEN_RANGE) for _ in range(length)]


def run(http: httpx.Client, model: str, args) -> Groups:
    rng = random.Random(args.seed)
    secret = random_prompt(rng, args.prefix_len)
    warm = probe(http, model, A, secret, None)  # A caches its secret
    assert warm.cached_tokens == 0, "the secret was cached before A sent it"
    for i in range(3):  # warm the engine's code paths; not recorded
        probe(http, model, B, random_prompt(rng, args.prefix_len), f"warmup-{i}")
    schedule = [(kind, i) for kind in ("b_secret", "b_cold", "a_secret") for i in range(args.samples)]
    rng.shuffle(schedule)
    groups = Groups()
    for kind, i in tqdm(schedule, desc="probes", unit="req"):
        if args.tier != "device":  # the device forgets everything: only the tier can still hold the secret
            http.post("/reset_prefix_cache", headers={"Authorization": f"Bearer {ADMIN}"}).raise_for_status()
        if kind == "a_secret":
            sample = probe(http, model, A, secret, None)
        else:
            prompt = secret if kind == "b_secret" else random_prompt(rng, args.prefix_len)
            sample = probe(http, model, B, prompt, f"probe-{kind}-{i}")
        getattr(groups, kind).append(sample)
    return groups


def report(groups: Groups, args) -> tuple[str, bool]:
    ttft = {name: [s.ttft for s in getattr(groups, name)] for name in ("b_secret", "b_cold", "a_secret")}
    cached = {name: [s.cached_tokens for s in getattr(groups, name)] for name in ttft}
    leak = ks_2samp(ttft["b_secret"], ttft["b_cold"])
    control = ks_2samp(ttft["a_secret"], ttft["b_cold"])
    checks = {
        "B's cached_tokens all 0": all(c == 0 for c in cached["b_secret"] + cached["b_cold"]),
        "B secret vs B cold indistinguishable (KS p > 0.01)": leak.pvalue > 0.01,
        "A's re-sends faster than cold (KS p < 1e-6)": control.pvalue < 1e-6,
        "A's re-sends hit its cache": min(cached["a_secret"]) > 0,
    }
    rows = [
        [name, len(ttft[name]), statistics.median(ttft[name]) * 1000,
         min(ttft[name]) * 1000, max(ttft[name]) * 1000, f"{min(cached[name])}–{max(cached[name])}"]
        for name in ("b_secret", "b_cold", "a_secret")
    ]
    table = markdown_table(["group", "n", "TTFT median (ms)", "min (ms)", "max (ms)", "cached_tokens"], rows)
    table += "\n\n" + markdown_table(["test", "KS statistic", "p-value"], [
        ["B secret vs B cold (leak?)", f"{leak.statistic:.3f}", f"{leak.pvalue:.3g}"],
        ["A secret vs B cold (positive control)", f"{control.statistic:.3f}", f"{control.pvalue:.3g}"],
    ])
    verdicts = [[check, "PASS" if passed else "FAIL"] for check, passed in checks.items()]
    table += "\n\n" + markdown_table(["check", "result"], verdicts)
    return table, all(checks.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prefix-len", type=int, default=1000)
    parser.add_argument("--samples", type=int, default=50, help="requests per group")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-memory", default="2GiB")
    parser.add_argument("--tier", default="device", choices=list(TIER_FLAGS),
                        help="where A's secret is when B probes: the device pool, or only a lower KV tier")
    parser.add_argument("--no-write", action="store_true", help="print only; leave results/ untouched")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        keys = Path(tmp) / "keys.json"
        keys.write_text(json.dumps({"keys": KEYS}))
        redis_url = stack.enter_context(LocalRedis()).url if args.tier == "remote" else ""
        tier_flags = [flag.format(tmp=tmp, redis=redis_url) for flag in TIER_FLAGS[args.tier]]
        print(f"starting a two-tenant server with {args.model} ({args.tier}) ...", file=sys.stderr)
        server = launch_server(["--model", args.model, "--kv-cache-memory", args.kv_cache_memory,
                                "--api-keys", str(keys), *tier_flags])
        try:
            with httpx.Client(base_url=server.url, timeout=600) as http:
                groups = run(http, args.model, args)
        finally:
            exit_code = server.terminate()
    table, ok = report(groups, args)
    notes = (f"Model `{args.model}`, {args.prefix_len}-token prompts (random token ids), one-token streamed "
             f"completions sent one at a time over loopback, {args.samples} per group in one shuffled order "
             f"(seed {args.seed}); every B probe has a fresh cache_salt. Tier: {args.tier}"
             f"{' (device cache emptied before every probe)' if args.tier != 'device' else ''}. "
             f"Server exit status: {exit_code}.")
    print(table)
    print(notes)
    if not args.no_write:
        name, title = "side_channel", "Cross-tenant timing side channel"
        if args.tier != "device":
            name, title = f"side_channel_{args.tier}", f"Cross-tenant timing side channel through the {args.tier} tier"
        print(f"wrote {write_result(name, title, table, notes)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
