"""Beam search: equal to transformers' `generate(num_beams=4, do_sample=False)`, shared blocks, no leaks.

HF settings compared (each with num_beams=4, num_return_sequences=4, max_new_tokens=20, one EOS id):
length_penalty / early_stopping = 1.0 / False (HF's defaults), 1.0 / True, 2.0 / "never", 0.0 / False.
The tiny model names token 356 as its EOS here (a copy of the fixture's config), a token the model
often ranks high, so hypotheses do end on EOS and some searches stop before max_new_tokens.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import assert_pool_drained, hf_greedy, random_prompts
from kvserve import LLM, BeamSearchParams

FREQUENT_EOS = 356
MAX_NEW = 20
PROMPTS = [random_prompts(16, 4, 40, seed=11)[i] for i in (0, 1, 3, 5, 8, 12)]
PROMPT_1000 = random_prompts(1, 1000, 1000, seed=7)[0]  # 62 full blocks of 16 + a tail of 8 tokens
# (length_penalty, early_stopping, whether some search ends before MAX_NEW tokens with these PROMPTS)
HF_SETTINGS = [(1.0, False, False), (1.0, True, True), (2.0, "never", False), (0.0, False, True)]


@pytest.fixture(scope="module")
def eos_model_dir(tiny_model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-eos") / "model"
    shutil.copytree(tiny_model_dir, path)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((path / name).read_text())
        config["eos_token_id"] = FREQUENT_EOS
        (path / name).write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def eos_hf_model(eos_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(eos_model_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_beam_search(
    model, prompt, width, max_new_tokens, length_penalty=1.0, early_stopping=False, eos_token_ids=None
):
    """HF's hypotheses (generated tokens, EOS included, padding cut) and their sequences_scores."""
    out = model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        num_beams=width, num_return_sequences=width, do_sample=False, max_new_tokens=max_new_tokens,
        length_penalty=length_penalty, early_stopping=early_stopping,
        eos_token_id=eos_token_ids or model.config.eos_token_id, pad_token_id=0,
        output_scores=True, return_dict_in_generate=True,
    )
    lengths = (out.beam_indices >= 0).sum(dim=1).tolist()  # generated tokens per hypothesis
    start = len(prompt)
    sequences = [row[start : start + n].tolist() for row, n in zip(out.sequences, lengths, strict=True)]
    return sequences, out.sequences_scores.tolist()


def make_llm(model_dir, **engine_args) -> LLM:
    engine_args.setdefault("num_blocks", 512)
    return LLM(str(model_dir), progress=False, **engine_args)


@pytest.mark.parametrize(("length_penalty", "early_stopping", "stops_early"), HF_SETTINGS)
def test_equals_hf_beam_search(eos_model_dir, eos_hf_model, length_penalty, early_stopping, stops_early):
    llm = make_llm(eos_model_dir)
    outputs = llm.beam_search(PROMPTS, 4, MAX_NEW, length_penalty=length_penalty,
                              early_stopping=early_stopping)
    ended_on_eos = ended_early = False
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        sequences, scores = hf_beam_search(eos_hf_model, prompt, 4, MAX_NEW, length_penalty, early_stopping)
        assert [c.token_ids for c in output.outputs] == sequences
        assert [c.score for c in output.outputs] == pytest.approx(scores, abs=1e-3)
        for completion in output.outputs:
            reason = "stop" if completion.token_ids[-1] == FREQUENT_EOS else "length"
            assert completion.finish_reason == reason
            length = len(completion.token_ids)
            assert completion.score == pytest.approx(completion.cumulative_logprob / length**length_penalty)
        ended_on_eos |= any(s[-1] == FREQUENT_EOS for s in sequences)
        ended_early |= max(len(s) for s in sequences) < MAX_NEW
    assert ended_on_eos  # finished hypotheses took part
    assert ended_early == stops_early
    assert_pool_drained(llm.engine)


def test_width_one_is_greedy(tiny_model_dir, tiny_hf_model):
    prompts = random_prompts(6, 3, 90, seed=1)
    expected = [hf_greedy(tiny_hf_model, p, 16) for p in prompts]
    assert all(2 not in tokens for tokens in expected)  # no EOS, where width 1 could differ from greedy
    llm = make_llm(tiny_model_dir)
    outputs = llm.beam_search(prompts, 1, 16)
    assert [o.token_ids for o in outputs] == expected
    assert all(len(o.outputs) == 1 for o in outputs)
    assert_pool_drained(llm.engine)


@pytest.mark.parametrize("width", [4, 8])
def test_beams_share_the_prompt_blocks(tiny_model_dir, width):
    """1,000-token prompt: 62 full blocks + a tail of 8 tokens. With 8 output tokens every write lands
    in a tail block, so the beams hold the full blocks once and at most one tail each (a kept beam's
    forks share its tail until they write it). Independent sequences would hold width x 63 blocks."""
    llm = make_llm(tiny_model_dir, num_blocks=600)
    llm.beam_search(PROMPT_1000, width, 8)
    assert llm.stats()["peak_used_blocks"] <= 62 + width
    assert_pool_drained(llm.engine)


@pytest.mark.parametrize("prefix_cache", ["radix", "hash", "off"])
def test_abort_midway_leaves_the_pool_drained(tiny_model_dir, prefix_cache):
    llm = make_llm(tiny_model_dir, prefix_cache=prefix_cache)
    engine = llm.engine
    request_id = engine.add_request(PROMPTS[2] * 3, BeamSearchParams(8, max_tokens=40))
    other = engine.add_request(PROMPTS[0], BeamSearchParams(2, max_tokens=10))
    for _ in range(6):
        engine.step()
    assert len(engine.groups[request_id].beams) == 8
    output = engine.abort_request(request_id)
    assert output.finished and output.finish_reason == "abort"
    assert engine.abort_request(request_id) is None
    while engine.has_unfinished_requests():
        engine.step()
    assert other not in engine.requests
    assert_pool_drained(engine)


@pytest.mark.parametrize("prefix_cache", ["radix", "off"])
def test_preemption_keeps_results(eos_model_dir, prefix_cache):
    """A pool too small for every beam at once: beams are preempted and recomputed, and beams that
    have their logits wait for their siblings; the hypotheses stay the same."""
    roomy = make_llm(eos_model_dir, prefix_cache=prefix_cache).beam_search(PROMPTS[:4], 4, MAX_NEW)
    llm = make_llm(eos_model_dir, num_blocks=10, prefix_cache=prefix_cache)
    tight = llm.beam_search(PROMPTS[:4], 4, MAX_NEW)
    for a, b in zip(roomy, tight, strict=True):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        assert [c.score for c in a.outputs] == pytest.approx([c.score for c in b.outputs], abs=1e-4)
    assert llm.stats()["num_preemptions"] > 0
    assert_pool_drained(llm.engine)


@pytest.mark.parametrize(
    "fields", [dict(beam_width=0), dict(beam_width=2, early_stopping="sometimes"),
               dict(beam_width=2, num_return_sequences=3), dict(beam_width=2, max_tokens=0)],
)
def test_invalid_params_are_rejected(fields):
    with pytest.raises(ValueError):
        BeamSearchParams(**fields)
