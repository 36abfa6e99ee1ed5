"""The gateway's configuration: a TOML file (``--config gpuhit.toml``) overridden by flags.

Example::

    [gateway]
    host = "0.0.0.0"
    port = 8080
    index = "precise"            # precise (KV events) | approximate (routing history)
    block_size = 32              # optional: else read from the engines (vllm:cache_config_info)
    hash = "sha256"              # the engines' --prefix-caching-hash-algo (sha256|sha256_cbor|xxhash|xxhash_cbor)
    hash_seed = "0"              # the engines' PYTHONHASHSEED, if they run with one
    max_body_bytes = 67108864
    max_prompt_tokens = 131072   # longer prompts get 400 before routing (0 = no limit)
    timeout = 0                  # whole-request cap, seconds (0 = none); cuts long generations too
    ttfb_timeout = 60.0          # seconds to the engine's first answer byte (0 = none); then:
    idle_timeout = 60.0          # seconds between two chunks of a streamed answer (0 = none)
    unary_timeout = 600.0        # cap on a non-streamed answer's ttfb + idle x max_tokens budget (0 = none)
    stall_timeout = 5.0          # an engine with requests in flight and no progress this long is ejected (0 = off)
    breaker_threshold = 3        # consecutive timeouts / broken connections that eject an engine
    breaker_connect_threshold = 1  # consecutive refused connects that eject it
    breaker_cooldown = 2.0       # seconds before the half-open probe; doubles per failed probe
    breaker_max_cooldown = 60.0
    api_key = "..."              # optional: clients must send "Authorization: Bearer <key>"
    tokenizer = "/models/qwen3-coder"   # optional (default: the engines' model dir if local), needs gpuhit[tokenizer]
    health_interval = 1.0
    health_fail_threshold = 2
    scrape_interval = 0.5
    otel = false
    metrics_auth = false         # true: /metrics needs the API key too (/debug/state always does)
    vocab_size = 151936          # optional: token ids beyond it get 400 (or model_config = "config.json")
    max_connections = 4096       # client connections; header_timeout (both fast transport only) / body_timeout / keepalive_timeout
    upstream_max_idle = 64       # idle connections kept per engine (upstream_idle_timeout = 30 s)
    transport = "fast"           # fast (httptools on uvloop, default) | aiohttp

    [policy]                     # or:  policy = "lpwl"  in [gateway]; omitted: lpwl_auto, with vLLM
    name = "lpwl"                #   priorities only where every engine schedules by them
    type = "lpwl"                #   (gateway/engine_scheduling.py: default_policy)
    params = {}

    [[engines]]
    url = "http://127.0.0.1:8000"
    name = "gpu0"                            # optional (default e0, e1, ...)
    kv_events = "tcp://127.0.0.1:5557"       # optional: else GET /kv_event_sources
    kv_replay = "tcp://127.0.0.1:5558"
    role = "both"
    bootstrap = "http://127.0.0.1:8998"      # optional: the engine's Mooncake bootstrap server
                                             # (VLLM_MOONCAKE_BOOTSTRAP_PORT) for migration / PD
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from gateway.breaker import BreakerPolicy
from gpuhit.errors import ConfigError

INDEXES = ("precise", "approximate")
MAX_CONNECTIONS = 4096
HEADER_TIMEOUT = 10.0
_FAST_ONLY = ("max_connections", "header_timeout")  # limits aiohttp's server has no hook for
TRANSPORTS = ("fast", "aiohttp")


@dataclass(frozen=True, slots=True)
class EngineEntry:
    url: str
    name: str = ""
    kv_events: str | None = None
    kv_replay: str | None = None
    topic: str = ""
    role: str = "both"
    # Where consumers reach this engine's KV when it produces for a migration / PD step (vLLM's
    # Mooncake bootstrap server, http://host:VLLM_MOONCAKE_BOOTSTRAP_PORT). None: use the
    # remote_bootstrap_addr the producer returns in its kv_transfer_params (the emulator does).
    bootstrap: str | None = None


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    engines: tuple[EngineEntry, ...] = ()
    # None: the default, lpwl_auto, its priorities decided by what the engines schedule (resolved
    # when the gateway starts: gateway/engine_scheduling.py, default_policy)
    policy: str | Mapping[str, Any] | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    index: str = "precise"
    block_size: int | None = None  # None: what the engines report
    hash: str = "sha256"
    hash_seed: str | None = None
    model: str | None = None  # served model name; default: what the first engine reports
    max_body_bytes: int = 64 * 1024 * 1024
    max_prompt_tokens: int = 0
    timeout: float = 0.0
    api_key: str | None = None
    tokenizer: str | None = None
    text_chunk_chars: int = 64
    health_interval: float = 1.0
    health_fail_threshold: int = 2
    scrape_interval: float = 0.5
    otel: bool = False
    transport: str = "fast"  # the HTTP implementation of the hot path (gateway.http.fast | aiohttp)
    # Use the C speedups (gpuhit/speedups.py: token ids, KV events, block hashing, the KV index's hash
    # sets) when they are built; False runs the reference implementations (the same answers).
    c_speedups: bool = True
    # Access, HTTP limits and timeouts, vocabulary (see README "Gateway")
    metrics_auth: bool = False  # /metrics needs the API key too (/debug/state always does)
    vocab_size: int = 0  # token ids >= this get 400 (0: from model_config, else unchecked)
    model_config: str | None = None  # the model's HF config.json (or its folder): vocab_size
    # Client connections held at once (more get 503 and are closed), and seconds from a request's
    # first byte to its complete head: the fast transport's (None: MAX_CONNECTIONS, HEADER_TIMEOUT);
    # the aiohttp transport cannot enforce either, so setting one with it is an error.
    max_connections: int | None = None
    header_timeout: float | None = None
    body_timeout: float = 60.0  # seconds from the head to the complete body
    keepalive_timeout: float = 60.0  # idle seconds before a keep-alive client connection is closed
    upstream_max_idle: int = 64  # idle keep-alive connections kept per engine
    upstream_idle_timeout: float = 30.0  # idle seconds before an upstream connection is closed
    # A wedged engine (see gateway/breaker.py and README "Gateway")
    ttfb_timeout: float = 60.0  # request sent -> first answer byte (a streamed chunk); 0 = none
    idle_timeout: float = 60.0  # between two upstream chunks of a stream; 0 = none
    # A non-streamed answer waits ttfb + idle x max_tokens, at most this (0 = no cap).
    unary_timeout: float = 600.0
    # Streamed requests in flight, no answer byte from any of an engine's requests and no progress
    # counter moving for this long: the engine is ejected while another takes traffic (0 = off).
    stall_timeout: float = 5.0
    breaker_threshold: int = 3  # consecutive timeouts / broken connections that open an engine's breaker
    breaker_connect_threshold: int = 1  # consecutive refused connects that open it
    breaker_cooldown: float = 2.0  # seconds open before the half-open probe (x2 per failed probe)
    breaker_max_cooldown: float = 60.0
    # Replicas (gateway/share_redis.py) and the session table's cap (gateway/bindings.py)
    share: str | None = None  # redis://host:port: share counters and bindings with the other replicas
    share_channel: str = "gpuhit:share"  # the pub/sub channel (one per group of replicas)
    max_sessions: int = 65536  # sessions kept in the binding table (LRU)
    extra: Mapping[str, Any] = field(default_factory=dict)

    def validate(self) -> GatewayConfig:
        if not self.engines:
            raise ConfigError("no engines: give --engine URL (repeatable) or [[engines]] in the config file")
        names = [e.name for e in self.engines]
        if len(set(names)) != len(names):
            raise ConfigError(f"engine names must be unique, got {names}")
        for e in self.engines:
            if not e.url.startswith(("http://", "https://")):
                raise ConfigError(f"engine URL must start with http:// or https://, got {e.url!r}")
            if e.role not in ("both", "prefill", "decode"):
                raise ConfigError(f"engine {e.name}: role must be both|prefill|decode, got {e.role!r}")
            if e.bootstrap is not None and not e.bootstrap.startswith(("http://", "https://")):
                raise ConfigError(f"engine {e.name}: bootstrap must be http://host:port, got {e.bootstrap!r}")
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.index not in INDEXES:
            raise ConfigError(f"index must be one of {INDEXES}, got {self.index!r}")
        if self.block_size is not None and (isinstance(self.block_size, bool) or not isinstance(self.block_size, int)
                                            or self.block_size <= 0):
            raise ConfigError(f"block_size must be a positive integer, got {self.block_size!r}")
        from engines.hash_functions import HASH_FUNCTIONS

        if self.hash not in HASH_FUNCTIONS:
            raise ConfigError(f"hash must be one of {sorted(HASH_FUNCTIONS)} (vLLM's --prefix-caching-hash-algo), "
                              f"got {self.hash!r}")
        if self.hash_seed is not None and not isinstance(self.hash_seed, str):
            raise ConfigError(f"hash_seed must be a string (the engines' PYTHONHASHSEED), got {self.hash_seed!r}")
        for name in ("max_body_bytes", "health_fail_threshold", "text_chunk_chars"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("max_connections", "header_timeout", "body_timeout", "keepalive_timeout",
                     "upstream_idle_timeout"):
            v = getattr(self, name)
            if v is None and name in _FAST_ONLY:
                continue
            if isinstance(v, bool) or not isinstance(v, int | float) or v <= 0:
                raise ConfigError(f"{name} must be positive, got {v!r}")
        for name in ("max_prompt_tokens", "timeout", "vocab_size", "upstream_max_idle", "ttfb_timeout",
                     "idle_timeout", "unary_timeout", "stall_timeout"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        self.breaker_policy()
        if self.max_sessions <= 0:
            raise ConfigError(f"max_sessions must be positive, got {self.max_sessions}")
        if self.share is not None and not self.share.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(f"share must be a redis://host:port URL, got {self.share!r}")
        if not self.share_channel:
            raise ConfigError("share_channel must not be empty")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be 0..65535, got {self.port}")
        if self.transport == "aiohttp":
            given = [n for n in _FAST_ONLY if getattr(self, n) is not None]
            if given:
                raise ConfigError(
                    f"{' and '.join(given)} cannot apply with transport aiohttp: aiohttp's server has no "
                    "header-read timeout and no connection bound (slow or excess clients are held); use "
                    "transport fast (the default), or leave them unset")
            return self
        return replace(self, max_connections=self.max_connections or MAX_CONNECTIONS,
                       header_timeout=self.header_timeout or HEADER_TIMEOUT)

    def breaker_policy(self) -> BreakerPolicy:
        """The engines' circuit-breaker settings (validated)."""
        return BreakerPolicy(self.breaker_threshold, self.breaker_connect_threshold, self.breaker_cooldown,
                             self.breaker_max_cooldown).validate()


