"""K gateway replicas in one simulation: what replicas that do not share state lose, and what sharing wins back.

An operator who outgrows one ``gpuhit serve`` runs K replicas behind a load balancer. Each replica
is a :class:`~gateway.router.Router` with its own counters (pending prefill, in-flight, decoding,
active blocks, routed), its own session bindings and stats, and sees only its own decisions and
completions. The KV index is shared: every replica subscribes to the engines' KV events, so each
would hold the same index; one :class:`~gateway.kv_index.PreciseKVIndex` fed once stands for those
K identical copies (replicas 1..K-1 get the engines through :class:`_NoEventSubscription`). With
the approximate index, which learns from each replica's own routing, every replica has its own.

Load balancer (``lb``), fixed per run and seeded:

* ``sticky``: a session always reaches the same replica, chosen by a hash of (seed, session id) —
  as a consistent-hash balancer on a session header does. Each sub-agent session is its own
  session.
* ``random``: every request goes to a uniformly random replica (a round-robin or least-connection
  balancer without affinity); a session's turns scatter over replicas, and with ``share="none"``
  a replica that did not route a session's previous turn has no binding for it.

Sharing (``share``):

* ``none``: nothing is shared beyond the KV index.
* ``decisions``: every replica's counters and bindings reach the others through a
  :class:`SimBus` after ``share_delay`` simulated seconds, by the same :class:`gateway.share.ShareLink`
  the live gateway uses over Redis (``gpuhit serve --share redis://...``). With delay 0 each
  replica sees every other's decision the moment it is made.

K = 1 is not built here at all: :func:`replayer.simulate.simulate` keeps its single router, so its
records are those of a run without the option.
"""

from __future__ import annotations

import collections
import hashlib
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gpuhit.errors import ConfigError

LB_MODES = ("sticky", "random")
SHARE_MODES = ("none", "decisions")


@dataclass(frozen=True, slots=True)
class ReplicaConfig:
    """How many gateway replicas, how clients reach them, and what they share."""

    replicas: int = 1
    share: str = "none"
    lb: str = "sticky"
    share_delay: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.replicas, int) or self.replicas <= 0:
            raise ConfigError(f"--gateway-replicas must be a positive integer, got {self.replicas!r}")
        if self.share not in SHARE_MODES:
            raise ConfigError(f"--share must be one of {', '.join(SHARE_MODES)}, got {self.share!r}")
        if self.lb not in LB_MODES:
            raise ConfigError(f"--replica-lb must be one of {', '.join(LB_MODES)}, got {self.lb!r}")
        if not self.share_delay >= 0:
            raise ConfigError(f"--share-delay must be >= 0 seconds, got {self.share_delay!r}")

    @property
    def label(self) -> str:
        """A suffix for run labels: '' for one replica."""
        if self.replicas == 1:
            return ""
        s = f"x{self.replicas}{'' if self.lb == 'sticky' else '-' + self.lb}"
        if self.share != "none":
            s += f"-share{'' if not self.share_delay else f'@{self.share_delay:g}s'}"
        return s

    def as_dict(self) -> dict[str, Any]:
        return {"replicas": self.replicas, "share": self.share, "lb": self.lb, "share_delay": self.share_delay}


