"""ZMQ PUB publisher of KV-event batches, as vLLM's `ZmqEventPublisher` does it on the wire.

Each batch goes out as three frames: topic, an 8-byte big-endian sequence number (0, 1, 2, ... per
process), and the msgpack payload. A bounded buffer of recent batches serves replay requests on an
optional ROUTER socket: a client sends the first sequence number it is missing (8 bytes) and gets
every buffered batch from there as (seq, payload), then (-1, epoch) to end. The socket's send limit
is the buffer's length: at ZMQ's default of 1,000 messages a router joining a worker with a few thousand
batches of history silently lost the later ones and indexed blocks that had long been removed. The epoch (8 random bytes
per publisher, where vLLM's end marker has an empty payload that its consumers ignore) tells a
subscriber that the process behind an endpoint changed, which sequence numbers alone cannot: a new
process's numbers may already have passed the old one's last.

`publish` may be called from any thread (the engine's); a background thread owns the sockets
(ZMQ sockets are not thread-safe) and never blocks the caller: a full queue drops the batch, and
subscribers see the gap in the sequence numbers and resynchronise.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence

import zmq

from kvserve.events.format import KVEvent, KVEventBatch, encode_batch

logger = logging.getLogger("kvserve.events")
END_SEQ = (-1).to_bytes(8, "big", signed=True)


BIND_PATIENCE_S = 5.0  # how long a busy endpoint port is retried before the server refuses to start

class KVEventPublisher:
    """Bind `endpoint` (e.g. `tcp://127.0.0.1:5557`); `publish(events)` sends one batch."""

    def __init__(
        self, endpoint: str, replay_endpoint: str | None = None, topic: str = "", buffer_steps: int = 10_000,
        max_queue: int = 100_000, bind_patience_s: float = BIND_PATIENCE_S,
    ) -> None:
        self.endpoint = endpoint
        self._bind_patience_s = bind_patience_s
        self.replay_endpoint = replay_endpoint
        self._topic = topic.encode("utf-8")
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=max_queue)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        self.epoch = os.urandom(8)  # this process's stream: sent with every replay's end marker
        self.num_dropped = 0
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise ValueError(f"cannot bind KV event endpoint {endpoint}: {self._error}") from self._error

    @property
    def num_published(self) -> int:
        return self._next_seq

    def publish(self, events: Sequence[KVEvent]) -> None:
        """Queue one batch (no-op for an empty one); never blocks."""
        if not events:
            return
        try:
            self._queue.put_nowait(KVEventBatch(ts=time.time(), events=list(events)))
        except queue.Full:
            self.num_dropped += 1  # the sequence gap makes subscribers resync

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued, then close the sockets."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout)

    def _run(self) -> None:
        context = zmq.Context.instance()
        pub = context.socket(zmq.PUB)
        replay = context.socket(zmq.ROUTER) if self.replay_endpoint else None
        if replay is not None:  # a whole buffer in one answer: ZMQ's default (1,000) dropped the rest
            replay.setsockopt(zmq.SNDHWM, self._buffer.maxlen + 1)
        try:
            _bind(pub, self.endpoint, self._bind_patience_s)
            if replay is not None:
                _bind(replay, self.replay_endpoint, self._bind_patience_s)
        except zmq.ZMQError as err:
            self._error = err
            pub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop(pub, replay)
        finally:
            pub.close(linger=500)
            if replay is not None:
                replay.close(linger=0)

    def _loop(self, pub: zmq.Socket, replay: zmq.Socket | None) -> None:
        while True:
            if replay is not None and replay.poll(0):
                self._serve_replay(replay)
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            seq, payload = self._next_seq, encode_batch(batch)
            self._next_seq += 1
            pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))

    def _serve_replay(self, replay: zmq.Socket) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("kv events: ignoring a malformed replay request (%d frames)", len(frames))
            return
        client, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", END_SEQ, self.epoch))


def _bind(socket: zmq.Socket, endpoint: str, patience_s: float) -> None:
    """Bind, waiting out a port that is briefly busy (EADDRINUSE) for up to `patience_s`. A worker restarted
    on its fixed endpoints can find its port held for a moment: a subscriber reconnecting to a loopback port
    in the ephemeral range while nothing listens can connect to itself through that very port (TCP
    simultaneous open) until the handshake fails. Seen once in CI's restart test; any other error is final."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            socket.bind(endpoint)
            return
        except zmq.ZMQError as err:
            if err.errno != zmq.EADDRINUSE or time.monotonic() >= deadline:
                raise
            time.sleep(0.05)
