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
        with pytest.raises(ConfigError, match="built from another version of _speedups.c / _tokenids.c / _kvbatch.c / _blockset.c / _usage.c / "
                                              "_reqparts.c: "
                                              "run `make "
                                              "compile` again"):
            speedups.verified(c_speedups, sources)
    assert speedups.verified(c_speedups) is c_speedups


def test_a_failed_build_says_what_it_needs(tmp_path):
    """Where a header is missing (OpenSSL's, on a machine without libssl-dev) the build stops with
    what it needs, never a silent pure-Python fall back."""
    import shutil

    if shutil.which("cc") is None:
        pytest.skip("no C compiler (cc)")
    source = tmp_path / "_speedups.c"
    source.write_text("#include <gpuhit_no_such_header/evp.h>\n")
    with pytest.raises(ConfigError, match="building the C speedups failed .*OpenSSL's .*libssl-dev"):
        speedups.build(tmp_path, sources=[source])
