"""Model loading: configs, GGUF / Hugging Face weight readers, tokenizer, and the model registry."""

from kvserve.model.config import ModelConfig, rope_inv_freq
from kvserve.model.registry import KNOWN_MODELS, LoadedModel, load_model, resolve_model
from kvserve.model.tokenizer import Tokenizer

__all__ = [
    "KNOWN_MODELS",
    "LoadedModel",
    "ModelConfig",
    "Tokenizer",
    "load_model",
    "resolve_model",
    "rope_inv_freq",
]
