"""The fused kernels (RoPE + KV write, SwiGLU) against their torch twins, and the native layer loop
(one C call per step, model/layer_loop.py) against the Python layer loop on a tiny quantized Llama.

Every kernel test runs for each ISA this CPU has (AVX-512 and the forced AVX2 path where both exist).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.scheduler import ScheduledRequest
from kvserve.kernels import reference
from kvserve.kernels.native import NativeLibrary
from kvserve.kernels.ops import Kernels
from kvserve.kernels.quant import QuantWeight
from kvserve.kv.pool import KVPool, KVPoolShape
from kvserve.model.hf import load_hf_dir
from kvserve.model.layer_loop import EXACT_MAX_STEP_ROWS, MAX_ROWS, MAX_STEP_ROWS, LayerLoop
from kvserve.model.llama import LlamaModel

SETTINGS = settings(max_examples=25, deadline=None)



@SETTINGS
@given(
    rows=st.integers(1, 6), kv_heads=st.integers(1, 3), group=st.sampled_from([1, 2, 3, 4]),
    head_dim=st.sampled_from([2, 8, 16, 24, 64]), block_size=st.sampled_from([1, 3, 4, 16]),
    seed=st.integers(0, 2**16),
)
def test_rope_kv_write_matches_reference(kernels, rows, kv_heads, group, head_dim, block_size, seed):
    generator = torch.Generator().manual_seed(seed)
    heads, num_blocks = kv_heads * group, 8
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=generator)
    angles = torch.rand(50, head_dim, generator=generator) * 6.3
    cos, sin = angles.cos(), angles.sin()
    positions = torch.randint(0, 50, (rows,), generator=generator)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:rows]
    pool = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=generator)
    pools = [pool.clone(), pool.clone()]
    expected = reference.rope_kv_write(qkv, heads, kv_heads, positions, cos, sin, pools[0][0], pools[0][1], slots)
    native = kernels.rope_kv_write(qkv, heads, kv_heads, positions, cos, sin, pools[1][0], pools[1][1], slots)
    # Same products and sums, rounded separately (no FMA contraction): bit-identical, untouched slots too.
    assert torch.equal(native, expected)
    assert torch.equal(pools[1], pools[0])


def test_rope_kv_write_and_swiglu_split_long_steps_across_threads(kernels):
    """From 33 rows both kernels split their rows across the threads: still bit-identical to the twins (each row
    computed alone), every slot written once."""
    generator = torch.Generator().manual_seed(7)
    rows, heads, kv_heads, head_dim, num_blocks, block_size = 300, 6, 2, 64, 40, 16
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=generator)
    angles = torch.rand(400, head_dim, generator=generator) * 6.3
    positions = torch.randint(0, 400, (rows,), generator=generator)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:rows]
    pools = [torch.zeros(2, num_blocks, block_size, kv_heads, head_dim) for _ in range(2)]
    args = (heads, kv_heads, positions, angles.cos(), angles.sin())
    expected = reference.rope_kv_write(qkv, *args, pools[0][0], pools[0][1], slots)
    assert torch.equal(kernels.rope_kv_write(qkv, *args, pools[1][0], pools[1][1], slots), expected)
    assert torch.equal(pools[1], pools[0])
    gate_up = torch.randn(rows, 2 * 96, generator=generator) * 6
    torch.testing.assert_close(kernels.swiglu(gate_up), reference.swiglu(gate_up), rtol=2e-6, atol=1e-6)


def test_rope_kv_write_rejects_bad_slots(kernels):
    qkv, tables = torch.zeros(2, 4 * 16), torch.zeros(10, 16)
    blocks = torch.zeros(4, 2, 1, 16)
    with pytest.raises(ValueError, match="slots"):
        kernels.rope_kv_write(qkv, 2, 1, torch.tensor([0, 1]), tables, tables, blocks, blocks, torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="positions"):
        kernels.rope_kv_write(qkv, 2, 1, torch.tensor([0, 10]), tables, tables, blocks, blocks, torch.tensor([0, 1]))


@SETTINGS
@given(rows=st.integers(1, 5), width=st.integers(1, 100), seed=st.integers(0, 2**16))
def test_swiglu_matches_reference(kernels, rows, width, seed):
    gate_up = torch.randn(rows, 2 * width, generator=torch.Generator().manual_seed(seed)) * 6
    torch.testing.assert_close(kernels.swiglu(gate_up), reference.swiglu(gate_up), rtol=2e-6, atol=1e-6)


# --- the layer loop ----------------------------------------------------------------------------------

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantized_tiny_llama(tiny_model_dir, kernels: Kernels) -> LlamaModel:
    """The conftest's tiny Llama with every projection quantized (Q8_0 and Q4_1 in alternate layers)."""
    import gguf

    config, weights, _ = load_hf_dir(tiny_model_dir, progress=False)
    for name, weight in list(weights.items()):
        if name.split(".")[-2] in PROJECTIONS:
            qtype = gguf.GGMLQuantizationType.Q8_0 if int(name.split(".")[2]) % 2 else gguf.GGMLQuantizationType.Q4_1
            data = gguf.quants.quantize(weight.numpy().astype(np.float32), qtype)
            weights[name] = QuantWeight(torch.from_numpy(np.ascontiguousarray(data)), int(qtype), weight.shape[1])
    return LlamaModel(config, weights, torch.float32, kernels=kernels)


