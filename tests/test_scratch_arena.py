"""The kernels' scratch arenas (csrc/scratch.h): calls of varying sizes reuse one per-thread arena, grown to
the largest call and kept, and give bit-identical results to calls on a freshly mapped arena; releasing the
arenas unmaps them, and the next call maps them again with the same results.

Each case runs with one and two native threads (per-thread arenas inside the OpenMP regions) for every ISA
this CPU has (`conftest.ISA_PARAMS`).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvserve.kernels import scratch as scratch_module
from kvserve.kernels.ops import Kernels
from kvserve.kernels.quant import QTYPES
from kvserve.kv.cascade import plan_cascade
from test_cascade_attention import draw_case, padded
from test_kernels import random_quant
from test_layer_loop import quantized_tiny_llama, run_steps

THREADS = (1, 2)


def layer_loop_cases(kernels: Kernels, tiny_model_dir) -> dict[str, Callable[[], list[torch.Tensor]]]:
    """Steps through the C layer loop: decode-only steps of <= 4 rows (decode_step.h's one region), and a
    300-token prefill beside decodes (layer.h's buffers at 302 rows, qgemm.h, prefill.h), by name."""
    model = quantized_tiny_llama(tiny_model_dir, kernels)
    assert model.layer_loop is not None
    small = [[5, 9, 200], [17, 4]]
    large = [[5, 9, 200], [17, 4], [3 + (7 * i) % 250 for i in range(300)]]
    return {"small": lambda: run_steps(model, small, 16, steps=3),
            "large": lambda: run_steps(model, large, 16, steps=2)}


def kernel_cases(kernels: Kernels) -> dict[str, Callable[[], list[torch.Tensor]]]:
    """Single kernels at a small and a large size: qgemm (packed rows, per-thread panels), paged attention
    (per-thread score rows as long as the longest context) and cascade attention (partial states)."""
    lib = kernels.native
    qtype = sorted(QTYPES)[0]
    weight = random_quant(40, 192, qtype, seed=3)

    def qgemm(rows: int) -> Callable[[], list[torch.Tensor]]:
        x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(rows))
        return lambda: [lib.qgemm(x, weight.data, weight.qtype, weight.in_features)]

    def attention(own: int) -> Callable[[], list[torch.Tensor]]:
        tables, lens, keys, values, queries = draw_case(4, 2, 3, 32, [(3, [own, 2, own // 2]), (0, [own])], own)
        plan = plan_cascade(tables, lens, 4, min_rows=1, min_blocks=1)
        assert plan is not None
        table, context = padded(tables), torch.tensor(lens)
        return lambda: [lib.paged_attention(queries, keys, values, table, context, 0.125),
                        lib.cascade_attention(queries, keys, values, table, context, plan, 0.125)]

    return {"qgemm small": qgemm(6), "qgemm large": qgemm(600),
            "attention small": attention(5), "attention large": attention(3000)}


def check_reuse(kernels: Kernels, cases: dict[str, Callable[[], list[torch.Tensor]]], small: list[str],
                large: list[str]) -> None:
    """Fresh (arenas released before each case) versus one after another on the kept arenas (small, large,
    small, large): equal bit for bit; the arenas grow for the large cases, then stay."""
    lib = kernels.native
    try:
        for threads in THREADS:
            lib.lib.kv_set_num_threads(threads)
            fresh = {}
            for name in small + large:
                lib.release_scratch()
                fresh[name] = cases[name]()
            lib.release_scratch()
            mapped = []
            for name in small + large + small + large:
                got = cases[name]()
                assert all(torch.equal(a, b) for a, b in zip(got, fresh[name], strict=True)), name
                mapped.append(lib.scratch_mapped())
            n = len(small)
            assert mapped[n + len(large) - 1] > mapped[n - 1]  # grown for the large calls
            assert mapped[-1] == mapped[n + len(large) - 1]  # kept, not regrown nor shrunk
    finally:
        lib.lib.kv_set_num_threads(torch.get_num_threads())


def test_layer_loop_steps_of_varying_sizes_reuse_the_arena(kernels, tiny_model_dir):
    check_reuse(kernels, layer_loop_cases(kernels, tiny_model_dir), ["small"], ["large"])


def test_kernels_of_varying_sizes_reuse_the_arena(kernels):
    check_reuse(kernels, kernel_cases(kernels), ["qgemm small", "attention small"], ["qgemm large", "attention large"])


@pytest.mark.parametrize("threads", THREADS)
def test_release_unmaps_and_the_next_call_maps_again(kernels, tiny_model_dir, threads):
    lib = kernels.native
    cases = {**layer_loop_cases(kernels, tiny_model_dir), **kernel_cases(kernels)}
    try:
        lib.lib.kv_set_num_threads(threads)
        before = {name: case() for name, case in cases.items()}
        mapped = lib.scratch_mapped()
        assert mapped > 0
        assert lib.release_scratch(min_idle_s=3600) == 0  # nothing has been idle that long
        assert lib.scratch_mapped() == mapped
        assert lib.release_scratch() == mapped  # every arena: none is in use between calls
        assert lib.scratch_mapped() == 0
        for name, case in cases.items():
            assert all(torch.equal(a, b) for a, b in zip(case(), before[name], strict=True)), name
        assert lib.scratch_mapped() > 0
        # The server's periodic trim finds the loaded library by path (no handle): the same arenas.
        assert scratch_module.release_idle_scratch(0) > 0
        assert lib.scratch_mapped() == 0
    finally:
        lib.lib.kv_set_num_threads(torch.get_num_threads())
