"""Perplexity and top-1 agreement on a fixed text: kvserve (dense fp32; native Q4_1 weights with fp32
activations; int8 activations where the engine offers them) beside transformers fp32 and llama.cpp.

Why: the native quantized path is exact only up to the dequantized weights (and int8 activations not even
that), so its quality is shown the way llama.cpp shows its own: perplexity on a fixed text, computed the
same way by every runner, and how often its greedy next token agrees with the fp32 reference's.

How each number is computed, identically for every runner: the text (benchmarks/data/
perplexity_python_reference.txt) is tokenized once by llama.cpp (no BOS: the GGUF sets add_bos_token
false); the tokens are cut into consecutive non-overlapping chunks of `--ctx` tokens (the remainder is
dropped); each chunk is evaluated from an empty cache; as llama-perplexity does, only the second half of
each chunk is scored (positions ctx/2 .. ctx-2 predicting the next token), so every scored token has at
least ctx/2 tokens of context. PPL = exp(mean negative log-likelihood over the scored tokens). Top-1
agreement: the fraction of scored positions where two runners' argmax tokens are equal.

Logits per position: kvserve has no prompt-logprobs API, so the script wraps the engine's model forward
to keep every row's hidden state of a one-token generation over the chunk (a fresh cache salt: nothing
cached) and applies the model's own lm head to all of them. llama.cpp's logits come from the installed
llama-cpp-python (the same llama.cpp version, `logits_all=True`); its own `llama-perplexity` tool (built
by benchmarks/llama_cpp_tools.py) is run on the same file with the same context as a cross-check of its
perplexity (its tokenization of the file is its own; the token counts are reported).

    python benchmarks/perplexity.py               # ctx 512, every chunk (about 5 minutes on 2 cores)
    python benchmarks/perplexity.py --chunks 4    # fewer chunks
    python benchmarks/perplexity.py --reuse       # keep the scores an earlier run saved
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, load_hf_model, markdown_table, write_result  # noqa: E402
from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.config import EngineConfig  # noqa: E402
from kvserve.kernels.native import cpu_flags  # noqa: E402
from kvserve.model.registry import resolve_model  # noqa: E402

TEXT = ROOT / "benchmarks" / "data" / "perplexity_python_reference.txt"
CACHE = ROOT / "benchmarks" / ".cache" / "perplexity"  # per-runner scores for --reuse (git-ignored)
KVSERVE_VARIANTS = {
    "kvserve dense fp32": {"weights": "dense"},
    "kvserve native Q4_1, fp32 activations": {"weights": "native"},
    "kvserve native Q4_1, int8 activations": {"weights": "native", "activation_quant": "int8"},
    "kvserve native Q4_1, bf16 KV cache": {"weights": "native", "kv_cache_dtype": "bfloat16"},
    "kvserve native Q4_1, int8 activations, bf16 KV + attention": {
        "weights": "native", "activation_quant": "int8", "kv_cache_dtype": "bfloat16", "attention_dtype": "bfloat16"},
}
KVSERVE_VARIANTS["kvserve native Q4_1, fp8 KV cache"] = {"weights": "native", "kv_cache_dtype": "fp8"}
if "amx_bf16" in cpu_flags():  # --prefill-dtype bfloat16 runs on AMX-BF16 tiles: every scored row is a prefill row
    KVSERVE_VARIANTS["kvserve native Q4_1, bf16 prefill matmuls"] = {"weights": "native", "prefill_dtype": "bfloat16"}
    KVSERVE_VARIANTS["kvserve native Q4_1, int8 activations, bf16 KV + attention + prefill"] = {
        **KVSERVE_VARIANTS["kvserve native Q4_1, int8 activations, bf16 KV + attention"], "prefill_dtype": "bfloat16"}
    KVSERVE_VARIANTS["kvserve native Q4_1, int8 activations, fp8 KV, bf16 prefill"] = {
        "weights": "native", "activation_quant": "int8", "kv_cache_dtype": "fp8", "prefill_dtype": "bfloat16"}
Logits = Callable[[list[int]], np.ndarray]  # a chunk's token ids -> float32 logits [len(chunk), vocab]


def llama_cpp_tokens(text: str) -> list[int]:
    from llama_cpp import Llama

    vocab = Llama(str(resolve_model("smollm2-135m")), vocab_only=True, verbose=False)
    return vocab.tokenize(text.encode(), add_bos=False, special=False)


def kvserve_logits(args: dict[str, str]) -> Logits:
    llm = LLM("smollm2-135m", progress=False, dtype="float32", kv_cache_memory="128MiB", **args)
    model = llm.engine.model
    captured: list[tuple[torch.Tensor, torch.Tensor]] = []
    original = model.forward

    def forward(input_ids, positions, *rest, **kwargs):
        hidden = original(input_ids, positions, *rest, **kwargs)
        captured.append((positions.clone(), hidden.clone()))
        return hidden

    model.forward = forward  # the runner calls `self.model.forward`: every prefill chunk passes here

    def run(chunk: list[int]) -> np.ndarray:
        captured.clear()
        llm.generate([chunk], SamplingParams(max_tokens=1, temperature=0.0), cache_salt=str(time.perf_counter()),
                     use_tqdm=False)
        hidden = torch.empty(len(chunk), captured[0][1].shape[1], dtype=captured[0][1].dtype)
        seen = torch.zeros(len(chunk), dtype=torch.bool)
        for positions, rows in captured:
            keep = positions < len(chunk)
            hidden[positions[keep]] = rows[keep]
            seen[positions[keep]] = True
        if not bool(seen.all()):
            raise RuntimeError("kvserve skipped prompt positions: was something cached?")
        return model.compute_logits(hidden).numpy()

    return run


def transformers_logits() -> Logits:
    model = load_hf_model(torch.float32)

    @torch.inference_mode()
    def run(chunk: list[int]) -> np.ndarray:
        ids = torch.tensor([chunk])
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].float().numpy()

    return run


def llama_cpp_logits(ctx: int) -> Logits:
    from llama_cpp import Llama

    model = Llama(str(resolve_model("smollm2-135m")), n_ctx=ctx, n_batch=ctx, n_threads=torch.get_num_threads(),
                  logits_all=True, verbose=False)

    def run(chunk: list[int]) -> np.ndarray:
        model.reset()
        model.eval(chunk)
        return np.array(model.scores[: len(chunk)], dtype=np.float32)

    return run


def scored(chunks: list[list[int]], logits: Logits) -> tuple[np.ndarray, np.ndarray]:
    """(negative log-likelihoods, argmax tokens) at the scored positions of every chunk, in order."""
    nll, top = [], []
    for chunk in chunks:
        first = len(chunk) // 2
        rows = torch.from_numpy(logits(chunk)[first:-1]).double()
        targets = torch.tensor(chunk[first + 1:])
        nll.append((torch.logsumexp(rows, dim=-1) - rows[torch.arange(len(targets)), targets]).numpy())
        top.append(rows.argmax(dim=-1).numpy())
    return np.concatenate(nll), np.concatenate(top)


def llama_perplexity_tool(ctx: int, chunks: int) -> tuple[float, float, str]:
    """llama-perplexity's own final estimate (PPL, ±) on the text file, or NaNs and the reason."""
    try:
        import llama_cpp_tools
    except ImportError as error:
        return math.nan, math.nan, f"llama-perplexity: {error}"
    try:
        return (*llama_cpp_tools.perplexity(resolve_model("smollm2-135m"), TEXT, ctx, chunks,
                                            threads=torch.get_num_threads()), "")
    except (OSError, RuntimeError, SystemExit) as error:
        return math.nan, math.nan, f"llama-perplexity did not run: {error}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ctx", type=int, default=512, help="tokens per chunk (llama-perplexity's -c)")
    parser.add_argument("--chunks", type=int, default=0, help="chunks to score (0: all that fit)")
    parser.add_argument("--no-tool", action="store_true", help="skip the llama-perplexity cross-check")
    parser.add_argument("--reuse", action="store_true", help="reuse runners' scores saved by an earlier run")
    args = parser.parse_args()
    text = TEXT.read_text()
    tokens = llama_cpp_tokens(text)
    count = len(tokens) // args.ctx if args.chunks <= 0 else min(args.chunks, len(tokens) // args.ctx)
    chunks = [tokens[i * args.ctx:(i + 1) * args.ctx] for i in range(count)]
    notes = []
    own = LLM("smollm2-135m", progress=False, kv_cache_memory="16MiB").get_tokenizer().encode(text)
    notes.append(f"Text: {len(text):,} characters, {len(tokens):,} llama.cpp tokens (kvserve's tokenizer: "
                 f"{len(own):,}, {'identical' if own == tokens else 'different'} ids; every runner gets "
                 f"llama.cpp's); {count} chunks of {args.ctx}, {count * (args.ctx - 1 - args.ctx // 2):,} scored "
                 "tokens.")

    runners: dict[str, Callable[[], Logits]] = {}
    for name, variant in KVSERVE_VARIANTS.items():
        missing = [field for field in variant if field not in EngineConfig.field_names()]
        if missing:
            notes.append(f"{name}: skipped, this kvserve has no `{missing[0]}` setting.")
            continue
        runners[name] = lambda variant=variant: kvserve_logits(variant)
    runners["transformers fp32"] = transformers_logits
    runners["llama.cpp Q4_1 (llama-cpp-python, logits_all)"] = lambda: llama_cpp_logits(args.ctx)

    results: dict[str, tuple[np.ndarray, np.ndarray, float]] = {}
    for name, make in runners.items():
        cached = CACHE / f"{args.ctx}x{count}-{''.join(c if c.isalnum() else '_' for c in name)}.npz"
        start = time.perf_counter()
        if args.reuse and cached.exists():
            saved = np.load(cached)
            nll, top = saved["nll"], saved["top"]
        else:
            nll, top = scored(chunks, make())
            CACHE.mkdir(parents=True, exist_ok=True)
            np.savez(cached, nll=nll, top=top)
        results[name] = (nll, top, time.perf_counter() - start)
        print(f"{name:48s} PPL {math.exp(nll.mean()):8.4f}  ({results[name][2]:.0f} s)", flush=True)

    references = ["transformers fp32", "llama.cpp Q4_1 (llama-cpp-python, logits_all)", "kvserve dense fp32"]
    header = ["runner", "PPL", "± (1 s.e.)", "NLL − transformers' (mean, max abs)",
              *(f"top-1 = {r}" for r in references)]
    rows = []
    base = results["transformers fp32"][0]
    for name, (nll, top, _) in results.items():
        error = math.exp(nll.mean()) * nll.std(ddof=1) / math.sqrt(len(nll))
        delta = nll - base
        rows.append([name, f"{math.exp(nll.mean()):.4f}", f"{error:.4f}",
                     f"{delta.mean():+.5f}, {np.abs(delta).max():.5f}",
                     *(f"{100 * float((top == results[r][1]).mean()):.2f}%" for r in references)])
    if not args.no_tool:
        ppl, error, why = llama_perplexity_tool(args.ctx, count)
        rows.append(["llama.cpp Q4_1 (its llama-perplexity tool)", f"{ppl:.4f}", f"{error:.4f}", "–", "–", "–", "–"])
        if why:
            notes.append(why)
    notes.append("PPL: exp(mean NLL) over the second half of each chunk, as llama-perplexity scores; ± is the "
                 "standard error of the mean NLL carried through exp (the spread of the text's tokens: the runners "
                 "score the same tokens, so compare them by the paired NLL difference). The llama-cpp-python "
                 "and llama-perplexity rows are the same llama.cpp version: they should agree closely. The "
                 "machine is a shared 2-core VM; perplexities do not depend on its load.")
    write_result("perplexity", "Perplexity and top-1 agreement on a fixed text", markdown_table(header, rows),
                 "\n\n".join(notes))
    print(markdown_table(header, rows))
    print("\n".join(notes))


if __name__ == "__main__":
    main()
