"""`kvserve generate | chat | serve | router | cluster`: the command line over the same engine flags everywhere."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvserve.config import (
    ACTIVATION_QUANTS,
    ATTENTION_DTYPES,
    DTYPES,
    KERNEL_BACKENDS,
    KV_CACHE_DTYPES,
    PREFILL_DTYPES,
    PREFIX_CACHE_KINDS,
    PREFIX_HASH_KINDS,
    SCHEDULE_POLICIES,
    WEIGHT_FORMATS,
    EngineConfig,
)
from kvserve.engine.params import SamplingParams
from kvserve.prefix.policies import ONLINE_POLICIES
from kvserve.settings import SettingsError, apply_sources


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """The engine flags, one per `EngineConfig` field; every command that runs an engine takes them."""
    defaults = EngineConfig()
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=defaults.model, help="registry name, .gguf file or HF directory")
    group.add_argument("--dtype", default=defaults.dtype, choices=DTYPES,
                       help="weights dtype (and the KV cache's with --kv-cache-dtype auto); bfloat16 on a CPU "
                       "without native bf16: bf16 weights, float32 arithmetic and KV cache")
    group.add_argument("--device", default=defaults.device, help="cpu or cuda")
    group.add_argument("--block-size", type=int, default=defaults.block_size, help="tokens per KV block")
    group.add_argument("--kv-cache-memory", default=None,
                       help="KV pool size, e.g. 2GiB; None: a quarter of free RAM, at most 2 GiB")
    group.add_argument("--kv-cache-dtype", default=defaults.kv_cache_dtype, choices=KV_CACHE_DTYPES,
                       help="what the KV pool stores: auto (the model's dtype), float32, or bfloat16 (half the "
                       "bytes: twice the cached tokens; attention reads the rounded keys and values)")
    group.add_argument("--num-blocks", type=int, default=None,
                       help="KV pool size in blocks (overrides --kv-cache-memory)")
    group.add_argument("--prefix-cache", default=defaults.prefix_cache, choices=PREFIX_CACHE_KINDS,
                       help="prefix cache: radix tree, block-hash map, or off")
    group.add_argument("--prefix-hash", default=defaults.prefix_hash, choices=PREFIX_HASH_KINDS,
                       help="block hash function of the prefix cache")
    group.add_argument("--max-model-len", type=int, default=None,
                       help="longest prompt + output in tokens; None: the model's context length")
    group.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs,
                       help="most sequences running at once")
    group.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens,
                       help="token budget of one step (prefill chunks + decodes)")
    group.add_argument("--schedule-policy", "--scheduling-policy", default=defaults.schedule_policy,
                       choices=SCHEDULE_POLICIES, help="admission order: first come first served, longest cached "
                       "prefix first, or each request's priority (lower first; preempts lower ones for it)")
    group.add_argument("--max-blocks-per-request", type=int, default=None,
                       help="KV blocks one request may need at worst, all its n / best_of / beam sequences "
                       "together; larger requests get 400 (default: half the pool, or one max-model-len "
                       "sequence if that is more)")
    group.add_argument("--long-prefill-token-threshold", type=int, default=None,
                       help="most prompt tokens one request computes per step, so newcomers are not held "
                       "behind a long prompt; 0: off (default: max(64, 4%% of max_model_len))")
    group.add_argument("--long-prefill-always", action="store_true",
                       help="apply --long-prefill-token-threshold to a prompt alone too (vLLM's rule): a request "
                       "that arrives during a step waits at most one chunk, at some cost to a lone long prompt "
                       "and, measured, to cache-aware chat tails (default: only while others wait or run)")
    group.add_argument("--long-prefill-busy-tokens", type=int, default=None, metavar="N",
                       help="while the server has had requests at once in the last 5 s, a prompt computing 512 "
                       "tokens or more computes at most N a step, alone or not, so a request arriving meanwhile "
                       "waits one short step; 0: off (default: 96 on a CPU, off on a GPU and offline)")
    group.add_argument("--max-admitted-prefill-tokens", type=int, default=None, metavar="N",
                       help="most prompt tokens one step admits from the queue while others wait or run (the "
                       "first request always gets its chunk), so prompts queued together are answered one "
                       "after another, not all after the last; 0: off (default: the long-prefill threshold on "
                       "a CPU, off on a GPU)")
    group.add_argument("--max-step-rows", type=parse_step_rows, default=0, metavar="N|auto",
                       help="most running sequences computing in one step, taking turns (longest-waiting "
                       "first), so every step stays short while newcomers arrive; 0: off (default); auto (CPU "
                       "only): the smallest cap that costs at most 20%% of decode throughput, from measured "
                       "step times")
    group.add_argument("--max-group-rows", type=int, default=defaults.max_group_rows, metavar="N",
                       help="most sequences of one request (its n / best_of / beams) computing in one step "
                       "while other requests run or wait, taking turns; 0: off (default)")
    group.add_argument("--num-threads", type=int, default=None, help="torch CPU threads; None: torch's default")
    group.add_argument("--seed", type=int, default=defaults.seed, help="seed of unseeded random requests")
    group.add_argument("--eviction", default=defaults.eviction, choices=ONLINE_POLICIES,
                       help="which unreferenced cached blocks the prefix cache drops first")
    group.add_argument("--kernels", default=defaults.kernels, choices=KERNEL_BACKENDS,
                       help="native C++ kernels (torch if they cannot load) or the torch reference")
    group.add_argument("--weights", default=defaults.weights, choices=WEIGHT_FORMATS,
                       help="native (default): run a GGUF's quantized tensors as stored (fp32 activations; a "
                       "file without quantized tensors loads dense anyway); dense: float32 weights, the "
                       "transformers-exact reference")
    group.add_argument("--activation-quant", default=defaults.activation_quant, choices=ACTIVATION_QUANTS,
                       help="int8: quantize the activations of quantized-weight matmuls to int8 blocks (as "
                       "llama.cpp's Q8_1; faster, approximate; needs --weights native); none: exact fp32")
    group.add_argument("--attention-dtype", default=defaults.attention_dtype, choices=ATTENTION_DTYPES,
                       help="bfloat16: prefill and shared-prefix attention multiply bf16 queries and "
                       "probabilities by the bf16 KV cache (needs --kv-cache-dtype bfloat16; approximate, "
                       "as llama.cpp's f16 cache; 2x the products' rate with AVX512-BF16, tiles with AMX); float32: "
                       "exact")
    group.add_argument("--prefill-dtype", default=defaults.prefill_dtype, choices=PREFILL_DTYPES,
                       help="bfloat16: the rows of prefill chunks multiply bf16 activations by a bf16 copy of the "
                       "weights on AMX-BF16 tiles (a bf16 model's arithmetic, approximate; ~2 bytes a weight more "
                       "memory; needs AMX, or --kernels torch); decode rows keep their arithmetic. float32: as "
                       "--activation-quant says")
    group.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (implied by --lora-modules)")
    group.add_argument("--max-loras", type=int, default=defaults.max_loras,
                       help="LoRA adapters resident at once (more are swapped in from host memory)")
    group.add_argument("--max-lora-rank", type=int, default=defaults.max_lora_rank, help="highest adapter rank")
    group.add_argument("--disable-prefix-hold", action="store_true",
                       help="admit a request at once even while a running one is computing the prefix it shares")
    group.add_argument("--disable-cascade-attn", action="store_true",
                       help="decode attention never reads shared prefix blocks once for all their sharers")
    group.add_argument("--speculative-config", default=None, metavar="JSON",
                       help='speculative decoding by prompt lookup, vLLM\'s form: \'{"method": "ngram", '
                       '"num_speculative_tokens": 3, "prompt_lookup_max": 4}\' (outputs unchanged); None: off')
    add_tier_flags(parser)


def parse_step_rows(text: str) -> int | None:
    """`--max-step-rows`: a count >= 0 (0: off) or `auto` (None: engine/step_cost.py sets it on a CPU)."""
    if text.strip().lower() == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0 or 'auto', got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0 (0: off) or 'auto', got {value}")
    return value


def add_tier_flags(parser: argparse.ArgumentParser) -> None:
    """Where KV blocks go when the pool evicts them, and where a prefix missing from the pool is looked for."""
    group = parser.add_argument_group("KV tiers (below the pool)")
    group.add_argument("--host-cache", default="1GiB", help="host RAM tier size, e.g. 4GiB; 0: off")
    group.add_argument("--disk-cache", default=None, help="directory of the local-disk tier; None: off")
    group.add_argument("--disk-cache-size", default="20GiB", help="disk tier size")
    group.add_argument("--remote-cache", default=None,
                       help="redis://host:port/db shared by every replica; None: off")
    group.add_argument("--remote-cache-ttl", type=float, default=None,
                       help="seconds a block stays in the remote tier; None: until Redis evicts it")
    group.add_argument("--kv-load-timeout", type=float, default=5.0,
                       help="seconds a disk/remote load may take before the prompt is recomputed")


def add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    group.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    group.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens; -1: all")
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass; 1: off")
    group.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top prob; 0: off")
    group.add_argument("--sampling-seed", type=int, default=None, help="per-request seed; None: from --seed")
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true", help="keep generating after EOS")


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    """`kvserve serve` flags beyond the engine's, named as vLLM's where vLLM has them."""
    from kvserve.server.limits import add_limit_flags
    from kvserve.server.options import DEFAULT_MAX_QUEUE, GRACEFUL_SHUTDOWN_S, LOG_LEVELS, STATS_LOG_INTERVAL_S
    from kvserve.server.roles import add_role_flags

    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model to serve, as `vllm serve MODEL` (same as --model)")
    group = parser.add_argument_group("server")
    group.add_argument("--config", default=None, help="YAML file of settings (keys are flag names); "
                       "command-line flags override it, KVSERVE_<FLAG> environment variables sit in between")
    group.add_argument("--host", default="127.0.0.1")
    group.add_argument("--port", type=int, default=8000)
    group.add_argument("--served-model-name", nargs="+", default=None,
                       help="names clients may use in `model`; the first is reported (default: the model's name)")
    group.add_argument("--api-key", nargs="+", default=[],
                       help="operator API keys: full access, shared cache namespace (as vLLM's)")
    group.add_argument("--api-keys", default=None, help="TOML/JSON file: API key -> tenant (enables auth)")
    group.add_argument("--chat-template", default=None, help="a Jinja chat template: a file or the template inline")
    group.add_argument("--allowed-origins", nargs="+", default=[],
                       help="CORS origins allowed to call the API from a browser ('*' for any)")
    group.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    group.add_argument("--stats-log-interval", type=float, default=STATS_LOG_INTERVAL_S,
                       help="seconds between the throughput / KV-usage log lines (0: never)")
    group.add_argument("--disable-log-stats", action="store_true", help="no periodic stats log line")
    group.add_argument("--request-log", default=None,
                       help="append each finished request (block hashes only, Mooncake format) to this file")
    group.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE, help="waiting requests beyond this get 429")
    group.add_argument("--shutdown-timeout", type=float, default=GRACEFUL_SHUTDOWN_S,
                       help="seconds in-flight requests may run after SIGTERM before they are aborted")
    group.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                       help="PEFT LoRA adapters to serve; requests pick one by `model`: NAME")
    group.add_argument("--dashboard", action=argparse.BooleanOptionalAction, default=None,
                       help="serve /dashboard (None: on with --api-keys or a loopback --host)")
    group.add_argument("--version", action="version", version=_version_text())
    add_limit_flags(parser)
    add_role_flags(parser)


def _version_text() -> str:
    from kvserve import __version__

    return f"kvserve {__version__}"


def add_kv_events_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("kv events")
    group.add_argument("--kv-events-endpoint", default=None,
                       help="publish KV events (vLLM format, ZMQ PUB) on this address, e.g. tcp://*:5557")
    group.add_argument("--kv-events-replay-endpoint", default=None,
                       help="serve replays of recent KV-event batches on this ZMQ ROUTER address")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    names = EngineConfig.field_names()
    values = {name: getattr(args, name) for name in names if hasattr(args, name)}
    if getattr(args, "lora_modules", None):
        values["enable_lora"] = True  # --lora-modules implies --enable-lora
    return EngineConfig(**values)


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        min_p=args.min_p, seed=args.sampling_seed, stop=args.stop, ignore_eos=args.ignore_eos,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description=__doc__, formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--version", action="version", version=_version_text())
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="complete one prompt and print the result",
                                   formatter_class=DefaultsHelpFormatter)
    generate.add_argument("prompt")
    generate.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    generate.add_argument("--stats", action="store_true", help="print engine stats afterwards")
    add_sampling_flags(generate)
    add_engine_flags(generate)

    chat = commands.add_parser("chat", help="multi-turn chat in the terminal, streaming tokens",
                               formatter_class=DefaultsHelpFormatter)
    chat.add_argument("--system", default=None, help="system prompt")
    add_sampling_flags(chat)
    add_engine_flags(chat)

    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server", formatter_class=DefaultsHelpFormatter)
    add_server_flags(serve)
    add_kv_events_flags(serve)
    add_engine_flags(serve)

    from kvserve.replay.cli import add_replay_parser
    from kvserve.router.cli import add_cluster_parser, add_router_parser

    router = add_router_parser(commands, DefaultsHelpFormatter)
    cluster = add_cluster_parser(commands, add_engine_flags, DefaultsHelpFormatter)
    replay = add_replay_parser(commands, DefaultsHelpFormatter)
    for command in (parser, generate, chat, serve, router, cluster, replay):
        _name_every_flag(command)
    return parser


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag with its default, unless its help already states one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.help and "default:" in action.help:
            return action.help
        return super()._get_help_string(action)


def _name_every_flag(parser: argparse.ArgumentParser) -> None:
    """argparse prints a default only beside help text: give every flag some, so --help shows them all."""
    for action in parser._actions:
        if not action.help and action.dest not in ("help", "version", argparse.SUPPRESS):
            action.help = action.dest.replace("_", " ")


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

    config = engine_config_from_args(args)
    run_server(config, args.host, args.port, args.api_keys, args.max_queue, args.shutdown_timeout,
               options=server_options_from_args(args), limits=limits_from_args(args, config.max_num_seqs),
               kv_events_endpoint=args.kv_events_endpoint, kv_events_replay_endpoint=args.kv_events_replay_endpoint,
               request_log=args.request_log)
    return 0


def take_positional_model(args: argparse.Namespace, argv: Sequence[str]) -> None:
    """`kvserve serve MODEL`: MODEL beats a config file or KVSERVE_MODEL; with --model too, they must agree."""
    if getattr(args, "model_tag", None) is None:
        return
    explicit = any(word == "--model" or word.startswith("--model=") for word in argv)
    if explicit and args.model != args.model_tag:
        raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
    args.model = args.model_tag


def limits_from_args(args: argparse.Namespace, max_num_seqs: int):  # -> ServerLimits
    from kvserve.server.limits import limits_from_args as build

    return build(args, max_num_seqs)


def server_options_from_args(args: argparse.Namespace):  # -> ServerOptions (imported lazily: no FastAPI here)
    from kvserve.server.options import ServerOptions, parse_lora_modules, resolve_chat_template

    template = resolve_chat_template(args.chat_template) if args.chat_template else None
    return ServerOptions(
        served_model_names=tuple(args.served_model_name or ()), api_keys=tuple(args.api_key),
        chat_template=template, log_level=args.log_level, allowed_origins=tuple(args.allowed_origins),
        stats_log_interval=0.0 if args.disable_log_stats else args.stats_log_interval,
        dashboard=args.dashboard, role=args.role, prefill_flush_timeout=args.prefill_flush_timeout,
        lora_modules=parse_lora_modules(args.lora_modules),
    )


def _config_kwargs(config: EngineConfig) -> dict:
    return {name: getattr(config, name) for name in EngineConfig.field_names()}


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    try:
        command = _command_parser(parser, argv)
        if command is not None:
            apply_sources(command, argv)  # --config FILE and KVSERVE_* become the command's defaults
    except SettingsError as error:
        print(f"kvserve: error: {error}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    from kvserve.replay.cli import run_replay
    from kvserve.router.cli import run_cluster, run_router

    runners = {"generate": run_generate, "chat": run_chat, "serve": run_serve, "router": run_router,
               "cluster": run_cluster, "replay": run_replay}
    try:
        take_positional_model(args, argv)
        return runners[args.command](args)
    except ValueError as error:
        print(f"kvserve: error: {error}", file=sys.stderr)
        return 2


def _command_parser(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.ArgumentParser | None:
    """The sub-command's parser named in `argv` (its first word), if any."""
    choices = next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    first = next((word for word in argv if not word.startswith("-")), None)
    return choices.get(first) if first is not None else None


if __name__ == "__main__":
    sys.exit(main())
