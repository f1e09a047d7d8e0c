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
