"""KV events: vLLM's wire format (round trip, the array form, bad input), and a real ZMQ publisher
feeding a subscriber on loopback: in-order delivery, replay of what a late subscriber missed,
gap → resync, a restarted publisher (sequence back to 0, or a new epoch on the replay socket) → the
worker's index is rebuilt, and the periodic catch-up that finds what the live feed lost."""

from __future__ import annotations

import asyncio
import threading

import msgpack
import pytest

from kvserve.events.format import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, decode_batch, encode_batch
from kvserve.events.publisher import KVEventPublisher
from kvserve.events.subscriber import EventStream
from kvserve.prefix.hashing import block_hashes
from kvserve.router.index import BlockIndex, WorkerEvents
from kvserve.server.launcher import free_port

H = [bytes([i]) * 32 for i in range(8)]


def test_format_round_trip_and_vllm_layout():
    batch = KVEventBatch(ts=12.5, events=[
        BlockStored([H[0], H[1]], None, list(range(8)), 4), BlockRemoved([H[0]]), AllBlocksCleared(),
    ], data_parallel_rank=0)
    payload = encode_batch(batch)
    assert decode_batch(payload) == batch
    raw = msgpack.unpackb(payload)
    assert raw["events"][0] == {"type": "BlockStored", "block_hashes": [H[0], H[1]], "parent_block_hash": None,
                                "token_ids": list(range(8)), "block_size": 4, "lora_id": None, "medium": "GPU",
                                "lora_name": None}
    assert raw["events"][2] == {"type": "AllBlocksCleared"}


def test_decoder_accepts_the_array_form_and_ignores_newer_fields():
    array_form = msgpack.packb([1.0, [["BlockStored", [H[2]], H[1], [1, 2, 3, 4], 4, None, "GPU"],
                                      ["BlockRemoved", [H[2]], "CPU"], ["AllBlocksCleared"]], 0])
    batch = decode_batch(array_form)
    assert batch.events == [BlockStored([H[2]], H[1], [1, 2, 3, 4], 4, None, "GPU"), BlockRemoved([H[2]], "CPU"),
                            AllBlocksCleared()]
    newer = msgpack.packb({"ts": 0, "events": [{"type": "BlockRemoved", "block_hashes": [H[0]], "medium": "GPU",
                                                "group_idx": 3}]})
    assert decode_batch(newer).events == [BlockRemoved([H[0]], "GPU")]


@pytest.mark.parametrize("payload", [b"\xc1", msgpack.packb({"events": [{"type": "Nope"}]}),
                                     msgpack.packb({"ts": 0}), msgpack.packb({"events": [{"type": "BlockStored"}]})])
def test_decoder_rejects_malformed_batches(payload):
    with pytest.raises(ValueError):
        decode_batch(payload)


def endpoints() -> tuple[str, str]:
    return f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"


async def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def rebind(endpoint: str, replay_endpoint: str) -> KVEventPublisher:
    """A new publisher on the same endpoints (ZMQ releases a closed socket's port asynchronously)."""
    for _ in range(100):
        try:
            return KVEventPublisher(endpoint, replay_endpoint)
        except ValueError:
            await asyncio.sleep(0.05)
    raise TimeoutError(f"{endpoint} stayed busy")


def wired(**stream_args) -> tuple[str, str, KVEventPublisher, BlockIndex, WorkerEvents, EventStream]:
    """A publisher on fresh loopback endpoints and a stream for worker "w0" over them (not running: a test
    starts `run()` or feeds it by hand)."""
    pub_endpoint, replay_endpoint = endpoints()
    publisher = KVEventPublisher(pub_endpoint, replay_endpoint)
    index = BlockIndex()
    handler = WorkerEvents(index, "w0")
    return pub_endpoint, replay_endpoint, publisher, index, handler, EventStream(pub_endpoint, handler,
                                                                                 replay_endpoint, **stream_args)


def test_publisher_to_index_with_replay_and_restart():
    asyncio.run(_publisher_to_index())


