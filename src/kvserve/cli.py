"""`kvserve generate | chat | serve`: the command line over the same engine flags everywhere."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvserve.config import (
    DTYPES,
    KERNEL_BACKENDS,
    PREFIX_CACHE_KINDS,
    PREFIX_HASH_KINDS,
    SCHEDULE_POLICIES,
    WEIGHT_FORMATS,
    EngineConfig,
)
from kvserve.engine.params import SamplingParams


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    defaults = EngineConfig()
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=defaults.model, help="registry name, .gguf file or HF directory")
    group.add_argument("--dtype", default=defaults.dtype, choices=DTYPES)
    group.add_argument("--device", default=defaults.device, help="cpu or cuda")
    group.add_argument("--block-size", type=int, default=defaults.block_size)
    group.add_argument("--kv-cache-memory", default=None, help="KV pool size, e.g. 2GiB (default: from RAM)")
    group.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks (overrides memory)")
    group.add_argument("--prefix-cache", default=defaults.prefix_cache, choices=PREFIX_CACHE_KINDS)
    group.add_argument("--prefix-hash", default=defaults.prefix_hash, choices=PREFIX_HASH_KINDS)
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    group.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens)
    group.add_argument("--schedule-policy", default=defaults.schedule_policy, choices=SCHEDULE_POLICIES)
    group.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    group.add_argument("--seed", type=int, default=defaults.seed)
    group.add_argument("--kernels", default=defaults.kernels, choices=KERNEL_BACKENDS,
                       help="native C++ kernels (torch if they cannot load) or the torch reference")
    group.add_argument("--weights", default=defaults.weights, choices=WEIGHT_FORMATS,
                       help="dense float32, or run a GGUF's quantized tensors as stored")


def add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=128)
    group.add_argument("--temperature", type=float, default=0.0)
    group.add_argument("--top-k", type=int, default=-1)
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    names = EngineConfig.field_names()
    return EngineConfig(**{name: getattr(args, name) for name in names if hasattr(args, name)})


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        min_p=args.min_p, seed=args.sampling_seed, stop=args.stop, ignore_eos=args.ignore_eos,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="complete one prompt and print the result")
    generate.add_argument("prompt")
    generate.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    generate.add_argument("--stats", action="store_true", help="print engine stats afterwards")
    add_sampling_flags(generate)
    add_engine_flags(generate)

    chat = commands.add_parser("chat", help="multi-turn chat in the terminal, streaming tokens")
    chat.add_argument("--system", default=None, help="system prompt")
    add_sampling_flags(chat)
    add_engine_flags(chat)

    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-keys", default=None, help="TOML/JSON file: API key -> tenant (enables auth)")
    serve.add_argument("--max-queue", type=int, default=256, help="waiting requests beyond this get 429")
    add_engine_flags(serve)
    return parser


def run_generate(args: argparse.Namespace) -> int:
    from kvserve.llm import LLM

    config = engine_config_from_args(args)
    llm = LLM(progress=True, **_config_kwargs(config))
    params = sampling_params_from_args(args)
    prompt = llm.render_chat([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    for output in llm.stream(prompt, params):
        print(output.delta_text, end="", flush=True)
    print()
    if args.stats:
        print(llm.stats(), file=sys.stderr)
    return 0


def run_chat(args: argparse.Namespace) -> int:
    from kvserve.llm import LLM

    llm = LLM(progress=True, **_config_kwargs(engine_config_from_args(args)))
    params = sampling_params_from_args(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("kvserve chat — empty line or Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            user_text = input("> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if not user_text:
            return 0
        messages.append({"role": "user", "content": user_text})
        reply = ""
        for output in llm.stream(llm.render_chat(messages), params):
            print(output.delta_text, end="", flush=True)
            reply = output.text
        print()
        messages.append({"role": "assistant", "content": reply})


def run_serve(args: argparse.Namespace) -> int:
    from kvserve.server.app import run_server

    run_server(engine_config_from_args(args), args.host, args.port, args.api_keys, args.max_queue)
    return 0


def _config_kwargs(config: EngineConfig) -> dict:
    return {name: getattr(config, name) for name in EngineConfig.field_names()}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    runners = {"generate": run_generate, "chat": run_chat, "serve": run_serve}
    try:
        return runners[args.command](args)
    except ValueError as error:
        print(f"kvserve: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