def stub_request(prompt: list[int], block_table: list[int]) -> SimpleNamespace:
    """What ModelRunner reads of a Request, for a prompt that asks no prompt log-probs."""
    return SimpleNamespace(all_token_ids=list(prompt), num_computed_tokens=0, num_tokens=len(prompt),
                           block_table=block_table, lora=None, prompt_positions_to_score=lambda start, end: range(0))


def run_steps(model: LlamaModel, prompts: list[list[int]], block_size: int, steps: int,
              pool_dtype: torch.dtype = torch.float32, together: int = 1) -> list[torch.Tensor]:
    """Prompt i prefills in step i beside the decodes of prompts before it (mixed steps), then all decode
    together greedily; the logits of every step. `together` > 1: the first `together` prompts prefill in the
    first step (several prefill spans in one step)."""
    config = model.config
    pool = KVPool(KVPoolShape(config.num_layers, 64, block_size, config.num_kv_heads, config.head_dim),
                  pool_dtype, "cpu")
    runner = ModelRunner(model, pool)
    blocks = torch.randperm(64, generator=torch.Generator().manual_seed(block_size)).tolist()
    requests = []
    for prompt in prompts:
        needed = -(-(len(prompt) + len(prompts) + steps) // block_size)
        table, blocks = blocks[:needed], blocks[needed:]
        requests.append(stub_request(prompt, table))
    schedule = [requests[: i + 1] for i in range(together - 1, len(requests))] + [requests] * steps
    all_logits = []
    for step in schedule:
        scheduled = [ScheduledRequest(r, r.num_tokens - r.num_computed_tokens) for r in step]
        logits, _ = runner.run(scheduled)
        all_logits.append(logits)
        for request, row in zip(step, logits, strict=True):
            request.num_computed_tokens = request.num_tokens
            request.all_token_ids.append(int(row.argmax()))
            request.num_tokens += 1
    return all_logits


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_layer_loop_matches_python_loop(kernels, tiny_model_dir, block_size, monkeypatch):
    model = quantized_tiny_llama(tiny_model_dir, kernels)
    assert model.layer_loop is not None
    calls = []
    original = LayerLoop.forward
    monkeypatch.setattr(LayerLoop, "forward", lambda self, *args: calls.append(1) or original(self, *args))
    # Steps: 5-token prefill; a decode + a 9-token prefill; two decodes + a 20-token prefill (22 rows: over
    # 16, a mixed step with a short prefill); three decodes + a 1-token prompt; then four decode steps.
    prompts = [[5, 9, 200, 31, 7], list(range(3, 12)), list(range(40, 60)), [11]]
    native = run_steps(model, prompts, block_size, steps=4)
    assert len(calls) == 4 + 4
    model.layer_loop = None
    python = run_steps(model, prompts, block_size, steps=4)
    torch_model = quantized_tiny_llama(tiny_model_dir, Kernels.create("torch"))
    assert torch_model.layer_loop is None
    oracle = run_steps(torch_model, prompts, block_size, steps=4)
    for ours, theirs, reference_logits in zip(native, python, oracle, strict=True):
        scale = theirs.abs().max()
        assert (ours - theirs).abs().max() <= 1e-4 * scale
        assert (ours - reference_logits).abs().max() <= 1e-4 * scale
        assert torch.equal(ours.argmax(-1), reference_logits.argmax(-1))


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("block_size", [1, 16])
def test_layer_loop_with_a_narrow_pool(kernels, tiny_model_dir, block_size, pool_dtype, monkeypatch):
    """A bf16 or fp8 KV pool (--kv-cache-dtype bfloat16 / fp8) through the C layer loop: the same logits as the
    Python loop on the same kernels (decode rows and short prefills run the same kernels in the same order; the
    rounding is the native write's in both), and close to the torch twin's."""
    model = quantized_tiny_llama(tiny_model_dir, kernels)
    calls = []
    original = LayerLoop.forward
    monkeypatch.setattr(LayerLoop, "forward", lambda self, *args: calls.append(1) or original(self, *args))
    prompts = [[5, 9, 200, 31, 7], list(range(3, 12)), list(range(40, 60)), [11]]
    native = run_steps(model, prompts, block_size, steps=4, pool_dtype=pool_dtype)
    assert len(calls) == 8
    model.layer_loop = None
    python = run_steps(model, prompts, block_size, steps=4, pool_dtype=pool_dtype)
    oracle = run_steps(quantized_tiny_llama(tiny_model_dir, Kernels.create("torch")), prompts, block_size, steps=4,
                       pool_dtype=pool_dtype)
    for ours, theirs, reference_logits in zip(native, python, oracle, strict=True):
        scale = theirs.abs().max()
        assert (ours - theirs).abs().max() <= 1e-4 * scale
        assert (ours - reference_logits).abs().max() <= 1e-2 * scale


def test_layer_loop_applies_only_where_it_can(kernels, tiny_model_dir):
    model = quantized_tiny_llama(tiny_model_dir, kernels)
    blocks = torch.zeros(1, 1, dtype=torch.float32)
    step = SimpleNamespace(prefills=[SimpleNamespace(start=0, end=300)])  # metadata: any mix of rows
    loop = model.layer_loop
    assert loop.applies(MAX_ROWS, blocks) and not loop.applies(MAX_ROWS + 1, blocks)  # no metadata: small only
    assert loop.applies(EXACT_MAX_STEP_ROWS, blocks, step) and not loop.applies(EXACT_MAX_STEP_ROWS + 1, blocks, step)
    int8 = quantized_tiny_llama(tiny_model_dir, Kernels("native", kernels.native, activation_quant="int8"))
    assert int8.layer_loop.applies(MAX_STEP_ROWS, blocks, step)
    assert not int8.layer_loop.applies(MAX_STEP_ROWS + 1, blocks, step)
    assert loop.applies(4, blocks.bfloat16())  # a bf16 KV cache (--kv-cache-dtype bfloat16)
    assert not loop.applies(4, blocks.half())
    config, weights, _ = load_hf_dir(tiny_model_dir, progress=False)
    assert LlamaModel(config, weights, torch.float32, kernels=kernels).layer_loop is None  # dense weights
    assert LayerLoop.build(quantized_tiny_llama(tiny_model_dir, Kernels.create("torch"))) is None


def test_layer_loop_rejects_bad_slots(kernels, tiny_model_dir):
    model = quantized_tiny_llama(tiny_model_dir, kernels)
    config = model.config
    pool = KVPool(KVPoolShape(config.num_layers, 4, 4, config.num_kv_heads, config.head_dim), torch.float32, "cpu")
    request = stub_request([5, 6], [9])
    with pytest.raises((ValueError, IndexError)):  # block 9 of a 4-block pool
        ModelRunner(model, pool).run([ScheduledRequest(request, 2)])


def test_layer_loop_is_bit_identical_up_to_the_python_loops_gemm_crossover(kernels, tiny_model_dir, monkeypatch):
    """Prompts of 66-72 tokens prefill in the loop beside decodes (prefill.h for their rows, qgemm.h for the
    matmuls, as the Python loop's native path up to QGEMM_MAX_ROWS rows): every step's logits equal it."""
    model = quantized_tiny_llama(tiny_model_dir, kernels)
    calls = []
    original = LayerLoop.forward
    monkeypatch.setattr(LayerLoop, "forward", lambda self, *args: calls.append(1) or original(self, *args))
    prompts = [list(range(3, 73)), list(range(140, 206)), list(range(300, 368))]
    native = run_steps(model, prompts, 4, steps=3)
    assert len(calls) == 3 + 3
    model.layer_loop = None
    python = run_steps(model, prompts, 4, steps=3)
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(native, python, strict=True))


