"""EngineConfig: every engine knob, parsed and validated once, in one place."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields

from kvserve.engine.speculative import parse_speculative_config
from kvserve.kernels.ops import PREFILL_DTYPES
from kvserve.prefix.factory import PREFIX_CACHE_KINDS, PREFIX_HASH_KINDS
from kvserve.prefix.policies import DEFAULT_EVICTION, ONLINE_POLICIES

__all__ = [
    "ACTIVATION_QUANTS", "ATTENTION_DTYPES", "DTYPES", "KV_CACHE_DTYPES", "PREFILL_DTYPES", "PREFIX_CACHE_KINDS",
    "PREFIX_HASH_KINDS", "SCHEDULE_POLICIES", "EngineConfig", "parse_size",
]
SCHEDULE_POLICIES = ("fcfs", "lpm", "priority")
DTYPES = ("float32", "bfloat16", "float16", "auto")  # auto: bf16 only where the CPU has it natively
KERNEL_BACKENDS = ("native", "torch")  # C++ kernels (falling back to torch if unavailable) or torch only
WEIGHT_FORMATS = ("dense", "native")  # float32 weights, or a GGUF's quantized tensors kept as stored
ACTIVATION_QUANTS = ("none", "int8")  # int8: quantized-weight matmuls take int8 activation blocks (Q8_1)
# bfloat16: prefill and shared-prefix attention multiply bf16 queries and probabilities by the bf16 KV cache's keys
# and values, summing in float32 (llama.cpp's 16-bit KV path; twice the float32 FMA rate with AVX512-BF16).
ATTENTION_DTYPES = ("float32", "bfloat16")
# What the KV pool stores: auto = the model's dtype; bfloat16 halves the pool's bytes per token under float32
# arithmetic (twice the cached tokens in the same memory; attention reads the rounded keys/values); fp8 (vLLM's
# name; fp8_e4m3 the same) stores e4m3fn, a quarter of float32's bytes, unscaled (as vLLM's default scale 1.0).
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "fp8", "fp8_e4m3")
FP8_KV_DTYPES = ("fp8", "fp8_e4m3")

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1024,
    "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gib": 1024**3,
    "t": 1000**4, "tb": 1000**4, "tib": 1024**4,
}


def parse_size(text: str | int) -> int:
    """Parse a byte size such as ``2GiB``, ``512MB`` or ``1048576`` into bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"invalid size {text!r}: use a number with an optional unit like 2GiB or 512MB")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def default_kv_cache_memory() -> int:
    """A quarter of available RAM, capped at 2 GiB: enough for tens of thousands of tokens."""
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        available = 8 * 1024**3
    return max(64 * 1024**2, min(2 * 1024**3, available // 4))


@dataclass(slots=True)
class EngineConfig:
    """Engine settings; the same names are CLI flags (``--block-size`` for ``block_size``)."""

    model: str = "smollm2-135m"
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    kv_cache_memory: int | str | None = None
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES
    num_blocks: int | None = None
    prefix_cache: str = "radix"
    prefix_hash: str = "sha256"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    schedule_policy: str = "fcfs"
    max_blocks_per_request: int | None = None  # None: max(half the pool, one max_model_len sequence)
    long_prefill_token_threshold: int | None = None  # None: max(64, 4% of max_model_len); 0: off
    long_prefill_always: bool = False  # chunk at the threshold even alone (vLLM's rule; Scheduler._chunk)
    long_prefill_busy_tokens: int | None = None  # a long prompt's chunk while busy lately; None: 96 on a CPU
    max_admitted_prefill_tokens: int | None = None  # None: the long-prefill threshold on a CPU, 0 (off) elsewhere
    max_step_rows: int | None = 0  # running sequences computing per step, in turn; None: auto (CPU); 0: off
    max_group_rows: int = 0  # most sequences of one request's group computing per step while others run; 0: off
    num_threads: int | None = None
    seed: int = 0
    eviction: str = DEFAULT_EVICTION  # prefix-cache eviction policy (prefix/eviction.py)
    host_cache: int | str = "1GiB"  # KV tier in host RAM below the pool; 0 turns it off
    disk_cache: str | None = None  # directory of the local-disk KV tier; None: off
    disk_cache_size: int | str = "20GiB"
    remote_cache: str | None = None  # redis://host:port/db shared by replicas; None: off
    remote_cache_ttl: float | None = None  # seconds; None: blocks stay until Redis evicts them
    kv_load_timeout: float = 5.0  # seconds a disk/remote load may take before the prompt is recomputed
    kernels: str = "native"
    weights: str = "native"  # a quantized GGUF runs as stored; "dense": float32, the transformers-exact reference
    activation_quant: str = "none"  # int8 needs quantized weights (weights="native")
    attention_dtype: str = "float32"  # bfloat16: bf16 products in prefill attention (needs a bfloat16 KV cache)
    prefill_dtype: str = "float32"  # bfloat16: prefill rows' matmuls bf16 x bf16 on AMX tiles (kernels/bf16pack.py)
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    disable_prefix_hold: bool = False  # admit requests sharing a prefix being computed without waiting for it
    disable_cascade_attn: bool = False  # vLLM's name: no shared-prefix (cascade) decode attention
    speculative_config: dict | str | None = None  # vLLM's: {"method": "ngram", ...} (engine/speculative.py)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field."""
        _require(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _require(
            1 <= self.block_size <= 256 and self.block_size & (self.block_size - 1) == 0,
            f"block_size must be a power of two from 1 to 256, got {self.block_size}",
        )
        if self.kv_cache_memory is not None:
            try:
                self.kv_cache_memory = parse_size(self.kv_cache_memory)
            except ValueError as error:
                raise ValueError(f"kv_cache_memory: {error}") from None
            _require(self.kv_cache_memory > 0, "kv_cache_memory must be positive")
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES,
                 f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
                 + (" (fp8 here is e4m3 only: e5m2's 2 mantissa bits lose too much for keys and values)"
                    if str(self.kv_cache_dtype).startswith("fp8") else ""))
        if self.num_blocks is not None:
            _require(self.num_blocks >= 1, f"num_blocks must be >= 1, got {self.num_blocks}")
        _require(
            self.prefix_cache in PREFIX_CACHE_KINDS,
            f"prefix_cache must be one of {PREFIX_CACHE_KINDS}, got {self.prefix_cache!r}",
        )
        _require(
            self.prefix_hash in PREFIX_HASH_KINDS,
            f"prefix_hash must be one of {PREFIX_HASH_KINDS}, got {self.prefix_hash!r}",
        )
        _require(
            self.schedule_policy in SCHEDULE_POLICIES,
            f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}",
        )
        if self.max_model_len is not None:
            _require(self.max_model_len >= 1, f"max_model_len must be >= 1, got {self.max_model_len}")
        _require(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _require(
            self.max_num_batched_tokens >= 1,
            f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}",
        )
        parse_speculative_config(self.speculative_config)
        _require(self.eviction in ONLINE_POLICIES, f"eviction must be one of {ONLINE_POLICIES}, got {self.eviction!r}")
        if self.max_blocks_per_request is not None:
            _require(self.max_blocks_per_request >= 1,
                     f"max_blocks_per_request must be >= 1, got {self.max_blocks_per_request}")
        if self.max_admitted_prefill_tokens is not None:
            _require(self.max_admitted_prefill_tokens >= 0,
                     f"max_admitted_prefill_tokens must be >= 0 (0: off), got {self.max_admitted_prefill_tokens}")
        if self.long_prefill_token_threshold is not None:
            _require(self.long_prefill_token_threshold >= 0,
                     f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        if self.long_prefill_busy_tokens is not None:
            _require(self.long_prefill_busy_tokens >= 0,
                     f"long_prefill_busy_tokens must be >= 0 (0: off), got {self.long_prefill_busy_tokens}")
        if self.max_step_rows is not None:
            _require(self.max_step_rows >= 0, f"max_step_rows must be >= 0 (0: off), got {self.max_step_rows}")
        _require(self.max_group_rows >= 0, f"max_group_rows must be >= 0 (0: off), got {self.max_group_rows}")
        if self.num_threads is not None:
            _require(self.num_threads >= 1, f"num_threads must be >= 1, got {self.num_threads}")
        _require(self.max_loras >= 1, f"max_loras must be >= 1, got {self.max_loras}")
        _require(self.max_lora_rank >= 1, f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        _require(self.kernels in KERNEL_BACKENDS, f"kernels must be one of {KERNEL_BACKENDS}, got {self.kernels!r}")
        _require(self.weights in WEIGHT_FORMATS, f"weights must be one of {WEIGHT_FORMATS}, got {self.weights!r}")
        _require(self.attention_dtype in ATTENTION_DTYPES,
                 f"attention_dtype must be one of {ATTENTION_DTYPES}, got {self.attention_dtype!r}")
        _require(self.attention_dtype == "float32" or self.kv_cache_dtype == "bfloat16",
                 f"attention_dtype={self.attention_dtype!r} multiplies bf16 keys and values: it needs "
                 f"kv_cache_dtype='bfloat16', got {self.kv_cache_dtype!r}")
        _require(self.prefill_dtype in PREFILL_DTYPES,
                 f"prefill_dtype must be one of {PREFILL_DTYPES}, got {self.prefill_dtype!r}")
        _require(self.prefill_dtype == "float32" or self.speculative_config is None,
                 f"prefill_dtype={self.prefill_dtype!r} computes prefill rows in bf16, and speculative decoding "
                 "verifies its drafts as prefill rows, so its output would differ from plain decoding: use one")
        _require(self.activation_quant in ACTIVATION_QUANTS,
                 f"activation_quant must be one of {ACTIVATION_QUANTS}, got {self.activation_quant!r}")
        _require(self.activation_quant == "none" or self.weights != "dense",
                 f"activation_quant={self.activation_quant!r} quantizes the activations of quantized-weight "
                 "matmuls: it needs weights='native' (a Q4_0/Q4_1/Q8_0 GGUF run as stored), not dense weights")
        self._validate_tiers()

    def _validate_tiers(self) -> None:
        for name in ("host_cache", "disk_cache_size"):
            try:
                setattr(self, name, parse_size(getattr(self, name)))
            except ValueError as error:
                raise ValueError(f"{name}: {error}") from None
            _require(getattr(self, name) >= 0, f"{name} must be >= 0 bytes")
        if self.disk_cache is not None:
            _require(bool(str(self.disk_cache).strip()), "disk_cache must be a directory path")
            _require(self.disk_cache_size > 0, "disk_cache_size must be positive when disk_cache is set")
        if self.remote_cache is not None:
            _require(
                re.match(r"^(redis|rediss|unix)://", self.remote_cache) is not None,
                f"remote_cache must be a redis://host:port/db URL, got {self.remote_cache!r}",
            )
        if self.remote_cache_ttl is not None:
            _require(self.remote_cache_ttl > 0, f"remote_cache_ttl must be positive, got {self.remote_cache_ttl}")
        _require(self.kv_load_timeout > 0, f"kv_load_timeout must be positive, got {self.kv_load_timeout}")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
