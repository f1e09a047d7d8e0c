"""Our tokenizer vs transformers' tokenizer from the same GGUF (the oracle): ids, pipeline, templates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.model.gguf import open_gguf, read_metadata
from kvserve.model.registry import resolve_model
from kvserve.model.tokenizer import Tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It wasn't me, I'd say; we'll see!",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "class A:\n\tdef f(self):\n\t\tpass  # tabs\r\n",
    "日本語のテキストです。中文文本，한국어 텍스트",
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flag 🏳️‍🌈 keycap 1️⃣",
    "   leading spaces,\t\ttabs,\n\n\nnewlines   and trailing   ",
    "  1  22   333\t4444\n55555",
    "pi is 3.14159, a million is 1,000,000 and today is 2024-01-31; 0x1F 1e-9",
    "café naïve résumé Ñandú façade Ærøskøbing, e\u0301 (combining accent)",
    "<|im_start|>user\nhi<|im_end|>",
    "text<|im_end|>more<|endoftext|><|im_start|",
    "",
    " ",
    "\n",
]
TEXTS_WITHOUT_SPECIALS = [text for text in CORPUS if "<|" not in text]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}, {"role": "assistant", "content": "Hello! How can I help?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Thanks 😀"},
    ],
]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    try:
        return resolve_model("smollm2-135m")
    except ValueError as err:
        pytest.skip(str(err))


@pytest.fixture(scope="module")
def ours(gguf_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(read_metadata(open_gguf(gguf_path)))


@pytest.fixture(scope="module")
def oracle(gguf_path: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


@pytest.mark.model
def test_pipeline_identical_to_transformers(ours: Tokenizer, oracle) -> None:
    # Same model/merges/added tokens/pre-tokenizer/decoder/post-processor, field by field.
    assert json.loads(ours.backend.to_str()) == json.loads(oracle.backend_tokenizer.to_str())


@pytest.mark.model
@pytest.mark.parametrize("text", CORPUS)
def test_ids_match_transformers(ours: Tokenizer, oracle, text: str) -> None:
    assert ours.encode(text) == oracle.encode(text, add_special_tokens=False)
    assert ours.encode(text, add_special_tokens=True) == oracle.encode(text, add_special_tokens=True)


@pytest.mark.model
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=st.characters(codec="utf-8"), max_size=60))
def test_random_text_matches_transformers(ours: Tokenizer, oracle, text: str) -> None:
    assert ours.encode(text) == oracle.encode(text, add_special_tokens=False)


@pytest.mark.model
@pytest.mark.parametrize("text", TEXTS_WITHOUT_SPECIALS)
def test_decode_inverts_encode(ours: Tokenizer, text: str) -> None:
    assert ours.decode(ours.encode(text)) == text


@pytest.mark.model
def test_special_tokens_inside_text_are_single_ids(ours: Tokenizer) -> None:
    ids = ours.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == ours.token_to_id("<|im_start|>") == 1
    assert ids[-1] == ours.token_to_id("<|im_end|>") == 2
    assert ours.decode(ids) == "user\nhi"
    assert ours.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


@pytest.mark.model
def test_special_ids_and_stop_tokens(ours: Tokenizer, oracle) -> None:
    assert (ours.bos_token_id, ours.eos_token_id) == (oracle.bos_token_id, oracle.eos_token_id) == (1, 2)
    assert ours.id_to_token(2) == "<|im_end|>"
    assert ours.eos_token_id in ours.stop_token_ids
    assert ours.token_to_id("<|endoftext|>") in ours.stop_token_ids
    assert ours.vocab_size == len(oracle) == 49152


@pytest.mark.model
@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    ours: Tokenizer, oracle, messages: list[dict], add_generation_prompt: bool
) -> None:
    prompt = add_generation_prompt
    expected = oracle.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
    assert ours.apply_chat_template(messages, add_generation_prompt=prompt) == expected


@pytest.mark.model
def test_hf_directory_tokenizer_matches(ours: Tokenizer, oracle, tmp_path: Path) -> None:
    oracle.save_pretrained(tmp_path)
    loaded = Tokenizer.from_pretrained_dir(tmp_path)
    assert loaded is not None
    for text in CORPUS:
        assert loaded.encode(text) == ours.encode(text)
    assert loaded.apply_chat_template(CONVERSATIONS[0]) == ours.apply_chat_template(CONVERSATIONS[0])
    assert (loaded.eos_token_id, loaded.stop_token_ids) == (ours.eos_token_id, ours.stop_token_ids)


def test_directory_without_tokenizer_json_gives_none(tmp_path: Path) -> None:
    assert Tokenizer.from_pretrained_dir(tmp_path) is None


@pytest.mark.parametrize("kind", ["llama", "t5", None])
def test_unsupported_gguf_tokenizer_model_raises(kind: str | None) -> None:
    with pytest.raises(ValueError, match="unsupported tokenizer model"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": kind, "tokenizer.ggml.tokens": ["a"]})


def test_chat_template_sandbox_and_raise_exception() -> None:
    tokenizer = _tiny_tokenizer("{{ raise_exception('no system role') }}")
    with pytest.raises(Exception, match="no system role"):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}])
    unsafe = _tiny_tokenizer("{{ messages.__class__.__mro__ }}")
    with pytest.raises(Exception, match="unsafe|access"):
        unsafe.apply_chat_template([])
    with pytest.raises(ValueError, match="no chat template"):
        _tiny_tokenizer(None).apply_chat_template([])


def test_chat_template_trims_blocks_and_uses_plain_tojson() -> None:
    # lstrip_blocks eats the indentation before block tags, trim_blocks the newline after them.
    template = "  {% for m in messages %}\n{{ m['content'] | tojson }}\n  {% endfor %}\n"
    rendered = _tiny_tokenizer(template).apply_chat_template([{"role": "user", "content": "<é>"}])
    assert rendered == '"<é>"\n'


def _tiny_tokenizer(template: str | None) -> Tokenizer:
    """A byte-level BPE GGUF tokenizer over a 4-token vocabulary, just to exercise templates."""
    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": ["<eos>", "a", "b", "ab"],
        "tokenizer.ggml.token_type": [3, 1, 1, 1],
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.eos_token_id": 0,
        "tokenizer.chat_template": template,
    }
    return Tokenizer.from_gguf_metadata(metadata)


def test_tiny_gguf_tokenizer_merges_and_specials() -> None:
    tokenizer = _tiny_tokenizer(None)
    assert tokenizer.encode("ab<eos>ba") == [3, 0, 2, 1]
    assert tokenizer.stop_token_ids == frozenset({0})
    assert tokenizer.decode([3, 0, 2, 1]) == "abba"
