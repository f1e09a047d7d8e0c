"""KV tiers benchmark (real default model, fp32, 2 threads, block size 16).

1. Multi-turn chat whose working set is 4x the device pool (--users users x --turns turns, one request
   at a time, each turn = the history + a --message-token user message, --answer-tokens greedy tokens):
   hit rate (turns 2+) split by source and TTFT p50/p90, for device only / + host (as large as the pool)
   / + host + disk / + host + Redis on a fresh replica whose Redis another replica filled with the same
   chat. Every configuration must produce the same transcript.
2. Restart: an engine with a disk tier serves each user's last prompt again after a restart (warm: the
   old directory) and from an empty directory (cold).
3. Load-back cost per block per tier: fetch + decode + copy of one block of smollm2-135m's KV from host
   RAM, local disk (a temp directory; reads come from the page cache when it is warm, so this is a
   lower bound on a cold disk) and Redis (a local server on loopback), against recomputing that block
   (marginal prefill time per 16 tokens of a 1,024-token prompt with the prefix cache off).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
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
from kvserve.tiers.offload import SOURCES, OffloadPolicy  # noqa: E402
from kvserve.tiers.redis import RedisStore  # noqa: E402
from kvserve.tiers.store import model_fingerprint  # noqa: E402

PROMPT_TOKENS = 1024
BLOCK_SIZE = 16


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


@dataclass(slots=True)
class Chat:
    """Each user's messages; the answers come from the model (greedy), so every config sees the same."""

    messages: list[list[list[int]]]  # [user][turn] -> token ids
    answer_tokens: int

    @classmethod
    def make(cls, users: int, turns: int, message_tokens: int, answer_tokens: int) -> Chat:
        low, high = load_workloads()["token_id_range"]
        rng = random.Random(0)
        messages = [[[rng.randrange(low, high) for _ in range(message_tokens)] for _ in range(turns)]
                    for _ in range(users)]
        return cls(messages, answer_tokens)

    def working_set_tokens(self) -> int:
        turns = len(self.messages[0])
        return len(self.messages) * turns * (len(self.messages[0][0]) + self.answer_tokens)


@dataclass(slots=True)
class ChatRun:
    ttfts: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached: dict[str, int] = field(default_factory=dict)
    transcript: list[list[int]] = field(default_factory=list)
    last_prompts: list[list[int]] = field(default_factory=list)


def run_chat(llm: LLM, chat: Chat) -> ChatRun:
    params = SamplingParams(max_tokens=chat.answer_tokens, temperature=0.0, ignore_eos=True)
    histories: list[list[int]] = [[] for _ in chat.messages]
    result = ChatRun()
    for turn in range(len(chat.messages[0])):
        for user, history in enumerate(histories):
            prompt = history + chat.messages[user][turn]
            output = llm.generate([prompt], params)[0]
            history[:] = prompt + output.token_ids
            result.ttfts.append(output.metrics.ttft)
            if turn == len(chat.messages[0]) - 1:
                result.last_prompts.append(prompt)
            if turn > 0:
                result.prompt_tokens += len(prompt)
                for source, tokens in output.cached_tokens_by_source.items():
                    result.cached[source] = result.cached.get(source, 0) + tokens
    result.transcript = histories
    if llm.engine.tiers is not None:
        llm.engine.tiers.policy.flush()
    return result


def make_llm(num_blocks: int, **tiers) -> LLM:
    return LLM("smollm2-135m", progress=False, num_blocks=num_blocks, block_size=BLOCK_SIZE,
               max_num_batched_tokens=4096, **{"host_cache": 0, **tiers})


def chat_row(name: str, run: ChatRun) -> list[object]:
    total = sum(run.cached.values())
    split = ", ".join(f"{s} {run.cached[s] / run.prompt_tokens:.0%}" for s in SOURCES if run.cached.get(s))
    deciles = statistics.quantiles(run.ttfts, n=10)
    return [name, f"{total / run.prompt_tokens:.0%}", split or "-", statistics.median(run.ttfts), deciles[8]]


