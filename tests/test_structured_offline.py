"""Structured outputs in the engine: a random-weight model still produces only what the grammar allows.

The tiny chat model's weights are random, so whatever it emits comes from the mask, not from skill:
each constrained output must parse (JSON), match (regex, choice) or derive (EBNF), and the request
must end by the grammar (finish_reason "stop"), for greedy, sampled and parallel (forked) requests.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kvserve import LLM, SamplingParams, StructuredOutputsParams
from test_server_support import chat_model_dir  # noqa: F401

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "enum": ["yes", "no", "maybe"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["answer", "ok", "tags"],
}
REGEX = r"[0-9]{3}-(red|green|blue)"
CHOICES = ["positive", "negative", "neutral"]
GRAMMAR = 'root ::= "(" digit ("+" digit)* ")"\ndigit ::= [0-9]'


@pytest.fixture(scope="module")
def llm(chat_model_dir) -> LLM:  # noqa: F811
    return LLM(str(chat_model_dir), progress=False, num_blocks=256)


def params(structured: StructuredOutputsParams, **fields) -> SamplingParams:
    return SamplingParams(max_tokens=64, structured_outputs=structured, **fields)


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, seed=4),
                                      dict(temperature=1.0, seed=5, n=3)])
def test_every_kind_is_enforced(llm, sampling):
    kinds = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(regex=REGEX),
             StructuredOutputsParams(choice=CHOICES), StructuredOutputsParams(grammar=GRAMMAR)]
    outputs = llm.generate(["Hello, how are"] * 4, [params(k, **sampling) for k in kinds], use_tqdm=False)
    json_out, regex_out, choice_out, grammar_out = outputs
    for completion in json_out.outputs:
        jsonschema.validate(json.loads(completion.text), SCHEMA)
    assert all(re.fullmatch(REGEX, c.text) for c in regex_out.outputs)
    assert all(c.text in CHOICES for c in choice_out.outputs)
    assert all(re.fullmatch(r"\([0-9](\+[0-9])*\)", c.text) for c in grammar_out.outputs)
    for output in outputs:
        assert len(output.outputs) == sampling.get("n", 1)
        assert all(c.finish_reason == "stop" for c in output.outputs), [c.text for c in output.outputs]
    assert llm.stats()["used_blocks"] == 0


def test_unconstrained_output_differs(llm):
    """The check above can fail: without the grammar the random model writes no JSON."""
    free = llm.generate("Hello, how are", SamplingParams(temperature=0.0, max_tokens=20), use_tqdm=False)[0]
    with pytest.raises(json.JSONDecodeError):
        json.loads(free.outputs[0].text)


def test_bad_grammars_are_refused(llm):
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a", choice=["b"]))
    with pytest.raises(ValueError, match="does not compile"):
        llm.generate("x", params(StructuredOutputsParams(grammar="root ::= undefined_rule")), use_tqdm=False)
    assert llm.stats()["used_blocks"] == 0
