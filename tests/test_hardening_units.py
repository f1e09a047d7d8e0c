"""Validation bounds, log-space beam scores and readable type errors (no server, no model)."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from kvserve.engine.groups.beam_scoring import BeamScorer, Candidate, length_normalized
from kvserve.engine.params import BeamSearchParams, SamplingParams
from kvserve.server.errors import from_engine_value_error, from_validation_error
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest


@given(score=st.floats(-1e4, 0.0), length=st.integers(1, 200_000), penalty=st.floats(-10.0, 10.0))
def test_length_normalized_is_hf_arithmetic_within_the_bounds(score, length, penalty):
    assert length_normalized(score, length, penalty) == score / (length**penalty)


@given(score=st.floats(-1e30, 0.0), length=st.integers(1, 10**12), penalty=st.floats(-1e6, 1e6))
def test_length_normalized_never_raises(score, length, penalty):
    value = length_normalized(score, length, penalty)
    assert value <= 0.0 and not math.isnan(value)


@pytest.mark.parametrize("penalty", [1100.0, -2000.0, 1e300, -1e300])
def test_scorer_survives_extreme_penalties_and_ranks(penalty):
    scorer = BeamScorer(beam_width=2, max_tokens=3, eos_token_ids=frozenset({2}), length_penalty=penalty)
    candidates = [Candidate(-0.5, 0, 2), Candidate(-1.0, 0, 2), Candidate(-1.5, 0, 7), Candidate(-2.0, 0, 8)]
    running = scorer.select(candidates, [[5, 6, 9]], num_generated=3)
    assert running == [] and len(scorer.hypotheses) == 2
    assert scorer.is_done(running, 3)
    assert all(not math.isnan(h.score) for h in scorer.hypotheses)


@pytest.mark.parametrize(("fields", "param"), [
    ({"temperature": float("nan")}, "temperature"), ({"temperature": 1e6}, "temperature"),
    ({"top_p": float("inf")}, "top_p"), ({"top_p": 0.0}, "top_p"), ({"min_p": float("nan")}, "min_p"),
    ({"top_k": 2**40}, "top_k"), ({"max_tokens": 2**40}, "max_tokens"), ({"max_tokens": True}, "max_tokens"),
    ({"seed": 2**70}, "seed"), ({"logprobs": 21}, "logprobs"), ({"n": 10**6}, "n"),
    ({"best_of": 10**6}, "best_of"), ({"stop": ["x"] * 1000}, "stop"), ({"stop_token_ids": [2**40]}, "stop_token_ids"),
])
def test_sampling_params_bounds_name_the_field(fields, param):
    with pytest.raises(ValueError) as info:
        SamplingParams(**fields)
    assert from_engine_value_error(info.value).param == param


@pytest.mark.parametrize(("fields", "param"), [
    ({"length_penalty": 1100.0}, "length_penalty"), ({"length_penalty": -2000.0}, "length_penalty"),
    ({"length_penalty": float("nan")}, "length_penalty"), ({"beam_width": 10**6}, "beam_width"),
    ({"max_tokens": 2**40}, "max_tokens"),
])
def test_beam_params_bounds_name_the_field(fields, param):
    with pytest.raises(ValueError) as info:
        BeamSearchParams(**{"beam_width": 2, **fields})
    assert from_engine_value_error(info.value).param == param


@pytest.mark.parametrize(("fields", "greedy"), [
    ({"temperature": 0.0}, True), ({"temperature": 1e-45}, True), ({"temperature": 9e-6}, True),
    ({"temperature": 1e-4}, False), ({"top_p": 1e-300}, True), ({"top_p": 1e-3}, False), ({"top_k": 1}, True),
])
def test_tiny_temperature_or_top_p_is_greedy(fields, greedy):
    assert SamplingParams(**fields).is_greedy is greedy


@pytest.mark.parametrize(("model", "body", "message"), [
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": 5}]},
     "messages[0].content: expected a string or a list of content parts, got an integer"),
    (CompletionRequest, {"prompt": 5},
     "prompt: expected a string, a list of strings, a list of token ids or a list of token-id lists, "
     "got an integer"),
    (CompletionRequest, {"prompt": "x", "stop": [1]},
     "stop: expected a string or a list of strings, got a list containing an integer"),
    (CompletionRequest, {"prompt": "x", "temperature": "hot"},
     "temperature: Input should be a valid number, got a string"),
])
def test_type_errors_read_well(model, body, message):
    with pytest.raises(ValidationError) as info:
        model.model_validate_json(json.dumps({"model": "m", **body}))
    error = from_validation_error(info.value)
    assert error.message == message
    assert error.param == message.split(":")[0].split("[")[0]
