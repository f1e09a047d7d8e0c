"""`python -m kvserve.server`: the same server and the same flags as `kvserve serve`.

Every flag is defined once, in `kvserve.cli` (`add_server_flags`, `add_engine_flags`).
"""

from __future__ import annotations

import argparse
import sys

from kvserve.cli import HelpFormatter, add_engine_flags, add_server_flags, run_serve


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvserve.server", description="OpenAI-compatible server",
                                     formatter_class=HelpFormatter)
    add_server_flags(parser)
    add_engine_flags(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run_serve(args)
    except ValueError as err:
        print(f"kvserve: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
