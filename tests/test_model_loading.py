"""Model loading: GGUF and HF readers vs transformers, dequantization, Q/K un-permutation, bad files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.model.config import ModelConfig, rope_inv_freq
from kvserve.model.gguf import dequantize_tensor, load_gguf, open_gguf
from kvserve.model.hf import load_hf_dir
from kvserve.model.registry import KNOWN_MODELS, LoadedModel, load_model, resolve_model

TINY = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "vocab": 128, "ffn": 96}


# ---------------------------------------------------------------- the real model (smollm2-135m)
@pytest.fixture(scope="module")
def smol_path() -> Path:
    try:
        return resolve_model("smollm2-135m")
    except ValueError as err:
        pytest.skip(str(err))


@pytest.fixture(scope="module")
def smol(smol_path: Path) -> LoadedModel:
    return load_model("smollm2-135m", progress=False)


@pytest.fixture(scope="module")
def hf_state(smollm2_hf) -> dict[str, torch.Tensor]:
    """transformers' own GGUF loading of the same file: the oracle (conftest's, loaded once per session)."""
    return smollm2_hf.state_dict()


@pytest.mark.model
def test_smollm2_config(smol: LoadedModel, smol_path: Path) -> None:
    c = smol.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert (c.vocab_size, c.intermediate_size, c.max_position_embeddings) == (49152, 1536, 8192)
    assert c.rope_theta == 100000.0 and c.rope_scaling is None
    assert c.rms_norm_eps == pytest.approx(1e-5)
    assert c.tie_word_embeddings and "lm_head.weight" not in smol.weights
    assert (c.bos_token_id, c.eos_token_id, c.architecture) == (1, 2, "llama")
    assert smol.name == "smollm2-135m" and smol.path == smol_path
    assert smol.tokenizer is not None and smol.tokenizer.eos_token_id == 2


@pytest.mark.model
@pytest.mark.slow  # the transformers oracle alone takes 15-30 s on 2 cores
def test_smollm2_weights_equal_transformers(smol: LoadedModel, hf_state: dict[str, torch.Tensor]) -> None:
    # transformers' state dict lists the tied lm_head separately; ours omits it.
    assert set(smol.weights) == set(hf_state) - {"lm_head.weight"}
    for name, weight in smol.weights.items():
        assert weight.dtype == torch.float32
        assert weight.shape == hf_state[name].shape, name
        # torch.equal is the fast path (and what we get: bit-identical); the diff only on mismatch.
        assert torch.equal(weight, hf_state[name]) or (weight - hf_state[name]).abs().max() <= 1e-6, name


@pytest.mark.model
@pytest.mark.parametrize("keep", ["1MB", "half"])
def test_truncated_gguf_raises(smol_path: Path, tmp_path: Path, keep: str) -> None:
    """Cut inside the tokenizer metadata (1 MB) and in the middle of the tensor data (half)."""
    keep_bytes = 1 << 20 if keep == "1MB" else smol_path.stat().st_size // 2
    broken = tmp_path / "cut.gguf"
    with smol_path.open("rb") as src, broken.open("wb") as dst:
        dst.write(src.read(keep_bytes))
    with pytest.raises(ValueError, match="cut.gguf"):
        load_gguf(broken, progress=False)


@pytest.mark.model
def test_gguf_path_and_directory_resolve(smol_path: Path, tmp_path: Path) -> None:
    assert resolve_model(str(smol_path)) == smol_path
    (tmp_path / "model.gguf").symlink_to(smol_path)
    assert resolve_model(str(tmp_path)) == tmp_path / "model.gguf"


# ---------------------------------------------------------------- registry and bad inputs
@pytest.mark.parametrize("name", ["no-such-model", "/nonexistent/dir", "./missing.gguf"])
def test_unknown_model_raises_listing_known_names(name: str) -> None:
    with pytest.raises(ValueError, match="smollm2-135m"):
        load_model(name, progress=False)
    assert "smollm2-135m" in KNOWN_MODELS


GARBAGE = [b"", b"garbage" * 100, b"GGUF" + bytes(range(256)) * 8, b"GGUF\x03\x00\x00\x00"]


@pytest.mark.parametrize("content", GARBAGE)
def test_garbage_file_raises(tmp_path: Path, content: bytes) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content)
    with pytest.raises(ValueError, match="bad.gguf"):
        load_gguf(bad, progress=False)


def test_hf_dir_without_config_or_weights_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="config.json"):
        load_hf_dir(tmp_path, progress=False)
    (tmp_path / "config.json").write_text(json.dumps(_tiny_hf_config_dict()))
    with pytest.raises(ValueError, match="safetensors"):
        load_hf_dir(tmp_path, progress=False)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "bias"),
        ({"model_type": "gpt2"}, "model_type"),
    ],
)
def test_hf_config_rejects_unsupported_features(tmp_path: Path, change: dict, message: str) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**_tiny_hf_config_dict(), **change}))
    with pytest.raises(ValueError, match=message):
        load_hf_dir(tmp_path, progress=False)


# ---------------------------------------------------------------- tiny HF Llama through hf.py
def _tiny_hf_config_dict() -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": TINY["vocab"],
        "hidden_size": TINY["hidden"],
        "intermediate_size": TINY["ffn"],
        "num_hidden_layers": TINY["layers"],
        "num_attention_heads": TINY["heads"],
        "num_key_value_heads": TINY["kv_heads"],
    }


def _tiny_hf_model(tie: bool = False, **overrides):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=TINY["layers"],
        hidden_size=TINY["hidden"],
        intermediate_size=TINY["ffn"],
        num_attention_heads=TINY["heads"],
        num_key_value_heads=TINY["kv_heads"],
        vocab_size=TINY["vocab"],
        tie_word_embeddings=tie,
        **overrides,
    )
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("tie", [False, True])
def test_tiny_hf_llama_loads_identically(tmp_path: Path, tie: bool) -> None:
    model = _tiny_hf_model(tie=tie)
    model.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), progress=False)
    expected = {k: v for k, v in model.state_dict().items() if not (tie and k == "lm_head.weight")}
    assert set(loaded.weights) == set(expected)
    for name, weight in loaded.weights.items():
        assert torch.equal(weight, expected[name]), name
    c = loaded.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (2, 64, 4, 2, 16)
    assert (c.vocab_size, c.intermediate_size, c.tie_word_embeddings) == (128, 96, tie)
    assert c.rope_theta == 10000.0 and c.rms_norm_eps == 1e-6
    assert loaded.tokenizer is None and loaded.name == tmp_path.name


def test_llama3_rope_scaling_matches_transformers(tmp_path: Path) -> None:
    scaling = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    model = _tiny_hf_model(rope_parameters=scaling, max_position_embeddings=512)
    model.save_pretrained(tmp_path)
    config, _, _ = load_hf_dir(tmp_path, progress=False)
    assert config.rope_scaling is not None and config.rope_scaling["factor"] == 8.0
    assert config.rope_theta == 500000.0
    expected = model.model.rotary_emb.inv_freq
    assert torch.allclose(rope_inv_freq(config), expected, rtol=0, atol=0)


# ---------------------------------------------------------------- GGUF written by gguf.GGUFWriter
def _llamacpp_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's Q/K permutation (written independently of our loader)."""
    return (
        weight.reshape(n_heads, 2, weight.shape[0] // n_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


_GGUF_LEAVES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf_name: str) -> str:
    globals_ = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf_name in globals_ or hf_name == "lm_head.weight":
        return globals_.get(hf_name, "output.weight")
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_GGUF_LEAVES[rest.removesuffix('.weight')]}.weight"


