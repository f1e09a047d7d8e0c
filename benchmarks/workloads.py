"""Synthetic traces in Mooncake's format (16-token blocks) for the eviction benchmark.

    python benchmarks/workloads.py chat out.jsonl     # multi-turn chat sharing one system prompt
    python benchmarks/workloads.py rag out.jsonl      # RAG: a few hot documents behind many questions

chat: conversations start as a Poisson process; each has a geometric number of turns (mean 4) with
exponential think time; turn k's prompt is the system prompt, the whole history (earlier prompts and
answers) and a new user message. rag: every request is the system prompt, two documents drawn from a
Zipf(1.1) popularity over the corpus, and a fresh question. Block ids are interned chained prefixes, as
in Mooncake's trace, so `kvserve replay` reads these files directly. Seeded: same file every run.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

BLOCK = 16


@dataclass
class Interner:
    """Chained block ids: a block's id names its content and everything before it."""

    ids: dict[tuple[int, tuple[int, ...]], int] = field(default_factory=dict)

    def hash_ids(self, tokens: list[int]) -> list[int]:
        parent, out = -1, []
        for start in range(0, len(tokens), BLOCK):
            key = (parent, tuple(tokens[start : start + BLOCK]))
            parent = self.ids.setdefault(key, len(self.ids))
            out.append(parent)
        return out


def fresh(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 32000) for _ in range(n)]


def record(interner: Interner, t: float, prompt: list[int], output: int) -> dict:
    return {
        "timestamp": int(t * 1000), "input_length": len(prompt), "output_length": output,
        "hash_ids": interner.hash_ids(prompt), "block_size": BLOCK,
    }


def chat(rng: random.Random, num_conversations: int = 600, rate: float = 0.5) -> Iterator[tuple[float, list[int], int]]:
    system = fresh(rng, 1024)
    t = 0.0
    for _ in range(num_conversations):
        t += rng.expovariate(rate)
        history, when = list(system), t
        while True:
            history += fresh(rng, rng.randint(30, 400))  # the user's message
            answer = rng.randint(50, 500)
            yield when, list(history), answer
            if rng.random() < 0.25:  # geometric: mean 4 turns
                break
            history += fresh(rng, answer)  # the answer becomes history
            when += answer * 0.03 + rng.expovariate(1 / 30)


def rag(rng: random.Random, num_requests: int = 2500, rate: float = 2.0) -> Iterator[tuple[float, list[int], int]]:
    system = fresh(rng, 512)
    docs = [fresh(rng, rng.randint(800, 3000)) for _ in range(400)]
    weights = [1 / (rank + 1) ** 1.1 for rank in range(len(docs))]
    t = 0.0
    for _ in range(num_requests):
        t += rng.expovariate(rate)
        first, second = rng.choices(range(len(docs)), weights, k=2)
        yield t, system + docs[first] + docs[second] + fresh(rng, rng.randint(20, 120)), rng.randint(50, 300)


def write(kind: str, path: Path, seed: int = 0) -> int:
    rng, interner = random.Random(seed), Interner()
    requests = sorted(chat(rng) if kind == "chat" else rag(rng), key=lambda r: r[0])
    with open(path, "w", encoding="utf-8") as handle:
        for t, prompt, output in requests:
            handle.write(json.dumps(record(interner, t, prompt, output)) + "\n")
    return len(requests)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=("chat", "rag"))
    parser.add_argument("path", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"wrote {write(args.kind, args.path, args.seed)} requests to {args.path}")


if __name__ == "__main__":
    main()
