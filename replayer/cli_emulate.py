"""``gpuhit emulate``: one emulated vLLM instance behind vLLM's HTTP API, in real time."""

from __future__ import annotations

import argparse
import dataclasses

from gpuhit.aio import until_signalled
from gpuhit.errors import ConfigError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "emulate", help="serve one emulated vLLM engine over HTTP (+ ZMQ KV events), in real time",
        description="vLLM's OpenAI API (/v1/completions, /v1/chat/completions, /v1/models, /health, "
                    "/metrics, /kv_event_sources, /server_info) and ZMQ KV events, served by the emulated engine.")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--profile", default="qwen3-coder-30b-a3b@h20", help="step-time profile (name or file.json#name)")
    p.add_argument("--model", default=None, help="served model name (default: the profile's model)")
    p.add_argument("--name", default=None, help="engine id (default emu-PORT)")
    p.add_argument("--kv-events-port", type=int, default=0,
                   help="ZMQ PUB port for KV events (replay socket on port+1); 0 = any free ports")
    p.add_argument("--no-kv-events", action="store_true", help="publish no KV events")
    p.add_argument("--kv-event-shape", choices=("vllm", "current", "array"), default="vllm",
                   help="KV event msgpack shape: vLLM 0.32's own (an array batch of map events, the default), "
                        "a map batch of map events, or older vLLM's (arrays)")
    p.add_argument("--num-gpu-blocks", type=int, default=None)
    p.add_argument("--kv-capacity-gb", type=float, default=None, help="GPU KV capacity (GB, 1e9 bytes)")
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                   help="vLLM's: priority orders the waiting queue by each request's priority (lower first)")
    p.add_argument("--cpu-offload-gb", type=float, default=0.0)
    p.add_argument("--zero-cost", action="store_true",
                   help="every step and frontend cost 0 s (gateway benchmarks: the engine is never the bottleneck)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="a model directory whose tokenizer.json (and chat template) tokenizes text and chat "
                        "prompts as vLLM serving it does (default: a stand-in word hash)")
    p.add_argument("--no-c-speedups", dest="c_speedups", action="store_false",
                   help="hash prompts with the pure-Python reference even when the C speedups are built "
                        "(make compile); the hashes are the same either way")
    p.add_argument("--otel", action="store_true", default=None,
                   help="export llm_request spans over OTLP/HTTP (OTEL_EXPORTER_OTLP_* variables)")
    p.set_defaults(func=_run)


def build_engine(args: argparse.Namespace):
    from engines.emulated.engine import EmulatedEngine
    from engines.emulated.profile import load_profile

    profile = load_profile(args.profile)
    if args.zero_cost:
        zero = {f.name: 0.0 for f in dataclasses.fields(profile)
                if f.name.endswith("_s") and isinstance(getattr(profile, f.name), float)}
        profile = dataclasses.replace(profile, **zero)
    return EmulatedEngine(
        args.name or f"emu-{args.port}", profile, num_gpu_blocks=args.num_gpu_blocks,
        kv_capacity_bytes=args.kv_capacity_gb * 1e9 if args.kv_capacity_gb else None,
        block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
        cpu_offload_bytes=args.cpu_offload_gb * 1e9, model_name=args.model,
        scheduling_policy=args.scheduling_policy,
    )


async def serve(args: argparse.Namespace) -> None:
    import time

    from engines.emulated.hf_tokenizer import HFTokenizer
    from engines.emulated.server import EmulatedServer
    from gpuhit import speedups, tracing

    tokenizer = HFTokenizer(args.tokenizer) if args.tokenizer else None
    engine = build_engine(args)
    if args.no_kv_events:
        pub = replay = None
    elif args.kv_events_port:
        pub = f"tcp://{args.host}:{args.kv_events_port}"
        replay = f"tcp://{args.host}:{args.kv_events_port + 1}"
    else:
        pub = replay = f"tcp://{args.host}:0"
    tracer = tracing.setup("gpuhit-emulated-vllm", args.otel)
    srv = EmulatedServer(engine, model=args.model or engine.model_name, kv_events_endpoint=pub,
                         kv_replay_endpoint=replay, advertise_host=args.host, max_model_len=engine.max_model_len,
                         kv_event_shape=args.kv_event_shape, tracer=tracer, tokenizer=tokenizer,
                         root=args.tokenizer, wall_clock=time.time,  # `created` is Unix time, as vLLM's
                         accel=speedups.load() if args.c_speedups else None)
    port = await srv.start(args.host, args.port)
    src = srv._sources["0"]["endpoint"] if srv._sources else "off"
    print(f"gpuhit emulate: {engine.name} serving {srv.model} on http://{args.host}:{port} (KV events {src})",
          flush=True)
    try:
        await until_signalled()
    finally:
        await srv.close()
        close = getattr(engine, "close", None)
        if close is not None:
            await close()
        tracing.shutdown()


def _run(args: argparse.Namespace) -> int:
    from gpuhit.vtime import run_live

    if args.port < 0 or args.port > 65535:
        raise ConfigError(f"--port must be 0..65535, got {args.port}")
    try:
        run_live(serve(args))
    except KeyboardInterrupt:
        pass
    return 0
