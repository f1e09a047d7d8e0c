"""Tokenizer: a `tokenizers.Tokenizer` plus special-token ids and a Jinja chat template.

Built either from a Hugging Face directory (`tokenizer.json` + `tokenizer_config.json`) or from GGUF
metadata. The GGUF build mirrors transformers' GGUF converter (GGUF_TOKENIZER_TYPES "gpt2" builder,
`add_gguf_special_tokens`, `set_split_regex`) so that token ids are identical to
`AutoTokenizer.from_pretrained(dir, gguf_file=...)`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

# Special tokens that end a turn/sequence in common chat models; added to stop ids when present.
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<|endoftext|>",
    "<end_of_turn>",
    "<|end|>",
    "</s>",
)
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


class Tokenizer:
    """Text <-> token ids, special tokens, stop tokens and chat-template rendering."""

    def __init__(
        self,
        backend: Backend,
        *,
        chat_template: str | None = None,
        special_tokens: Mapping[str, str | None] | None = None,
        extra_stop_token_ids: Iterable[int] = (),
    ) -> None:
        """`special_tokens` maps bos_token/eos_token/unk_token/pad_token to their text (or None)."""
        self.backend = backend
        self.chat_template = chat_template
        self.special_tokens = {name: (special_tokens or {}).get(name) for name in SPECIAL_TOKEN_NAMES}
        self._stop_token_ids = self._collect_stop_ids(extra_stop_token_ids)

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Build from llama.cpp `tokenizer.*` GGUF metadata (byte-level BPE: `tokenizer.ggml.model` gpt2)."""
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
        # Newer llama.cpp files name end-of-turn tokens explicitly; they stop generation like EOS.
        end_of_turn = [int(metadata[key]) for key in _GGUF_END_OF_TURN_KEYS if metadata.get(key) is not None]
        return cls(
            backend,
            chat_template=metadata.get("tokenizer.chat_template"),
            special_tokens=special,
            extra_stop_token_ids=end_of_turn,
        )

    @classmethod
    def from_pretrained_dir(
        cls, directory: str | Path, extra_stop_token_ids: Iterable[int] = ()
    ) -> Tokenizer | None:
        """Load `tokenizer.json` (+ `tokenizer_config.json`, `chat_template.jinja`) from a HF directory.

        Returns None when the directory has no `tokenizer.json`.
        """
        directory = Path(directory)
        if not (directory / "tokenizer.json").is_file():
            return None
        backend = Backend.from_file(str(directory / "tokenizer.json"))
        config = _read_json(directory / "tokenizer_config.json")
        special = {name: _token_content(config.get(name)) for name in SPECIAL_TOKEN_NAMES}
        template_file = directory / "chat_template.jinja"
        template = template_file.read_text() if template_file.is_file() else _default_template(config)
        return cls(
            backend, chat_template=template, special_tokens=special, extra_stop_token_ids=extra_stop_token_ids
        )

    # ---- encoding ------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written inside the text (e.g. `<|im_start|>`) stay whole.

        `add_special_tokens` applies the post-processor (e.g. a BOS the model asks for).
        """
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`, dropping special tokens unless `skip_special_tokens` is False."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of one id (byte-level spelled for BPE vocabularies), None if unknown."""
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        """The id of one vocabulary string, None if absent."""
        return self.backend.token_to_id(token)

    # ---- properties ---------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of ids, including added tokens."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """Ids that end generation: EOS, declared extra EOS ids and known end-of-turn special tokens."""
        return self._stop_token_ids

    def _special_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self.backend.token_to_id(token)

    def _collect_stop_ids(self, extra: Iterable[int]) -> frozenset[int]:
        ids = set(extra)
        if self.eos_token_id is not None:
            ids.add(self.eos_token_id)
        # Only special (added) tokens count: a plain vocabulary entry spelled "</s>" is ordinary text.
        special = {
            tok.content: index
            for index, tok in self.backend.get_added_tokens_decoder().items()
            if tok.special
        }
        ids.update(special[token] for token in END_OF_TURN_TOKENS if token in special)
        return frozenset(ids)

    # ---- chat ----------------------------------------------------------------------------------
    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render `messages` with the model's Jinja chat template, like transformers (tokenize=False)."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        context = {name: value for name, value in self.special_tokens.items() if value is not None}
        context.update(kwargs)
        template = _compile_template(self.chat_template)
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **context)


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


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


def _default_template(config: Mapping[str, Any]) -> str | None:
    """`chat_template` may be a string or a list of named templates; we want the default one."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template}
        return named.get("default") or next(iter(named.values()), None)
    return template


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's built-in tojson HTML-escapes; chat templates (and transformers) expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    """Compile in a sandbox: chat templates come from downloaded files and are untrusted code."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)
