"""Chained block hashes: the cross-process contract (golden values) and its properties."""

from __future__ import annotations

import hashlib
import struct

import pytest

from kvserve.prefix.hashing import (
    SEED_LABEL,
    HashFunction,
    block_hashes,
    digest_size,
    encode_block,
    extend_block_hashes,
    hash_block,
    seed_hash,
)

BS = 16
TOKENS = list(range(32))
NAMESPACE = ("tenant-a", "salt")

# Computed once and pasted: if these change, every tier key and router event changes with them.
GOLDEN_SEED_SHA256 = "1fd5972052797a7918efeea6c01885d9638c4d2a43ac1b30178d2f102dd37a8f"
GOLDEN_SHA256 = [
    "f8b2d80fb06056a2df2a301f539aa38eacf4ff5c5dda46ad24acd3d7e957d7d3",
    "1a1fb7010ca379dc97acd97589f39474fca85ccb86d752a98e4c601baba56f35",
]
GOLDEN_XXHASH = ["c36b41a9452e89800a0b21f6fbfac690", "6193baa0581d91ba40227586dd89f318"]


def test_golden_values_sha256() -> None:
    assert seed_hash().hex() == GOLDEN_SEED_SHA256
    assert [h.hex() for h in block_hashes(TOKENS, BS, NAMESPACE)] == GOLDEN_SHA256


def test_golden_values_xxhash() -> None:
    assert [h.hex() for h in block_hashes(TOKENS, BS, NAMESPACE, "xxhash")] == GOLDEN_XXHASH


def test_encoding_matches_the_documented_layout() -> None:
    """An independent re-implementation of the module docstring's encoding."""

    def u32(n: int) -> bytes:
        return struct.pack("<I", n)

    parent = hashlib.sha256(SEED_LABEL).digest()
    expected = parent + u32(2) + u32(7) + u32(70000) + u32(2) + u32(2) + b"ab" + u32(2) + "é".encode()
    assert encode_block(parent, [7, 70000], ("ab", "é")) == expected
    assert hash_block(None, [7, 70000], ("ab", "é")) == hashlib.sha256(expected).digest()
    # Block 1 chains on block 0's digest and carries no extra fields.
    h0, h1 = block_hashes(TOKENS, BS, NAMESPACE)
    body = h0 + u32(BS) + struct.pack(f"<{BS}I", *TOKENS[BS:]) + u32(0)
    assert h1 == hashlib.sha256(body).digest()


def test_deterministic_across_calls() -> None:
    for algo in HashFunction:
        assert block_hashes(TOKENS, BS, NAMESPACE, algo) == block_hashes(list(TOKENS), BS, NAMESPACE, algo)
        first = TOKENS[:BS]
        assert hash_block(None, first, NAMESPACE, algo) == hash_block(None, tuple(first), NAMESPACE, algo)


@pytest.mark.parametrize(
    ("a", "b"), [(("ab", "c"), ("a", "bc")), ((), ("",)), (("a",), ("a", "")), (("x",), ("y",))]
)
def test_namespace_fields_stay_separate(a: tuple[str, ...], b: tuple[str, ...]) -> None:
    ha, hb = block_hashes(TOKENS, BS, a), block_hashes(TOKENS, BS, b)
    assert ha[0] != hb[0]
    assert ha[1] != hb[1]  # the namespace reaches every later block through the chain


def test_changing_block_0_changes_every_later_hash() -> None:
    tokens = list(range(5 * BS))
    changed = [999] + tokens[1:]
    for before, after in zip(block_hashes(tokens, BS, ()), block_hashes(changed, BS, ()), strict=True):
        assert before != after


def test_changing_a_later_block_keeps_earlier_hashes() -> None:
    tokens = list(range(5 * BS))
    changed = tokens[: 3 * BS] + [999] + tokens[3 * BS + 1 :]
    before, after = block_hashes(tokens, BS, ()), block_hashes(changed, BS, ())
    assert before[:3] == after[:3]
    assert all(x != y for x, y in zip(before[3:], after[3:], strict=True))


@pytest.mark.parametrize("algo", list(HashFunction))
def test_incremental_equals_all_at_once(algo: HashFunction) -> None:
    tokens = [(i * 7919) % 50000 for i in range(10 * BS + 5)]
    hashes: list[bytes] = []
    for end in (0, 3, BS, BS + 1, 4 * BS - 1, 4 * BS, 7 * BS + 2, len(tokens)):
        extend_block_hashes(hashes, tokens[:end], BS, NAMESPACE, algo)
        assert hashes == block_hashes(tokens[:end], BS, NAMESPACE, algo)
    assert len(hashes) == 10


def test_extend_only_hashes_new_blocks() -> None:
    hashes = [b"\x00" * 32]  # a sentinel first hash: block 0 must not be recomputed
    extend_block_hashes(hashes, TOKENS, BS, NAMESPACE)
    assert hashes[0] == b"\x00" * 32
    assert hashes[1] == hash_block(b"\x00" * 32, TOKENS[BS:], ())


def test_partial_blocks_are_not_hashed() -> None:
    assert block_hashes(list(range(BS - 1)), BS, ()) == []
    assert len(block_hashes(list(range(3 * BS - 1)), BS, ())) == 2


def test_xxhash_differs_from_sha256_but_is_deterministic() -> None:
    sha = block_hashes(TOKENS, BS, NAMESPACE, "sha256")
    xx = block_hashes(TOKENS, BS, NAMESPACE, HashFunction.XXHASH)
    assert xx == block_hashes(TOKENS, BS, NAMESPACE, "xxhash")
    assert all(a != b for a, b in zip(sha, xx, strict=True))
    assert digest_size("sha256") == 32 and digest_size("xxhash") == 16
    assert all(len(h) == 16 for h in xx)


def test_bad_parent_and_algo_are_rejected() -> None:
    with pytest.raises(ValueError):
        hash_block(b"short", TOKENS[:BS])
    with pytest.raises(ValueError):
        hash_block(None, TOKENS[:BS], algo="md5")
