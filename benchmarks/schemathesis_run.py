"""Property-based API check: schemathesis against kvserve's own `/openapi.json`, bounded.

Starts a server on a tiny random-weight chat model (so every generated request is cheap), runs
`schemathesis run` over the OpenAI routes (chat and text completions, models, tokenize, detokenize)
with the checks `not_a_server_error` (no 5xx), `response_schema_conformance` (every documented
response matches its schema) and `content_type_conformance`, then waits until the engine holds no KV
block and nothing runs or waits. Exit status 0 only if all of that holds.

    python benchmarks/schemathesis_run.py --max-examples 30
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from kvserve.server.launcher import launch_server  # noqa: E402
from test_server_support import make_chat_model_dir, metric_value  # noqa: E402

CHECKS = "not_a_server_error,response_schema_conformance,content_type_conformance"
PATHS = r"^/(v1/chat/completions|v1/completions|v1/models|tokenize|detokenize)$"


def drained(url: str, timeout: float = 60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        used = metric_value(url, 'kvserve_kv_cache_blocks{state="used"}')
        busy = sum(metric_value(url, name) for name in ("kvserve_num_requests_running",
                                                          "kvserve_num_requests_waiting"))
        if (used == 0 and busy == 0) or time.monotonic() > deadline:
            return {"used_blocks": used, "running_or_waiting": busy}
        time.sleep(0.2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-examples", type=int, default=30, help="examples per operation")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model_dir = make_chat_model_dir(Path(tempfile.mkdtemp(prefix="kvserve-st-")) / "tiny-chat")
    with launch_server([str(model_dir), "--num-blocks", "256", "--max-model-len", "512"],
                       startup_timeout=180) as server:
        command = [
            str(Path(sys.executable).parent / "schemathesis"), "run", f"{server.url}/openapi.json",
            "--checks", CHECKS, "--max-examples", str(args.max_examples), "--seed", str(args.seed),
            "--include-path-regex", PATHS, "--request-timeout", "60", "--phases", "examples,coverage,fuzzing",
        ]
        print(" ".join(command[1:]), flush=True)
        result = subprocess.run(command, cwd=tempfile.mkdtemp(prefix="kvserve-st-run-"))  # its cache stays out
        state = drained(server.url)
        health = httpx.get(f"{server.url}/health", timeout=10).status_code
    print(f"schemathesis exit {result.returncode}; after the run: {state}, /health {health}")
    ok = result.returncode == 0 and state["used_blocks"] == 0 and state["running_or_waiting"] == 0
    return 0 if ok and health == 200 else 1


if __name__ == "__main__":
    sys.exit(main())
