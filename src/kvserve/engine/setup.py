"""What an engine derives from its config and model at start: context length, pool shape, stop ids."""

from __future__ import annotations

import torch

from kvserve.config import EngineConfig, default_kv_cache_memory
from kvserve.engine.limits import default_long_prefill_threshold
from kvserve.kernels.quant import QuantWeight
from kvserve.kv.pool import KVPoolShape, num_blocks_for_memory
from kvserve.model.config import ModelConfig
from kvserve.model.tokenizer import Tokenizer


def resolve_max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    """`max_model_len`, or the model's positions; never more than the model has."""
    limit = model_config.max_position_embeddings
    wanted = config.max_model_len or limit
    if wanted > limit:
        raise ValueError(f"max_model_len {wanted} exceeds the model's {limit} positions")
    return wanted


def check_activation_quant(config: EngineConfig, weights: dict[str, object]) -> None:
    """int8 activations apply to matmuls with quantized weights kept as stored, on the CPU: refuse the option
    where there are none, rather than silently running the fp32 path."""
    if config.activation_quant == "none":
        return
    if torch.device(config.device).type != "cpu":
        raise ValueError(f"activation_quant={config.activation_quant!r} runs on the CPU only, not {config.device!r}")
    if not any(isinstance(weight, QuantWeight) for weight in weights.values()):
        raise ValueError(f"activation_quant={config.activation_quant!r} needs quantized weights (a Q4_0/Q4_1/Q8_0 "
                         f"GGUF with weights='native'); {config.model!r} loaded none")


def resolve_long_prefill_threshold(config: EngineConfig, max_model_len: int) -> int:
    if config.long_prefill_token_threshold is not None:
        return config.long_prefill_token_threshold
    return default_long_prefill_threshold(max_model_len)


def pool_shape(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype) -> KVPoolShape:
    """The KV pool's shape: `num_blocks`, or as many blocks as `kv_cache_memory` holds."""
    mc = model_config
    num_blocks = config.num_blocks or num_blocks_for_memory(
        int(config.kv_cache_memory or default_kv_cache_memory()), mc.num_layers, config.block_size,
        mc.num_kv_heads, mc.head_dim, dtype,
    )
    return KVPoolShape(mc.num_layers, num_blocks, config.block_size, mc.num_kv_heads, mc.head_dim)


def eos_token_ids(tokenizer: Tokenizer | None, model_config: ModelConfig) -> frozenset[int]:
    """The ids that end a generation: the tokenizer's stop tokens, else the model config's EOS."""
    if tokenizer is not None:
        return frozenset(tokenizer.stop_token_ids)
    eos = model_config.eos_token_id
    return frozenset() if eos is None else frozenset([eos])
