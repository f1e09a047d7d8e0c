"""Every request field kvserve knows and does not implement, with why: each is a 400 naming it.

The request models (protocol.py) hold the implemented fields; these tables hold OpenAI's and vLLM's
other fields. A refused field is accepted only at its neutral value (what leaving it out means), so
a client that sends defaults still works; any other value is refused with the reason below. A field
in neither place is unknown and refused too (`extra="forbid"`): nothing is silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Refused:
    reason: str
    neutral: tuple[Any, ...] = (None,)


_NO_MULTIMODAL = Refused("kvserve serves text-only models")
_NO_REASONING = Refused("kvserve has no reasoning parser")

COMMON: dict[str, Refused] = {
    # OpenAI
    "service_tier": Refused("kvserve has one service tier", (None, "auto", "default")),
    "store": Refused("kvserve stores no completions", (None, False)),
    "metadata": Refused("kvserve stores no completions, so there is nothing to tag", (None, {})),
    "safety_identifier": Refused("kvserve runs no abuse monitoring"),
    # vLLM extras
    "spaces_between_special_tokens": Refused("special tokens are decoded as the tokenizer writes them",
                                             (None, True)),
    "logits_processors": Refused("custom logits processors cannot be sent over HTTP to kvserve"),
    "kv_transfer_params": Refused("kvserve has no disaggregated prefill"),
    "vllm_xargs": Refused("kvserve takes no engine-specific extra arguments"),
    "mm_processor_kwargs": _NO_MULTIMODAL,
    "prompt_embeds": Refused("prompts are text or token ids"),
    "guided_decoding_backend": Refused("the grammar engine is always xgrammar"),
    "guided_whitespace_pattern": Refused("JSON is generated compact (no free whitespace)"),
}

CHAT: dict[str, Refused] = {
    **COMMON,
    "audio": _NO_MULTIMODAL,
    "modalities": Refused("kvserve generates text only", (None, ["text"])),
    "prediction": Refused("kvserve has no predicted-output decoding"),
    "web_search_options": Refused("kvserve has no web search"),
    "functions": Refused("deprecated by OpenAI: use tools"),
    "function_call": Refused("deprecated by OpenAI: use tool_choice"),
    "reasoning_effort": _NO_REASONING,
    "include_reasoning": Refused("kvserve has no reasoning parser", (None, True)),
    "verbosity": _NO_REASONING,
    "echo": Refused("chat responses do not repeat the conversation; use /v1/completions echo",
                    (None, False)),
    "documents": Refused("documents are not passed to chat templates by kvserve"),
    "add_special_tokens": Refused("the chat template writes the special tokens", (None, False)),
    "use_beam_search": Refused("beam search runs on /v1/completions only", (None, False)),
    "length_penalty": Refused("length_penalty needs use_beam_search, on /v1/completions only", (None, 1.0)),
}

COMPLETION: dict[str, Refused] = {
    **COMMON,
    "suffix": Refused("kvserve has no fill-in-the-middle completion"),
}


RESPONSES: dict[str, Refused] = {
    "reasoning": _NO_REASONING,
    "include": Refused("kvserve adds no optional output data (reasoning, log-probs, hosted tools' results)",
                       (None, [])),
    "background": Refused("kvserve runs every response in the foreground", (None, False)),
    "truncation": Refused("kvserve never drops a conversation's items: input that does not fit is a 400",
                          (None, "disabled")),
    "conversation": Refused("kvserve continues conversations by previous_response_id"),
    "prompt": Refused("kvserve has no stored prompt templates"),
    "top_logprobs": Refused("kvserve returns no log-probs on /v1/responses", (None, 0)),
    "max_tool_calls": Refused("kvserve returns every call the model makes"),
    "service_tier": COMMON["service_tier"],
    "safety_identifier": COMMON["safety_identifier"],
}


def refused_value(table: dict[str, Refused], name: str, value: Any) -> str | None:
    """The 400 message for `name=value`, or None when the field is absent from `table` or neutral."""
    refused = table.get(name)
    if refused is None or value in refused.neutral:
        return None
    return f"{name} is not supported: {refused.reason}"
