"""KV events over ZMQ as vLLM's ``ZmqEventPublisher`` speaks them, and the subscribing end.

Wire protocol (vLLM ``vllm/distributed/kv_events.py``):

* PUB socket, multipart frames ``[topic, seq (8 bytes big-endian, 0, 1, 2, ...), payload]``.
* ROUTER replay socket: a DEALER sends ``[b"", start_seq (8 bytes)]``; the ROUTER answers one
  ``[b"", topic, seq, payload]`` per buffered batch with ``seq >= start_seq`` and then the end marker
  ``[b"", b"", b"\\xff" * 8, b""]`` (vLLM 0.32's ``_service_replay``: the DEALER sees 4 frames; some
  earlier releases sent ``[b"", seq, payload]`` without the topic, which the subscriber also accepts).

:class:`KVEventSubscriber` keeps an index consistent with one engine (one data-parallel rank):
on start it replays the publisher's buffer from 0 (so it learns blocks cached before it joined),
then applies live batches in order. A sequence gap (ZMQ drops at the high-water mark, or the
subscriber was slow to join) triggers a replay of the missing range; if the replay cannot be had
(no replay socket, timeout, buffer already evicted) or a payload cannot be decoded, the subscriber
delivers an ``AllBlocksCleared`` batch so the consumer drops that instance's state instead of
routing on stale knowledge, and then goes on from the live stream. A replay that times out or
errors is retried with back-off (``replay_retries``) before it counts as failed. It never dies on
bad input.

A restarted engine (back on the same ports before any health check noticed) starts a new
publisher whose sequence counts from 0 again, and its cache is empty: the old blocks must go, or
they stay in the index as phantom hits. vLLM publishes nothing that names the publisher's
incarnation (no engine id or start time in a batch; ``AllBlocksCleared`` only follows a prefix
cache reset), so the subscriber watches for the two signs it can see: the live sequence going
backwards, and the SUB side losing its TCP connection to the publisher and connecting again (the
subscriber's own connection, :mod:`engines.vllm.zmtp`, tells both in order with the data). Either
one is a restart: the consumer gets ``AllBlocksCleared`` and the subscriber syncs again as at
start (replay from 0), counted in ``stats.restarts``. A reconnect without a restart (a network
blip) costs a resync, never a wrong index. With ``watch_reconnects`` the index is fenced as soon as
the connection drops, not when it comes back: the consumer gets ``AllBlocksCleared`` at once and
nothing is delivered until the reconnection's resync, so an engine restarted within the
subscriber's reconnect interval is never credited with the blocks it lost.

:class:`engines.vllm.kv_events_publisher.KVEventPublisher` is the emulated server's side (PUB +
ROUTER with a bounded replay buffer).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from engines.kv_event_codec import BatchDecoder
from engines.kv_event_encode import END_SEQ, encode_seq
from engines.kv_events import AllBlocksCleared, KVEventBatch, KVEventDecodeError
from engines.vllm.zmtp import ZmtpSubscriber
from gpuhit.aio import cancel_and_wait

log = logging.getLogger(__name__)


BatchCallback = Callable[[KVEventBatch], None]


@dataclass(slots=True)
class SubscriberStats:
    batches: int = 0
    gaps: int = 0
    replays_ok: int = 0
    replays_failed: int = 0
    resets: int = 0
    decode_errors: int = 0
    restarts: int = 0  # publisher restarts detected (sequence back to the start, socket reconnected)
    last_seq: int | None = None


class KVEventSubscriber:
    """Subscribes to one engine's (one rank's) KV events and delivers them, in order, to ``callback``.

    Missing batches are fetched from the replay socket; when that is impossible the callback gets
    a synthetic ``AllBlocksCleared`` batch first so the consumer forgets that instance's blocks.
    ``replay_timeout`` bounds each replay round trip (seconds of loop time); a round trip that
    fails is tried ``replay_retries`` more times, ``retry_delay`` seconds apart, doubling.
    ``watch_reconnects`` makes a reconnection count as a restarted publisher (the sequence check is
    always on). ``merge_removed`` delivers each run of one-block removal events as one event
    (:func:`engines.kv_event_codec.merge_removed`), for readers that take removals as set differences.
    """

    def __init__(
        self,
        endpoint: str,
        callback: BatchCallback,
        replay_endpoint: str | None = None,
        topic: str = "",
        name: str = "",
        replay_timeout: float = 2.0,
        replay_retries: int = 3,
        retry_delay: float = 0.2,
        watch_reconnects: bool = True,
        merge_removed: bool = False,
        decoder: BatchDecoder | None = None,
    ):
        self.endpoint = endpoint
        # The KV-event stage (C with the C speedups, else the reference), and its fallback count.
        self.decoder = BatchDecoder() if decoder is None else decoder
        self.merge_removed = merge_removed
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.name = name or endpoint
        self.replay_timeout = replay_timeout
        self.replay_retries = replay_retries
        self.retry_delay = retry_delay
        self.watch_reconnects = watch_reconnects
        self._callback = callback
        self._ctx = zmq.asyncio.Context()
        self._conn: ZmtpSubscriber | None = None
        self._task: asyncio.Task | None = None
        self._last: int | None = None  # the last sequence delivered (live or replayed)
        self._live_last: int | None = None  # the last sequence read from the live socket
        self._resync = False  # a restarted publisher was detected: sync again from 0
        self._peer_lost = False  # a connection ended; the next handshake is a restart
        self._clean = False  # the consumer was told AllBlocksCleared and nothing since
        self._syncing = True  # the initial replay runs: live batches wait behind it
        self._backlog: collections.deque[list[bytes]] = collections.deque()  # live batches behind a replay
        self._wake = asyncio.Event()  # the backlog or a restart needs _run's attention
        self._connected = asyncio.Event()  # the live connection's first handshake completed
        self.stats = SubscriberStats()
        # Set once the initial replay is done and the live stream is being consumed.
        self.synced = asyncio.Event()

    def start(self) -> None:
        # The SUB side on the loop's own TCP connection (engines.vllm.zmtp says why not pyzmq's).
        self._conn = ZmtpSubscriber(self.endpoint, self.topic.encode(), self._on_frames,
                                    on_connected=self._on_connected, on_disconnected=self._on_disconnected,
                                    name=self.name)
        self._conn.start()
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"kv-sub-{self.name}")

    @property
    def connections(self) -> int:
        """Connections to the publisher that completed their handshake (1 unless it went away)."""
        return self._conn.connections if self._conn is not None else 0

    @property
    def protocol_errors(self) -> int:
        """Connections refused because the peer did not speak what a ZMQ PUB socket does."""
        return self._conn.protocol_errors if self._conn is not None else 0

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        if self._conn is not None:
            await self._conn.close()
            self._conn = None
        # destroy, not term: a socket still open (a replay cut short) would make term() wait for it
        # forever; closing twice is a no-op.
        self._ctx.destroy(linger=0)

    # -------------------------------------------------------------------------------- internals

    def _deliver(self, seq: int, payload: bytes) -> None:
        if self._resync or (self._peer_lost and self.watch_reconnects):
            return  # fenced: the publisher is gone or restarted; the resync replays what is true
        try:
            batch = self.decoder.decode(payload, self.merge_removed)
        except KVEventDecodeError as exc:
            self.stats.decode_errors += 1
            log.warning("KV events from %s: batch %d undecodable (%s); clearing its index", self.name, seq, exc)
            self._reset()
        else:
            self.stats.batches += 1
            self._clean = False
            self._callback(batch)
        self._last = seq
        self.stats.last_seq = seq

    def _reset(self) -> None:
        self.stats.resets += 1
        self._clean = True
        self._callback(KVEventBatch(ts=0.0, events=(AllBlocksCleared(),)))

    async def _replay(self, start_seq: int) -> list[tuple[int, bytes]] | None:
        """Batches from ``start_seq`` on, or None when the replay socket cannot give them."""
        if not self.replay_endpoint:
            return None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(self.replay_endpoint)
            await dealer.send_multipart((b"", encode_seq(start_seq)))
            out: list[tuple[int, bytes]] = []
            while True:
                # asyncio.timeout, not wait_for: Python 3.11's wait_for swallows a cancellation that
                # arrives as the reply does, and close() would then wait forever on this task.
                async with asyncio.timeout(self.replay_timeout):
                    frames = await dealer.recv_multipart()
                # vLLM 0.32: [b"", topic, seq, payload]; older releases: [b"", seq, payload].
                if len(frames) not in (3, 4) or len(frames[-2]) != 8:
                    raise KVEventDecodeError(
                        f"replay reply has {len(frames)} frames {[len(f) for f in frames]} (bytes), expected "
                        f"[empty, topic, 8-byte seq, payload] or [empty, 8-byte seq, payload]")
                seq_raw, payload = frames[-2], frames[-1]
                if seq_raw == END_SEQ:
                    return out
                out.append((int.from_bytes(seq_raw, "big"), payload))
        except (TimeoutError, KVEventDecodeError, zmq.ZMQError) as exc:
            # a TimeoutError's text is empty: say what it means
            why = f"no reply within {self.replay_timeout:g} s" if isinstance(exc, TimeoutError) else str(exc)
            log.warning("KV event replay from %s failed: %s", self.replay_endpoint, why or type(exc).__name__)
            return None
        finally:
            dealer.close(0)

    async def _replay_retrying(self, start_seq: int) -> list[tuple[int, bytes]] | None:
        """:meth:`_replay`, tried again with back-off while the round trip fails (the publisher may be
        busy or still binding after a restart). A buffer that no longer holds the range is not a
        failure here: retrying would not bring it back."""
        delay = self.retry_delay
        for attempt in range(self.replay_retries + 1):
            got = await self._replay(start_seq)
            if got is not None or not self.replay_endpoint:
                return got
            if attempt < self.replay_retries:
                await asyncio.sleep(delay)  # back-off between attempts (loop time)
                delay *= 2
        return None

    async def _catch_up(self, start_seq: int, upto: int | None) -> bool:
        """Replay ``[start_seq, upto)`` (``upto`` None = everything buffered); True when complete."""
        got = await self._replay_retrying(start_seq)
        if got is None:
            self.stats.replays_failed += 1
            return False
        expected = start_seq
        if upto is None and got and got[0][0] > start_seq:
            # Initial sync: the buffer no longer reaches back to the start; what it holds is all
            # anyone can know (vLLM has no snapshot), so take it from its first batch.
            expected = got[0][0]
        for seq, payload in got:
            if upto is not None and seq >= upto:
                break
            if seq < expected:
                continue
            if seq > expected:
                # The publisher's buffer no longer holds what we missed.
                self.stats.replays_failed += 1
                return False
            self._deliver(seq, payload)
            expected = seq + 1
        if upto is not None and expected < upto:
            self.stats.replays_failed += 1
            return False
        self.stats.replays_ok += 1
        return True

    async def _run(self) -> None:
        # Initial state: everything the publisher still buffers (blocks cached before we joined),
        # asked for once the live connection is up (bounded: a publisher not there yet is replayed
        # as far as it can be now). Asked before, a batch published between the replay and the
        # handshake reached neither, and with no later batch to show the gap it stayed missing
        # (an e2e test caught it on a loaded CI machine).
        if self.replay_endpoint:
            try:
                async with asyncio.timeout(self.replay_timeout):
                    await self._connected.wait()
            except TimeoutError:
                pass
            await self._catch_up(0, None)
        self._syncing = False
        self.synced.set()
        backlog = self._backlog
        while True:
            if self._resync:
                await self._sync_again()
            while backlog and not self._resync:
                await self._handle(backlog.popleft())
            if not (backlog or self._resync):
                self._wake.clear()
                await self._wake.wait()

    def _on_frames(self, frames: list[bytes]) -> None:
        """A live message, in the order the connection carried it."""
        seq = self._seq_of(frames)
        if seq is not None:
            if self._live_last is not None and seq <= self._live_last:
                # The live sequence went backwards: a new publisher. What is queued is the old
                # one's (or in the new one's replay buffer).
                self._restarted(f"sequence went back from {self._live_last} to {seq}")
            self._live_last = seq
            if self._last is None and not self.replay_endpoint and not self._syncing:
                # Joined a stream already under way (at start, or after a restart's reset) with no
                # replay socket: what came before is unknowable and the index holds none of it, so
                # the stream starts here; a gap (and a failed replay) would only cry wolf.
                self._last = seq - 1
        if self._backlog or self._resync or self._syncing or (seq is not None and seq > self._next_seq()):
            # A replay (async) must come first; keep order by queueing behind it.
            self._backlog.append(frames)
            self._wake.set()
        else:
            self._handle_in_order(frames, seq)

    def _on_disconnected(self) -> None:
        self._peer_lost = True
        if self.watch_reconnects:
            # Fence now: the engine may be restarting with an empty cache, and the reconnect that
            # proves it comes only after the subscriber's reconnect interval.
            self._backlog.clear()
            if not self._clean:
                self._reset()

    def _on_connected(self) -> None:
        self._connected.set()
        # Connected again after losing the publisher: a restart (see the module docstring).
        if self._peer_lost and self.watch_reconnects:
            self._restarted("the publisher's socket reconnected")
        self._peer_lost = False

    def _restarted(self, why: str) -> None:
        log.warning("KV events from %s: the publisher restarted (%s); clearing its index and replaying",
                    self.name, why)
        self.stats.restarts += 1
        self._resync = True
        self._peer_lost = False
        self._live_last = None
        self._backlog.clear()
        self._wake.set()

    async def _sync_again(self) -> None:
        """After a restart: forget everything, then sync as at start (replay from 0)."""
        self._resync = False
        self._last = None
        if not self._clean:  # already cleared when the connection dropped
            self._reset()
        if self.replay_endpoint:
            # Live batches wait behind the replay, as at start: one read while it runs would be
            # delivered now and again by the replay, which also holds it.
            self._syncing = True
            try:
                await self._catch_up(0, None)
            finally:
                self._syncing = False

    def _seq_of(self, frames: list[bytes]) -> int | None:
        if len(frames) != 3 or len(frames[1]) != 8:
            return None
        return int.from_bytes(frames[1], "big")

    def _next_seq(self) -> int:
        """The sequence number delivered next when nothing is missing."""
        return 0 if self._last is None else self._last + 1

    def _handle_in_order(self, frames: list[bytes], seq: int | None) -> None:
        """A frame set that needs no replay (``seq``: its :meth:`_seq_of`): deliver it, or skip a
        duplicate / malformed one."""
        if seq is None:
            self.stats.decode_errors += 1
            log.warning("KV events from %s: malformed frame set (%d frames); ignored", self.name, len(frames))
            return
        if seq < self._next_seq():
            return  # already delivered through a replay
        self._deliver(seq, frames[2])

    async def _handle(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.stats.decode_errors += 1
            log.warning("KV events from %s: malformed frame set (%d frames); ignored", self.name, len(frames))
            return
        _, seq_raw, payload = frames
        seq = int.from_bytes(seq_raw, "big")
        expected = self._next_seq()
        if seq < expected:
            return  # already delivered through a replay (a restart was caught when it was read)
        if seq > expected:
            self.stats.gaps += 1
            if not await self._catch_up(expected, seq):
                self._reset()
        self._deliver(seq, payload)
