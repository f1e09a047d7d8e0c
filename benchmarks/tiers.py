"""KV tiers benchmark (real default model, fp32).

1. Load-back cost per block per tier: fetch + decode + copy of one block of smollm2-135m's KV from host
   RAM, local disk (a temp directory; reads come from the page cache when it is warm, so this is a
   lower bound on a cold disk) and Redis (a local server on loopback), against recomputing that block
   (marginal prefill time per 16 tokens of a 1,024-token prompt with the prefix cache off).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Timer, load_workloads, markdown_table, write_result  # noqa: E402
from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.prefix.hashing import block_hashes  # noqa: E402
from kvserve.tiers.codec import BlockCodec  # noqa: E402
from kvserve.tiers.disk import DiskStore  # noqa: E402
from kvserve.tiers.host import HostStore  # noqa: E402
from kvserve.tiers.local_redis import LocalRedis  # noqa: E402
from kvserve.tiers.offload import OffloadPolicy  # noqa: E402
from kvserve.tiers.redis import RedisStore  # noqa: E402
from kvserve.tiers.store import model_fingerprint  # noqa: E402

PROMPT_TOKENS = 1024


def recompute_ms_per_block(llm: LLM, prompt: list[int], repeats: int) -> float:
    """Prefill time of `prompt` over its number of blocks (prefix cache off: nothing reused)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times = []
    for _ in range(repeats):
        with Timer() as timer:
            llm.generate([prompt], params)
        times.append(timer.seconds)
    return 1000 * statistics.median(times) / (len(prompt) // llm.engine.kv_pool.block_size)


def load_ms_per_block(policy: OffloadPolicy, tier: str, hashes: list[bytes], pool: torch.Tensor, repeats: int):
    """Median over `repeats` of loading every block (fetch, verify, decode) and copying it into the pool."""
    times = []
    for _ in range(repeats):
        with Timer() as timer:
            if tier == "host":
                blocks = policy.load_host(hashes)
            else:
                blocks = policy.load(hashes, [tier] * len(hashes)).result().blocks
                if policy.host is not None:  # keep the next repeat a miss on host
                    policy.host.delete(policy.fingerprint.keys(hashes))
            policy.codec.write_blocks(pool, list(range(len(blocks))), blocks)
        assert len(blocks) == len(hashes), f"{tier}: loaded {len(blocks)} of {len(hashes)}"
        times.append(timer.seconds)
    return 1000 * statistics.median(times) / len(hashes)


def loadback(llm: LLM, prompt: list[int], repeats: int) -> str:
    pool = llm.engine.kv_pool.tensor
    codec = BlockCodec.for_pool(pool)
    block_size = llm.engine.kv_pool.block_size
    fingerprint = model_fingerprint(kv_dtype=str(pool.dtype), block_size=block_size, config={"bench": 1})
    hashes = block_hashes(prompt, block_size, ())
    block_ids = list(range(len(hashes)))
    recompute = recompute_ms_per_block(llm, prompt, repeats)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, LocalRedis() as redis_server:
        stores = {
            "host": lambda: dict(host=HostStore(1 << 30)),
            "disk": lambda: dict(disk=DiskStore(Path(tmp) / "disk", 1 << 30)),
            "remote": lambda: dict(remote=RedisStore(redis_server.url, timeout_s=5.0)),
        }
        for tier, make in stores.items():
            policy = OffloadPolicy(codec, fingerprint, **make())
            if tier == "remote":
                policy.write_through(hashes, pool, block_ids)
            else:
                policy.demote(hashes, pool, block_ids)
            policy.flush()
            cost = load_ms_per_block(policy, tier, hashes, pool, repeats)
            rows.append([tier, cost, recompute, recompute / cost])
            policy.close()
    header = [f"tier ({codec.payload_bytes // 1024} KiB/block)", "load ms/block", "recompute ms/block",
              "recompute / load"]
    return markdown_table(header, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    prompt = load_workloads()["prefill"]["2048"][:PROMPT_TOKENS]
    llm = LLM("smollm2-135m", progress=False, prefix_cache="off", kv_cache_memory="256MiB")
    table = "### Load-back cost per block\n\n" + loadback(llm, prompt, args.repeats)
    notes = (
        "Load = fetch + checksum/header check + decode + copy into the pool, per block, batch of "
        f"{PROMPT_TOKENS // llm.engine.kv_pool.block_size} blocks. Disk reads hit the page cache here (a "
        "just-written file); a cold disk adds its read latency. Redis is a local server over loopback: "
        "a remote one adds the network round trip and bandwidth."
    )
    print(table)
    print(write_result("tiers", "KV tiers: host, disk, Redis", table, notes))


if __name__ == "__main__":
    main()
