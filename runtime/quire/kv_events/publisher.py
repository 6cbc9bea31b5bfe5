"""vLLM's ZMQ event publisher: a PUB socket that sends (topic, 8-byte big-endian sequence
number, msgpack KVEventBatch) multipart messages, and a ROUTER replay socket that answers
[start sequence] with every kept batch from it on, then (-1, b"").

The endpoint is bound when it holds `*` (tcp://*:5557), else connected to, so a central
indexer can bind and every replica connect to it (llm-d's layout). One thread owns both
sockets (ZMQ sockets are not thread-safe); `publish` only queues.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque

import msgspec
import zmq

from quire.kv_events.config import KVEventsConfig

logger = logging.getLogger(__name__)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
        self._queue: queue.Queue = queue.Queue(config.max_queue_size)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        if "*" in config.endpoint:
            self._pub.bind(config.endpoint)
        else:
            self._pub.connect(config.endpoint)
        self._replay = None
        if config.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(config.replay_endpoint)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._encoder = msgspec.msgpack.Encoder()
        self._seq = 0
        self.num_dropped = 0
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        logger.info("KV-cache events: %s %s%s", "binding" if "*" in config.endpoint
                    else "connecting to", config.endpoint,
                    f", replay on {config.replay_endpoint}" if self._replay else "")

    def publish(self, batch) -> None:
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.num_dropped += 1  # the subscriber sees a gap in the sequence and replays

    def close(self) -> None:
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join(timeout=10)
        self._thread = None
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._answer_replay()
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            try:
                payload = self._encoder.encode(batch)
                self._pub.send_multipart((self._topic, self._seq.to_bytes(8, "big"), payload))
                self._buffer.append((self._seq, payload))
                self._seq += 1
            except zmq.ZMQError as e:
                logger.warning("KV-cache events: cannot send a batch (%s)", e)

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV-cache events: ignoring a malformed replay request")
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))