def chat_benchmark(chat: Chat, tmp: Path, redis_url: str) -> tuple[str, dict[str, ChatRun], int]:
    longest = len(chat.messages[0]) * (len(chat.messages[0][0]) + chat.answer_tokens)
    pool_blocks = max(chat.working_set_tokens() // 4 // BLOCK_SIZE, -(-longest // BLOCK_SIZE) + 1)
    probe = make_llm(pool_blocks)
    host_bytes = pool_blocks * BlockCodec.for_pool(probe.engine.kv_pool.tensor).payload_bytes
    del probe
    configs = {  # the third also writes every block through to Redis; the fourth is a fresh replica reading it
        "device only": dict(),
        "+ host": dict(host_cache=host_bytes),
        "+ host + disk (+ Redis write-through)": dict(host_cache=host_bytes, disk_cache=str(tmp / "chat-disk"),
                                                      remote_cache=redis_url),
        "+ host + Redis (fresh replica)": dict(host_cache=host_bytes, remote_cache=redis_url),
    }
    runs: dict[str, ChatRun] = {}
    for name, tiers in configs.items():
        llm = make_llm(pool_blocks, **tiers)
        runs[name] = run_chat(llm, chat)
        llm.engine.close()
        print(name, chat_row(name, runs[name]), flush=True)
    transcripts = {tuple(map(tuple, run.transcript)) for run in runs.values()}
    assert len(transcripts) == 1, "a tier changed an answer"
    table = markdown_table(["configuration", "hit rate (turns 2+)", "by source", "TTFT p50 (s)", "TTFT p90 (s)"],
                           [chat_row(name, run) for name, run in runs.items()])
    return table, runs, pool_blocks


def restart_benchmark(chat: Chat, runs: dict[str, ChatRun], tmp: Path, pool_blocks: int) -> str:
    """The + host + disk engine's directory after a restart (warm) against an empty one (cold)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prompts = runs["+ host + disk (+ Redis write-through)"].last_prompts
    rows = []
    for name, directory in (("warm (same disk directory)", tmp / "chat-disk"), ("cold (empty directory)",
                                                                                 tmp / "empty-disk")):
        llm = make_llm(pool_blocks, disk_cache=str(directory))
        outputs = [llm.generate([p], params)[0] for p in prompts]
        llm.engine.close()
        ttfts = [o.metrics.ttft for o in outputs]
        cached = sum(o.cached_tokens_by_source.get("disk", 0) for o in outputs)
        rows.append([name, f"{cached / sum(map(len, prompts)):.0%}", statistics.median(ttfts), max(ttfts)])
    return markdown_table(["after restart", "served from disk", "TTFT p50 (s)", "TTFT max (s)"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--users", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--message-tokens", type=int, default=48)
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS, help="load-back: prompt recomputed")
    args = parser.parse_args()
    torch.set_num_threads(2)
    chat = Chat.make(args.users, args.turns, args.message_tokens, args.answer_tokens)
    with tempfile.TemporaryDirectory() as tmp, LocalRedis() as redis_server:
        chat_table, runs, pool_blocks = chat_benchmark(chat, Path(tmp), redis_server.url)
        restart_table = restart_benchmark(chat, runs, Path(tmp), pool_blocks)
    prompt = load_workloads()["prefill"]["2048"][: args.prompt_tokens]
    llm = LLM("smollm2-135m", progress=False, prefix_cache="off", kv_cache_memory="256MiB", host_cache=0)
    table = (
        f"### Multi-turn chat, working set {chat.working_set_tokens()} tokens, device pool {pool_blocks} blocks of "
        f"{BLOCK_SIZE} ({chat.working_set_tokens() / (pool_blocks * BLOCK_SIZE):.1f}x smaller)\n\n{chat_table}\n\n"
        f"### Restart\n\n{restart_table}\n\n"
        f"### Load-back cost per block\n\n{loadback(llm, prompt, args.repeats)}"
    )
    notes = (
        f"{args.users} users x {args.turns} turns, {args.message_tokens}-token messages, {args.answer_tokens}-token "
        "greedy answers, one request at a time; every configuration produced the same transcript. Hit rate = "
        "cached prompt tokens / prompt tokens over turns 2+. Load = fetch + checksum/header check + decode + "
        f"copy into the pool, per block, batch of {args.prompt_tokens // BLOCK_SIZE} blocks. Disk reads hit the page "
        "cache here (just-written files); a cold disk adds its read latency. Redis is a local server over "
        "loopback: a remote one adds the network round trip and bandwidth."
    )
    print(table)
    print(write_result("tiers", "KV tiers: host, disk, Redis", table, notes))


if __name__ == "__main__":
    main()
