"""The group cap (`--max-group-rows`, `step_rows.group_sit_outs`): one request's n / best_of / beams compute
at most N rows per step while other requests run or wait, taking turns; alone, every row.

Checked on the engine (tiny random Llama): the cap holds in every contended step and lifts when the group
is alone; samples stay level and finish whole; greedy outputs (single requests and a greedy n=4 group)
and beam search hypotheses are the same as without the cap, on a pool that preempts too; every block
comes back. Greedy equality with transformers is in test_engine_equivalence.py (the cap only reorders
which rows compute in which step).
"""

from __future__ import annotations

import pytest

from conftest import assert_pool_drained, random_prompts
from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig


def make_llm(model_dir, **engine_args) -> LLM:
    engine_args.setdefault("num_blocks", 256)
    return LLM(str(model_dir), progress=False, **engine_args)


def test_a_group_computes_at_most_the_cap_while_others_run(tiny_model_dir):
    engine = make_llm(tiny_model_dir, max_group_rows=2).engine
    group = engine.add_request([5, 6, 7], SamplingParams(n=6, max_tokens=12, temperature=1.0, seed=2,
                                                         ignore_eos=True))
    singles = [engine.add_request(p, SamplingParams(max_tokens=6, ignore_eos=True))
               for p in random_prompts(2, 3, 12, seed=4)]
    schedule, steps = engine.scheduler.schedule, []

    def spy():  # (the group's rows, whether anyone else ran or waited) in each step
        others = engine.scheduler.waiting or any(r.group_id != group for r in engine.scheduler.running)
        output = schedule()
        steps.append((sum(item.request.group_id == group for item in output.scheduled), bool(others)))
        return output

    engine.scheduler.schedule = spy
    final = {}
    while engine.has_unfinished_requests():
        final.update({o.request_id: o for o in engine.step()})
    assert all(rows <= 2 for rows, contended in steps if contended)
    assert any(rows > 2 for rows, contended in steps if not contended)  # alone: every row
    assert [len(c.token_ids) for c in final[group].outputs] == [12] * 6
    assert all(len(final[r].outputs[0].token_ids) == 6 for r in singles)
    assert_pool_drained(engine)


@pytest.mark.parametrize("num_blocks", [256, 12])
def test_greedy_outputs_are_unchanged(tiny_model_dir, num_blocks):
    prompts = random_prompts(4, 3, 30, seed=7)
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    group = SamplingParams(n=4, max_tokens=16, temperature=0.0, ignore_eos=True)

    def run(cap):
        llm = make_llm(tiny_model_dir, max_group_rows=cap, num_blocks=num_blocks)
        outputs = llm.generate(prompts + prompts[:1], [greedy] * 4 + [group])
        assert_pool_drained(llm.engine)
        return [[c.token_ids for c in o.outputs] for o in outputs], llm.stats()["num_preemptions"]

    expected, _ = run(0)
    capped, preemptions = run(1)
    assert capped == expected
    assert expected[-1] == [expected[0][0]] * 4  # greedy samples equal the single greedy request
    if num_blocks == 12:
        assert preemptions > 0


def test_beam_search_is_unchanged(tiny_model_dir):
    prompts = random_prompts(3, 4, 30, seed=5)
    expected = make_llm(tiny_model_dir).beam_search(prompts, 4, 12)
    llm = make_llm(tiny_model_dir, max_group_rows=2)
    outputs = llm.beam_search(prompts, 4, 12)
    for a, b in zip(expected, outputs, strict=True):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        assert [c.score for c in a.outputs] == pytest.approx([c.score for c in b.outputs], abs=1e-4)
    assert_pool_drained(llm.engine)


def test_the_flag():
    import argparse

    from kvserve.cli import add_engine_flags, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert engine_config_from_args(parser.parse_args([])).max_group_rows == 0
    assert engine_config_from_args(parser.parse_args(["--max-group-rows", "4"])).max_group_rows == 4
    with pytest.raises(ValueError, match="max_group_rows must be >= 0"):
        EngineConfig(max_group_rows=-1)