async def _publisher_to_index() -> None:
    pub_endpoint, replay_endpoint = endpoints()
    publisher = KVEventPublisher(pub_endpoint, replay_endpoint)
    tokens = list(range(100, 116))
    hashes = block_hashes(tokens, 4, ("alice", ""), "sha256")
    # Published before anyone subscribes: a late subscriber must get these by replay.
    publisher.publish([AllBlocksCleared()])
    publisher.publish([BlockStored(hashes[:2], None, tokens[:8], 4)])
    # publish() only queues (the publisher's thread sends): make sure both went out before subscribing.
    await wait_until(lambda: publisher.num_published == 2)
    index = BlockIndex()
    handler = WorkerEvents(index, "w0")
    stream = EventStream(pub_endpoint, handler, replay_endpoint)
    task = asyncio.create_task(stream.run())
    try:
        await asyncio.sleep(0.3)  # let the SUB connect
        publisher.publish([BlockStored(hashes[2:], hashes[1], tokens[8:], 4)])
        await wait_until(lambda: stream.stats.last_seq == 2)
        assert index.longest_runs(hashes, ["w0"]) == {"w0": 4}
        # 2 from the replay; 3 when a loaded machine connected the SUB only after the third was published
        assert stream.stats.replayed in (2, 3) and handler.resets == 0
        publisher.publish([BlockRemoved([hashes[1]])])
        await wait_until(lambda: stream.stats.last_seq == 3)
        assert index.longest_runs(hashes, ["w0"]) == {"w0": 1}
        # The worker restarts: a new process, sequence numbers from 0, an empty cache.
        publisher.close()
        publisher = await rebind(pub_endpoint, replay_endpoint)
        await asyncio.sleep(0.3)
        publisher.publish([AllBlocksCleared()])
        publisher.publish([BlockStored(hashes[:1], None, tokens[:4], 4)])
        await wait_until(lambda: stream.stats.resets >= 1 and stream.stats.last_seq == 1)
        assert index.longest_runs(hashes, ["w0"]) == {"w0": 1} and index.num_blocks("w0") == 1
        index.check_invariants()
    finally:
        task.cancel()
        publisher.close()


def test_unfillable_gap_resets_the_workers_index():
    asyncio.run(_gap_without_replay())


async def _gap_without_replay() -> None:
    index = BlockIndex()
    index.store("w0", H[:3])
    handler = WorkerEvents(index, "w0")
    stream = EventStream("tcp://127.0.0.1:1", handler, replay_endpoint=None)  # never connected: fed by hand
    stored = encode_batch(KVEventBatch(ts=0.0, events=[BlockStored([H[5]], None, [1, 2, 3, 4], 4)]))
    await stream.deliver(0, stored)
    assert handler.resets == 0 and index.num_blocks("w0") == 4
    await stream.deliver(5, stored)  # batches 1..4 lost, nobody to replay them: forget, then go on
    assert handler.resets == 1 and index.num_blocks("w0") == 1
    await stream.deliver(6, b"garbage")  # unreadable: also a reset
    assert handler.resets == 2 and index.num_blocks("w0") == 0 and stream.stats.last_seq == 6


def stored(tokens: list[int], namespace: tuple = ("alice", "")) -> BlockStored:
    return BlockStored(block_hashes(tokens, 4, namespace, "sha256"), None, list(tokens), 4)


def test_a_restart_whose_numbers_passed_the_old_ones_is_seen_by_its_epoch():
    asyncio.run(_restart_seen_by_epoch())


async def _restart_seen_by_epoch() -> None:
    pub_endpoint, replay_endpoint, publisher, index, handler, stream = wired()  # fed by hand: catch_up() only
    old, new = list(range(100, 108)), list(range(200, 216))
    try:
        publisher.publish([AllBlocksCleared()])
        publisher.publish([stored(old)])
        await wait_until(lambda: publisher.num_published == 2)
        await stream.catch_up()
        assert stream.stats.last_seq == 1 and index.num_blocks("w0") == 2
        # The worker restarts and publishes more batches than the old process did before this stream hears
        # of it: the numbers never go back, so only the replay's epoch shows the restart.
        publisher.close()
        publisher = await rebind(pub_endpoint, replay_endpoint)
        for chunk in (new[:4], new[4:8], new[8:12], new[12:]):
            publisher.publish([stored(chunk)])
        await wait_until(lambda: publisher.num_published == 4)
        await stream.catch_up()
        assert handler.resets == 1 and stream.stats.last_seq == 3
        assert index.num_blocks("w0") == 4  # the new process's four blocks, none of the old one's
        assert not any(index.holds("w0", h) for h in block_hashes(old, 4, ("alice", ""), "sha256"))
        index.check_invariants()
    finally:
        publisher.close()


def test_a_periodic_catch_up_fills_a_lost_tail_and_skips_its_live_copies():
    asyncio.run(_tail_catch_up())


async def _tail_catch_up() -> None:
    _, _, publisher, index, handler, stream = wired()  # fed by hand
    tokens = list(range(300, 316))
    try:
        publisher.publish([stored(tokens[:4])])
        await wait_until(lambda: publisher.num_published == 1)
        await stream.catch_up()
        publisher.publish([stored(tokens[4:8])])
        publisher.publish([stored(tokens[8:12])])
        await wait_until(lambda: publisher.num_published == 3)
        await stream.catch_up()  # what the live feed did not bring (yet)
        assert stream.stats.last_seq == 2 and index.num_blocks("w0") == 3
        for seq in (1, 2):  # the live copies arrive after all: already applied, not a restart
            await stream.deliver(seq, encode_batch(KVEventBatch(ts=0.0, events=[stored(tokens[:4])])))
        await stream.deliver(3, encode_batch(KVEventBatch(ts=0.0, events=[stored(tokens[12:])])))
        assert handler.resets == 0 and stream.stats.last_seq == 3 and index.num_blocks("w0") == 4
    finally:
        publisher.close()


