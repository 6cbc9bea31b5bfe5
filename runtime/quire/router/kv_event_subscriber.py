"""Receives the replicas' KV-cache events for `--routing precise-prefix`.

The router binds one SUB socket (`--kv-events-bind tcp://*:5557`) and every replica connects
its publisher to it (llm-d's layout: the operator gives each replica
`--kv-events-config {"endpoint": "tcp://<router>:5557", "topic": "kv@<pod-ip>:<port>@<model>"}`),
so replicas that come and go need no socket work here. The topic names the replica: its
`host:port` is the backend the events are about. A gap in a replica's sequence numbers is
logged (its blocks stay as last told; BlockRemoved corrects them as they come).

The socket lives on a thread of its own (blocking polls, 0.1 s at a time), so a burst of
events never holds up the proxy's event loop; the index takes a lock. A PUB socket drops what
it sends before a new subscriber's subscription reaches it, so a replica's first batch after
the router (re)starts may be lost: its blocks are then learnt from its next events.
"""

from __future__ import annotations

import asyncio
import logging
import threading

import msgspec
import zmq

from quire.kv_events.structs import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from quire.router.backends import normalize_url
from quire.router.kv_event_index import KVEventIndex

logger = logging.getLogger(__name__)
TOPIC_PREFIX = "kv@"


def backend_of_topic(topic: str, scheme: str = "http") -> str | None:
    """kv@HOST:PORT@MODEL (llm-d's topic shape) -> http://HOST:PORT; None for other topics."""
    if not topic.startswith(TOPIC_PREFIX):
        return None
    pod = topic[len(TOPIC_PREFIX):].split("@", 1)[0]
    return normalize_url(pod, scheme) if pod else None


class KVEventSubscriber:
    def __init__(self, bind: str, index: KVEventIndex, scheme: str = "http") -> None:
        self.bind = bind
        self.index = index
        self.scheme = scheme
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._last_seq: dict[str, int] = {}
        self.num_gaps = 0

    async def run(self) -> None:
        """For the router app's lifetime (a background task): the receiving thread."""
        stop = threading.Event()
        bound = threading.Event()
        errors: list[BaseException] = []
        thread = threading.Thread(target=self._receive, args=(stop, bound, errors),
                                  name="kv-events", daemon=True)
        thread.start()
        try:
            await asyncio.to_thread(bound.wait)
            if errors:
                raise errors[0]
            await asyncio.Event().wait()  # until the app stops and cancels the task
        finally:
            stop.set()
            await asyncio.to_thread(thread.join, 5)

    def _receive(self, stop: threading.Event, bound: threading.Event, errors: list) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.SUBSCRIBE, TOPIC_PREFIX.encode())
            sock.bind(self.bind)
        except zmq.ZMQError as e:
            errors.append(e)
        bound.set()
        if not errors:
            logger.info("precise-prefix routing: KV-cache events on %s", self.bind)
        try:
            while not errors and not stop.is_set():
                if not sock.poll(100):
                    continue
                frames = sock.recv_multipart()
                if len(frames) == 3:
                    self.apply(*frames)
        finally:
            sock.close(linger=0)
            ctx.term()

    def apply(self, topic: bytes, seq: bytes, payload: bytes) -> None:
        url = backend_of_topic(topic.decode("utf-8", "replace"), self.scheme)
        if url is None:
            return
        try:
            batch = self._decoder.decode(payload)
        except msgspec.DecodeError as e:
            logger.warning("precise-prefix routing: undecodable events from %s (%s)", url, e)
            return
        n = int.from_bytes(seq, "big")
        last = self._last_seq.get(url)
        if last is not None and n != last + 1:
            self.num_gaps += 1
            logger.info("KV events from %s: sequence %d after %d (events lost)", url, n, last)
        self._last_seq[url] = n
        for event in batch.events:
            self.index.num_events += 1
            if isinstance(event, BlockStored):
                self.index.stored(url, event.block_hashes, event.medium)
            elif isinstance(event, BlockRemoved):
                self.index.removed(url, event.block_hashes, event.medium)
            elif isinstance(event, AllBlocksCleared):
                self.index.forget(url)
