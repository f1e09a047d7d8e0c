"""Tokenizer: a `tokenizers.Tokenizer` plus special-token ids, stop tokens and a Jinja chat template.

Built either from a Hugging Face directory (`tokenizer.json` + `tokenizer_config.json`) or from GGUF
metadata (the pipeline is built in gguf_tokenizer.py). Chat templates render in a Jinja sandbox.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer as Backend

from kvserve.model.gguf_tokenizer import SPECIAL_TOKEN_NAMES, build_gguf_tokenizer

if TYPE_CHECKING:
    import jinja2

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
        parts = build_gguf_tokenizer(metadata)
        return cls(
            parts.backend,
            chat_template=parts.chat_template,
            special_tokens=parts.special_tokens,
            extra_stop_token_ids=parts.end_of_turn_ids,
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

        `add_special_tokens` applies the post-processor (e.g. a BOS the model asks for). Goes through
        `encode_batch`, which releases the GIL (`encode` holds it throughout: a long text would stall
        every other thread, the server's event loop included).
        """
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

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
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        chat_template: str | None = None, **kwargs: Any,
    ) -> str:
        """Render `messages` with the model's Jinja chat template (or `chat_template`), like transformers
        (tokenize=False); `kwargs` (e.g. `tools`) are template variables."""
        source = chat_template or self.chat_template
        if not source:
            raise ValueError("this tokenizer has no chat template")
        context = {name: value for name, value in self.special_tokens.items() if value is not None}
        context.update(kwargs)
        template = _compile_template(source)
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **context)


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
    import jinja2

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
    """Compile in a sandbox: chat templates come from downloaded files and are untrusted code. Jinja is
    imported here, at the first chat template: it is ~0.1 s of an offline `LLM()`'s start that needs none."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)