@pytest.mark.parametrize("activation_quant", ["none", "int8"])
@pytest.mark.parametrize("num_prompts", [1, 2, 4])
def test_decode_step_is_bit_identical_whatever_the_threads(kernels, tiny_model_dir, monkeypatch, activation_quant,
                                                           num_prompts):
    """Decode steps of 1-4 rows run csrc/decode_step.h (one region between attentions, each kernel's chunks
    shared out to the team and stolen when a thread is late): with 1, 2 or 3 native threads their logits
    equal the Python loop's (which calls the same kernels one by one) bit for bit."""
    model = quantized_tiny_llama(tiny_model_dir, Kernels("native", kernels.native, activation_quant=activation_quant))
    prompts = [list(range(3 + 70 * i, 73 + 70 * i)) for i in range(num_prompts)]  # past the prefill bound
    model.layer_loop = None
    python = run_steps(model, prompts, 16, steps=3)
    model.layer_loop = LayerLoop.build(model)
    rows = []
    original = LayerLoop.forward
    monkeypatch.setattr(LayerLoop, "forward",
                        lambda self, ids, *args: rows.append(ids.shape[0]) or original(self, ids, *args))
    try:
        for threads in (1, 2, 3):
            kernels.native.lib.kv_set_num_threads(threads)
            native = run_steps(model, prompts, 16, steps=3)
            assert all(torch.equal(ours, theirs) for ours, theirs in zip(native, python, strict=True))
    finally:
        kernels.native.lib.kv_set_num_threads(torch.get_num_threads())
    assert rows.count(num_prompts) >= 3 * 3  # the loop ran every decode step


