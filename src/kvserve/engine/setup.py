"""What an engine derives from its config and model at start: context length, pool shape, stop ids."""

from __future__ import annotations

import logging

import torch

from kvserve.config import FP8_KV_DTYPES, EngineConfig, default_kv_cache_memory
from kvserve.engine.busy_chunk import BUSY_CHUNK_TOKENS, BusyChunking
from kvserve.engine.limits import default_long_prefill_threshold
from kvserve.kernels.ops import Kernels
from kvserve.kernels.quant import BLOCK, BLOCK_QTYPES, QuantWeight, bf16_weight
from kvserve.kv.pool import KVPool, KVPoolShape, num_blocks_for_memory
from kvserve.model.config import ModelConfig
from kvserve.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


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
    if not any(isinstance(weight, QuantWeight) and weight.qtype in BLOCK_QTYPES for weight in weights.values()):
        raise ValueError(f"activation_quant={config.activation_quant!r} needs quantized weights (a Q4_0/Q4_1/Q8_0 "
                         f"GGUF with weights='native'); {config.model!r} loaded none")


def bf16_storage(weights: dict[str, object]) -> dict[str, object]:
    """`Kernels.stores_bf16`'s weights: every dense matrix (projections, embedding, head) as BF16 rows read by
    the native float kernels; vectors (norms) stay as they are, in the fp32 the model computes in."""
    def convert(weight: object) -> object:
        if isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.is_floating_point() \
                and weight.shape[1] % BLOCK == 0:
            return bf16_weight(weight)
        return weight

    return {name: convert(weight) for name, weight in weights.items()}


def model_weights(kernels: Kernels, config: EngineConfig, weights: dict[str, object]
                  ) -> tuple[torch.dtype, dict[str, object], bool]:
    """The dtype the model computes in, its weights as it will hold them, and whether they were rounded to
    bf16 for storage (`Kernels.stores_bf16`: bf16 asked for on a CPU without native bf16 arithmetic, or with
    quantized weights).

    Without the native kernels (`--kernels torch`, or no compiler), GGUF blocks are dequantized once here:
    the torch kernels would dequantize every matrix at every call (decode 29x slower than fp32: BENCHMARKS.md,
    "Every configuration"). int8 activations keep them: their torch twin is the test oracle."""
    name = kernels.resolve_dtype(config.dtype, config.weights)
    if kernels.native is None and config.activation_quant == "none":
        weights = {key: kernels.dequantize(w) if isinstance(w, QuantWeight) else w for key, w in weights.items()}
    if not kernels.stores_bf16(name, config.device, config.weights):
        return getattr(torch, name), weights, False
    logger.info("bfloat16 with the native float kernels (quantized weights, or a CPU without native bf16): dense "
                "matrices stored in bf16; arithmetic, activations and the KV cache in float32")
    stored = bf16_storage(weights)
    # GGUF blocks stay as they are: only dense matrices are rounded, and the tiers' fingerprint says so
    return torch.float32, stored, any(stored[key] is not weight for key, weight in weights.items())


def resolve_long_prefill_threshold(config: EngineConfig, max_model_len: int) -> int:
    if config.long_prefill_token_threshold is not None:
        return config.long_prefill_token_threshold
    return default_long_prefill_threshold(max_model_len)


def resolve_admitted_prefill_cap(config: EngineConfig, long_prefill_threshold: int) -> int:
    """Prompt tokens one step admits from the queue while others wait or run (`Scheduler._schedule_waiting`):
    by default the long-prefill threshold on a CPU, where a step's time grows with its tokens from the first
    one, and off on a GPU, where batching several prompts into one step is nearly free."""
    if config.max_admitted_prefill_tokens is not None:
        return config.max_admitted_prefill_tokens
    return long_prefill_threshold if torch.device(config.device).type == "cpu" else 0


def make_busy_chunking(config: EngineConfig) -> BusyChunking:
    """Long prompts in short steps while the server is busy lately (`engine/busy_chunk.py`): by default at
    `BUSY_CHUNK_TOKENS` on a CPU, where a long prompt's step takes seconds, and off on a GPU (offline `LLM`
    turns it off too: engine_args.py)."""
    tokens = config.long_prefill_busy_tokens
    if tokens is None:
        tokens = BUSY_CHUNK_TOKENS if torch.device(config.device).type == "cpu" else 0
    return BusyChunking(tokens)


def kv_cache_dtype(config: EngineConfig, model_dtype: torch.dtype) -> torch.dtype:
    """What the KV pool stores: `kv_cache_dtype`, or the model's dtype for auto. A bfloat16 pool under float32
    arithmetic holds each key and value rounded to nearest even (half the bytes per token); every attention
    path, native or torch, reads those rounded values back, fresh or cached alike, and a tier load returns the
    same bits. fp8 (e4m3fn, unscaled) likewise, at a quarter of float32's bytes and with 3 mantissa bits."""
    if config.kv_cache_dtype in FP8_KV_DTYPES:
        return torch.float8_e4m3fn
    return model_dtype if config.kv_cache_dtype == "auto" else getattr(torch, config.kv_cache_dtype)


def make_kv_pool(config: EngineConfig, model_config: ModelConfig, model_dtype: torch.dtype,
                 device: torch.device | str) -> KVPool:
    dtype = kv_cache_dtype(config, model_dtype)
    return KVPool(pool_shape(config, model_config, dtype), dtype, device)


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
