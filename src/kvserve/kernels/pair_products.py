"""Whether `--attention-dtype bfloat16` multiplies as AVX512-BF16 pair dot products (`vdpbf16ps`) or as float32
FMAs on the same rounded values, chosen for the CPU when the library loads. AMX-BF16 tiles, where the
library runs them, take precedence over both (csrc/prefill.h `pf_route`).

Both give the same products (exact in float32) summed in another order, so the choice is speed alone.
Measured (`benchmarks/attention_products.py`, one 2,048-token causal layer, 2 threads): on a Zen 4 (AMD family
25) the pair products ran 16.3 ms against 26.7 for float32 attention, twice the FMAs' rate; on a
Sapphire-Rapids-class Xeon (Intel family 6) with the tiles off they ran 27.4-28.8 ms against 24.2 for the FMAs
on the rounded values -- `vdpbf16ps` issues once a cycle there -- so Intel CPUs whose tiles are unusable
(Linux < 5.16, `KVSERVE_AMX=0`, Cooper Lake) take the FMAs. Other CPUs keep the pair products (the library's
default) until measured.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

from kvserve.kernels.crossover import cpu_identity

if TYPE_CHECKING:
    from kvserve.kernels.native import NativeLibrary

SLOWER = {("GenuineIntel", 6)}  # (vendor_id, cpu family) where the pair products lose to the FMAs


def pairs_pay(identity: tuple[str, int]) -> bool:
    return identity not in SLOWER


def set_pairs(library: NativeLibrary, on: bool) -> bool:
    """Pair products on or off for the whole library (both builds share the switch); returns whether they are on
    now (False where the CPU has no AVX512-BF16 or the library predates the switch)."""
    switch = getattr(library.lib, "kv_bf16_pairs", None)
    if switch is None:
        return False
    switch.argtypes, switch.restype = [ctypes.c_int], ctypes.c_int
    return switch(1 if on else 0) > 0


def apply(library: NativeLibrary) -> None:
    """The measured choice for this CPU, on a freshly loaded library."""
    set_pairs(library, pairs_pay(cpu_identity()))
