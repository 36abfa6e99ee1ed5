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
REAL_VLLM_PRIORITY_FIXTURE = "real_vllm_priority"
# each real-vLLM fixture and the launcher (tests/e2e/real_vllm.py) that boots its servers
_REAL_VLLM_LAUNCHERS = {REAL_VLLM_FIXTURE: "LAUNCHER", REAL_VLLM_PRIORITY_FIXTURE: "PRIORITY_LAUNCHER"}


def pytest_collection_modifyitems(session, config, items):
    """Tests on real vLLM go last, and their servers start booting now (1-3.5 min) while the rest runs."""
    def uses(it, fixture):
        return fixture in getattr(it, "fixturenames", ())

    real = [it for it in items if any(uses(it, f) for f in _REAL_VLLM_LAUNCHERS)]
    if not real:
        return
    items[:] = [it for it in items if it not in real] + real
    from tests.e2e import real_vllm

    for fixture, launcher in _REAL_VLLM_LAUNCHERS.items():
        if any(uses(it, fixture) for it in real):
            getattr(real_vllm, launcher).launch()


def pytest_sessionfinish(session, exitstatus):
    import sys

    mod = sys.modules.get("tests.e2e.real_vllm")
    if mod is not None:
        for launcher in _REAL_VLLM_LAUNCHERS.values():
            getattr(mod, launcher).shutdown()


@pytest.fixture(scope="session")
def real_vllm_pair():
    """Two real vLLM servers (see tests/e2e/real_vllm.py); skips with one line without the vLLM venv."""
    from tests.e2e.real_vllm import LAUNCHER

    try:
        return LAUNCHER.get()
    except LookupError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def real_vllm_priority():
    """One real vLLM server under ``--scheduling-policy priority`` with ``--max-num-seqs 1`` (see
    tests/e2e/real_vllm.py); skips with one line without the vLLM venv."""
    from tests.e2e.real_vllm import PRIORITY_LAUNCHER

    try:
        return PRIORITY_LAUNCHER.get()
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
