"""Helpers for the router tests (this module holds no tests): key files, metric reads, waiting."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx

KEYS = {"keys": {"sk-alice": "alice", "sk-bob": "bob", "sk-ops": {"tenant": "ops", "admin": True}}}
ADMIN = {"Authorization": "Bearer sk-ops"}  # /metrics and /load are admin-only where keys are on


def write_keys(directory: Path) -> Path:
    path = directory / "keys.json"
    path.write_text(json.dumps(KEYS))
    return path


def metric(url: str, name: str, labels: dict[str, str] | None = None, headers: dict | None = None) -> float:
    """Sum of the samples of `name` whose labels include `labels` (0 when absent); asks as the admin."""
    response = httpx.get(f"{url}/metrics", headers=ADMIN if headers is None else headers, timeout=10)
    response.raise_for_status()
    text = response.text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        series, _, value = line.rpartition(" ")
        if series.split("{")[0] != name:
            continue
        if all(f'{key}="{val}"' in series for key, val in (labels or {}).items()):
            total += float(value)
    return total


def wait_for(condition, timeout: float = 20.0, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(interval)


ALICE = {"Authorization": "Bearer sk-alice"}


def complete(url: str, prompt: list[int], model: str = "tiny-chat") -> httpx.Response:
    """Alice's greedy 6-token completion of token ids `prompt` (asserted 200)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    response = httpx.post(url + "/v1/completions", json=body, headers=ALICE, timeout=120)
    assert response.status_code == 200, response.text
    return response


def route_of(response: httpx.Response) -> dict[str, str]:
    """The router's `x-kvserve-route` header as a dict (worker, reason, ...)."""
    return dict(item.strip().split("=", 1) for item in response.headers["x-kvserve-route"].split(";"))


def wait_for_streams(policy, count: int) -> None:
    """Until a kv_events policy has `count` event streams, each past its first batch."""
    wait_for(lambda: len(policy.streams) == count and all(s.stats.last_seq is not None
                                                          for s in policy.streams.values()), timeout=30)


def complete_behind(router_url: str, worker, tokens: int, prompt: list[int]) -> httpx.Response:
    """`complete` through the router while `worker` looks `tokens` of prefill behind in its books."""
    from kvserve.router.workers import PrefillStart

    worker.starts = [PrefillStart(tokens)]
    try:
        return complete(router_url, prompt)
    finally:
        worker.starts = []
