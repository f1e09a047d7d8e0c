"""The architecture hyper-parameters of a Llama-style decoder, independent of the file format."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

# The only rope scaling we implement; "default" / absent means plain RoPE.
SUPPORTED_ROPE_TYPES = ("default", "llama3")
_POSITIVE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads")
_POSITIVE_FIELDS += ("num_kv_heads", "head_dim", "max_position_embeddings")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(slots=True)
class ModelConfig:
    """Shape and numerics of a Llama-architecture model.

    `rope_scaling` is None or a llama3-type dict with keys `rope_type`, `factor`, `low_freq_factor`,
    `high_freq_factor`, `original_max_position_embeddings` (see `normalize_rope_scaling`).
    `eos_token_ids` lists every id the checkpoint declares as end-of-sequence (generation_config may
    give several); `eos_token_id` is the primary one.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_id: int | None
    architecture: str = "llama"
    rope_scaling: dict[str, Any] | None = None
    eos_token_ids: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        for name in _POSITIVE_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        self.rope_scaling = normalize_rope_scaling(self.rope_scaling, self.max_position_embeddings)
        if self.eos_token_id is not None and self.eos_token_id not in self.eos_token_ids:
            self.eos_token_ids = (self.eos_token_id, *self.eos_token_ids)

    @property
    def num_queries_per_kv(self) -> int:
        """How many query heads share one KV head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight a Llama checkpoint must hold (HF names) and its shape; `lm_head` only when untied."""
    hidden = config.hidden_size
    q_out, kv_out = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}."
        shapes[prefix + "input_layernorm.weight"] = (hidden,)
        shapes[prefix + "self_attn.q_proj.weight"] = (q_out, hidden)
        shapes[prefix + "self_attn.k_proj.weight"] = (kv_out, hidden)
        shapes[prefix + "self_attn.v_proj.weight"] = (kv_out, hidden)
        shapes[prefix + "self_attn.o_proj.weight"] = (hidden, q_out)
        shapes[prefix + "post_attention_layernorm.weight"] = (hidden,)
        shapes[prefix + "mlp.gate_proj.weight"] = (config.intermediate_size, hidden)
        shapes[prefix + "mlp.up_proj.weight"] = (config.intermediate_size, hidden)
        shapes[prefix + "mlp.down_proj.weight"] = (hidden, config.intermediate_size)
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes


def check_weights(config: ModelConfig, weights: dict[str, torch.Tensor], source: object) -> None:
    """Raise ValueError naming `source` if weights are missing, unexpected or mis-shaped for `config`.

    A tied checkpoint may still carry an `lm_head.weight` (some exporters write it); that is allowed.
    """
    expected = expected_weight_shapes(config)
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise ValueError(f"{source}: missing {len(missing)} weight(s), e.g. {missing[:5]}")
    allowed_extra = {"lm_head.weight"} if config.tie_word_embeddings else set()
    unexpected = sorted(set(weights) - set(expected) - allowed_extra)
    if unexpected:
        raise ValueError(f"{source}: unexpected weight(s) for a Llama model: {unexpected[:5]}")
    for name, tensor in weights.items():
        want = expected.get(name, (config.vocab_size, config.hidden_size))
        if tuple(tensor.shape) != want:
            raise ValueError(f"{source}: {name} has shape {tuple(tensor.shape)}, expected {want}")


def normalize_rope_scaling(
    scaling: dict[str, Any] | None, max_position_embeddings: int
) -> dict[str, Any] | None:
    """Validate a HF-style rope scaling dict; None for plain RoPE, a complete llama3 dict otherwise.

    Raises ValueError for any other rope type, since running with the wrong positions would silently
    produce garbage instead of failing.
    """
    if not scaling:
        return None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "llama3":
        raise ValueError(
            f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    params = dict(scaling)
    params.setdefault("original_max_position_embeddings", max_position_embeddings)
    missing = [key for key in _LLAMA3_KEYS if key not in params]
    if missing:
        raise ValueError(f"llama3 rope scaling is missing {missing}")
    if params["high_freq_factor"] <= params["low_freq_factor"]:
        raise ValueError("llama3 rope scaling needs high_freq_factor > low_freq_factor")
    return {"rope_type": "llama3", **{key: params[key] for key in _LLAMA3_KEYS}}


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """The RoPE inverse frequencies (float32, shape [head_dim // 2]), computed as transformers does."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    if config.rope_scaling is None:
        return inv_freq
    return _llama3_scaled(inv_freq, config.rope_scaling)


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency scaling: slow down low frequencies, keep high ones, blend in between."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)
