"""PEFT adapters made in the tests (fixed seed, non-zero B), and the transformers + peft greedy oracle."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_peft_adapter(
    base_dir: Path, out_dir: Path, seed: int, rank: int = 8, alpha: float = 16,
    targets: tuple[str, ...] = ALL_TARGETS, use_rslora: bool = False, scale_b: float = 1.0, **load_kwargs,
) -> Path:
    """Save a PEFT LoRA adapter for the model at `base_dir` (random A and B, `init_lora_weights=False`)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32, **load_kwargs)
    torch.manual_seed(seed)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
        init_lora_weights=False, use_rslora=use_rslora,
    )
    model = get_peft_model(base, config)
    if scale_b != 1.0:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.mul_(scale_b)
    model.save_pretrained(out_dir)
    return out_dir


def load_peft_model(base_dir: Path, adapter_dir: Path, **load_kwargs):
    """transformers base + the saved adapter, fp32, eval mode: the oracle."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32, **load_kwargs)
    return PeftModel.from_pretrained(base, adapter_dir).eval()