def _write_tiny_llama_gguf(path: Path, state: dict[str, torch.Tensor], skip: str | None = None) -> None:
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(TINY["layers"])
    writer.add_context_length(256)
    writer.add_embedding_length(TINY["hidden"])
    writer.add_feed_forward_length(TINY["ffn"])
    writer.add_head_count(TINY["heads"])
    writer.add_head_count_kv(TINY["kv_heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(TINY["vocab"])
    writer.add_rope_dimension_count(TINY["hidden"] // TINY["heads"])
    for name, tensor in state.items():
        array = tensor.numpy()
        if "q_proj" in name:
            array = _llamacpp_permute(array, TINY["heads"])
        elif "k_proj" in name:
            array = _llamacpp_permute(array, TINY["kv_heads"])
        if _gguf_name(name) != skip:
            writer.add_tensor(_gguf_name(name), np.ascontiguousarray(array))
    _finish(writer)


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_state() -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in _tiny_hf_model().state_dict().items()}


def test_gguf_loader_undoes_llamacpp_qk_permutation(tmp_path: Path, tiny_state: dict) -> None:
    path = tmp_path / "tiny.gguf"
    _write_tiny_llama_gguf(path, tiny_state)
    config, weights, metadata = load_gguf(path, progress=False)
    assert isinstance(config, ModelConfig) and metadata["general.architecture"] == "llama"
    assert (config.num_layers, config.head_dim, config.tie_word_embeddings) == (2, 16, False)
    assert set(weights) == set(tiny_state)
    for name, weight in weights.items():
        assert torch.equal(weight, tiny_state[name]), name
    assert load_model(str(path), progress=False).tokenizer is None


def test_gguf_missing_tensor_raises(tmp_path: Path, tiny_state: dict) -> None:
    path = tmp_path / "holey.gguf"
    _write_tiny_llama_gguf(path, tiny_state, skip="blk.1.ffn_up.weight")
    with pytest.raises(ValueError, match=r"holey.gguf.*missing.*layers\.1\.mlp\.up_proj"):
        load_gguf(path, progress=False)


@pytest.mark.parametrize("fraction", [0.0001, 0.002, 0.01, 0.5, 0.99, -1])
def test_truncated_tiny_gguf_raises(tmp_path: Path, tiny_state: dict, fraction: float) -> None:
    path = tmp_path / "short.gguf"
    _write_tiny_llama_gguf(path, tiny_state)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1] if fraction == -1 else data[: int(len(data) * fraction)])
    with pytest.raises(ValueError, match="short.gguf"):
        load_gguf(path, progress=False)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(position=st.integers(0, 2047), value=st.integers(0, 255))
