"""Rate sweep of `kvserve serve` with an established load generator: GuideLLM (vllm-project/guidellm).

Starts `python -m kvserve.server MODEL` on a free loopback port, exports the model's tokenizer as a
Hugging Face `tokenizer.json` (GuideLLM builds synthetic prompts of an exact token count with it; no
network is needed), and runs `guidellm run --profile sweep`: a synchronous run (one request at a time),
a throughput run (all `--max-concurrency` streams busy), and constant request rates in between. Each
benchmark runs for `--seconds`. Requests are streaming /v1/completions with EOS ignored, so every
request prefills `--prompt-tokens` and decodes `--output-tokens`.

Keeps the summary with TTFT / ITL / e2e percentiles per rate (benchmarks/results/serve_sweep.json), a plot
(docs/serve_sweep.png) and the table (benchmarks/results/serve_sweep.md).

    python benchmarks/serve_sweep.py                        # about 3-4 minutes on 2 cores
    python benchmarks/serve_sweep.py --seconds 10 --sweep-size 3   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, ROOT, command_line, machine, markdown_table, today  # noqa: E402
from kvserve.server.launcher import launch_server  # noqa: E402

PERCENTILES = ("p50", "p90", "p99")
# llama.cpp on the same model (Q4_1 GGUF) and a 2-core Zen 4, from benchmarks/data/PEERS.md.
PEER_DECODE_ONE = 137.5  # tokens/s, one request
PEER_DECODE_BATCH = (158.0, 170.0)  # tokens/s, batch 8 / 32 (llama-batched-bench)
PEER_PREFILL_128 = 345.0  # tokens/s for a 128-token prompt


def export_tokenizer(model: str, directory: Path) -> Path:
    """The model's tokenizer as a HF directory (tokenizer.json + config) that AutoTokenizer loads offline."""
    from kvserve.model.gguf import open_gguf, read_metadata
    from kvserve.model.registry import resolve_model
    from kvserve.model.tokenizer import Tokenizer

    path = resolve_model(model)
    if path.is_dir():
        return path  # already a Hugging Face directory
    tokenizer = Tokenizer.from_gguf_metadata(read_metadata(open_gguf(path)))
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.backend.save(str(directory / "tokenizer.json"))
    specials = {name: value for name, value in tokenizer.special_tokens.items() if value is not None}
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 8192, **specials}))
    return directory


def run_guidellm(args: argparse.Namespace, target: str, served_name: str, tokenizer_dir: Path, out: Path) -> None:
    guidellm = shutil.which("guidellm") or str(Path(sys.executable).with_name("guidellm"))
    command = [
        guidellm, "run",
        "--backend", f"kind=openai_http,target={target},model={served_name},request_format=/v1/completions",
        "--profile", f"kind=sweep,sweep_size={args.sweep_size},max_concurrency={args.max_concurrency}",
        "--constraint", f"kind=max_duration,seconds={args.seconds}",
        "--tokenizer", f"kind=hf_auto,model={tokenizer_dir}",
        "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
        "--output", f"kind=json,path={out}",
        "--disable-console-interactive",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "GUIDELLM__MAX_WORKER_PROCESSES": str(args.client_workers)}
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True, env=env)


def summarize(report: dict) -> list[dict]:
    """One row per benchmark of GuideLLM's report: rate, throughput and latency percentiles (seconds)."""
    rows = []
    for bench in report["benchmarks"]:
        strategy, metrics = bench["config"]["strategy"], bench["metrics"]

        def dist(name: str, scale: float = 1.0, metrics: dict = metrics) -> dict:
            stats = metrics[name]["successful"]
            return {"mean": stats["mean"] * scale, **{p: stats["percentiles"][p] * scale for p in PERCENTILES}}

        totals = metrics["request_totals"]
        rows.append({
            "strategy": strategy["type_"], "target_rate": strategy.get("rate"),
            "requests_per_s": metrics["requests_per_second"]["successful"]["mean"],
            "output_tokens_per_s": metrics["output_tokens_per_second"]["successful"]["mean"],
            "concurrency_mean": metrics["request_concurrency"]["successful"]["mean"],
            "completed": totals["successful"], "errored": totals["errored"], "incomplete": totals["incomplete"],
            "ttft_s": dist("time_to_first_token_ms", 1e-3), "itl_s": dist("inter_token_latency_ms", 1e-3),
            "tpot_s": dist("time_per_output_token_ms", 1e-3), "e2e_s": dist("request_latency"),
        })
    return rows


