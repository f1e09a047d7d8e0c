"""Read llama.cpp GGUF files: a ModelConfig from the metadata and weights under HF Llama names.

Weights come back as float32 tensors (dense: the transformers-exact reference), or, with
``quantized=True``, 2-D Q4_0/Q4_1/Q8_0 tensors stay in their stored blocks as `QuantWeight`s for the
native kernels (norms and other types are still dequantized).
"""

from __future__ import annotations

import re
import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from tqdm import tqdm

from kvserve.kernels.quant import BLOCK_QTYPES, QuantWeight
from kvserve.model.config import ModelConfig, check_weights, expected_weight_shapes
from kvserve.model.gguf_header import GGUFFile, read_gguf

# llama.cpp tensor names -> Hugging Face Llama names. Layer tensors are "blk.{i}.<leaf>".
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
_HEADER = struct.Struct("<4sIQQ")  # magic, version, tensor count, metadata key/value count
SUPPORTED_ARCHITECTURES = ("llama",)


def open_gguf(path: str | Path) -> gguf.GGUFReader:
    """Open and parse a GGUF file's header, raising ValueError (naming the file) if it is not a valid one.

    GGUFReader fails on bad or truncated files with whatever numpy/struct error it hits first
    (IndexError, a reshape ValueError, ...); we turn all of those into one clear error.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"GGUF file not found: {path}")
    _check_header(path)
    try:
        reader = gguf.GGUFReader(path)
    except Exception as err:  # noqa: BLE001 - any parse failure means a corrupt file
        raise ValueError(f"{path} is not a valid GGUF file (corrupt or truncated): {err}") from err
    if reader.byte_order != "I":
        raise ValueError(f"{path}: big-endian GGUF files are not supported")
    _check_tensor_bounds(reader, path)
    return reader


def _check_header(path: Path) -> None:
    """Reject files whose fixed header is wrong before GGUFReader loops over (possibly absurd) counts."""
    with path.open("rb") as file:
        header = file.read(_HEADER.size)
    if len(header) < 4 or header[:4] != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (bad magic bytes)")
    if len(header) < _HEADER.size:
        raise ValueError(f"{path} is truncated: shorter than the GGUF header")
    _, _, tensor_count, kv_count = _HEADER.unpack(header)
    # Every key/value takes >= 12 bytes and every tensor description >= 24, so counts beyond what the
    # file size allows mean corruption (GGUFReader would otherwise iterate over them one by one).
    size = path.stat().st_size
    if kv_count * 12 > size or tensor_count * 24 > size:
        raise ValueError(f"{path} is corrupt: header claims {kv_count} keys and {tensor_count} tensors")


def _check_tensor_bounds(reader: gguf.GGUFReader, path: Path) -> None:
    """Catch truncation the reader did not notice (numpy memmap slicing silently clips at EOF)."""
    file_size = len(reader.data)
    for tensor in reader.tensors:
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        if end > file_size or tensor.data.nbytes != int(tensor.n_bytes):
            raise ValueError(
                f"{path} is truncated: tensor {tensor.name!r} needs bytes up to {end}, file has {file_size}"
            )


def read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """All metadata key/values as plain Python values (strings, numbers, lists)."""
    try:
        return {key: field.contents() for key, field in reader.fields.items()}
    except Exception as err:  # noqa: BLE001
        raise ValueError(f"{reader.data.filename}: unreadable GGUF metadata: {err}") from err


def config_from_metadata(
    metadata: dict[str, Any], tensor_names: set[str], source: object = "GGUF"
) -> ModelConfig:
    """Build a ModelConfig from llama.cpp `{arch}.*` metadata keys (only the llama architecture)."""
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{source}: unsupported architecture {arch!r}; supported: {SUPPORTED_ARCHITECTURES}")
    _reject_rope_scaling(metadata, tensor_names, arch, source)

    def need(key: str) -> Any:
        if f"{arch}.{key}" not in metadata:
            raise ValueError(f"{source}: missing GGUF metadata key {arch}.{key}")
        return metadata[f"{arch}.{key}"]

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(metadata.get(f"{arch}.attention.key_length", hidden // heads))
    rope_dim = int(metadata.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(
            f"{source}: partial rotary embeddings (rope dim {rope_dim} < {head_dim}) unsupported"
        )
    num_layers = int(need("block_count"))
    _check_layer_count(num_layers, tensor_names, source)
    vocab = metadata.get(f"{arch}.vocab_size") or len(metadata.get("tokenizer.ggml.tokens", ()))
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(metadata.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=float(metadata.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(need("context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=_optional_int(metadata.get("tokenizer.ggml.bos_token_id")),
        eos_token_id=_optional_int(metadata.get("tokenizer.ggml.eos_token_id")),
        architecture=arch,
    )


def _check_layer_count(num_layers: int, tensor_names: set[str], source: object) -> None:
    """The declared block count must match the blk.N tensors present (guards against corrupt metadata)."""
    found = {int(match.group(1)) for name in tensor_names if (match := _LAYER_RE.match(name))}
    if len(found) != num_layers or max(found, default=-1) != num_layers - 1:  # i.e. found != {0..n-1}
        raise ValueError(f"{source}: metadata says {num_layers} layers but tensors exist for {len(found)}")


def _reject_rope_scaling(metadata: dict[str, Any], tensor_names: set[str], arch: str, source: object) -> None:
    """GGUF encodes rope scaling in ways we do not implement; fail loudly rather than run wrong positions."""
    scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"{source}: GGUF rope scaling type {scaling!r} is not supported")
    if "rope_freqs.weight" in tensor_names:
        raise ValueError(
            f"{source}: GGUF rope_freqs (Llama-3.1-style rope scaling) is not supported; "
            "load the Hugging Face checkpoint directory instead"
        )


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def hf_name(gguf_name: str) -> str:
    """The Hugging Face name of a llama.cpp tensor; ValueError for tensors a Llama model cannot use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.match(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    raise ValueError(f"unexpected tensor {gguf_name!r} for a llama model")


def unpermute_qk(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation, exactly like transformers' `reverse_permute_weights`.

    llama.cpp's converter reorders each head's rows so RoPE rotates adjacent pairs (x0, x1), (x2, x3)...;
    HF's rotate_half pairs x_i with x_{i + head_dim/2}. Per head, llama.cpp row 2j+k came from HF row
    k*half + j, so we view rows as (head, j, k) and swap j and k back.
    """
    half = weight.shape[0] // n_heads // 2
    return weight.reshape(n_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def dequantize_tensor(tensor: gguf.ReaderTensor) -> torch.Tensor:
    """One GGUF tensor as an owned float32 torch tensor in HF (row-major, [out, in]) shape."""
    array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    # F32 comes back as a read-only view of the file's memmap: copy it, so weights are writable and do
    # not pin the mapping. Quantized types already come back as fresh float32 arrays (no extra copy).
    if not array.flags.writeable or np.may_share_memory(array, tensor.data) or array.dtype != np.float32:
        array = np.array(array, dtype=np.float32)
    return torch.from_numpy(array)


def stored_tensor(tensor: gguf.ReaderTensor, file_bytes: torch.Tensor | None = None) -> QuantWeight | None:
    """A 2-D tensor in a format the native kernels run, as its blocks (a view of a copy-on-write mapping,
    else a copy); else None. With `file_bytes` (the whole mapping as one tensor) the view is a slice of it, so
    tensors stored back to back share one storage and can be fused without a copy (`concat_rows`)."""
    qtype = int(tensor.tensor_type)
    if qtype not in BLOCK_QTYPES or len(tensor.shape) != 2:
        return None
    if file_bytes is not None:
        start = int(tensor.data_offset)
        data = file_bytes[start : start + int(tensor.n_bytes)].view(tensor.data.shape)
        return QuantWeight(data, qtype, int(tensor.shape[0]))
    writable = tensor.data.flags.writeable
    data = torch.from_numpy(tensor.data if writable else np.array(tensor.data, dtype=np.uint8, copy=True))
    return QuantWeight(data, qtype, int(tensor.shape[0]))


def load_gguf_weights(
    reader: gguf.GGUFReader | GGUFFile, config: ModelConfig, progress: bool = True, quantized: bool = False
) -> dict[str, torch.Tensor | QuantWeight]:
    """Every tensor under HF names: dequantized (one at a time, to keep peak memory at one extra tensor)
    or, with `quantized`, kept in stored form where the native kernels support the format."""
    path = reader.path if isinstance(reader, GGUFFile) else Path(reader.data.filename)
    # lm_head is listed even when tied so a stray output.weight is shape-checked too.
    expected = expected_weight_shapes(config) | {"lm_head.weight": (config.vocab_size, config.hidden_size)}
    weights: dict[str, torch.Tensor | QuantWeight] = {}
    # The fast reader's copy-on-write mapping as one tensor: every stored tensor a slice of it.
    file_bytes = torch.frombuffer(reader.mapping, dtype=torch.uint8) if isinstance(reader, GGUFFile) else None
    for tensor in tqdm(reader.tensors, desc=f"Loading {path.name}", unit="tensor", disable=not progress):
        try:
            name = hf_name(tensor.name)
            _check_shape(tensor, expected[name])
            weight = (stored_tensor(tensor, file_bytes) if quantized else None) or dequantize_tensor(tensor)
        except Exception as err:  # noqa: BLE001 - unsupported quant types, corrupt data, unknown names
            raise ValueError(f"{path}: cannot load tensor {tensor.name!r}: {err}") from err
        heads = {"q_proj.weight": config.num_heads, "k_proj.weight": config.num_kv_heads}.get(name[-13:])
        if heads and isinstance(weight, QuantWeight):  # rows hold whole blocks: permute them as bytes
            weight = QuantWeight(unpermute_qk(weight.data, heads).contiguous(), weight.qtype, weight.in_features)
        elif heads:
            weight = unpermute_qk(weight, heads)
        weights[name] = weight
    check_weights(config, weights, path)
    return weights


def _check_shape(tensor: gguf.ReaderTensor, expected: tuple[int, ...]) -> None:
    # Checked before dequantizing: a corrupt header must not reach the Q/K reshape with a wrong shape.
    shape = tuple(reversed([int(dim) for dim in tensor.shape]))  # ggml lists dims innermost first
    if shape != expected:
        raise ValueError(f"shape {shape} does not match the config's {expected}")


def load_gguf(
    path: str | Path, progress: bool = True, quantized: bool = False
) -> tuple[ModelConfig, dict[str, torch.Tensor | QuantWeight], dict[str, Any]]:
    """Read a GGUF file: (config, weights with HF names, raw metadata for the tokenizer).

    Uses the fast reader (`gguf_header`); `open_gguf` (gguf's own reader) stays for inspection and tests.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"GGUF file not found: {path}")
    _check_header(path)
    reader = read_gguf(path)
    metadata = reader.metadata
    try:
        config = config_from_metadata(metadata, {t.name for t in reader.tensors}, source=path)
    except (TypeError, KeyError, IndexError, ArithmeticError) as err:  # metadata values of the wrong kind
        raise ValueError(f"{path}: invalid model metadata: {err!r}") from err
    return config, load_gguf_weights(reader, config, progress=progress, quantized=quantized), metadata
