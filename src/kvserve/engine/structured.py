"""Structured output: a grammar per request, enforced by masking the tokens it forbids at every step.

Grammars are compiled by xgrammar (JSON schema, any JSON object, regex, a choice of strings, EBNF)
against the model's tokenizer; compiled grammars are cached by their source, so twenty requests with
one schema compile it once. Each request keeps its own `GrammarMatcher`: before sampling it fills a
bitmask of the tokens that keep the output inside the grammar (EOS only where the grammar may end), and
after sampling it advances by the chosen token. JSON is generated compact (no free whitespace), so a
small model cannot spend its budget on blank lines.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from kvserve.engine.params import StructuredOutputsParams
from kvserve.model.tokenizer import Tokenizer


def _xgrammar():
    try:
        import xgrammar
    except ImportError as error:  # pragma: no cover - a dependency; the message says how to fix it
        raise ValueError("structured output needs xgrammar: pip install xgrammar") from error
    return xgrammar


@dataclass(slots=True)
class GrammarCompiler:
    """Compiles `StructuredOutputsParams` for one tokenizer and vocabulary (lazily: no cost unused)."""

    tokenizer: Tokenizer
    vocab_size: int
    stop_token_ids: list[int]
    _compiler: Any = None
    _cache: dict[str, Any] = field(default_factory=dict)

    def matcher(self, params: StructuredOutputsParams) -> GrammarState:
        """A fresh matcher for one request; raises ValueError when the grammar does not compile."""
        xgr = _xgrammar()
        key = json.dumps([params.json, params.regex, params.choice, params.grammar, params.json_object],
                         sort_keys=True)
        compiled = self._cache.get(key)
        if compiled is None:
            try:
                compiled = self._compile(params)
            except (RuntimeError, ValueError) as error:
                raise ValueError(f"structured_outputs: the grammar does not compile: {error}") from None
            self._cache[key] = compiled
        return GrammarState(compiled, xgr.GrammarMatcher(compiled))

    def _compile(self, params: StructuredOutputsParams) -> Any:
        compiler = self._get_compiler()
        if params.json is not None:
            schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
            return compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=True)
        if params.json_object:
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                strict_mode=False)
        if params.regex is not None:
            return compiler.compile_regex(params.regex)
        if params.choice is not None:
            return compiler.compile_regex("|".join(f"(?:{re.escape(c)})" for c in params.choice))
        return compiler.compile_grammar(params.grammar)

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            from transformers import PreTrainedTokenizerFast

            xgr = _xgrammar()
            wrapped = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer.backend)
            info = xgr.TokenizerInfo.from_huggingface(
                wrapped, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
            )
            self._compiler = xgr.GrammarCompiler(info)
        return self._compiler


@dataclass(slots=True, eq=False)
class GrammarState:
    """One request's position in its grammar."""

    compiled: Any
    matcher: Any
    bitmask: torch.Tensor | None = None  # allocated on first use, refilled every step

    def fork(self, output_token_ids: list[int]) -> GrammarState:
        """A matcher at the same position, for a forked sequence (replays its output tokens)."""
        child = GrammarState(self.compiled, _xgrammar().GrammarMatcher(self.compiled))
        for token_id in output_token_ids:
            child.accept(token_id)
        return child

    def mask(self, logits_row: torch.Tensor) -> None:
        """Set the logits of every token the grammar forbids now to -inf (in place)."""
        xgr = _xgrammar()
        if self.bitmask is None:
            self.bitmask = xgr.allocate_token_bitmask(1, logits_row.shape[-1])
        self.matcher.fill_next_token_bitmask(self.bitmask)
        xgr.apply_token_bitmask_inplace(logits_row.unsqueeze(0), self.bitmask)

    def accept(self, token_id: int) -> None:
        """Advance by the sampled token (the mask allowed it, so this cannot fail)."""
        if not self.matcher.accept_token(token_id):
            raise RuntimeError(f"grammar rejected token {token_id} that its own mask allowed")

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()
