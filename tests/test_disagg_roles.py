"""A worker's role (server/roles.py) without a model: the flag, the checks, and the prefill flush over a
fake offload policy — ok once every full block of every prompt is in the store (asked of the store,
keyed as the engine keys them), failed when the store is unreachable or the blocks never arrive."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import pytest

from kvserve.cli import build_parser
from kvserve.prefix.hashing import block_hashes
from kvserve.server.roles import FLUSH_BYTES_HEADER, FLUSH_HEADER, RoleInfo, remote_offload

NS = ("alice", "salt")
PAYLOAD = 1000


@dataclass
class FakeFingerprint:
    def keys(self, hashes):
        return [b"fp" + h for h in hashes]


@dataclass
class FakeCodec:
    payload_bytes: int = PAYLOAD


@dataclass
class FakeStore:
    held: set = field(default_factory=set)

    def longest_prefix(self, keys) -> int:
        count = 0
        for key in keys:
            if key not in self.held:
                break
            count += 1
        return count


@dataclass
class FakeOffload:
    remote: FakeStore = field(default_factory=FakeStore)
    fingerprint: FakeFingerprint = field(default_factory=FakeFingerprint)
    codec: FakeCodec = field(default_factory=FakeCodec)
    up: bool = True
    in_flight: int = 1  # blocks queued for the store and not yet written

    def remote_available(self) -> bool:
        return self.up

    def stats(self) -> dict:
        return {"remote": {"writer": {"queued": 10 + self.in_flight, "written": 8, "failed": 2}}}

    def keys_of(self, prompt):
        return self.fingerprint.keys(block_hashes(prompt, 4, NS, "sha256"))


def test_role_flag_parses_and_defaults_to_mixed():
    parser = build_parser()
    assert parser.parse_args(["serve"]).role == "mixed"
    args = parser.parse_args(["serve", "--role", "prefill", "--prefill-flush-timeout", "0.5"])
    assert (args.role, args.prefill_flush_timeout) == ("prefill", 0.5)
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--role", "both"])


def test_prefill_and_decode_roles_need_the_shared_store():
    with pytest.raises(ValueError, match="--remote-cache"):
        RoleInfo("prefill")
    with pytest.raises(ValueError, match="--remote-cache"):
        RoleInfo("decode")
    assert RoleInfo("mixed").remote_tier() is None
    assert remote_offload(object()) is None
    with pytest.raises(ValueError, match="role"):
        RoleInfo("other", offload=FakeOffload())


def test_flush_waits_until_every_full_block_of_every_prompt_is_in_the_store():
    offload = FakeOffload()
    role = RoleInfo("prefill", flush_timeout_s=5.0, offload=offload)
    prompts = [list(range(1, 11)), list(range(1, 7)) + [99, 98, 97]]  # 2 + 2 full blocks of 4, sharing one
    wanted = offload.keys_of(prompts[0]) + offload.keys_of(prompts[1])

    def writer():
        for key in wanted:
            time.sleep(0.02)
            offload.remote.held.add(key)

    thread = threading.Thread(target=writer)
    thread.start()
    report = role.flush(prompts, 4, NS, "sha256")
    thread.join()
    assert report.status == "ok" and report.num_blocks == 4 and report.nbytes == 4 * PAYLOAD
    assert report.seconds >= 0.06  # it waited for the writes
    assert report.headers()[FLUSH_HEADER] == "ok" and report.headers()[FLUSH_BYTES_HEADER] == str(4 * PAYLOAD)


def test_flush_fails_when_a_block_never_arrives_or_the_store_is_down():
    offload = FakeOffload()
    role = RoleInfo("prefill", flush_timeout_s=0.1, offload=offload)
    prompt = list(range(1, 13))
    offload.remote.held.update(offload.keys_of(prompt)[:2])  # the third block was dropped
    report = role.flush([prompt], 4, NS, "sha256")
    assert report.status == "failed" and "not in the store" in report.detail and report.seconds >= 0.09
    offload.in_flight = 0  # the writer is idle: the missing block was dropped, no need to wait it out
    patient = RoleInfo("prefill", flush_timeout_s=5.0, offload=offload)
    report = patient.flush([prompt], 4, NS, "sha256")
    assert report.status == "failed" and "dropped" in report.detail and report.seconds < 2.5  # not the timeout
    offload.remote.held.update(offload.keys_of(prompt))
    assert role.flush([prompt], 4, ("bob", ""), "sha256").status == "failed"  # another namespace: other keys
    assert role.flush([prompt], 4, NS, "sha256").status == "ok"
    offload.up = False
    assert role.remote_tier() == "open"
    down = role.flush([prompt], 4, NS, "sha256")
    assert down.status == "failed" and down.detail == "store unreachable"