def count_loop_rows(monkeypatch) -> list[int]:
    """Record the row count of every step the C layer loop runs (it still runs them)."""
    calls: list[int] = []
    original = LayerLoop.forward
    monkeypatch.setattr(
        LayerLoop, "forward", lambda self, *args: calls.append(args[0].shape[0]) or original(self, *args)
    )
    return calls


@pytest.mark.parametrize("activation_quant", ["none", "int8"])
def test_layer_loop_runs_long_prefills(kernels, tiny_model_dir, monkeypatch, activation_quant):
    """A 300-token prompt beside two decodes and a 9-token prompt (311 rows: the Python loop dequantizes for
    torch's GEMM there, exact) runs in the loop; int8 also a 600-token one. Logits agree with the Python loop
    and (exact) with the torch kernels, argmax equal."""
    chosen = Kernels("native", kernels.native, activation_quant=activation_quant)
    model = quantized_tiny_llama(tiny_model_dir, chosen)
    calls = count_loop_rows(monkeypatch)
    long = 600 if activation_quant == "int8" else 300
    prompts = [[5, 9, 200], [17, 4], [3 + (7 * i) % 250 for i in range(long)], list(range(7, 16))]
    native = run_steps(model, prompts, 16, steps=2)
    assert 2 + long in calls
    assert len(calls) == len(prompts) + 2  # every step ran in the loop
    model.layer_loop = None
    python = run_steps(model, prompts, 16, steps=2)
    for ours, theirs in zip(native, python, strict=True):
        assert (ours - theirs).abs().max() <= 1e-4 * theirs.abs().max()
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    if activation_quant == "none":
        oracle = run_steps(quantized_tiny_llama(tiny_model_dir, Kernels.create("torch")), prompts, 16, steps=2)
        for ours, reference_logits in zip(native, oracle, strict=True):
            assert (ours - reference_logits).abs().max() <= 1e-4 * reference_logits.abs().max()
            assert torch.equal(ours.argmax(-1), reference_logits.argmax(-1))


