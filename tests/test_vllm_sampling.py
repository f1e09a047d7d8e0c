"""SamplingParams' logits processors against an oracle: a plain forward loop over the HF model that
applies vLLM's formulas (repetition through transformers' own `RepetitionPenaltyLogitsProcessor`).

Also: logit_bias bans and forces tokens, min_tokens holds EOS and stop ids back, stop_reason names the
stop string or id, include_stop_str_in_output keeps it, out-of-range values are refused by name.
"""

from __future__ import annotations

import pytest
import torch

from conftest import random_prompts
from kvserve import LLM, SamplingParams
from test_server_support import chat_model_dir  # noqa: F401

EOS = 2  # the tiny model's eos_token_id


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), progress=False, num_blocks=256)


@torch.inference_mode()
def oracle(model, prompt: list[int], steps: int, repetition: float = 1.0, frequency: float = 0.0,
           presence: float = 0.0, bias: dict[int, float] | None = None) -> list[int]:
    from transformers import RepetitionPenaltyLogitsProcessor

    ids, out = list(prompt), []
    for _ in range(steps):
        logits = model(torch.tensor([ids])).logits[0, -1].clone()
        for token, value in (bias or {}).items():
            logits[token] += value
        if repetition != 1.0:
            logits = RepetitionPenaltyLogitsProcessor(repetition)(torch.tensor([ids]), logits[None])[0]
        for token in set(out):
            logits[token] -= frequency * out.count(token) + presence
        ids.append(int(logits.argmax()))
        out.append(ids[-1])
    return out


@pytest.mark.parametrize("penalties", [dict(repetition=1.8), dict(frequency=1.5), dict(presence=1.5),
                                       dict(repetition=1.3, frequency=0.5, presence=0.5, bias={7: 3.0})])
def test_penalties_equal_the_oracle(llm, tiny_hf_model, penalties):
    prompts = random_prompts(3, 5, 20, seed=4)
    params = SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=penalties.get("repetition", 1.0),
        frequency_penalty=penalties.get("frequency", 0.0), presence_penalty=penalties.get("presence", 0.0),
        logit_bias=penalties.get("bias"),
    )
    outputs = llm.generate(prompts, params, use_tqdm=False)
    plain = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    expected = [oracle(tiny_hf_model, p, 12, **penalties) for p in prompts]
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert expected != [o.token_ids for o in plain]  # the penalty changed something


def test_logit_bias_bans_and_forces(llm):
    prompt = random_prompts(1, 10, 10, seed=9)[0]
    greedy = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))[0].token_ids
    banned = {token: -100.0 for token in greedy}
    for seed in range(3):
        out = llm.generate(prompt, SamplingParams(temperature=1.0, seed=seed, max_tokens=10, ignore_eos=True,
                                                  logit_bias=banned), use_tqdm=False)[0]
        assert not set(out.token_ids) & set(banned)
    forced = llm.generate(prompt, SamplingParams(temperature=1.0, seed=1, max_tokens=6, ignore_eos=True,
                                                 logit_bias={77: 100.0}), use_tqdm=False)[0]
    assert forced.token_ids == [77] * 6


def test_min_tokens_holds_eos_and_stop_ids_back(llm):
    prompt = random_prompts(1, 8, 8, seed=2)[0]
    eager_eos = SamplingParams(temperature=0.0, max_tokens=10, logit_bias={EOS: 100.0})
    assert llm.generate(prompt, eager_eos, use_tqdm=False)[0].token_ids == [EOS]
    held = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=10, logit_bias={EOS: 100.0},
                                               min_tokens=4), use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) == 5 and EOS not in held.token_ids[:4] and held.token_ids[4] == EOS
    assert held.finish_reason == "stop" and held.stop_reason is None  # EOS: no stop_reason, as vLLM
    stop_id = SamplingParams(temperature=0.0, max_tokens=10, logit_bias={50: 100.0}, stop_token_ids=[50],
                             min_tokens=3)
    out = llm.generate(prompt, stop_id, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[-1] == 50 and len(out.token_ids) == 4 and out.stop_reason == 50


def test_stop_reason_and_include_stop_str(chat_model_dir):  # noqa: F811
    llm = LLM(str(chat_model_dir), progress=False, num_blocks=128)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    text = llm.generate("Hello, how are", greedy, use_tqdm=False)[0].outputs[0].text
    stop = text[6:9]
    assert stop.strip() and text.index(stop) == 6
    cut = llm.generate("Hello, how are", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                        stop=[stop]), use_tqdm=False)[0].outputs[0]
    kept = llm.generate("Hello, how are", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                         stop=[stop], include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert cut.text == text[:6] and cut.stop_reason == stop and cut.finish_reason == "stop"
    assert kept.text == text[:9] and kept.stop_reason == stop


@pytest.mark.parametrize("fields, name", [
    (dict(prompt_logprobs=21), "prompt_logprobs"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=3.0), "presence_penalty"), (dict(min_tokens=20, max_tokens=5), "min_tokens"),
    (dict(logit_bias={5: 500.0}), "logit_bias"),
])
def test_invalid_params_are_named(fields, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**fields)


def test_out_of_vocabulary_ids_are_refused(llm):
    for params in (SamplingParams(logit_bias={10**6: 1.0}), SamplingParams(stop_token_ids=[10**6])):
        with pytest.raises(ValueError, match="vocabulary|token ids must be in"):
            llm.generate([5, 6, 7], params, use_tqdm=False)
    assert llm.stats()["used_blocks"] == 0
