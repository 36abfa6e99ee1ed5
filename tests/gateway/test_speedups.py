"""The C speedups' loader (gpuhit/speedups.py): a build from other sources is refused. Built for
the test run by the ``c_speedups`` fixture (tests/conftest.py); what they compute is held to the
reference implementations in tests/engines/test_hashing_accel.py and tests/gateway/test_blockset.py."""

from __future__ import annotations

import pytest

from gpuhit import speedups
from gpuhit.errors import ConfigError


def test_a_build_from_another_source_is_refused(c_speedups, tmp_path):
    for k, source in enumerate(speedups.SOURCES):  # any source edited after the build
        changed = tmp_path / source.name
        changed.write_bytes(source.read_bytes() + b"\n/* edited after the build */\n")
        sources = [*speedups.SOURCES[:k], changed, *speedups.SOURCES[k + 1:]]
        with pytest.raises(ConfigError, match="built from another version of _speedups.c / _tokenids.c / _kvbatch.c / _blockset.c / _usage.c: "
                                              "run `make "
                                              "compile` again"):
            speedups.verified(c_speedups, sources)
    assert speedups.verified(c_speedups) is c_speedups
