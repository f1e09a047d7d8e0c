"""Subscribe to one worker's KV events and deliver them in order, or say that history was lost.

On connect the stream asks the replay socket for everything the publisher still buffers (its
history, when it started recently), then follows the live feed. Sequence numbers and the publisher's
epoch (sent with each replay's end marker) drive resynchronisation:
- the first batch received is not seq 0 (joined late), or a later one skips ahead (dropped batches):
  ask the replay socket for the missing ones; if it cannot fill the gap, `reset` -- the consumer
  forgets the worker's blocks (an index that under-claims only costs a cache hit; one that
  over-claims steers requests to a cache that is not there);
- a sequence number at or below the last one, or a replay under another epoch: the worker restarted
  (its cache is empty) -- `reset`, then apply the new process's history and follow it;
- every `resync_interval` seconds the stream asks the replay socket what came after its last batch.
  A SUB socket that reconnects to a restarted worker misses what the new process published before
  the reconnect completed (ZMQ's slow joiner), and when nothing follows, no gap ever shows: without
  this check those batches, and the restart itself, would stay unseen.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Protocol

import zmq
import zmq.asyncio

from kvserve.events.format import KVEventBatch, decode_batch

logger = logging.getLogger("kvserve.events")
REPLAY_TIMEOUT_S = 2.0
MAX_CATCH_UP_ROUNDS = 8  # replay rounds one catch-up may take to fill holes before leaving it to the next
RESYNC_INTERVAL_S = 1.0


class EventHandler(Protocol):
    def apply(self, batch: KVEventBatch) -> None: ...

    def reset(self, reason: str) -> None: ...


@dataclass(slots=True)
class StreamStats:
    batches: int = 0
    replayed: int = 0
    resets: int = 0
    last_seq: int | None = None


@dataclass(slots=True)
class Replay:
    """One answer of the replay socket: the publisher's epoch and the buffered batches by sequence number
    from `start` (the first one asked for)."""

    start: int
    epoch: bytes
    batches: dict[int, bytes] = field(default_factory=dict)


class EventStream:
    """One SUB socket on `endpoint`; `run()` until cancelled."""

    def __init__(self, endpoint: str, handler: EventHandler, replay_endpoint: str | None = None,
                 context: zmq.asyncio.Context | None = None, resync_interval: float = RESYNC_INTERVAL_S) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.handler = handler
        self.stats = StreamStats()
        self._context = context or zmq.asyncio.Context.instance()
        self.resync_interval = resync_interval
        self._replayed: tuple[int, int] | None = None  # live copies of these may still be queued: skip them
        self._epoch: bytes | None = None  # the publisher process the applied batches came from, once known

    async def run(self) -> None:
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.endpoint)
        loop = asyncio.get_running_loop()
        try:
            await self.catch_up()
            next_check = loop.time() + self.resync_interval
            while True:
                wait_ms = max(0.0, next_check - loop.time()) * 1000
                if await sub.poll(timeout=wait_ms, flags=zmq.POLLIN):
                    await self._receive(sub)
                if loop.time() >= next_check:
                    await self.catch_up(periodic=True)
                    next_check = loop.time() + self.resync_interval
        finally:
            sub.close(linger=0)

    async def _receive(self, sub: zmq.asyncio.Socket) -> None:
        frames = await sub.recv_multipart()
        if len(frames) != 3:
            logger.warning("kv events from %s: expected 3 frames, got %d", self.endpoint, len(frames))
            return
        await self.deliver(int.from_bytes(frames[1], "big", signed=True), frames[2])

    async def catch_up(self, periodic: bool = False) -> None:
        """Apply what the publisher still buffers after the last applied batch (on connect: its history;
        after a restart: the new process's history, once the old one's blocks are forgotten). `periodic`:
        a failed fetch is logged at debug level only (a worker that is down would log every interval).
        An answer with a hole (a publisher that dropped part of a long replay) is applied up to the hole
        and asked again from there at once: history applied only in part over-claims (the removals that
        came later are missing), so nothing may route on it."""
        for _ in range(MAX_CATCH_UP_ROUNDS):
            if not await self._catch_up_once(periodic):
                return
        logger.warning("kv events from %s: the replay still had holes after %d rounds", self.endpoint,
                       MAX_CATCH_UP_ROUNDS)

    async def _catch_up_once(self, periodic: bool) -> bool:
        """One replay round of `catch_up`; True when it stopped at a hole with more batches after it."""
        start = 0 if self.stats.last_seq is None else self.stats.last_seq + 1
        replay = await self._fetch_current(start, quiet=periodic)
        if replay is None:
            return False
        start, received = replay.start, replay.batches
        if not received:
            return False
        first = min(received)
        if first != start:
            if self.stats.last_seq is not None:
                self._reset(f"batches {start}..{first - 1} were missed and are no longer buffered")
            logger.info("kv events from %s: history before batch %d is gone; the index starts there",
                        self.endpoint, first)
        seq = first
        while seq in received:
            self._apply(seq, received[seq])
            seq += 1
        self.stats.replayed += seq - first
        # Live copies of an earlier catch-up's batches may still be queued behind these: skip them all.
        low = first if self._replayed is None else min(self._replayed[0], first)
        self._replayed = (low, seq - 1)
        return seq <= max(received)

    async def deliver(self, seq: int, payload: bytes) -> None:
        """Apply batch `seq`, first recovering whatever came before it that was missed."""
        last = self.stats.last_seq
        if self._replayed is not None:
            if self._replayed[0] <= seq <= self._replayed[1]:
                return  # the live copy of a batch already applied from the replay
            self._replayed = None
        if last is not None and seq <= last:
            self._restart(f"sequence went back from {last} to {seq}: the worker restarted")
            last = None
        expected = 0 if last is None else last + 1
        if seq > expected and not await self._replay(expected, seq):
            self._reset(f"batches {expected}..{seq - 1} were missed and cannot be replayed")
        self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except ValueError as err:
            logger.warning("kv events from %s: batch %d dropped: %s", self.endpoint, seq, err)
            self._reset(f"batch {seq} was unreadable")
        else:
            self.handler.apply(batch)
        self.stats.batches += 1
        self.stats.last_seq = seq

    def _reset(self, reason: str) -> None:
        logger.info("kv events from %s: index reset: %s", self.endpoint, reason)
        self.stats.resets += 1
        self.handler.reset(reason)

    def _restart(self, reason: str) -> None:
        """The publisher is a new process: forget the old one's blocks and where its stream was."""
        self._reset(reason)
        self.stats.last_seq = None
        self._replayed = None
        self._epoch = None

    async def _replay(self, start: int, stop: int) -> bool:
        """Apply batches start..stop-1 from the replay socket (from 0 if the publisher restarted); True
        when all of them came back."""
        replay = await self._fetch_current(start)
        if replay is None:
            return False
        start, received = replay.start, replay.batches
        if any(seq not in received for seq in range(start, stop)):
            return False
        for seq in range(start, stop):
            self._apply(seq, received[seq])
        self.stats.replayed += stop - start
        return True

    async def _fetch_current(self, start: int, quiet: bool = False) -> Replay | None:
        """`_fetch(start)`, or, when the answer comes from another publisher process than the batches
        applied so far, `_restart` and the new process's whole buffered history."""
        replay = await self._fetch(start, quiet)
        if replay is None:
            return None
        if self._epoch is not None and replay.epoch != self._epoch:
            self._restart("the replay socket answers for a new process: the worker restarted")
            if start != 0:
                replay = await self._fetch(0, quiet)
                if replay is None:
                    return None
        self._epoch = replay.epoch
        return replay

    async def _fetch(self, start: int, quiet: bool = False) -> Replay | None:
        """Every batch from `start` the publisher still buffers; None without a replay socket or on failure."""
        if self.replay_endpoint is None:
            return None
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVHWM, 0)  # the answer is bounded by the publisher's buffer: never drop any of it
        dealer.connect(self.replay_endpoint)
        received: dict[int, bytes] = {}
        try:
            await dealer.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), REPLAY_TIMEOUT_S)
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq < 0:
                    return Replay(start, frames[2], received)
                if seq >= start:
                    received[seq] = frames[2]
        except (TimeoutError, IndexError, zmq.ZMQError) as err:
            logger.log(logging.DEBUG if quiet else logging.WARNING, "kv events: replay from %s failed: %s",
                       self.replay_endpoint, err)
            return None
        finally:
            dealer.close(linger=0)