@pytest.mark.parametrize("activation_quant", ["none", "int8"])
def test_layer_loop_covers_wide_decode_steps(kernels, tiny_model_dir, monkeypatch, activation_quant):
    """The loop takes decode-only steps beyond 16 rows (exact: the wide GEMM of qgemm.h; int8: the int8
    matmul), and agrees with the Python loop running the same matmuls."""
    chosen = Kernels("native", kernels.native, activation_quant=activation_quant)
    model = quantized_tiny_llama(tiny_model_dir, chosen)
    assert model.layer_loop is not None and model.layer_loop.act_quant == (activation_quant == "int8")
    calls = count_loop_rows(monkeypatch)
    prompts = [[3 + i, 40 + i] for i in range(20)]
    native = run_steps(model, prompts, 16, steps=3)
    assert calls.count(20) == 4  # the three 20-row decode steps, and 18 decodes + the last 2-token prefill
    assert len(calls) == 20 + 3  # every step ran in the loop, the mixed ones over 16 rows too
    model.layer_loop = None
    python = run_steps(model, prompts, 16, steps=3)
    for ours, theirs in zip(native, python, strict=True):
        assert (ours - theirs).abs().max() <= 1e-5 * theirs.abs().max()
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.mark.parametrize("activation_quant", ["none", "int8"])
def test_layer_loop_covers_mixed_steps(kernels, tiny_model_dir, monkeypatch, activation_quant):
    """A step of 14 decodes beside a newcomer's 30-token prefill (44 rows) runs in the loop: its prefill rows
    attend through the pool, causal within the chunk; its logits agree with the Python loop and the torch
    kernels (exact: wide GEMM; int8: the int8 matmul, against the Python loop only), with equal argmax."""
    chosen = Kernels("native", kernels.native, activation_quant=activation_quant)
    model = quantized_tiny_llama(tiny_model_dir, chosen)
    calls = count_loop_rows(monkeypatch)
    prompts = [[3 + i, 40 + i] for i in range(14)] + [list(range(100, 130))]
    native = run_steps(model, prompts, 16, steps=2)
    assert calls.count(14 + 30) == 1  # the mixed step ran in the loop
    assert len(calls) == len(prompts) + 2  # and every other step too (at most 16 rows)
    model.layer_loop = None
    python = run_steps(model, prompts, 16, steps=2)
    for ours, theirs in zip(native, python, strict=True):
        assert (ours - theirs).abs().max() <= 1e-4 * theirs.abs().max()
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    if activation_quant == "none":  # int8 activation blocks round apart from the torch twin's (either loop)
        oracle = run_steps(quantized_tiny_llama(tiny_model_dir, Kernels.create("torch")), prompts, 16, steps=2)
        for ours, reference_logits in zip(native, oracle, strict=True):
            assert (ours - reference_logits).abs().max() <= 1e-4 * reference_logits.abs().max()
            assert torch.equal(ours.argmax(-1), reference_logits.argmax(-1))