_SCALARS = {f.name for f in fields(GatewayConfig)} - {"engines", "policy", "extra"}


def _engine(i: int, raw: Any) -> EngineEntry:
    if isinstance(raw, str):
        raw = {"url": raw}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"engines[{i}] must be a URL or a table, got {type(raw).__name__}")
    known = {f.name for f in fields(EngineEntry)}
    unknown = set(raw) - known
    if unknown:
        raise ConfigError(f"engines[{i}]: unknown keys {sorted(unknown)}; known: {sorted(known)}")
    if not isinstance(raw.get("url"), str):
        raise ConfigError(f"engines[{i}] needs url = \"http://host:port\"")
    e = EngineEntry(**raw)
    return e if e.name else replace(e, name=f"e{i}")


def _check_type(name: str, value: Any) -> Any:
    default = GatewayConfig.__dataclass_fields__[name].default
    if default is None or value is None:
        return value
    want = type(default)
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, want) or (want is int and isinstance(value, bool)):
        raise ConfigError(f"{name} must be {want.__name__}, got {value!r}")
    return value


def from_mapping(doc: Mapping[str, Any]) -> GatewayConfig:
    """Build from a parsed TOML document (sections ``gateway``, ``policy``, ``engines``)."""
    unknown_top = set(doc) - {"gateway", "policy", "engines"}
    if unknown_top:
        raise ConfigError(f"unknown config sections {sorted(unknown_top)}; expected gateway, policy, engines")
    gw = dict(doc.get("gateway") or {})
    kw: dict[str, Any] = {}
    if "policy" in gw:
        kw["policy"] = gw.pop("policy")
    unknown = set(gw) - _SCALARS
    if unknown:
        raise ConfigError(f"[gateway]: unknown keys {sorted(unknown)}")
    for k, v in gw.items():
        kw[k] = _check_type(k, v)
    if "policy" in doc:
        kw["policy"] = doc["policy"]
    engines = doc.get("engines") or []
    if not isinstance(engines, list):
        raise ConfigError("engines must be an array of tables ([[engines]])")
    kw["engines"] = tuple(_engine(i, e) for i, e in enumerate(engines))
    return GatewayConfig(**kw)


def load(path: str) -> GatewayConfig:
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    return from_mapping(doc)


def with_overrides(cfg: GatewayConfig, engines: Sequence[str] | None = None,
                   bootstraps: Sequence[str] | None = None, **flags: Any) -> GatewayConfig:
    """Flags win over the file; ``None`` means "not given". ``--engine`` replaces the file's list;
    ``--bootstrap`` (one per engine, in the same order) sets their Mooncake bootstrap addresses."""
    kw = {k: _check_type(k, v) for k, v in flags.items() if v is not None and k in _SCALARS}
    if flags.get("policy") is not None:
        kw["policy"] = flags["policy"]
    if engines:
        kw["engines"] = tuple(_engine(i, u) for i, u in enumerate(engines))
    if bootstraps:
        ents = kw.get("engines", cfg.engines)
        if len(bootstraps) != len(ents):
            raise ConfigError(f"--bootstrap given {len(bootstraps)} times for {len(ents)} engines; give one per "
                              "engine, in --engine order")
        kw["engines"] = tuple(replace(e, bootstrap=b) for e, b in zip(ents, bootstraps))
    return replace(cfg, **kw)
