"""A livelock found by the fork pool property test (a fresh-clone CI run hung in it): beam groups in a
pool too small for two of them, prefix cache off. Two beam groups each kept one beam computed (holding
its logits for the group) while its sibling waited behind newcomers; a third request was admitted with a
first prefill chunk, could not grow its next chunk, was preempted (recompute: with the cache off its
blocks are gone), and was admitted again next step -- forever. Now the oldest sequence's group comes
first when that sequence waits for it (`scheduler.oldest_group_first`, `pool_share._ordered`), so the
oldest group always completes, as a lone sequence always did.
"""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

from kvserve import LLM, BeamSearchParams
from kvserve.engine.scheduler import oldest_group_first

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


def _member(request_id: str, group_id: str, computed: bool) -> SimpleNamespace:
    return SimpleNamespace(request_id=request_id, group_id=group_id, num_tokens=10,
                           num_computed_tokens=10 if computed else 0)


def test_a_waiting_oldest_beam_brings_its_siblings_to_the_head_of_the_queue():
    oldest, other = _member("a", "a", computed=True), _member("b", "b", computed=True)
    waiting = deque([_member("c", "c", False), _member("b#1", "b", False), _member("a#1", "a", False)])
    assert [r.request_id for r in oldest_group_first(waiting, [oldest, other])] == ["a#1", "c", "b#1"]
    computing = _member("a", "a", computed=False)  # the oldest still computes: the queue is left as it is
    assert oldest_group_first(waiting, [computing, other]) is waiting
    assert oldest_group_first(waiting, []) is waiting
