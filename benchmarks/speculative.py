"""Speculative decoding by prompt lookup: decode speed with and without drafts, beside the same idea in
transformers (`prompt_lookup_num_tokens`) and llama.cpp (llama-cpp-python's `LlamaPromptLookupDecoding`).

Three workloads of chat prompts (smollm2-135m's template), one request at a time, greedy, until EOS or
`--max-tokens`: code edits (the answer repeats the code it was given), RAG quotes (the answer copies a
sentence of the document) and open questions (little to copy: what drafts cost when they miss). Figure:
decode tokens/s = (tokens - 1) / (time after the first token), summed over the workload's prompts; for
kvserve also the share of drafts accepted, and a check that drafts changed no token (float32 activations).

    python benchmarks/speculative.py [--max-tokens 160] [--k 3] [--no-peers] [--batches 1 2 4 9]

Then the same prompts sent together (kvserve exact): plain, drafts in every step, and the default, which
stops drafting while more than `disable_by_batch_size` (2) requests run.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from common import ROOT, Timer, load_hf_model, markdown_table, write_result
from kvserve import LLM, SamplingParams
from kvserve.model.registry import resolve_model

CODE = [
    '''def fibonacci(n):
    """Return the n-th Fibonacci number."""
    if n < 2:
        return n
    a, b = 0, 1
    for _ in range(n - 1):
        a, b = b, a + b
    return b


def factorial(n):
    """Return n factorial."""
    result = 1
    for i in range(2, n + 1):
        result *= i
    return result
''',
    '''class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

    def peek(self):
        return self.items[-1]

    def __len__(self):
        return len(self.items)
''',
    '''def read_config(path):
    values = {}
    with open(path) as handle:
        for line in handle:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            values[key.strip()] = value.strip()
    return values
''',
]
CODE_ASKS = ["Add type hints to this Python code and return the whole code.",
             "Rename the class to LifoStack and return the whole code.",
             "Add a docstring to this function and return the whole code."]
DOCUMENT = (
    "The Loire is the longest river in France. It rises in the Massif Central and flows north, then west, "
    "for 1,006 kilometres before it reaches the Atlantic Ocean at Saint-Nazaire. Its valley is known for "
    "its castles, among them Chambord, Chenonceau and Amboise, built by French kings during the "
    "Renaissance. The river is also known for its sandbanks, which make navigation difficult in summer. "
    "Since 2000 the central part of the valley, between Sully-sur-Loire and Chalonnes-sur-Loire, has been "
    "a UNESCO World Heritage Site. The vineyards along the river produce white wines such as Sancerre, "
    "Vouvray and Muscadet."
)
RAG_ASKS = ["Quote, word for word, the sentence of the text that says where the Loire reaches the ocean.",
            "Quote, word for word, the sentence of the text about the UNESCO World Heritage Site.",
            "Copy the sentence of the text that names the castles, exactly as written."]
OPEN_ASKS = ["Write a short story about a lighthouse keeper.", "Give three tips for learning to cook.",
             "Why is the sky blue? Answer in a few sentences."]


def workloads() -> dict[str, list[str]]:
    return {
        "code edit": [f"{ask}\n\n```python\n{code}```" for ask, code in zip(CODE_ASKS, CODE, strict=True)],
        "RAG quote": [f"Text:\n{DOCUMENT}\n\n{ask}" for ask in RAG_ASKS],
        "open question": OPEN_ASKS,
    }


class Kvserve:
    def __init__(self, name: str, k: int | None, **args) -> None:
        self.name = name
        spec = None if k is None else {"method": "ngram", "num_speculative_tokens": k}
        self.llm = LLM("smollm2-135m", progress=False, kv_cache_memory="512MiB", speculative_config=spec, **args)
        self.tokens: list[list[int]] = []

    def run(self, prompt: list[int], max_tokens: int) -> tuple[int, float, tuple[int, int]]:
        before = self._drafts()
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        out = self.llm.generate([prompt], params, cache_salt=str(time.perf_counter()))[0]  # nothing cached
        self.tokens.append(list(out.token_ids))
        after = self._drafts()
        drafts = (after[0] - before[0], after[1] - before[1])
        return len(out.token_ids), out.metrics.total_time - out.metrics.ttft, drafts

    def _drafts(self) -> tuple[int, int]:
        stats = self.llm.stats()
        return stats.get("spec_accepted_tokens", 0), stats.get("spec_draft_tokens", 0)


class Transformers:
    def __init__(self, k: int | None) -> None:
        self.name = "transformers fp32" + ("" if k is None else f" + prompt lookup {k}")
        self.k = k
        self.model = load_hf_model(torch.float32)
        self.eos = self.model.generation_config.eos_token_id

    @torch.inference_mode()
    def _generate(self, prompt: list[int], max_tokens: int) -> list[int]:
        ids = torch.tensor([prompt])
        extra = {} if self.k is None else {"prompt_lookup_num_tokens": self.k}
        out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                  do_sample=False, pad_token_id=self.eos, **extra)
        return out[0, len(prompt):].tolist()

    def run(self, prompt: list[int], max_tokens: int) -> tuple[int, float, tuple[int, int]]:
        with Timer() as first:
            self._generate(prompt, 1)
        with Timer() as full:
            tokens = self._generate(prompt, max_tokens)
        return len(tokens), full.seconds - first.seconds, (0, 0)


class LlamaCpp:
    def __init__(self, k: int | None) -> None:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.name = "llama.cpp (llama-cpp-python)" + ("" if k is None else f" + prompt lookup {k}")
        draft = None if k is None else LlamaPromptLookupDecoding(num_pred_tokens=k)
        self.model = Llama(str(resolve_model("smollm2-135m")), n_ctx=4096, n_threads=torch.get_num_threads(),
                           n_batch=512, verbose=False, draft_model=draft)

    def run(self, prompt: list[int], max_tokens: int) -> tuple[int, float, tuple[int, int]]:
        self.model.reset()
        first, count = None, 0
        for token in self.model.generate(prompt, temp=0.0, top_k=1, reset=True):
            count += 1
            first = first if first is not None else time.perf_counter()
            if token == self.model.token_eos() or count >= max_tokens:
                break
        return count, time.perf_counter() - first, (0, 0)


def runners(args: argparse.Namespace) -> list:
    made: list = [Kvserve("kvserve exact", None), Kvserve(f"kvserve exact + ngram {args.k}", args.k),
                  Kvserve("kvserve int8", None, activation_quant="int8"),
                  Kvserve(f"kvserve int8 + ngram {args.k}", args.k, activation_quant="int8")]
    if args.no_peers:
        return made
    made += [Transformers(None), Transformers(args.k)]
    try:
        made += [LlamaCpp(None), LlamaCpp(args.k)]
    except ImportError:
        print("llama-cpp-python is not installed (pip install -e '.[bench]'): llama.cpp rows skipped")
    return made


def measure(all_runners: list, prompts: dict[str, list[list[int]]], max_tokens: int) -> dict:
    """{runner: {workload: [tokens after the first, decode seconds, drafts accepted, drafted]}}, every runner
    on one prompt before the next prompt (so a change of the machine's load reaches all of them alike)."""
    results = {r.name: {w: [0, 0.0, 0, 0] for w in prompts} for r in all_runners}
    for workload, items in prompts.items():
        for index, prompt in enumerate(items):
            for runner in all_runners:
                tokens, seconds, (accepted, drafted) = runner.run(prompt, max_tokens)
                cell = results[runner.name][workload]
                cell[0] += tokens - 1
                cell[1] += seconds
                cell[2] += accepted
                cell[3] += drafted
                print(f"{workload} {index + 1}/{len(items)} {runner.name}: {tokens} tokens, "
                      f"{(tokens - 1) / seconds:.1f} tok/s", flush=True)
    return results


def batched(sizes: list[int], k: int, max_tokens: int, rounds: int = 2) -> str:
    """Requests sent together (the workloads' prompts in turn): wall seconds of plain decoding, of drafts in
    every step, and of the default (no drafts while more than `disable_by_batch_size` requests run)."""
    configs = {"plain": None, "drafts in every step": {"num_speculative_tokens": k, "disable_by_batch_size": 64},
               "drafts, default batch limit": {"num_speculative_tokens": k}}
    llms = {name: LLM("smollm2-135m", progress=False, kv_cache_memory="512MiB", speculative_config=config)
            for name, config in configs.items()}
    texts = [text for items in workloads().values() for text in items]
    render = llms["plain"].render_chat
    rows = []
    for size in sizes:
        prompts = [render([{"role": "user", "content": texts[i % len(texts)]}]) for i in range(size)]
        seconds = {name: [] for name in llms}
        for _ in range(rounds):
            for name, llm in llms.items():
                with Timer() as timer:
                    llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                                 cache_salt=str(time.perf_counter()))
                seconds[name].append(timer.seconds)
        best = {name: min(values) for name, values in seconds.items()}
        rows.append([size, *best.values(), *(best["plain"] / best[name] for name in list(llms)[1:])])
        print(f"batch {size}: {best}", flush=True)
    header = ["requests at once", *(f"{name} s" for name in configs), "speed-up, drafts in every step",
              "speed-up, default"]
    return markdown_table(header, rows)


