"""Two real vLLM servers (CPU build, tiny dummy-weight model) shared by every real-vLLM test in a run,
and a third under vLLM's priority scheduler for the tests of request priorities.

Start-up takes 1-3.5 minutes, so ``tests/conftest.py`` launches the pair as soon as collection finds a
test that asks for the ``real_vllm_pair`` fixture and moves those tests to the end of the run: the
servers boot while the rest of the suite runs. Both export OTLP traces (HTTP/protobuf) to one
collector process, write KV events on their own ZMQ ports, use block size 32 (the CPU attention
backend takes only multiples of 32) and the shipped tiny model with its tokenizer and chat template.
Without the vLLM venv the fixture skips with one line (CI builds the venv, so CI runs these tests).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import subprocess
import sys
import tempfile
from collections.abc import Sequence

from engines.vllm.launch import VllmServer, make_server
from engines.vllm.venv import missing_reason, vllm_python

BLOCK_SIZE = 32
MAX_MODEL_LEN = 4096
# --enable-scale-out serves the render routes (the exact ids vLLM runs for a request). No tool-call
# parser: with one, vLLM streams no chunk for the tiny model's empty token texts (tests send tools
# with tool_choice none, which needs none).
ENGINE_ARGS = ("--enable-scale-out",)


@dataclasses.dataclass
class RealVllmPair:
    """What tests get: the two servers, the collector's span file, and the run's log folder."""

    servers: Sequence[VllmServer]
    spans_path: pathlib.Path
    log_dir: pathlib.Path
    block_size: int = BLOCK_SIZE
    max_model_len: int = MAX_MODEL_LEN

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def spans(self) -> list[dict]:
        """Every span the collector has received so far."""
        text = self.spans_path.read_text() if self.spans_path.exists() else ""
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def restart(self, i: int) -> None:
        """Start server ``i`` again on the same ports (after a test killed it) and wait until ready."""
        s = self.servers[i]
        s.stop()
        s.start()
        s.wait_ready()


class _Boot:
    """Servers launched once (non-blocking, at collection, so they boot while the rest of the suite
    runs) and awaited by the first test that needs them. A subclass says what to start."""

    def __init__(self) -> None:
        self.servers: list[VllmServer] | None = None
        self.error: str | None = None
        self.ready = False

    def _make(self) -> list[VllmServer]:
        raise NotImplementedError

    def launch(self) -> None:
        if self.servers is not None or self.error is not None:
            return
        if vllm_python() is None:
            self.error = missing_reason()
            return
        self.servers = self._make()
        for s in self.servers:
            s.start()

    def _ready(self) -> list[VllmServer]:
        """The started servers, ready; raises ``LookupError`` with the reason when there are none."""
        self.launch()
        if self.error is not None:
            raise LookupError(self.error)
        assert self.servers is not None
        if not self.ready:
            for s in self.servers:
                s.wait_ready()
            self.ready = True
        return self.servers

    def shutdown(self) -> None:
        for s in self.servers or ():
            s.stop()


class _Launcher(_Boot):
    """The session's pair, with an OTLP collector for their spans."""

    def __init__(self) -> None:
        super().__init__()
        self.pair: RealVllmPair | None = None
        self.collector: subprocess.Popen[bytes] | None = None

    def _make(self) -> list[VllmServer]:
        log_dir = pathlib.Path(tempfile.mkdtemp(prefix="gpuhit-real-vllm-"))
        spans = log_dir / "spans.jsonl"
        self.collector = subprocess.Popen([sys.executable, "-m", "gpuhit.otlp_collector", str(spans)], stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL)
        assert self.collector.stdout is not None
        port = int(self.collector.stdout.readline().decode().strip())
        # Stored responses (previous_response_id): what Responses clients need from the engines.
        env = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_SERVICE_NAME": "vllm",
               "VLLM_ENABLE_RESPONSES_API_STORE": "1"}
        servers = [make_server(log_dir, f"vllm{i}", env=env, block_size=BLOCK_SIZE,
                               max_model_len=MAX_MODEL_LEN, extra=ENGINE_ARGS,
                               otlp_traces_endpoint=f"http://127.0.0.1:{port}/v1/traces")
                   for i in range(2)]
        self.pair = RealVllmPair(servers, spans, log_dir)
        return servers

    def get(self) -> RealVllmPair:
        """The ready pair; raises ``LookupError`` with the reason when there is none."""
        self._ready()
        assert self.pair is not None
        return self.pair

    def shutdown(self) -> None:
        super().shutdown()
        if self.collector is not None:
            self.collector.kill()
            self.collector.wait()


LAUNCHER = _Launcher()


class _PriorityLauncher(_Boot):
    """One more server, under ``--scheduling-policy priority`` and running one sequence at a time
    (``--max-num-seqs 1``), so the order in which queued requests run is the scheduler's and
    observable without timing; it logs every request it takes (``--enable-log-requests``: "Added
    request ..." once the engine core has it), so a test knows what is queued while the engine is
    paused. Launched like the pair when a test asks for ``real_vllm_priority``."""

    def _make(self) -> list[VllmServer]:
        log_dir = pathlib.Path(tempfile.mkdtemp(prefix="gpuhit-real-vllm-priority-"))
        return [make_server(log_dir, "vllm-priority", block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
                            scheduling_policy="priority", max_num_seqs=1, extra=("--enable-log-requests",))]

    def get(self) -> VllmServer:
        """The ready server; raises ``LookupError`` with the reason when there is none."""
        return self._ready()[0]


PRIORITY_LAUNCHER = _PriorityLauncher()


def cli_json(capsys, argv: list[str]) -> dict:
    """``gpuhit ARGV`` in this process: its exit status checked (0, else its stderr shown) and its
    standard output read as JSON."""
    from replayer.cli import main

    assert main(argv) == 0, capsys.readouterr().err[-3000:]
    return json.loads(capsys.readouterr().out)
