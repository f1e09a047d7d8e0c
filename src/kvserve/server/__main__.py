"""`python -m kvserve.server ARGS`: the same as `kvserve serve ARGS` (tests and scripts use it).

One parser: the flags are `kvserve serve`'s own (cli.py), config file and environment included.
"""

from __future__ import annotations

import sys

from kvserve.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
