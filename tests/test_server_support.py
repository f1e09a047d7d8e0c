"""Helpers shared by the server tests (this module holds no tests).

`make_chat_model_dir` saves a tiny random Llama *with* a tokenizer: a byte-level BPE trained in a few
milliseconds on a handful of sentences, ChatML special tokens, and a ChatML chat template in
`tokenizer_config.json`. The model's vocabulary is the tokenizer's, so every sampled id decodes.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from kvserve.server.launcher import ServerProcess, launch_server

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
_CORPUS = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
    "Hello, how are you today? I am fine, thank you, and you?",
    "You are a helpful assistant. Answer the user's question briefly and politely.",
    "Paged attention stores keys and values in fixed-size blocks; the prefix cache reuses them.",
    "system user assistant tenant cache block token prompt completion stream",
]


def make_chat_tokenizer(vocab_size: int = 384):
    """A byte-level BPE with ChatML specials (every byte is a token, so any text encodes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer)
    return tokenizer


def make_chat_model_dir(
    path: Path, seed: int = 0, max_position_embeddings: int = 2048, hidden_size: int = 64,
    intermediate_size: int = 128, num_hidden_layers: int = 2,
) -> Path:
    """Save a random Llama (2 layers, hidden 64 unless told) + tokenizer + ChatML template as a Hugging
    Face directory.

    Weights are written with safetensors directly (HF names and shapes): importing transformers
    would cost seconds of every test session.
    """
    from safetensors.torch import save_file

    tokenizer = make_chat_tokenizer()
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "vocab_size": tokenizer.get_vocab_size(), "hidden_size": hidden_size, "intermediate_size": intermediate_size,
        "num_hidden_layers": num_hidden_layers, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": max_position_embeddings, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
    }
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(_random_llama_weights(config, torch.Generator().manual_seed(seed)), path / "model.safetensors")
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML_TEMPLATE,
    }))
    return path


def _random_llama_weights(
    config: dict, generator: torch.Generator, std: float = 0.3
) -> dict[str, torch.Tensor]:
    # A wide init (HF's default is 0.02) makes logits peaked, so greedy picks are never near-ties.
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    kv_dim = config["num_key_value_heads"] * head_dim

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * std

    weights = {
        "model.embed_tokens.weight": rand(config["vocab_size"], hidden),
        "model.norm.weight": torch.ones(hidden),
        "lm_head.weight": rand(config["vocab_size"], hidden),
    }
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        weights.update({
            prefix + "self_attn.q_proj.weight": rand(hidden, hidden),
            prefix + "self_attn.k_proj.weight": rand(kv_dim, hidden),
            prefix + "self_attn.v_proj.weight": rand(kv_dim, hidden),
            prefix + "self_attn.o_proj.weight": rand(hidden, hidden),
            prefix + "mlp.gate_proj.weight": rand(inter, hidden),
            prefix + "mlp.up_proj.weight": rand(inter, hidden),
            prefix + "mlp.down_proj.weight": rand(hidden, inter),
            prefix + "input_layernorm.weight": torch.ones(hidden),
            prefix + "post_attention_layernorm.weight": torch.ones(hidden),
        })
    return weights


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chat_model_dir(tmp_path_factory.mktemp("chat-model") / "tiny-chat")


def start_server(model_dir: Path, *extra: str, num_blocks: int = 512) -> ServerProcess:
    return launch_server(["--model", str(model_dir), "--num-blocks", str(num_blocks), *extra],
                         startup_timeout=120)


@pytest.fixture(scope="module")
def server(chat_model_dir: Path) -> Iterator[ServerProcess]:
    """A single-tenant server over the tiny chat model (shared by a module's tests)."""
    with start_server(chat_model_dir) as process:
        yield process


def metric_value(url: str, name: str, headers: dict | None = None, default: float | None = None) -> float:
    """One sample of /metrics, e.g. `kvserve_kv_cache_blocks{state="used"}` (`default` if absent).
    The `model_name` label every series carries is left out of `name`."""
    return metric_values(url, [name], headers, default)[name]


def metric_values(url: str, names: list[str], headers: dict | None = None,
                  default: float | None = None) -> dict[str, float]:
    """Samples from one /metrics page: one engine snapshot, so they agree with each other (three fetches
    could straddle a step that moves blocks between states)."""
    text = without_model_label(httpx.get(f"{url}/metrics", headers=headers, timeout=10).text)
    values = {}
    for name in names:
        match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.MULTILINE)
        if match is None and default is not None:
            values[name] = default
            continue
        assert match, f"{name} missing from /metrics"
        values[name] = float(match.group(1))
    return values


def without_model_label(text: str) -> str:
    """Prometheus text with the `model_name="..."` label removed from every sample."""
    text = re.sub(r'model_name="[^"]*",?', "", text)
    return text.replace(",}", "}").replace("{}", "")


def wait_until_drained(url: str, headers: dict | None = None, timeout: float = 15.0) -> dict[str, float]:
    """Poll /metrics until no block is referenced and nothing runs or waits; return the block counts."""
    deadline = time.monotonic() + timeout
    while True:
        states = {state: f'kvserve_kv_cache_blocks{{state="{state}"}}' for state in ("free", "cached", "used")}
        busy_names = ["kvserve_num_requests_running", "kvserve_num_requests_waiting"]
        values = metric_values(url, [*states.values(), *busy_names], headers)
        counts = {state: values[name] for state, name in states.items()}
        busy = sum(values[name] for name in busy_names)
        if counts["used"] == 0 and busy == 0:
            return counts
        assert time.monotonic() < deadline, f"pool not drained: {counts}, busy={busy}"
        time.sleep(0.05)
