"""The router's exact index mirrors a real engine, tiers included: an engine (tiny model, small pool, a host
tier that overflows into a disk tier) publishes its device and tier events straight into the router's
`BlockIndex` (no network); after every request, for every prompt seen so far, the run the index gives
(device, then host and disk, as `kv_events` walks it) equals where the engine finds the prompt's blocks itself
(device match, then its tiers' lookup). An index that over-claims sends requests to caches that are not there;
one that under-claims loses hits."""

from __future__ import annotations

import random

import pytest

from conftest import random_prompts
from kvserve.events.engine_hook import attach_kv_events, attach_tier_events
from kvserve.events.format import KVEventBatch
from kvserve.prefix.hashing import block_hashes
from kvserve.prefix.namespace import make_namespace
from kvserve.router.index import BlockIndex, WorkerEvents
from test_tiers_engine import BLOCK, make_llm, run, where_blocks_are


class IndexFeed:
    """A publisher that applies each batch to the router's index at once, as a subscriber would."""

    def __init__(self, handler: WorkerEvents) -> None:
        self.handler = handler

    def publish(self, events: list) -> None:
        self.handler.apply(KVEventBatch(ts=0.0, events=list(events)))


def indexed_run(index: BlockIndex, prompt: list[int]) -> dict[str, int]:
    """Tokens of `prompt`'s usable prefix the index puts on the device, then in the lower tiers after it."""
    usable = (len(prompt) - 1) // BLOCK
    hashes = block_hashes(prompt[: usable * BLOCK], BLOCK, make_namespace(None))
    device = 0
    while device < len(hashes) and index.holds("w", hashes[device]):
        device += 1
    lower = device
    while lower < len(hashes) and index.holds_lower("w", hashes[lower]):
        lower += 1
    return {"device": device * BLOCK, "lower": (lower - device) * BLOCK}


@pytest.mark.parametrize("tiers", [dict(host_cache="16KiB"), dict(host_cache="16KiB", disk="disk")])
def test_the_index_mirrors_the_engine_and_its_tiers(tiny_model_dir, tmp_path, request, tiers):
    llm = make_llm(tiny_model_dir, tmp_path, request, **tiers)
    index = BlockIndex()
    feed = IndexFeed(WorkerEvents(index, "w"))
    attach_kv_events(llm.engine.block_manager, feed)
    attach_tier_events(llm.engine.tiers.policy, feed, BLOCK)
    rng = random.Random(5)
    bases = random_prompts(4, 12, 28, seed=11)
    tails = random_prompts(40, 1, 12, seed=12)
    seen: list[list[int]] = []
    sources: set[str] = set()
    for tail in tails:
        prompt = rng.choice(bases) + tail if rng.random() < 0.7 else tail + rng.choice(bases)
        run(llm, prompt)
        seen.append(prompt)
        llm.engine.tiers.policy.flush()  # disk writes (and their events) land
        for past in seen:
            where = where_blocks_are(llm, past)
            sources.update(where)
            expected = {"device": where.get("device", 0), "lower": where.get("host", 0) + where.get("disk", 0)}
            assert indexed_run(index, past) == expected, (len(seen), past)
    assert sources == ({"device", "host", "disk"} if "disk" in tiers else {"device", "host"})  # all were exercised
    index.check_invariants()
    llm.engine.close()
