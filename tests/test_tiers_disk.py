"""DiskStore: survives a restart, drops damaged blocks, and a kill -9 mid-write leaves no torn block."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvserve.prefix.hashing import block_hashes
from kvserve.tiers.disk import DiskStore
from kvserve.tiers.store import model_fingerprint

FP = model_fingerprint(kv_dtype="float32", block_size=4, config={"hidden": 64})


def keys(count: int) -> list[bytes]:
    return FP.keys(block_hashes(list(range(count * 4)), 4, ()))


def payload_for(key: bytes, size: int = 3000) -> bytes:
    """Deterministic bytes per key, so any reader can tell a whole block from a torn one."""
    return hashlib.shake_256(key).digest(size)


def test_reopened_store_serves_old_blocks_in_lru_order(tmp_path):
    ks = keys(4)
    store = DiskStore(tmp_path, 1 << 20)
    for key in ks:
        store.put([(key, payload_for(key))])
        time.sleep(0.01)  # distinct mtimes
    store.get([ks[0]])  # most recently used now
    reopened = DiskStore(tmp_path, 1 << 20)
    assert reopened.keys_lru_first() == ks[1:] + ks[:1]
    assert reopened.longest_prefix(ks) == 4
    assert reopened.get(ks) == [payload_for(k) for k in ks]
    assert reopened.stats().bytes == store.stats().bytes


def test_reopen_with_smaller_budget_evicts_least_recent(tmp_path):
    ks = keys(4)
    store = DiskStore(tmp_path, 1 << 20)
    for key in ks:
        store.put([(key, payload_for(key))])
        time.sleep(0.01)
    per_block = store.stats().bytes // 4
    smaller = DiskStore(tmp_path, 2 * per_block)
    assert smaller.keys_lru_first() == ks[2:]
    assert len(list(tmp_path.glob("*/*.kvb"))) == 2


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "foreign_key"])
def test_damaged_block_is_detected_and_dropped(tmp_path, damage):
    ks = keys(3)
    store = DiskStore(tmp_path, 1 << 20)
    store.put([(k, payload_for(k)) for k in ks])
    path = store.path_of(ks[1])
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    elif damage == "truncate":
        data = data[: len(data) - 100]
    elif damage == "empty":
        data = bytearray()
    else:  # another block's (valid) file under this block's name
        data = bytearray(store.path_of(ks[2]).read_bytes())
    path.write_bytes(bytes(data))
    store = DiskStore(tmp_path, 1 << 20)  # also after a restart, the index trusts nothing it has not read
    assert store.longest_prefix(ks) == 3
    assert store.get(ks) == [payload_for(ks[0]), None, payload_for(ks[2])]
    assert not path.exists()
    assert store.longest_prefix(ks) == 1
    stats = store.stats()
    assert stats.extra["corrupt"] == 1 and stats.errors == 1
    store.check_invariants()


# The writers import kvserve.tiers.disk without running kvserve/__init__.py (which loads torch and the
# engine: seconds per start on a busy machine); disk.py itself needs only the standard library and xxhash.
_BARE_PACKAGE = """
import os, sys, types
package = types.ModuleType("kvserve")
package.__path__ = [os.path.join(os.environ["PYTHONPATH"].split(os.pathsep)[0], "kvserve")]
sys.modules["kvserve"] = package
"""

_SLOW_WRITER = _BARE_PACKAGE + """
import time
from kvserve.tiers.disk import DiskStore
root, key_hex = sys.argv[1], sys.argv[2:]
store = DiskStore(root, 1 << 30, fsync=False)
keys = [bytes.fromhex(k) for k in key_hex]
data = lambda k: bytes(range(256)) * 400
store.put([(k, data(k)) for k in keys[:-1]])
def slow(fd, view):
    os.write(fd, view[: len(view) // 2])
    print("MID", flush=True)
    time.sleep(60)
store._write_chunks = slow
store.put([(keys[-1], data(keys[-1]))])
"""

_FAST_WRITER = _BARE_PACKAGE + """
import hashlib
from kvserve.tiers.disk import DiskStore
store = DiskStore(sys.argv[1], 1 << 30, fsync=False)
i = 0
print("GO", flush=True)
while True:
    key = hashlib.sha256(str(i).encode()).digest()
    store.put([(key, hashlib.shake_256(key).digest(200_000))])
    i += 1
"""


def _spawn(script: str, *args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"))
    return subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True, env=env)


def test_kill_9_mid_write_leaves_no_readable_torn_block(tmp_path):
    ks = keys(3)
    proc = _spawn(_SLOW_WRITER, str(tmp_path), *[k.hex() for k in ks])
    try:
        assert proc.stdout.readline().strip() == "MID"
        assert list(tmp_path.glob("*/*.tmp")), "the writer should be mid-way through a temp file"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    store = DiskStore(tmp_path, 1 << 30)
    assert store.get(ks) == [bytes(range(256)) * 400] * 2 + [None]
    assert store.longest_prefix(ks) == 2
    assert not list(tmp_path.glob("*/*.tmp")) and store.stats().extra["temp_removed"] == 1


def test_kill_9_at_random_moments_every_readable_block_is_whole(tmp_path):
    rng = random.Random(0)
    for _ in range(3):
        proc = _spawn(_FAST_WRITER, str(tmp_path))
        assert proc.stdout.readline().strip() == "GO"
        time.sleep(rng.uniform(0.05, 0.3))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    store = DiskStore(tmp_path, 1 << 30)
    stored = store.keys_lru_first()
    assert stored, "the writer should have finished some blocks"
    for key, data in zip(stored, store.get(stored), strict=True):
        assert data == payload_for(key, 200_000)
    assert store.stats().errors == 0