class _NoEventSubscription:
    """An engine as a replica other than the first sees it: the same engine, minus the KV-event
    subscription (the shared index is fed once; see the module docstring)."""

    __slots__ = ("_engine",)

    def __init__(self, engine: Any):
        self._engine = engine

    def subscribe_kv_events(self, callback: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


class SimBus:
    """In-process transport for :class:`gateway.share.ShareLink`: a message reaches every other
    replica ``delay`` simulated seconds after it was sent, in send order (one FIFO, one timer)."""

    def __init__(self, delay: float = 0.0):
        self.delay = delay
        self.links: list[Any] = []
        self._queue: collections.deque[tuple[float, dict[str, Any]]] = collections.deque()
        self._timer: Any = None
        self.sent = 0

    def dirty(self, i: int) -> Callable[[], None]:
        """The ``on_dirty`` of replica ``i``'s link: send its message now."""

        def go() -> None:
            self.send(self.links[i].message())

        return go

    def send(self, msg: dict[str, Any]) -> None:
        self.sent += 1
        if self.delay == 0:
            self._deliver(msg)
            return
        import asyncio

        loop = asyncio.get_running_loop()
        self._queue.append((loop.time() + self.delay, msg))
        if self._timer is None:
            self._timer = loop.call_at(self._queue[0][0], self._drain)

    def _deliver(self, msg: dict[str, Any]) -> None:
        for link in self.links:
            link.receive(msg)

    def _drain(self) -> None:
        import asyncio

        loop = asyncio.get_running_loop()
        now = loop.time()
        self._timer = None
        q = self._queue
        while q and q[0][0] <= now:
            self._deliver(q.popleft()[1])
        if q:
            self._timer = loop.call_at(q[0][0], self._drain)


class ReplicaSet:
    """K routers behind a simulated load balancer; quacks like one router for
    :class:`replayer.simulate.SimTarget` (``engines``, ``submit``, ``stats``)."""

    def __init__(self, routers: Sequence[Any], cfg: ReplicaConfig, seed: int, bus: SimBus | None = None):
        self.routers = tuple(routers)
        self.cfg = cfg
        self.seed = seed
        self.bus = bus
        self._rng = random.Random(f"gpuhit-replica-lb-{seed}")
        self._sticky: dict[str, int] = {}
        self.requests_by_replica = [0] * len(self.routers)

    @property
    def engines(self) -> tuple[Any, ...]:
        return self.routers[0].engines

    def replica_of(self, session: str | None) -> int:
        """The replica the balancer sends this request to (advances the random balancer)."""
        k = len(self.routers)
        if self.cfg.lb == "random" or session is None:
            return self._rng.randrange(k)
        r = self._sticky.get(session)
        if r is None:
            h = hashlib.blake2b(f"{self.seed}:{session}".encode(), digest_size=8).digest()
            r = self._sticky[session] = int.from_bytes(h, "big") % k
        return r

    async def submit(self, req: Any) -> Any:
        r = self.replica_of(req.session_id)
        self.requests_by_replica[r] += 1
        return await self.routers[r].submit(req)

    @property
    def stats(self) -> _MergedStats:
        return _MergedStats(self)


class _MergedStats:
    """The replicas' RouterStats summed field by field, plus per-replica request counts."""

    def __init__(self, rs: ReplicaSet):
        self._rs = rs

    def as_dict(self) -> dict[str, Any]:
        rs = self._rs
        out: dict[str, Any] = {}
        for r in rs.routers:
            for k, v in r.stats.as_dict().items():
                if k not in out:
                    out[k] = v
                elif isinstance(v, dict):
                    for kk, vv in v.items():
                        out[k][kk] = out[k].get(kk, 0) + vv
                elif isinstance(v, list):
                    out[k] = [a + b for a, b in zip(out[k], v)]
                else:
                    out[k] += v
        out["replicas"] = rs.cfg.as_dict()
        out["requests_by_replica"] = list(rs.requests_by_replica)
        if rs.bus is not None:
            out["share_messages"] = rs.bus.sent
        return out


def build_replicas(cfg: ReplicaConfig, engines: Sequence[Any], make_policy: Callable[[], Any],
                   make_index: Callable[[Sequence[Any]], Any], shared_index: bool, seed: int,
                   **router_kw: Any) -> ReplicaSet:
    """``cfg.replicas`` routers over ``engines``. ``make_index(engines)`` builds a KV index; with
    ``shared_index`` one is built and fed by the first router's event subscription, else one per
    replica. ``router_kw`` go to every :class:`~gateway.router.Router`."""
    from gateway.router import Router
    from gateway.share import ShareLink

    if cfg.replicas < 2:
        raise ConfigError("build_replicas is for 2 or more replicas; one replica is the plain router")
    shared = make_index(engines) if shared_index else None
    routers = []
    for k in range(cfg.replicas):
        engs = list(engines) if k == 0 else [_NoEventSubscription(e) for e in engines]
        idx = shared if shared is not None else make_index(engines)
        routers.append(Router(engs, make_policy(), index=idx, **router_kw))
    bus = None
    if cfg.share == "decisions":
        bus = SimBus(cfg.share_delay)
        bus.links = [ShareLink(r, f"replica{k}", bus.dirty(k)) for k, r in enumerate(routers)]
    return ReplicaSet(routers, cfg, seed, bus)
