"""A PEFT LoRA adapter (`adapter_config.json` + `adapter_model.safetensors`), validated against the base model.

Loading either yields a complete `LoRAAdapter` or raises ValueError naming the problem; nothing is
half-registered. Each target module keeps `A` as ``[in, r]`` and `B` as ``[r, out]`` with the scaling
(`lora_alpha / r`, or `lora_alpha / sqrt(r)` under `use_rslora`) folded into `B`, so the update is
`x @ A @ B`, the `[in, out]` layout of llama.py's transposed weights.

`adapter_id` is a SHA-256 digest of the scaling and every tensor's name, shape and bytes: the key the
prefix cache sees. A renamed identical adapter gets the same id (and hits the same cached blocks); a
changed one never does.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvserve.model.config import ModelConfig

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_ID_LENGTH = 32  # hex characters of the digest kept as the id
_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\."
    r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.lora_([AB])\.weight$"
)


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """vLLM's adapter reference: a name, a positive integer id, and the PEFT directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")


@dataclass(slots=True)
class LoRAAdapter:
    """One loaded adapter in host memory: per (layer, module) the pair (A [in, r], B*scaling [r, out])."""

    name: str
    path: str
    rank: int
    scaling: float
    adapter_id: str
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each target module of the base model."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {
        "q_proj": (hidden, q_size), "k_proj": (hidden, kv_size), "v_proj": (hidden, kv_size),
        "o_proj": (q_size, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def load_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Read and validate a PEFT adapter directory; ValueError naming the problem."""
    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(f"LoRA adapter {name!r}: {str(directory)!r} is not a directory")
    rank, alpha, rslora = _read_config(name, directory / "adapter_config.json")
    if rank > max_rank:
        raise ValueError(f"LoRA adapter {name!r} has rank {rank}, over --max-lora-rank {max_rank}")
    scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
    tensors = _read_tensors(name, directory / "adapter_model.safetensors")
    pairs = _pair_tensors(name, tensors, config, rank)
    weights = {key: (a.t().contiguous(), (b.t() * scaling).contiguous()) for key, (a, b) in pairs.items()}
    return LoRAAdapter(name, str(directory), rank, scaling, _digest(scaling, pairs), weights)


def _read_config(name: str, path: Path) -> tuple[int, float, bool]:
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"LoRA adapter {name!r}: {path.name} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"LoRA adapter {name!r}: {path.name} is not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {name!r}: {path.name} must hold a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {name!r}: peft_type {config.get('peft_type')!r} is not LORA")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"LoRA adapter {name!r}: r must be a positive integer, got {rank!r}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise ValueError(f"LoRA adapter {name!r}: lora_alpha must be a number, got {alpha!r}")
    for unsupported in ("rank_pattern", "alpha_pattern"):
        if config.get(unsupported):
            raise ValueError(f"LoRA adapter {name!r}: {unsupported} is not supported")
    if config.get("use_dora"):
        raise ValueError(f"LoRA adapter {name!r}: DoRA (use_dora) is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {name!r}: bias={config.get('bias')!r} is not supported (only 'none')")
    return rank, float(alpha), bool(config.get("use_rslora", False))


def _read_tensors(name: str, path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_file():
        raise ValueError(f"LoRA adapter {name!r}: {path.name} is missing")
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        raise ValueError(f"LoRA adapter {name!r}: {path.name} is corrupt ({error})") from None


def _pair_tensors(
    name: str, tensors: dict[str, torch.Tensor], config: ModelConfig, rank: int
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, module) -> (A [r, in], B [out, r]) in float32, every shape checked against the base model."""
    shapes = module_shapes(config)
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            targets = ", ".join(TARGET_MODULES)
            raise ValueError(f"LoRA adapter {name!r}: unsupported tensor {key!r} (targets: {targets})")
        layer, module, which = int(match[1]), match[2], match[3]
        if layer >= config.num_layers:
            raise ValueError(
                f"LoRA adapter {name!r}: {key} names layer {layer}; the base model has {config.num_layers}"
            )
        in_features, out_features = shapes[module]
        want = (rank, in_features) if which == "A" else (out_features, rank)
        if tuple(tensor.shape) != want:
            raise ValueError(
                f"LoRA adapter {name!r}: {key} has shape {tuple(tensor.shape)}, the base model needs {want}"
            )
        if not tensor.is_floating_point() or not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"LoRA adapter {name!r}: {key} must hold finite floating-point values")
        found.setdefault((layer, module), {})[which] = tensor.float()
    if not found:
        raise ValueError(f"LoRA adapter {name!r}: no LoRA weights found")
    for (layer, module), pair in found.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: layer {layer} {module} lacks lora_A or lora_B")
    return {key: (pair["A"], pair["B"]) for key, pair in sorted(found.items())}


def _digest(scaling: float, pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]) -> str:
    digest = hashlib.sha256(b"kvserve-lora-v1")
    digest.update(repr(float(scaling)).encode())
    for (layer, module), (a, b) in pairs.items():
        for which, tensor in (("A", a), ("B", b)):
            digest.update(f"|{layer}.{module}.{which}{tuple(tensor.shape)}|".encode())
            digest.update(tensor.contiguous().numpy().tobytes())
    return digest.hexdigest()[:ADAPTER_ID_LENGTH]
