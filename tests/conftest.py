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
