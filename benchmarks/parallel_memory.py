"""KV blocks held by parallel sampling and beam search vs independent copies of the sequences.

One 1,000-token prompt (the first 1,000 tokens of the shared 2,048-token prefill workload), 32 new
tokens. For parallel sampling n in {1, 2, 4, 8} (temperature 0.8, EOS ignored) and beam search
widths {1, 4, 8}, the figure is the allocator's peak of referenced blocks (`LLM.stats()`
`peak_used_blocks`) during the request. "Independent" runs the same number of separate requests of
the same prompt with the prefix cache off, so nothing is shared: the memory n copies would take.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Timer, load_workloads, markdown_table, write_result  # noqa: E402
from kvserve import LLM, SamplingParams  # noqa: E402

PROMPT_TOKENS = 1000
NEW_TOKENS = 32
PARALLEL_NS = (1, 2, 4, 8)
BEAM_WIDTHS = (1, 4, 8)


def measure(llm: LLM, run) -> tuple[int, float]:
    """Peak referenced blocks and seconds for `run(llm)` on an idle engine with an empty cache."""
    assert llm.reset_prefix_cache()
    llm.engine.block_manager.reset_peak()  # the peak since the engine started: restart it
    with Timer() as timer:
        run(llm)
    return llm.stats()["peak_used_blocks"], timer.seconds


def sampling(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, seed=0, ignore_eos=True, n=n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-blocks", type=int, default=600)
    args = parser.parse_args()
    prompt = load_workloads()["prefill"]["2048"][:PROMPT_TOKENS]
    shared = LLM("smollm2-135m", progress=False, num_blocks=args.num_blocks)
    separate = LLM("smollm2-135m", progress=False, num_blocks=args.num_blocks, prefix_cache="off")
    block_size = shared.stats()["block_size"]
    prompt_blocks = -(-PROMPT_TOKENS // block_size)
    independent = {
        count: measure(separate, lambda llm, c=count: llm.generate([prompt] * c, sampling(1)))[0]
        for count in sorted(set(PARALLEL_NS) | set(BEAM_WIDTHS))
    }
    rows = []
    for n in PARALLEL_NS:
        peak, seconds = measure(shared, lambda llm, n=n: llm.generate(prompt, sampling(n)))
        rows.append(_row(f"parallel n={n}", n, peak, prompt_blocks, independent[n], seconds))
    for width in BEAM_WIDTHS:
        peak, seconds = measure(shared, lambda llm, w=width: llm.beam_search(prompt, w, NEW_TOKENS))
        rows.append(_row(f"beam width={width}", width, peak, prompt_blocks, independent[width], seconds))
    header = ["request", "sequences", "peak blocks", "prompt blocks", "extra blocks / sequence",
              "independent copies", "saving", "seconds"]
    table = markdown_table(header, rows)
    print(table)
    notes = (
        f"{PROMPT_TOKENS}-token prompt, {NEW_TOKENS} new tokens, block size {block_size}, smollm2-135m fp32. "
        "Extra blocks per sequence = (peak - prompt blocks) / sequences: the copied tail block plus the "
        f"blocks its own {NEW_TOKENS} tokens fill (the prompt's 8-token tail leaves 8 free slots, so 32 "
        "tokens need 2 more blocks). Beam search may end before 32 tokens when hypotheses finish on EOS."
    )
    path = write_result("parallel_memory", "Parallel sampling and beam search: KV blocks held", table, notes)
    print(f"\nwrote {path}")


def _row(name: str, count: int, peak: int, prompt_blocks: int, independent: int, seconds: float) -> list:
    per_sequence = (peak - prompt_blocks) / count
    saving = f"{independent / peak:.1f}x"
    return [name, count, peak, prompt_blocks, per_sequence, independent, saving, seconds]


if __name__ == "__main__":
    main()
