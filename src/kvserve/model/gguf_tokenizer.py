"""The `tokenizers` pipeline for a GGUF file's byte-level BPE vocabulary (llama.cpp `tokenizer.*` metadata).

It mirrors transformers' GGUF converter (GGUF_TOKENIZER_TYPES "gpt2" builder, `add_gguf_special_tokens`,
`set_split_regex`) so that token ids are identical to `AutoTokenizer.from_pretrained(dir, gguf_file=...)`.
The `Tokenizer` wrapper (tokenizer.py) takes the parts built here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
_GGUF_SPECIAL_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}
_GGUF_END_OF_TURN_KEYS = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Pre-tokenizer split regexes keyed by `tokenizer.ggml.pre`, copied from transformers'
# GGUF_PRE_TOKENIZER_SPLITS. Names not listed (SmolLM2 says "smollm") fall back to GPT-2's ByteLevel
# regex, as transformers does -- so unlike SmolLM2's original tokenizer.json there is no separate
# Digits(individual) step; SmolLM2's vocab has no multi-digit tokens, so this only shows at space/digit
# boundaries (e.g. "  1"), and we follow transformers, our test oracle.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GGUF_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0".split(), _LLAMA3_SPLIT),
    **dict.fromkeys("lfm2 jina-v5-nano dbrx smaug-bpe".split(), _LLAMA3_SPLIT),
    **dict.fromkeys("qwen2 deepseek-r1-qwen kormo f2llmv2 megrez".split(), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys("gpt-4o llama4 kanana2 talkie minimax-m2".split(), _GPT4O_SPLIT),
}


@dataclass(slots=True)
class GGUFTokenizerParts:
    backend: Backend
    special_tokens: dict[str, str | None]  # bos_token/eos_token/unk_token/pad_token -> text
    chat_template: str | None
    end_of_turn_ids: list[int]  # newer llama.cpp files name end-of-turn tokens; they stop like EOS


def build_gguf_tokenizer(metadata: Mapping[str, Any]) -> GGUFTokenizerParts:
    """Backend (with special tokens and post-processor), special tokens and template of a GGUF file."""
    tokens: list[str] = list(metadata.get("tokenizer.ggml.tokens") or [])
    backend = build_gguf_backend(metadata)
    special = {name: _token_at(tokens, metadata.get(key)) for name, key in _GGUF_SPECIAL_KEYS.items()}
    _add_named_specials(backend, special.values())
    backend.post_processor = _template_processor(
        backend,
        special,
        bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
    )
    end_of_turn = [int(metadata[key]) for key in _GGUF_END_OF_TURN_KEYS if metadata.get(key) is not None]
    return GGUFTokenizerParts(backend, special, metadata.get("tokenizer.chat_template"), end_of_turn)


def build_gguf_backend(metadata: Mapping[str, Any]) -> Backend:
    """The `tokenizers` pipeline transformers builds for a GGUF byte-level BPE vocabulary."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"unsupported tokenizer model {kind!r}: only byte-level BPE ('gpt2') GGUF tokenizers"
        )
    tokens = list(metadata.get("tokenizer.ggml.tokens") or [])
    merges = metadata.get("tokenizer.ggml.merges")
    if not tokens or not merges:
        raise ValueError("GGUF tokenizer metadata lacks tokenizer.ggml.tokens or tokenizer.ggml.merges")
    backend = Backend(
        models.BPE(
            vocab=_byte_level_vocab(tokens),
            merges=[tuple(merge.split(" ")) for merge in merges],
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    backend.pre_tokenizer = _gguf_pre_tokenizer(metadata.get("tokenizer.ggml.pre"))
    backend.decoder = decoders.ByteLevel()
    _add_gguf_typed_tokens(backend, tokens, list(metadata.get("tokenizer.ggml.token_type") or []))
    return backend


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars, strict=True)}


def _byte_level_vocab(tokens: list[str]) -> dict[str, int]:
    """Token -> id, re-spelling (as transformers does) tokens the file wrote as raw text, not byte-level."""
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    return {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
        for index, token in enumerate(tokens)
    }


def _gguf_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    split = GGUF_PRE_TOKENIZER_SPLITS.get(pre or "")
    if split is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _add_gguf_typed_tokens(backend: Backend, tokens: list[str], token_types: list[int]) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens, so both match whole.

    A control token spelled outside the byte alphabet is a llama.cpp mislabel; adding it would grow the
    vocabulary past the model's, so (like transformers) it is skipped.
    """
    alphabet = set(_bytes_to_unicode().values())
    control = [
        AddedToken(token, normalized=False, special=True)
        for token, kind in zip(tokens, token_types, strict=False)
        if kind == _TOKEN_TYPE_CONTROL and set(token) <= alphabet
    ]
    if control:
        backend.add_special_tokens(control)
    vocab = backend.get_vocab()
    user_defined = [
        AddedToken(token, normalized=False, special=False)
        for token, kind in zip(tokens, token_types, strict=False)
        if kind == _TOKEN_TYPE_USER_DEFINED and token in vocab
    ]
    if user_defined:
        backend.add_tokens(user_defined)


def _token_at(tokens: list[str], index: Any) -> str | None:
    return tokens[int(index)] if index is not None and 0 <= int(index) < len(tokens) else None


def _add_named_specials(backend: Backend, tokens: Iterable[str | None]) -> None:
    """Make bos/eos/unk/pad special added tokens, as transformers does for named special tokens.

    Unlike transformers we skip a token missing from the vocabulary instead of appending a new id
    the model has no embedding for.
    """
    added = {tok.content for tok in backend.get_added_tokens_decoder().values()}
    vocab = backend.get_vocab()
    new = [
        AddedToken(token, normalized=False, special=True)
        for token in dict.fromkeys(tokens)
        if token and token not in added and token in vocab
    ]
    if new:
        backend.add_special_tokens(new)


def _template_processor(
    backend: Backend, special: Mapping[str, str | None], add_bos: bool, add_eos: bool
) -> processors.TemplateProcessing:
    """What `encode(..., add_special_tokens=True)` adds: BOS/EOS only if the GGUF asks for them."""
    bos, eos = special.get("bos_token"), special.get("eos_token")
    add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
    pairs = [(tok, backend.token_to_id(tok)) for tok, wanted in ((bos, add_bos), (eos, add_eos)) if wanted]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=pairs)
