"""vLLM's engine-argument names for `LLM(...)`, mapped onto `EngineConfig` where they mean the same.

A vLLM user's `LLM(model=..., enable_prefix_caching=True, max_num_seqs=8, seed=0)` then runs as
written. Names with no kvserve meaning that change nothing here are accepted only at their harmless
value (`tensor_parallel_size=1`); anything else unknown is refused by name (docs/reference.md has the
table).
"""

from __future__ import annotations

from typing import Any

from kvserve.config import EngineConfig

# vLLM name -> EngineConfig field, for names whose meaning is the same.
RENAMED = {
    "kv_cache_memory_bytes": "kv_cache_memory",
    "num_gpu_blocks_override": "num_blocks",
}
# vLLM dtype spellings -> kvserve's.
DTYPE_ALIASES = {"auto": "float32", "float": "float32", "half": "float16", "bf16": "bfloat16",
                 "fp16": "float16", "fp32": "float32"}
# Offline (`LLM`), the row cap is off unless asked for: a batch given at once wants throughput, and no
# newcomer's time to first token waits on its steps (vLLM's defaults differ by usage context likewise).
OFFLINE_MAX_STEP_ROWS = 0
# Likewise the admission cap (`Scheduler._schedule_waiting`): prompts given together are admitted while the
# step's budget lasts; who of them answers first does not matter when the batch's end is what is awaited.
OFFLINE_MAX_ADMITTED_PREFILL_TOKENS = 0
# And busy chunking (`engine/busy_chunk.py`): it splits a long prompt so a newcomer waits less, and offline
# no newcomer arrives while a batch runs.
OFFLINE_LONG_PREFILL_BUSY_TOKENS = 0
# vLLM names accepted at these values only (they select what kvserve always does).
FIXED = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "trust_remote_code": (True, False),
         "enforce_eager": (True, False), "disable_log_stats": (True, False)}


def engine_config(model: str, args: dict[str, Any]) -> EngineConfig:
    """`EngineConfig` from kvserve's field names and vLLM's engine-argument names together."""
    known = set(EngineConfig.field_names())
    fields: dict[str, Any] = {}
    for name, value in args.items():
        if name in known:
            fields[name] = value
        elif name in RENAMED:
            fields[RENAMED[name]] = value
        elif name == "enable_prefix_caching":
            fields["prefix_cache"] = "radix" if value else "off"
        elif name in FIXED:
            allowed = FIXED[name]
            if value != allowed and not (isinstance(allowed, tuple) and value in allowed):
                raise ValueError(f"{name}={value!r} is not supported (kvserve runs one CPU/GPU process)")
        else:
            raise TypeError(f"LLM() got an unknown engine argument {name!r}")
    if "dtype" in fields:
        fields["dtype"] = DTYPE_ALIASES.get(fields["dtype"], fields["dtype"])
    fields.setdefault("max_step_rows", OFFLINE_MAX_STEP_ROWS)
    fields.setdefault("max_admitted_prefill_tokens", OFFLINE_MAX_ADMITTED_PREFILL_TOKENS)
    fields.setdefault("long_prefill_busy_tokens", OFFLINE_LONG_PREFILL_BUSY_TOKENS)
    return EngineConfig(model=model, **fields)