def label(row: dict) -> str:
    if row["strategy"] == "constant":
        return f"{row['target_rate']:.2f} req/s"
    return row["strategy"]


def table(rows: list[dict]) -> str:
    header = ["profile", "done / err", "req/s", "out tok/s", "TTFT p50 / p99 (s)", "ITL p50 / p99 (ms)",
              "e2e p50 / p99 (s)"]
    body = [[label(r), f"{r['completed']} / {r['errored']}", round(r["requests_per_s"], 2),
             round(r["output_tokens_per_s"], 1), f"{r['ttft_s']['p50']:.2f} / {r['ttft_s']['p99']:.2f}",
             f"{1e3 * r['itl_s']['p50']:.0f} / {1e3 * r['itl_s']['p99']:.0f}",
             f"{r['e2e_s']['p50']:.2f} / {r['e2e_s']['p99']:.2f}"] for r in sweep_order(rows)]
    return markdown_table(header, body)


def comparison(summary: dict) -> str:
    """The plain comparison with llama.cpp's figures in PEERS.md (another machine: ratios, not exact)."""
    by = {r["strategy"]: r for r in summary["benchmarks"]}
    prompt_tokens, lines = summary["prompt_tokens"], []
    if "synchronous" in by:
        one = by["synchronous"]
        decode = 1.0 / one["itl_s"]["mean"] if one["itl_s"]["mean"] else float("nan")
        lines.append(f"- **One request at a time**: kvserve decodes at {decode:.1f} tokens/s (1 / mean ITL) "
                     f"where llama.cpp decodes {PEER_DECODE_ONE} tokens/s: kvserve is "
                     f"{_ratio(decode, PEER_DECODE_ONE)}. Its median TTFT for a {prompt_tokens}-token prompt is "
                     f"{one['ttft_s']['p50']:.2f} s (HTTP included) against "
                     f"{prompt_tokens / PEER_PREFILL_128:.2f} s at llama.cpp's prefill rate of "
                     f"{PEER_PREFILL_128:.0f} tokens/s.")
    if "throughput" in by:
        peak = by["throughput"]
        lines.append(f"- **Saturated** ({summary['max_concurrency']} streams): {peak['output_tokens_per_s']:.1f} "
                     f"output tokens/s against llama.cpp's batched {PEER_DECODE_BATCH[0]:.0f} tokens/s at batch 8: "
                     f"kvserve is {_ratio(peak['output_tokens_per_s'], PEER_DECODE_BATCH[0])}, with TTFT p99 "
                     f"{peak['ttft_s']['p99']:.1f} s as requests queue.")
    lines.append("- Why: kvserve runs the model in fp32 PyTorch, so one-request decode reads every weight as 4 "
                 "bytes per step (PEERS.md puts that ceiling near 65 steps/s on its machine); llama.cpp reads the "
                 "Q4_1 weights (about 0.6 bytes each) with hand-written kernels. The load generator shares the "
                 "cores with the server here.")
    if summary["load_average_at_start"] > summary["cpu_count"]:
        lines.append(f"- **Caveat**: the machine was busy with other work (load average "
                     f"{summary['load_average_at_start']:.0f} on {summary['cpu_count']} cores), so kvserve had a "
                     "fraction of the CPU and these figures understate it, most of all when saturated; rerun on "
                     "an idle machine before comparing with PEERS.md.")
    return "\n".join(lines)


def _ratio(ours: float, theirs: float) -> str:
    if ours < theirs:
        return f"{theirs / ours:.1f}x slower"
    return f"{ours / theirs:.1f}x faster"


