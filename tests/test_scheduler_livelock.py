"""A livelock found by the fork pool property test (a fresh-clone CI run hung in it): beam groups in a
pool too small for two of them, prefix cache off. Two beam groups each kept one beam computed (holding
its logits for the group) while its sibling waited behind newcomers; a third request was admitted with a
first prefill chunk, could not grow its next chunk, was preempted (recompute: with the cache off its
blocks are gone), and was admitted again next step -- forever. Now the oldest sequence's group comes
first when that sequence waits for it (`scheduler.oldest_group_first`, `pool_share._ordered`), so the
oldest group always completes, as a lone sequence always did.
"""

from __future__ import annotations

from kvserve import LLM, BeamSearchParams

SHARED_PREFIX = list(range(10, 45))
MAX_STEPS = 2000  # the requests need ~30 steps when they make progress


def test_beam_groups_finish_in_a_pool_that_fits_one_group_at_a_time(tiny_model_dir):
    engine = LLM(str(tiny_model_dir), progress=False, num_blocks=12, block_size=16, prefix_cache="off",
                 max_num_batched_tokens=48, max_num_seqs=6).engine
    def add(repeat: int, max_tokens: int) -> None:
        engine.add_request((SHARED_PREFIX + [15699 % 400 + 60] * repeat)[: 120 - max_tokens],
                           BeamSearchParams(2, max_tokens=max_tokens))

    add(21, 3)
    add(40, 5)
    engine.step()
    engine.step()
    add(40, 5)
    steps = 0
    while engine.has_unfinished_requests() and steps < MAX_STEPS:
        engine.step()
        steps += 1
    assert not engine.has_unfinished_requests(), f"still unfinished after {MAX_STEPS} steps"
