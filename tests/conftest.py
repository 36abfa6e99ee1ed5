"""Shared test fixtures. ``SHARED`` is ../shared (tests and benchmarks may read it; the product never does)."""

from __future__ import annotations

import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
BUNDLED_TRACES = ROOT / "traces"


@pytest.fixture
def shared_traces() -> pathlib.Path:
    path = SHARED / "traces"
    if not path.is_dir():
        pytest.skip("../shared/traces is not beside this checkout")
    return path


REAL_VLLM_FIXTURE = "real_vllm_pair"


def pytest_collection_modifyitems(session, config, items):
    """Tests on real vLLM go last, and their servers start booting now (1-3.5 min) while the rest runs."""
    real = [it for it in items if REAL_VLLM_FIXTURE in getattr(it, "fixturenames", ())]
    if not real:
        return
    items[:] = [it for it in items if REAL_VLLM_FIXTURE not in getattr(it, "fixturenames", ())] + real
    from tests.e2e.real_vllm import LAUNCHER

    LAUNCHER.launch()


def pytest_sessionfinish(session, exitstatus):
    import sys

    mod = sys.modules.get("tests.e2e.real_vllm")
    if mod is not None:
        mod.LAUNCHER.shutdown()


@pytest.fixture(scope="session")
def real_vllm_pair():
    """Two real vLLM servers (see tests/e2e/real_vllm.py); skips with one line without the vLLM venv."""
    from tests.e2e.real_vllm import LAUNCHER

    try:
        return LAUNCHER.get()
    except LookupError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def c_speedups(tmp_path_factory):
    """The C speedups (gpuhit/_speedups.c) compiled into a temporary folder and loaded from there, so
    that tests run the C path whether or not this checkout is built (`make compile`); CI has a C
    compiler, and a machine without one skips with one line."""
    import shutil

    if shutil.which("cc") is None:
        pytest.skip("no C compiler (cc) to build gpuhit/_speedups.c")
    from gpuhit import speedups

    return speedups.load_file(speedups.build(tmp_path_factory.mktemp("speedups")))