def test_layer_loop_runs_cascade_groups(kernels, tiny_model_dir, monkeypatch):
    """A decode step whose rows share leading blocks runs cascade attention inside the loop, and its logits
    equal the Python loop's (cascade kernel per layer) and the loop without the plan (paged attention)."""
    from kvserve.kv.attention import AttentionMetadata
    from kvserve.kv.cascade import plan_cascade

    model = quantized_tiny_llama(tiny_model_dir, kernels)
    config, block_size = model.config, 4
    shape = KVPoolShape(config.num_layers, 32, block_size, config.num_kv_heads, config.head_dim)
    generator = torch.Generator().manual_seed(7)
    base = torch.randn(config.num_layers, 2, 32, block_size, config.num_kv_heads, config.head_dim,
                       generator=generator) * 0.5
    shared = [3, 9, 12, 20, 1]  # five shared blocks, then each row's own
    tables = [shared + [5, 6], shared + [7, 8], shared + [10, 11], [13, 14, 15, 16, 17, 18, 0]]
    context_lens = [23, 25, 22, 21]
    slots = [tables[row][(n - 1) // block_size] * block_size + (n - 1) % block_size
             for row, n in enumerate(context_lens)]
    plan = plan_cascade(tables, context_lens, block_size)
    assert plan is not None and plan.num_groups == 1
    ids, positions = torch.tensor([4, 8, 15, 16]), torch.tensor([n - 1 for n in context_lens])

    def step(use_plan: bool, loop: bool) -> torch.Tensor:
        pool = KVPool(shape, torch.float32, "cpu")
        pool.tensor.copy_(base)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots), num_decodes=4, decode_block_tables=torch.tensor(tables),
            decode_context_lens=torch.tensor(context_lens), decode_key_mask=None, prefills=[],
            decode_cascade=plan if use_plan else None,
        )
        saved, model.layer_loop = model.layer_loop, (model.layer_loop if loop else None)
        try:
            return model.forward(ids, positions, pool, meta)
        finally:
            model.layer_loop = saved

    calls = []
    original = NativeLibrary.cascade_attention
    monkeypatch.setattr(NativeLibrary, "cascade_attention", lambda *a: calls.append(1) or original(*a))
    loop_cascade, loop_paged, python_cascade = step(True, True), step(False, True), step(True, False)
    assert len(calls) == config.num_layers  # the Python loop's calls; the C loop ran its own
    scale = python_cascade.abs().max()
    assert (loop_cascade - python_cascade).abs().max() <= 1e-5 * scale
    assert (loop_cascade - loop_paged).abs().max() <= 1e-4 * scale
    assert not torch.equal(loop_cascade, loop_paged)  # another summation order: the loop ran the cascade kernel
    plan.group_shared_blocks[0] = 6  # row 3's table does not start with these blocks: refused before C
    plan.checked_with = None
    with pytest.raises(ValueError, match="same blocks|exceed"):
        step(True, True)