def sweep_order(rows: list[dict]) -> list[dict]:
    """Synchronous, then the constant rates ascending, then throughput (the load rises left to right)."""
    rank = {"synchronous": 0, "constant": 1, "throughput": 2}
    return sorted(rows, key=lambda r: (rank.get(r["strategy"], 1), r["target_rate"] or 0.0))


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sweep_order(rows)
    labels = [f"{label(r)}\n({r['requests_per_s']:.2f} done/s)" for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for axis, key, title, scale in ((axes[0], "ttft_s", "TTFT (s)", 1), (axes[1], "itl_s", "ITL (ms)", 1e3),
                                    (axes[2], "e2e_s", "end-to-end latency (s)", 1)):
        for p in PERCENTILES:
            axis.plot(range(len(rows)), [scale * r[key][p] for r in rows], marker="o", label=p)
        axis.set_xticks(range(len(rows)), labels, fontsize=7)
        axis.set_title(title)
        axis.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("kvserve serve: GuideLLM sweep (load rises left to right)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=40.0, help="duration of each benchmark of the sweep")
    parser.add_argument("--sweep-size", type=int, default=4, help="synchronous + throughput + constant rates")
    parser.add_argument("--max-concurrency", type=int, default=8, help="streams of the throughput benchmark")
    parser.add_argument("--client-workers", type=int, default=1, help="GuideLLM worker processes")
    parser.add_argument("--server-args", default="", help="extra `kvserve serve` flags")
    parser.add_argument("--from-json", type=Path, default=None,
                        help="only redraw the table and plot from a saved serve_sweep.json")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the server and GuideLLM too
    summary = json.loads(args.from_json.read_text()) if args.from_json else run_sweep(args)
    (RESULTS / "serve_sweep.json").write_text(json.dumps(summary, indent=2) + "\n")
    report(summary)
    return 0


def run_sweep(args: argparse.Namespace) -> dict:
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="kvserve-sweep-") as tmp:
        tokenizer_dir = export_tokenizer(args.model, Path(tmp) / "tokenizer")
        server_args = [args.model, "--served-model-name", "kvserve", "--disable-log-stats",
                       *args.server_args.split()]
        raw = Path(tmp) / "guidellm.json"  # GuideLLM's full report, every request: megabytes, not kept
        with launch_server(server_args, startup_timeout=600) as server:
            run_guidellm(args, server.url, "kvserve", tokenizer_dir, raw)
        rows = summarize(json.loads(raw.read_text()))
    return {"command": command_line(), "machine": machine(), "date": today(), "tool": "guidellm",
            "tool_version": _guidellm_version(), "model": args.model, "prompt_tokens": args.prompt_tokens,
            "output_tokens": args.output_tokens, "seconds_per_benchmark": args.seconds,
            "max_concurrency": args.max_concurrency, "load_average_at_start": load_before,
            "cpu_count": os.cpu_count(), "benchmarks": rows}


def report(summary: dict) -> None:
    rows = summary["benchmarks"]
    plot(rows, ROOT / "docs" / "serve_sweep.png")
    header = f"`{summary['command']}` — {summary['machine']} — {summary['date']}"
    notes = (f"GuideLLM {summary['tool_version']} sweep against `kvserve serve {summary['model']}` (streaming "
             f"/v1/completions, {summary['prompt_tokens']} prompt + {summary['output_tokens']} output tokens, EOS "
             f"ignored, {summary['seconds_per_benchmark']:.0f} s per benchmark, loopback; load average "
             f"{summary['load_average_at_start']:.1f} on {summary['cpu_count']} cores when it started). Latencies "
             "are client-side; ITL is the gap between streamed tokens; requests still running when a benchmark's "
             "time is up are not counted. Full percentiles in `benchmarks/results/serve_sweep.json`; plot "
             "`docs/serve_sweep.png`.\n\n![sweep](docs/serve_sweep.png)\n\n"
             "**Against llama.cpp** (benchmarks/data/PEERS.md, same model, its Q4_1 weights):\n\n"
             + comparison(summary))
    body = f"## Serving rate sweep (GuideLLM)\n\n{header}\n\n{table(rows)}\n\n{notes}\n"
    path = RESULTS / "serve_sweep.md"
    path.write_text(body)
    print(f"wrote {path}")


def _guidellm_version() -> str:
    from importlib.metadata import version

    return version("guidellm")


if __name__ == "__main__":
    sys.exit(main())
