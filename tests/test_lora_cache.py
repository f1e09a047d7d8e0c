"""LoRA and the prefix cache: the adapter's weight digest keys every block; bad adapters load nothing."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import assert_pool_drained
from kvserve import LLM, LoRARequest, SamplingParams
from kvserve.prefix.hashing import block_hashes
from kvserve.prefix.namespace import make_namespace
from lora_util import make_peft_adapter

BLOCK = 4
PROMPT = list(range(10, 31))  # 21 tokens: 5 full blocks of 4
PARAMS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("cache-adapters")
    a = make_peft_adapter(tiny_model_dir, root / "a", seed=1, rank=4)
    renamed = root / "a-copy"
    shutil.copytree(a, renamed)
    return {
        "a": a, "a-copy": renamed,
        "b": make_peft_adapter(tiny_model_dir, root / "b", seed=2, rank=4),
        "big": make_peft_adapter(tiny_model_dir, root / "big", seed=3, rank=32),
    }


@pytest.fixture()
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), progress=False, num_blocks=64, block_size=BLOCK, enable_lora=True,
               max_loras=2, max_lora_rank=8)


def _run(llm, name, adapter_dirs):
    lora = None if name is None else LoRARequest(name, 1, str(adapter_dirs[name]))
    return llm.generate([PROMPT], PARAMS, lora_request=lora)[0]


def test_adapters_never_share_blocks_and_the_same_adapter_does(llm, adapter_dirs):
    assert _run(llm, "a", adapter_dirs).num_cached_tokens == 0
    assert _run(llm, "b", adapter_dirs).num_cached_tokens == 0
    assert _run(llm, None, adapter_dirs).num_cached_tokens == 0
    assert _run(llm, "a", adapter_dirs).num_cached_tokens == 20  # all 5 full prompt blocks
    # Renamed, identical weights: the same digest, the same cached blocks.
    assert _run(llm, "a-copy", adapter_dirs).num_cached_tokens == 20
    assert _run(llm, None, adapter_dirs).num_cached_tokens == 20
    assert_pool_drained(llm.engine)


def test_adapter_digest_is_in_block_zero_and_composes_with_tenant(llm, adapter_dirs):
    engine = llm.engine
    a = engine.load_lora("a", str(adapter_dirs["a"]))
    b = engine.load_lora("b", str(adapter_dirs["b"]))
    copy = engine.load_lora("a-copy", str(adapter_dirs["a-copy"]))
    assert a.adapter_id == copy.adapter_id != b.adapter_id
    spaces = [make_namespace(tenant=t, adapter_id=x) for t in (None, "t1") for x in (None, a.adapter_id, b.adapter_id)]
    assert len(set(spaces)) == 6
    firsts = {block_hashes(PROMPT, BLOCK, space)[0] for space in spaces}
    assert len(firsts) == 6  # block 0's hash differs for every tenant x adapter pair
    request = engine.make_request(PROMPT, PARAMS, namespace=make_namespace(tenant="t1"), lora=a)
    assert request.namespace == ("t1", "", "lora/" + a.adapter_id)


def _assert_rejected(llm, path, *words):
    with pytest.raises(ValueError) as error:
        llm.engine.load_lora("bad", str(path))
    for word in words:
        assert word in str(error.value)
    assert llm.engine.lora.get("bad") is None and llm.engine.lora.num_swaps == 0


def test_bad_adapters_are_rejected_with_nothing_loaded(llm, adapter_dirs, tmp_path, tiny_model_dir):
    _assert_rejected(llm, adapter_dirs["big"], "rank 32", "max-lora-rank 8")
    corrupt = tmp_path / "corrupt"
    shutil.copytree(adapter_dirs["a"], corrupt)
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")
    _assert_rejected(llm, corrupt, "adapter_model.safetensors", "corrupt")
    missing = tmp_path / "missing"
    shutil.copytree(adapter_dirs["a"], missing)
    (missing / "adapter_config.json").unlink()
    _assert_rejected(llm, missing, "adapter_config.json", "missing")
    _assert_rejected(llm, tmp_path / "nowhere", "not a directory")
    # Another base model's shapes: an adapter for a wider model.
    from transformers import LlamaConfig, LlamaForCausalLM

    wide_dir = tmp_path / "wide-base"
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=96, intermediate_size=128, num_hidden_layers=3,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(wide_dir)
    wrong = make_peft_adapter(wide_dir, tmp_path / "wrong", seed=4, rank=4)
    _assert_rejected(llm, wrong, "shape", "the base model needs")
    bad_config = tmp_path / "bad-config"
    shutil.copytree(adapter_dirs["a"], bad_config)
    config = json.loads((bad_config / "adapter_config.json").read_text())
    (bad_config / "adapter_config.json").write_text(json.dumps({**config, "r": 0}))
    _assert_rejected(llm, bad_config, "r must be a positive integer")
    # After all that, the engine still serves the base model and a good adapter.
    assert _run(llm, "a", adapter_dirs).finish_reason == "length"
    assert_pool_drained(llm.engine)


def test_lora_needs_enable_lora(tiny_model_dir, adapter_dirs):
    plain = LLM(str(tiny_model_dir), progress=False, num_blocks=16, block_size=BLOCK)
    with pytest.raises(ValueError, match="enable_lora"):
        plain.generate([PROMPT], PARAMS, lora_request=LoRARequest("a", 1, str(adapter_dirs["a"])))
