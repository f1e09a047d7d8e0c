"""Structured output: the per-token cost of the grammar mask, and end-to-end generation with and without.

smollm2-135m (fp32, 49,152-token vocabulary), a batch of 8 chat prompts, greedy, up to 32 new tokens.
Each grammar kind generates the batch once through `LLM.generate` (wall time, output tokens/s), then
every constrained output is replayed through a fresh matcher of its grammar, timing what the engine
does per token: fill the bitmask, apply it to a logits row, accept the token (mean and p99, in µs).
"Compile" is the first request's grammar compilation (cached afterwards by its source).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, write_result  # noqa: E402
from kvserve import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer"},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                     "zip": {"type": "string", "pattern": "[0-9]{5}"}},
                    "required": ["city", "zip"]},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age", "address", "tags"],
}
KINDS = {
    "none": None,
    "json schema": StructuredOutputsParams(json=SCHEMA),
    "json object": StructuredOutputsParams(json_object=True),
    "regex": StructuredOutputsParams(regex=r"[A-Z][a-z]{2,8} [0-9]{1,3} (years|months)"),
    "choice": StructuredOutputsParams(choice=["positive", "negative", "neutral"]),
    "grammar (EBNF)": StructuredOutputsParams(grammar='root ::= item (", " item)*\nitem ::= [a-z]+'),
}
QUESTIONS = ["Describe a person as JSON.", "Who lives in Paris?", "Write a short review.", "Pick a colour.",
             "Give me a name and an age.", "What is the sentiment of: I love it?", "List some fruits.",
             "Tell me about a city."]


def replay_cost(llm: LLM, kind: StructuredOutputsParams, outputs: list[list[int]]) -> list[float]:
    """Seconds per token of mask + apply + accept, replaying each output through a fresh matcher."""
    compiler = llm.engine._grammar_compiler()
    row = torch.zeros(llm.engine.model_config.vocab_size)
    costs = []
    for token_ids in outputs:
        state = compiler.matcher(kind)
        for token_id in token_ids:
            start = time.perf_counter()
            state.mask(row)
            state.accept(token_id)
            costs.append(time.perf_counter() - start)
            row.zero_()
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    llm = LLM("smollm2-135m", progress=False, kv_cache_memory_bytes=256 << 20)
    prompts = [llm.render_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm up
    setup_start = time.perf_counter()
    llm.engine._grammar_compiler()._get_compiler()  # the vocabulary's token table, built once per engine
    setup_ms = (time.perf_counter() - setup_start) * 1e3
    rows = []
    for name, kind in KINDS.items():
        compile_start = time.perf_counter()
        if kind is not None:
            llm.engine._grammar_compiler().matcher(kind)
        compile_ms = (time.perf_counter() - compile_start) * 1e3
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, structured_outputs=kind)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = [o.outputs[0].token_ids for o in outputs]
        num_tokens = sum(len(t) for t in tokens)
        finished = sum(o.outputs[0].finish_reason == "stop" for o in outputs)
        if kind is None:
            rows.append([name, "-", "-", "-", num_tokens, f"{finished}/8", f"{num_tokens / seconds:.1f}"])
            continue
        costs = sorted(replay_cost(llm, kind, tokens))
        p99 = costs[min(len(costs) - 1, int(0.99 * len(costs)))]
        rows.append([name, f"{compile_ms:.1f}", f"{statistics.mean(costs) * 1e6:.0f}", f"{p99 * 1e6:.0f}",
                     num_tokens, f"{finished}/8", f"{num_tokens / seconds:.1f}"])
        print(rows[-1], flush=True)
    header = ["grammar", "compile ms", "mask µs/token (mean)", "mask µs/token (p99)", "output tokens",
              "ended by grammar/EOS", "output tokens/s"]
    table = markdown_table(header, rows)
    print(table)
    notes = (
        f"One-time set-up (xgrammar's table of the {llm.engine.model_config.vocab_size:,}-token vocabulary): "
        f"{setup_ms:.0f} ms. "
        f"8 chat prompts batched, greedy, max_tokens {args.max_tokens}, smollm2-135m fp32, xgrammar masks "
        "(compact JSON: no free whitespace). The mask runs on the CPU for each constrained row of every step, "
        "one row at a time, between the forward and the sampler; tokens/s compares the batch with and without "
        "the grammar (outputs differ in length, so compare per-token rates, not wall time)."
    )
    path = write_result("structured", "Structured output: grammar mask cost per token", table, notes)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
