"""benchmarks/turn_bound.py's arithmetic and fp_rate.py's 512-bit rates (the seed's turn against the CPU's peak)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import fp_rate  # noqa: E402
import turn_bound  # noqa: E402
from kvserve.kernels.native import cpu_flags  # noqa: E402


def test_attention_multiply_adds_count_every_key_of_every_query():
    per_key = turn_bound.LAYERS * turn_bound.HEADS * turn_bound.HEAD_DIM * 2  # a score and a value product
    assert turn_bound.attention_macs(0, 1) == per_key  # one token sees itself
    assert turn_bound.attention_macs(3, 2) == (4 + 5) * per_key
    brute = sum(1 for i in range(100) for _ in range(1900 + i + 1)) * per_key
    assert turn_bound.attention_macs(1900, 100) == brute
    assert 6.7e9 < brute < 6.8e9  # the figure the section quotes


def test_512_bit_rates_are_measured_only_where_the_cpu_has_them():
    with tempfile.TemporaryDirectory() as workdir:
        lib = fp_rate.build(Path(workdir))
        rates = fp_rate.rates_512(lib, iterations=200_000, passes=1, threads=1)
    flags = cpu_flags()
    expected = {which for which, (_, _, needs) in fp_rate.OPS_512.items() if all(f in flags for f in needs)}
    assert set(rates) == expected
    if not expected:
        pytest.skip("no AVX-512 here: nothing to measure")
    assert all(rate > 0.1 for rate in rates.values())  # operations per ns: any working core does more
