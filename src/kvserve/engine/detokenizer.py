"""Incremental detokenization and stop strings.

Decoding a short window (from `prefix_offset`) rather than the whole output keeps each step O(window).
Text ending in U+FFFD is held back: it is an incomplete UTF-8 sequence that the next token completes.
Text that could still become a stop string is held back from streaming, so a stop string is never sent.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.model.tokenizer import Tokenizer


@dataclass(slots=True)
class DetokenizerState:
    prefix_offset: int = 0
    read_offset: int = 0


def append_new_text(
    tokenizer: Tokenizer, output_ids: list[int], state: DetokenizerState, skip_special_tokens: bool
) -> str:
    """Text added by the tokens after `state.read_offset`; advances the state when text is complete."""
    prefix_text = tokenizer.decode(output_ids[state.prefix_offset : state.read_offset], skip_special_tokens)
    full_text = tokenizer.decode(output_ids[state.prefix_offset :], skip_special_tokens)
    if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
        state.prefix_offset = state.read_offset
        state.read_offset = len(output_ids)
        return full_text[len(prefix_text) :]
    return ""


def find_stop_string(text: str, stop: list[str], search_from: int) -> int | None:
    """Index in `text` where the earliest stop string starts (searching new text only), or None."""
    starts = [text.find(s, max(0, search_from - len(s) + 1)) for s in stop]
    found = [index for index in starts if index >= 0]
    return min(found) if found else None


def streamable_length(text: str, stop: list[str], finished: bool) -> int:
    """How much of `text` may be sent now: all when finished, else minus a possible stop-string start."""
    if finished or not stop:
        return len(text)
    return max(0, len(text) - (max(len(s) for s in stop) - 1))
