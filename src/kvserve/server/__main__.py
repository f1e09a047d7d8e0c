"""`python -m kvserve.server`: `kvserve serve` plus `--shutdown-timeout` (tests and scripts use it).

Engine flags come from the CLI's own `add_engine_flags`, so both entry points accept the same ones.
"""

from __future__ import annotations

import argparse
import sys

from kvserve.cli import add_engine_flags, engine_config_from_args
from kvserve.server.app import DEFAULT_MAX_QUEUE, GRACEFUL_SHUTDOWN_S, run_server
from kvserve.server.limits import add_server_flags, limits_from_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvserve.server", description="OpenAI-compatible server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-keys", default=None, help="TOML/JSON file: API key -> tenant (enables auth)")
    parser.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                        help="waiting requests beyond this get 429")
    parser.add_argument("--shutdown-timeout", type=float, default=GRACEFUL_SHUTDOWN_S,
                        help="seconds in-flight requests may run after SIGTERM before they are aborted")
    add_server_flags(parser)
    add_engine_flags(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = engine_config_from_args(args)
        limits = limits_from_args(args, config.max_num_seqs)
        run_server(config, args.host, args.port, args.api_keys, args.max_queue, args.shutdown_timeout, limits)
    except ValueError as err:
        print(f"kvserve: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