def test_batches_lost_while_the_sub_socket_reconnects_arrive_by_the_periodic_resync():
    asyncio.run(_slow_joiner())


async def _slow_joiner() -> None:
    """The router's failure of old: a restarted worker's first batch, published before the SUB socket
    had reconnected, was lost, and with nothing after it the index never learnt of it."""
    pub_endpoint, replay_endpoint, publisher, index, handler, stream = wired(resync_interval=0.2)
    old, new = list(range(400, 404)), list(range(500, 508))
    task = asyncio.create_task(stream.run())
    try:
        await asyncio.sleep(0.3)  # let the SUB connect
        publisher.publish([stored(old)])
        await wait_until(lambda: index.num_blocks("w0") == 1)
        publisher.close()
        publisher = await rebind(pub_endpoint, replay_endpoint)
        publisher.publish([stored(new)])  # at once: the SUB has most likely not reconnected yet
        await wait_until(lambda: index.num_blocks("w0") == 2 and handler.resets >= 1, timeout=5.0)
        assert all(index.holds("w0", h) for h in block_hashes(new, 4, ("alice", ""), "sha256"))
        assert not any(index.holds("w0", h) for h in block_hashes(old, 4, ("alice", ""), "sha256"))
    finally:
        task.cancel()
        publisher.close()


def test_publisher_reports_a_busy_endpoint():
    endpoint, _ = endpoints()
    first = KVEventPublisher(endpoint)
    try:
        with pytest.raises(ValueError, match="cannot bind"):
            KVEventPublisher(endpoint, bind_patience_s=0.2)
    finally:
        first.close()


def test_publisher_waits_out_a_port_that_frees_soon():
    """A restarted worker whose port is held for a moment (see publisher._bind) still starts."""
    endpoint, _ = endpoints()
    first = KVEventPublisher(endpoint)
    closer = threading.Timer(0.3, first.close)
    closer.start()
    second = KVEventPublisher(endpoint, bind_patience_s=5.0)
    closer.join()
    second.close()


def test_a_late_subscriber_gets_a_long_history_whole():
    """5,000 batches published before the router subscribes (a worker's thrashing minutes): one catch-up
    applies all of them. ZMQ's default send limit (1,000 messages) dropped the end of such a replay, and the
    index kept blocks whose removals were in the lost part (a router joining then routed to caches that
    were gone)."""
    asyncio.run(_long_history())


async def _long_history() -> None:
    pub_endpoint, replay_endpoint, publisher, index, handler, stream = wired()
    hashes = [i.to_bytes(4, "big") * 8 for i in range(2500)]
    try:
        for block_hash in hashes:
            publisher.publish([BlockStored([block_hash], None, [1, 2, 3, 4], 4)])
        for block_hash in hashes:
            publisher.publish([BlockRemoved([block_hash])])
        await wait_until(lambda: publisher.num_published == 5000)
        await stream.catch_up()
        assert stream.stats.last_seq == 4999 and index.num_blocks("w0") == 0
    finally:
        publisher.close()


def test_a_replay_with_a_hole_is_asked_again_at_once():
    """A publisher that drops part of a replay (any vLLM-format publisher at its send limit): the batches
    before the hole are applied and the rest fetched in the same catch-up, not a resync interval later."""
    asyncio.run(_replay_with_a_hole())


async def _replay_with_a_hole() -> None:
    from kvserve.events.subscriber import Replay

    index = BlockIndex()
    handler = WorkerEvents(index, "w0")
    stream = EventStream("tcp://127.0.0.1:1", handler, replay_endpoint="tcp://127.0.0.1:2")
    batches = [encode_batch(KVEventBatch(ts=0.0, events=[event])) for event in (
        BlockStored([H[0]], None, [1, 2, 3, 4], 4), BlockStored([H[1]], H[0], [5, 6, 7, 8], 4),
        BlockRemoved([H[0]]), BlockRemoved([H[1]]))]
    answers = [{0: batches[0], 1: batches[1], 3: batches[3]}, {2: batches[2], 3: batches[3]}]
    asked: list[int] = []

    async def fetch(start: int, quiet: bool = False) -> Replay:
        asked.append(start)
        return Replay(start, b"e" * 8, answers.pop(0) if answers else {})

    stream._fetch = fetch  # type: ignore[method-assign]
    await stream.catch_up()
    assert asked == [0, 2] and stream.stats.last_seq == 3 and index.num_blocks("w0") == 0
