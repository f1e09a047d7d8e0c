"""Shared fixtures: a tiny random Llama saved as a Hugging Face directory, and an HF greedy oracle."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

TINY_VOCAB = 512

# Every engine in the suite (server subprocesses too, which inherit the environment) checks the
# allocator, the prefix cache and every block table after each step.
os.environ.setdefault("KVSERVE_DEBUG_CHECKS", "1")


def make_tiny_llama_dir(path: Path, tie_word_embeddings: bool = False, seed: int = 0) -> Path:
    """Save a small random LlamaForCausalLM (HF format, safetensors, fp32) under `path`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=tie_word_embeddings,
        # Wider weights than HF's default 0.02 make logits peaked, so greedy picks are never near-ties.
        initializer_range=0.3, bos_token_id=1, eos_token_id=2,
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    return path


def _native_isas() -> list[str]:
    """Every ISA this CPU runs natively, best first: the forced AVX2 path too where AVX-512 exists."""
    from kvserve.kernels.ops import Kernels

    isa = Kernels.create("native").isa
    return ["avx512", "avx2"] if isa == "avx512" else ["avx2"] if isa == "avx2" else []


ISAS = _native_isas()
# One param per ISA, or one skipped param (no compiler / no AVX2): shared by the kernel test modules.
ISA_PARAMS = ISAS or [pytest.param("none", marks=pytest.mark.skip(reason="native kernels unavailable"))]


def avx512_with(feature: str) -> bool:
    """Whether the AVX-512 kernels run here on a CPU with `feature` (e.g. "amx_int8"): the AMX test modules'
    skip condition."""
    from kvserve.kernels.ops import Kernels

    kernels = Kernels.create("native")
    return kernels.native is not None and feature in kernels.native.features and "avx512" in ISAS


def on_then_off(switch, call, restore=None):
    """(`call()` with `switch(True)`, then with `switch(False)`), then `restore()` (default: `switch(True)`):
    the AMX tests compare each tile kernel with the one it replaces in one process."""
    assert switch(True)
    try:
        tiles = call()
        switch(False)
        return tiles, call()
    finally:
        (restore or (lambda: switch(True)))()


@pytest.fixture(scope="module", params=ISA_PARAMS)
def kernels(request):
    """Native kernels forced to each ISA in turn (see ISA_PARAMS)."""
    from kvserve.kernels.ops import Kernels

    forced = Kernels.create("native", isa=request.param)
    assert forced.isa == request.param
    return forced


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2_hf():
    """transformers' own fp32 load of the default model's GGUF: the oracle of every real-model test. It takes
    ~35 s on 2 cores (the gguf reader, then dequantizing), so it is loaded once per session and shared; a test
    that changes the model (peft wraps it in place) works on a `copy.deepcopy`."""
    from transformers import AutoModelForCausalLM

    from kvserve.model.registry import resolve_model

    try:
        path = resolve_model("smollm2-135m")
    except ValueError as err:
        pytest.skip(str(err))
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, cache=None) -> list[int]:
    """Greedy continuation by a plain forward loop (EOS ignored, explicit all-ones attention mask); `cache`: a
    fresh transformers cache to run it through (None: the model's default)."""
    input_ids = torch.tensor([prompt_ids])
    past = cache
    generated: list[int] = []
    for _ in range(max_new_tokens):
        mask = torch.ones(1, len(prompt_ids) + len(generated), dtype=torch.long)
        out = model(input_ids=input_ids, attention_mask=mask, past_key_values=past, use_cache=True)
        past = out.past_key_values
        next_id = int(out.logits[0, -1].argmax())
        generated.append(next_id)
        input_ids = torch.tensor([[next_id]])
    return generated


def random_prompts(count: int, min_len: int, max_len: int, seed: int = 0, vocab: int = TINY_VOCAB) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (count,), generator=generator).tolist()
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


def assert_pool_drained(engine) -> None:
    """After all requests finish: nothing referenced, and free + cached = total."""
    stats = engine.stats()
    assert stats["used_blocks"] == 0, stats
    assert stats["free_blocks"] + stats["cached_blocks"] == stats["num_blocks"], stats
    assert not engine.has_unfinished_requests()


@pytest.fixture(scope="session")
def vllm_chat_server(tmp_path_factory: pytest.TempPathFactory):
    """(server, model_dir): one server over a tiny chat model shared by the vLLM-compatibility tests
    (structured output, the request-field walk), so the suite starts it once."""
    from test_server_support import make_chat_model_dir, start_server

    model_dir = make_chat_model_dir(tmp_path_factory.mktemp("vllm-chat") / "tiny-chat")
    with start_server(model_dir, num_blocks=256) as process:
        yield process, model_dir


@pytest.fixture(scope="session")
def redis_server():
    """A real Redis server on a free loopback port for the whole session (tiers tests)."""
    from kvserve.tiers.local_redis import LocalRedis

    with LocalRedis() as server:
        yield server


@pytest.fixture
def redis_url(redis_server) -> str:
    """The session server's URL, emptied before each test."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url
