"""The publisher: the allocator's event sink on the engine thread (appends only), and a thread that batches the
events every few milliseconds, publishes them on a ZeroMQ PUB socket and answers replay requests.

Messages are vLLM's: PUB frames `[topic, seq, payload]` (seq: 8-byte big-endian batch number, payload: a msgpack
`KVEventBatch`); the ROUTER replay socket takes a start seq and answers every buffered batch from it as
`[seq, payload]`, then `[-1, b""]`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import msgspec
import zmq
from pagoda.blockalloc import BlockHash, BlockManager
from pagoda.server.kv_events.config import KVEventsConfig
from pagoda.server.kv_events.keys import KVEventsKeys, publish_securely, remove_certificate, write_certificate
from pagoda.server.kv_events.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

logger = logging.getLogger(__name__)

FLUSH_INTERVAL_S = 0.01  # events are batched this often
_END = (-1).to_bytes(8, "big", signed=True)
Event = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventPublisher:
    """Publishes a BlockManager's prefix-cache events (it is that manager's `KVEventSink`)."""

    def __init__(
        self,
        config: KVEventsConfig,
        *,
        medium: str,
        data_parallel_rank: int | None = None,
        keys: KVEventsKeys | None = None,
    ) -> None:
        """Bind the sockets (`config.endpoint`, `config.replay_endpoint`) as CURVE servers with `keys` and start
        the publishing thread. Without `keys` (a publisher of its own, not an engine core's) it makes a key pair
        and writes the public certificate (`certificate`, logged at INFO; removed by `close`)."""
        self.config = config
        self.medium = medium
        self.data_parallel_rank = data_parallel_rank
        self._pending: deque[Event] = deque()  # engine thread appends, the publisher thread pops
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._encoder = msgspec.msgpack.Encoder()
        self._seq = 0
        self.num_dropped = 0  # events dropped because the queue was full
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._pub: zmq.Socket[bytes] | None = None
        self._replay: zmq.Socket[bytes] | None = None
        self.endpoint: str | None = None  # what the PUB socket really bound (a `*` port resolved)
        self.replay_endpoint: str | None = None
        self.certificate: Path | None = None  # the public key's file, when this publisher made the keys
        if config.publisher == "zmq":
            if keys is None:
                keys = KVEventsKeys.new()
                self.certificate = write_certificate(keys)
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.SNDHWM, config.hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            publish_securely(self._pub, keys)
            self._pub.bind(config.endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                publish_securely(self._replay, keys)
                self._replay.bind(config.replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._thread = threading.Thread(target=self._run, name="pagoda-kv-events", daemon=True)
        self._thread.start()

    # --- the KVEventSink side (engine thread) ---------------------------------------------------------

    def _put(self, event: Event) -> None:
        if len(self._pending) >= self.config.max_queue_size:
            self.num_dropped += 1  # a stalled publisher must not grow the engine's memory
            return
        self._pending.append(event)

    def blocks_stored(
        self,
        block_hashes: Sequence[BlockHash],
        parent_hash: BlockHash | None,
        token_ids: Sequence[int],
        block_size: int,
    ) -> None:
        """Queue a BlockStored."""
        self._put(
            BlockStored(list(block_hashes), parent_hash, list(token_ids), block_size, None, self.medium)
        )

    def blocks_removed(self, block_hashes: Sequence[BlockHash]) -> None:
        """Queue a BlockRemoved."""
        self._put(BlockRemoved(list(block_hashes), self.medium))

    def all_cleared(self) -> None:
        """Queue an AllBlocksCleared."""
        self._put(AllBlocksCleared())

    def medium_sink(self, medium: str) -> MediumSink:
        """A sink whose events this publisher sends under `medium` (a KV tier's stores and evictions)."""
        return MediumSink(self, medium)

    # --- the publisher thread ------------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if self._replay is not None:
                    if poller.poll(int(FLUSH_INTERVAL_S * 1000)):
                        self._answer_replay()
                else:
                    time.sleep(FLUSH_INTERVAL_S)
                self._flush()
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                logger.exception("KV event publishing failed; events keep being collected")
        self._flush()

    def _flush(self) -> None:
        """Publish every pending event as one batch."""
        if not self._pending:
            return
        events: list[Event] = []
        while self._pending:
            events.append(self._pending.popleft())
        self._seq += 1
        payload = self._encoder.encode(KVEventBatch(time.time(), events, self.data_parallel_rank))
        seq = self._seq.to_bytes(8, "big")
        self._buffer.append((self._seq, payload))
        if self._pub is not None:
            # Over the high-water mark the batch is not sent: subscribers can replay it.
            with contextlib.suppress(zmq.Again):
                self._pub.send_multipart((self.config.topic.encode(), seq, payload), flags=zmq.NOBLOCK)

    def _answer_replay(self) -> None:
        """One replay request: [client, (b""), start seq] -> every buffered batch from it, then the end marker."""
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        client, rest = frames[0], frames[1:]
        delimiter = [b""] if len(rest) == 2 and rest[0] == b"" else []  # a REQ client sends an empty frame
        start = int.from_bytes(rest[-1], "big", signed=True) if rest and len(rest[-1]) == 8 else 0
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart([client, *delimiter, seq.to_bytes(8, "big"), payload])
        self._replay.send_multipart([client, *delimiter, _END, b""])

    def close(self) -> None:
        """Publish what is pending, stop the thread, close the sockets."""
        self._stop.set()
        self._thread.join(5)
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()
        if self.certificate is not None:
            remove_certificate(self.certificate)


class MediumSink:
    """A `KVEventSink` for another medium of the same publisher (the host KV tier's blocks, in the same batches)."""

    def __init__(self, publisher: KVEventPublisher, medium: str) -> None:
        """Events of `medium` through `publisher` (callable from any thread: the queue is a deque)."""
        self.publisher = publisher
        self.medium = medium

    def blocks_stored(
        self,
        block_hashes: Sequence[BlockHash],
        parent_hash: BlockHash | None,
        token_ids: Sequence[int],
        block_size: int,
    ) -> None:
        """Queue a BlockStored of this medium."""
        self.publisher._put(
            BlockStored(list(block_hashes), parent_hash, list(token_ids), block_size, None, self.medium)
        )

    def blocks_removed(self, block_hashes: Sequence[BlockHash]) -> None:
        """Queue a BlockRemoved of this medium."""
        self.publisher._put(BlockRemoved(list(block_hashes), self.medium))

    def all_cleared(self) -> None:
        """Nothing: AllBlocksCleared names no medium, and a tier is not cleared with the device cache."""


def start_kv_events(
    config: KVEventsConfig | None,
    kv: object,
    *,
    medium: str,
    data_parallel_rank: int | None = None,
    keys: KVEventsKeys | None = None,
) -> KVEventPublisher | None:
    """A publisher wired to `kv` when the config tree's `kv_events_config` enables events (None otherwise, or for
    a KV manager without a prefix cache); `keys`: an engine core's (its front end wrote the certificate)."""
    if config is None or not config.enable_kv_cache_events:
        return None
    if not isinstance(kv, BlockManager):
        logger.warning("KV cache events need the paged KV manager; none are published")
        return None
    publisher = KVEventPublisher(config, medium=medium, data_parallel_rank=data_parallel_rank, keys=keys)
    kv.set_event_sink(publisher)
    logger.info("publishing KV cache events on %s", publisher.endpoint)
    return publisher
