"""Run vLLM's two-step PD protocol against two real vLLM servers (CPU build) and report what happened.

    python -m engines.vllm.pd_check [--connector NixlConnector] [--extra-path DIR] [--out result.json]

Starts a producer and a consumer (the shipped tiny model, block 32) with ``--kv-transfer-config`` for
the connector, then, for a few prompts: (1) sends the whole prompt to the producer with
``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": true, ...}``; (2) sends the same prompt
to the consumer with the ``kv_transfer_params`` the producer returned (``do_remote_prefill``), and
records the consumer's ``cached_tokens`` (vLLM counts connector-loaded tokens as cached) next to a
control request on a fresh prompt. Prints one JSON object (and writes it to ``--out``).

The connector's package may live outside the vLLM venv (``--extra-path``, prepended to the servers'
``PYTHONPATH``): NIXL's wheel (``pip install --target DIR --no-deps nixl nixl-cu12``, 240 MB) loads
on a CPU-only host and its UCX backend moves host memory. Not run in CI: two more vLLM servers cost
~4-6 minutes of CI's two cores, and the ``nixl`` wheels are not part of the vLLM venv.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import urllib.request
from typing import Any

from engines.vllm.launch import free_port, make_server, running

BLOCK = 32


def _external_hits(url: str) -> float:
    """The consumer's ``vllm:external_prefix_cache_hits`` counter (tokens loaded through the connector)."""
    with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:external_prefix_cache_hits_total{"))


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def check(connector: str, extra_path: str | None, log_dir: pathlib.Path) -> dict[str, Any]:
    env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, os.environ.get("PYTHONPATH")) if p)
    ktc = {"kv_connector": connector, "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    servers = [
        make_server(log_dir, name, env={**env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}, kv_events=False,
                    block_size=BLOCK, extra=["--kv-transfer-config", json.dumps(ktc)])
        for name in ("producer", "consumer")
    ]
    out: dict[str, Any] = {"connector": connector, "kv_transfer_config": ktc, "turns": []}
    try:
        with running(servers, timeout=900) as (prod, cons):
            for i, n in enumerate((100, 200, 333)):
                prompt = list(range(3000 + 1000 * i, 3000 + 1000 * i + n))
                first = _post(prod.url + "/v1/completions", {
                    "model": "tiny", "prompt": prompt, "max_tokens": 1,
                    "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                           "remote_engine_id": None, "remote_block_ids": None,
                                           "remote_host": None, "remote_port": None}})
                params = first.get("kv_transfer_params")
                before = _external_hits(cons.url)
                second = _post(cons.url + "/v1/completions", {
                    "model": "tiny", "prompt": prompt, "max_tokens": 4, "ignore_eos": True,
                    "kv_transfer_params": params})
                loaded = _external_hits(cons.url) - before
                control = _post(cons.url + "/v1/completions", {
                    "model": "tiny", "prompt": [p + 7 for p in prompt], "max_tokens": 1})
                out["turns"].append({
                    "prompt_tokens": n,
                    "producer_returned": params,
                    # vLLM 0.32 reports the PRODUCER's prefix hits here (remote_prefill_cached_tokens)
                    "consumer_cached_tokens": second["usage"]["prompt_tokens_details"]["cached_tokens"],
                    "consumer_external_prefix_cache_hits": loaded,
                    "consumer_completion_tokens": second["usage"]["completion_tokens"],
                    "control_cached_tokens": control["usage"]["prompt_tokens_details"]["cached_tokens"],
                })
        # the consumer loads the whole prompt's KV (NIXL: all of it, less a model-specific backoff)
        out["ok"] = all(t["consumer_external_prefix_cache_hits"] >= t["prompt_tokens"] - 1
                        and t["control_cached_tokens"] == 0 for t in out["turns"])
    except Exception as exc:  # noqa: BLE001 - the report says what failed, with the servers' logs
        out["ok"] = False
        out["error"] = f"{type(exc).__name__}: {exc}"[:3000]
    out["logs"] = {s.log_path.name: [ln[:300] for ln in s.log_path.read_text(errors="replace").splitlines()
                                     if "KV Transfer metrics" in ln or "ERROR" in ln][:20] for s in servers}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connector", default="NixlConnector")
    ap.add_argument("--extra-path", default=None, help="prepended to the servers' PYTHONPATH (the connector's wheel)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    log_dir = pathlib.Path(tempfile.mkdtemp(prefix="gpuhit-pd-check-"))
    res = check(args.connector, args.extra_path, log_dir)
    text = json.dumps(res, indent=1)
    if args.out:
        pathlib.Path(args.out).write_text(text + "\n")
    print(text)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