def cell_text(cell: list) -> str:
    """tok/s, and for a runner that reports its drafts, the share accepted."""
    rate = f"{cell[0] / cell[1]:,.1f}"
    return f"{rate} ({cell[2] / cell[3]:.0%} of drafts)" if cell[3] else rate


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, workloads_ = list(results), list(next(iter(results.values())))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        rates = [results[name][w][0] / results[name][w][1] for w in workloads_]
        ax.bar([j + i * width for j in range(len(workloads_))], rates, width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(workloads_))], workloads_)
    ax.set_ylabel("decode tokens/s (one request)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--k", type=int, default=3, help="draft tokens per step (every runner)")
    parser.add_argument("--no-peers", action="store_true", help="kvserve only")
    parser.add_argument("--out", default="speculative")
    parser.add_argument("--batches", nargs="*", type=int, default=[1, 2, 4, 9],
                        help="also send this many requests at once (kvserve exact only); none: skip")
    args = parser.parse_args()
    all_runners = runners(args)
    render = all_runners[0].llm.render_chat
    prompts = {w: [render([{"role": "user", "content": text}]) for text in texts] for w, texts in workloads().items()}
    results = measure(all_runners, prompts, args.max_tokens)
    exact = [r for r in all_runners if isinstance(r, Kvserve) and "exact" in r.name]
    same = "yes" if exact[0].tokens == exact[1].tokens else "**no**"
    header = ["runner", *(f"{w} tok/s" for w in prompts), *(f"{w} tokens" for w in prompts)]
    rows = [[r.name, *(cell_text(results[r.name][w]) for w in prompts), *(results[r.name][w][0] for w in prompts)]
            for r in all_runners]
    plot(results, ROOT / "docs" / f"{args.out}.png")
    notes = (f"![decode speed](docs/{args.out}.png)\n\nOne request at a time, greedy, until EOS or {args.max_tokens} "
             f"tokens; each workload 3 chat prompts (benchmarks/speculative.py); tok/s = generated tokens after the "
             f"first / time after the first, summed over the prompts; {args.k} draft tokens per step for every "
             f"runner. kvserve exact with drafts gave the same tokens as without: {same}. In brackets: kvserve's draft "
             "tokens accepted / proposed in that workload; `tokens` columns: tokens after the first, summed.")
    if args.batches:
        notes += ("\n\nRequests sent together (kvserve exact, the workloads' 9 prompts in turn, best of 2 "
                  "alternating rounds, wall seconds including prefill):\n\n"
                  + batched(args.batches, args.k, args.max_tokens))
    print(write_result(args.out, "Speculative decoding by prompt lookup", markdown_table(header, rows), notes))


if __name__ == "__main__":
    main()