@settings(max_examples=12, deadline=None)
@given(
    decodes=st.lists(st.integers(1, 40), max_size=4), spans=st.lists(
        st.tuples(st.integers(1, 45), st.integers(0, 30)), min_size=1, max_size=3),  # (new tokens, cached)
    block_size=st.sampled_from([1, 4, 16]), seed=st.integers(0, 2**16),
)
def test_layer_loop_prefill_spans_match_python_loop_and_torch(kernels, tiny_model_dir, decodes, spans, block_size,
                                                              seed):
    """One step of decode rows (context lengths `decodes`) beside prefill chunks (some after cached tokens),
    built by hand over a random pool: the loop (decode attention for the decode rows, prefill.h for the
    chunks) equals the Python loop with native kernels bit for bit (the same kernels, at most 256 rows) and
    the torch kernels within 1e-4 relative."""
    from kvserve.kv.attention import AttentionMetadata, PrefillSpan

    model = _tiny_models(tiny_model_dir, kernels)
    config = model.config
    generator = torch.Generator().manual_seed(seed)
    contexts = decodes + [new + cached for new, cached in spans]
    needed = [-(-n // block_size) for n in contexts]
    num_blocks = sum(needed) + 1
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables, start = [], 0
    for count in needed:
        tables.append(order[start : start + count])
        start += count
    positions, slots = [], []
    for row, n in enumerate(contexts):
        first = n - 1 if row < len(decodes) else n - spans[row - len(decodes)][0]
        for pos in range(first, n):
            positions.append(pos)
            slots.append(tables[row][pos // block_size] * block_size + pos % block_size)
    width = max(needed)
    padded = [table + [0] * (width - len(table)) for table in tables]
    prefills, row = [], len(decodes)
    for index, (new, _) in enumerate(spans):
        table = tables[len(decodes) + index]
        prefills.append(PrefillSpan(row, row + new, contexts[len(decodes) + index], torch.tensor(table)))
        row += new
    decode_lens = torch.tensor(decodes, dtype=torch.long)
    key_pos = torch.arange(width * block_size)
    meta_args = dict(
        slot_mapping=torch.tensor(slots), num_decodes=len(decodes),
        decode_block_tables=torch.tensor(padded[: len(decodes)]).view(len(decodes), width) if decodes else None,
        decode_context_lens=decode_lens if decodes else None,
        decode_key_mask=(key_pos < decode_lens.view(-1, 1)).view(len(decodes), 1, 1, -1) if decodes else None,
    )
    ids = torch.randint(0, 512, (len(positions),), generator=generator)
    base = torch.randn(config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim,
                       generator=generator)
    shape = KVPoolShape(config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)

    def forward(chosen: LlamaModel, loop: bool) -> torch.Tensor:
        pool = KVPool(shape, torch.float32, "cpu")
        pool.tensor.copy_(base)
        saved = chosen.layer_loop
        chosen.layer_loop = saved if loop else None
        try:
            meta = AttentionMetadata(prefills=list(prefills), **meta_args)
            if loop:
                assert saved is not None and saved.applies(len(positions), pool.tensor[0, 0], meta)
            return chosen.forward(ids, torch.tensor(positions), pool, meta)
        finally:
            chosen.layer_loop = saved

    ours, python = forward(model, True), forward(model, False)
    oracle = forward(_tiny_models(tiny_model_dir, None), False)
    assert torch.equal(ours, python)
    assert (ours - oracle).abs().max() <= 1e-4 * oracle.abs().max()


_TINY: dict = {}


def _tiny_models(tiny_model_dir, kernels: Kernels | None) -> LlamaModel:
    """The quantized tiny Llama for these kernels (None: the torch kernels), built once per test module run."""
    key = (str(tiny_model_dir), None if kernels is None else kernels.isa)
    if key not in _TINY:
        _TINY[key] = quantized_tiny_llama(tiny_model_dir, kernels or Kernels.create("torch"))
    return _TINY[key]


def test_layer_loop_checks_prefill_spans_before_c():
    """Spans that would send C past its rows or a block table are refused in Python (ValueError)."""
    from kvserve.model.layer_loop import _check_spans

    table = torch.tensor([[3, 1]])
    _check_spans(torch.tensor([[2, 5, 7]]), table, 2, 7, num_blocks=4, block_size=4)  # rows 2..6 after 2 decodes
    bad = [
        (torch.tensor([[1, 5, 7]]), table, "follow"),  # overlaps the decode rows
        (torch.tensor([[2, 4, 7]]), table, "end at row"),  # leaves row 6 uncovered
        (torch.tensor([[2, 5, 9]]), table, "follow"),  # context beyond the table's 8 slots
        (torch.tensor([[2, 5, 4]]), table, "follow"),  # fewer context tokens than new ones
        (torch.tensor([[2, 5, 7]]), torch.tensor([[3, 4]]), "out of range"),  # block 4 of 4
    ]
    for spans, tables, message in bad:
        with pytest.raises(ValueError, match=message):
            _check_spans(spans, tables, 2, 7, num_blocks=4, block_size=4)


def test_layer_loop_runs_cascade_groups_beside_a_prefill(kernels, tiny_model_dir):
    """Decode rows sharing leading blocks beside a prefill chunk: the loop runs cascade attention for the
    decode rows and prefill.h for the chunk, as the Python loop does -- logits equal bit for bit -- and
    differs (summation order only) from the loop without the plan."""
    from kvserve.kv.attention import AttentionMetadata, PrefillSpan
    from kvserve.kv.cascade import plan_cascade

    model = quantized_tiny_llama(tiny_model_dir, kernels)
    config, block_size = model.config, 4
    shape = KVPoolShape(config.num_layers, 32, block_size, config.num_kv_heads, config.head_dim)
    base = torch.randn(config.num_layers, 2, 32, block_size, config.num_kv_heads, config.head_dim,
                       generator=torch.Generator().manual_seed(11)) * 0.5
    shared = [3, 9, 12, 20, 1]
    tables = [shared + [5, 6], shared + [7, 8], shared + [10, 11]]
    context_lens = [23, 25, 22]
    slots = [tables[row][(n - 1) // block_size] * block_size + (n - 1) % block_size
             for row, n in enumerate(context_lens)]
    span_table = [13, 14, 15]  # a chunk of 5 tokens after 6 cached ones: positions 6..10
    slots += [span_table[p // block_size] * block_size + p % block_size for p in range(6, 11)]
    positions = torch.tensor([n - 1 for n in context_lens] + list(range(6, 11)))
    ids = torch.tensor([4, 8, 15, 16, 23, 42, 7, 9])
    plan = plan_cascade(tables, context_lens, block_size)
    assert plan is not None and plan.num_groups == 1

    def step(use_plan: bool, loop: bool) -> torch.Tensor:
        pool = KVPool(shape, torch.float32, "cpu")
        pool.tensor.copy_(base)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots), num_decodes=3, decode_block_tables=torch.tensor(tables),
            decode_context_lens=torch.tensor(context_lens), decode_key_mask=None,
            prefills=[PrefillSpan(3, 8, 11, torch.tensor(span_table))], decode_cascade=plan if use_plan else None,
        )
        saved, model.layer_loop = model.layer_loop, (model.layer_loop if loop else None)
        try:
            return model.forward(ids, positions, pool, meta)
        finally:
            model.layer_loop = saved

    loop_cascade, loop_paged, python_cascade = step(True, True), step(False, True), step(True, False)
    assert torch.equal(loop_cascade, python_cascade)
    assert (loop_cascade - loop_paged).abs().max() <= 1e-4 * loop_paged.abs().max()
    assert not torch.equal(loop_cascade[:3], loop_paged[:3])  # the loop ran the cascade kernel for decodes


def test_pinned_mmap_threshold_sends_long_exact_steps_to_the_loop(kernels, tiny_model_dir, monkeypatch):
    """A server pins glibc's mmap threshold (kernels/malloc.py); then float32 steps of every size run in the
    C loop (its scratch is kept) instead of the Python loop, whose torch temporaries would each fault in
    fresh pages. A 600-token prompt beside a decode: one loop step, logits as the torch kernels'."""
    monkeypatch.setattr("kvserve.model.layer_loop.mmap_threshold_pinned", lambda: 256 * 1024)
    model = quantized_tiny_llama(tiny_model_dir, kernels)
    blocks, step = torch.zeros(1, 1, dtype=torch.float32), SimpleNamespace(prefills=[])
    assert model.layer_loop.applies(MAX_STEP_ROWS, blocks, step)
    assert not model.layer_loop.applies(MAX_STEP_ROWS + 1, blocks, step)
    calls = count_loop_rows(monkeypatch)
    prompts = [[5, 9, 200], [3 + (7 * i) % 250 for i in range(600)]]
    native = run_steps(model, prompts, 16, steps=2)
    assert 601 in calls and len(calls) == len(prompts) + 2
    oracle = run_steps(quantized_tiny_llama(tiny_model_dir, Kernels.create("torch")), prompts, 16, steps=2)
    for ours, reference_logits in zip(native, oracle, strict=True):
        assert (ours - reference_logits).abs().max() <= 1e-4 * reference_logits.abs().max()
        assert torch.equal(ours.argmax(-1), reference_logits.argmax(-1))