def test_corrupt_header_bytes_raise_value_error_only(tmp_path_factory, tiny_state, position, value) -> None:
    path = tmp_path_factory.mktemp("fuzz") / "fuzz.gguf"
    _write_tiny_llama_gguf(path, tiny_state)
    data = bytearray(path.read_bytes())
    data[position] = value
    path.write_bytes(bytes(data))
    try:
        load_gguf(path, progress=False)
    except ValueError:
        pass  # the only acceptable failure; anything else (IndexError, struct.error...) fails the test


def _random_k_blocks(qtype: Q, rows: int, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks (gguf cannot quantize these in numpy) with sane float16 scale fields."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, 256 // block_elems, block_bytes), dtype=np.uint8)
    n_floats = 2 if qtype == Q.Q4_K else 1
    floats = rng.uniform(0.001, 0.05, size=(rows, blocks.shape[1], n_floats)).astype(np.float16)
    if qtype == Q.Q4_K:  # layout: d (f16), dmin (f16), scales[12], qs[128]
        blocks[..., 0:4] = floats.view(np.uint8)
    else:  # Q6_K layout: ql[128], qh[64], scales[16], d (f16)
        blocks[..., -2:] = floats.view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q4_K, Q.Q6_K])
def test_dequantization_round_trip(tmp_path: Path, qtype: Q) -> None:
    rng = np.random.default_rng(int(qtype))
    original = rng.standard_normal((4, 256)).astype(np.float32)
    if qtype in (Q.Q4_K, Q.Q6_K):
        stored = _random_k_blocks(qtype, 4, rng)
    else:
        stored = gguf.quants.quantize(original, qtype)
    writer = gguf.GGUFWriter(tmp_path / "q.gguf", "llama")
    # Block types are handed over as uint8 bytes; the writer derives the logical shape from raw_dtype.
    writer.add_tensor("t.weight", stored, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
    _finish(writer)

    (tensor,) = open_gguf(tmp_path / "q.gguf").tensors
    ours = dequantize_tensor(tensor)
    reference = gguf.quants.dequantize(stored, qtype)
    assert ours.dtype == torch.float32 and ours.shape == (4, 256)
    assert np.array_equal(ours.numpy(), reference)
    assert np.isfinite(reference).all()
    if qtype not in (Q.Q4_K, Q.Q6_K):  # sanity: quantization error is small
        assert np.abs(reference - original).max() < 0.5


def test_offline_start_imports_neither_jinja_nor_redis(smol_path):
    """`LLM()` needs no chat template and no Redis tier: their libraries (~0.1 s of a cold start) load only
    when a template is rendered or a Redis tier is configured. A fresh interpreter, so other tests' imports
    do not count."""
    code = ("import sys; from kvserve import LLM; "
            f"LLM({str(smol_path)!r}, progress=False, kv_cache_memory='64MiB'); "
            "print(sorted(m for m in ('jinja2', 'redis') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.model
def test_native_weights_that_need_no_copy_stay_in_the_files_mapping(smol_path: Path) -> None:
    """o_proj, down_proj and the fused gate_up are used as stored: views of the GGUF's mapping, not private
    copies (~100 MiB less RSS per process for the default model, pages shared by every replica that maps the
    file)."""
    from kvserve import LLM
    from kvserve.kernels.quant import QuantWeight

    llm = LLM(model="smollm2-135m", weights="native")
    layer = llm.engine.model.layers[0]
    if not isinstance(layer.o_proj, QuantWeight):
        pytest.skip("native weights unavailable here")
    mapped = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5] == str(smol_path.resolve()):
            start, end = (int(part, 16) for part in fields[0].split("-"))
            mapped.append((start, end))

    def in_file(weight: QuantWeight) -> bool:
        return any(start <= weight.data.data_ptr() < end for start, end in mapped)

    assert mapped, "the GGUF is not mapped"
    assert in_file(layer.o_proj) and in_file(layer.down_proj)
    assert in_file(layer.gate_up_proj)  # gate and up are stored back to back: one view spans them
    assert not in_file(layer.qkv_proj)  # fused (and q, k un-permuted): a copy, as expected


def test_concat_rows_spans_back_to_back_slices_and_copies_the_rest() -> None:
    from kvserve.kernels.quant import QuantWeight, concat_rows

    row = 40  # a Q4_1 row of 64 weights: two 20-byte blocks
    storage = torch.randint(0, 256, (10 * row,), dtype=torch.uint8)

    def rows(start: int, end: int) -> QuantWeight:
        return QuantWeight(storage[start * row : end * row].view(-1, row), 3, 64)

    a, b, c = rows(0, 2), rows(2, 5), rows(6, 8)
    fused = concat_rows([a, b])
    assert fused is not None and fused.data.data_ptr() == a.data.data_ptr()  # a view: no copy
    assert torch.equal(fused.data, torch.cat([a.data, b.data]))
    for parts in ([a, c], [b, a]):  # not back to back: a copy with the same rows
        copied = concat_rows(parts)
        assert copied is not None and copied.data.data_ptr() != parts[0].data.data_ptr()
        assert torch.equal(copied.data, torch.cat([part.data for part in parts]))
    q8 = QuantWeight(torch.zeros(2, 68, dtype=torch.uint8), 8, 64)
    assert concat_rows([a, q8]) is None  # formats differ
