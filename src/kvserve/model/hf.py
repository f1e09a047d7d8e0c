"""Load a Hugging Face Llama/Mistral checkpoint directory: config.json, *.safetensors, tokenizer files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from tqdm import tqdm

from kvserve.model.config import ModelConfig, check_weights
from kvserve.model.tokenizer import Tokenizer

SUPPORTED_MODEL_TYPES = ("llama", "mistral")
# Buffers some old checkpoints saved; recomputed by the model, so safe to drop.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def is_hf_dir(path: Path) -> bool:
    """Whether `path` looks like a HF checkpoint directory (has a config.json)."""
    return path.is_dir() and (path / "config.json").is_file()


def read_json(path: Path) -> dict[str, Any]:
    """Parse a JSON file, raising ValueError naming it when it is malformed."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read {path}: {err}") from err


def config_from_hf(
    config: dict[str, Any], generation: dict[str, Any] | None = None, source: object = ""
) -> ModelConfig:
    """ModelConfig from a LlamaForCausalLM/MistralForCausalLM `config.json` (and `generation_config.json`)."""
    model_type = config.get("model_type", "llama")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{source}: unsupported model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}"
        )
    _reject_unsupported_features(config, source)
    heads = int(config["num_attention_heads"])
    # transformers 5 moved rope_theta (and scaling) into `rope_parameters`; older files use rope_scaling.
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    eos_ids = _as_ids(config.get("eos_token_id")) + _as_ids((generation or {}).get("eos_token_id"))
    try:
        return ModelConfig(
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
            rope_theta=float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            bos_token_id=(_as_ids(config.get("bos_token_id")) or [None])[0],
            eos_token_id=(eos_ids or [None])[0],
            architecture=model_type,
            rope_scaling=rope or None,
            eos_token_ids=tuple(dict.fromkeys(eos_ids)),
        )
    except KeyError as err:
        raise ValueError(f"{source}: config.json lacks required key {err}") from err


def _reject_unsupported_features(config: dict[str, Any], source: object) -> None:
    """Fail on options our Llama implementation does not have instead of silently ignoring them."""
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: hidden_act {config['hidden_act']!r} unsupported (only silu)")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ValueError(f"{source}: attention/MLP biases are not supported")
    window = config.get("sliding_window")
    if window is not None and window < config.get("max_position_embeddings", 0):
        raise ValueError(f"{source}: sliding-window attention ({window}) is not supported")


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def load_safetensors(directory: Path, progress: bool = True) -> dict[str, torch.Tensor]:
    """All tensors of every (possibly sharded) `*.safetensors` file, as float32, names unchanged."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{directory}: no *.safetensors weights found")
    weights: dict[str, torch.Tensor] = {}
    for file in tqdm(files, desc=f"Loading {directory.name}", unit="shard", disable=not progress):
        try:
            shard = load_file(file)
        except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
            raise ValueError(f"{file} is not a valid safetensors file: {err}") from err
        for name, tensor in shard.items():
            if not name.endswith(_IGNORED_SUFFIXES):
                weights[name] = tensor.to(torch.float32)
    return weights


def load_hf_dir(
    directory: str | Path, progress: bool = True
) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer | None]:
    """Load config, float32 weights (HF names) and tokenizer (None without tokenizer.json)."""
    directory = Path(directory)
    if not is_hf_dir(directory):
        raise ValueError(f"{directory} is not a Hugging Face model directory (no config.json)")
    generation_file = directory / "generation_config.json"
    generation = read_json(generation_file) if generation_file.is_file() else None
    config = config_from_hf(read_json(directory / "config.json"), generation, source=directory)
    weights = load_safetensors(directory, progress=progress)
    check_weights(config, weights, directory)
    tokenizer = Tokenizer.from_pretrained_dir(directory, extra_stop_token_ids=config.eos_token_ids)
    return config, weights, tokenizer
