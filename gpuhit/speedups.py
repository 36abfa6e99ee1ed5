"""The optional C speedups (``gpuhit/_speedups.c``, ``_blockset.c`` and ``_sha256.c``, one extension) and the guard
against a stale build.

Three parsers in C that the gateway otherwise runs with numpy, orjson and msgspec
(:func:`gateway.http.prompt.fast_completion_ids`, :func:`engines.kv_event_codec.decode_batch`,
:func:`gateway.http.usage.usage_of_json`): ``parse_uint_array`` (a token-id JSON array, validated
and parsed into uint64 in one pass), ``kv_batch`` (a vLLM KV-event batch, BlockStored's token ids
skipped without building them) and ``usage_object`` (an answer's usage object, read from its tail
without building the rest of the answer). Each
answers only the common, strict shape of its input and None for anything else, which the Python
path then decides as it always did: the answers are the same with or without the build (the
differential tests in ``tests/gateway/test_speedups.py`` hold the two to that). And one hash:
``chunk_hashes``, the approximate index's chained BLAKE2b-64 text-chunk hashes
(:func:`gateway.http.prompt.text_chunk_hashes`), equal to hashlib's (tested likewise); and vLLM's
sha256 block-hash chain, ``sha256_blocks`` (:meth:`engines.hashing.BlockHasher.hash_array`: each
block's pickle written and hashed in one pass, on the CPU's SHA extensions where it has them; held
to hashlib and the Python chain by ``tests/engines/test_hashing_accel.py``). And one
type: ``BlockSet``, the precise KV index's set of block hashes (:class:`gateway.kv_index._ChainSet`;
bare uint64 keys, batches probed with their slots prefetched), which answers as a Python set of ints
does (``tests/gateway/test_blockset.py``).

``make compile`` builds them (with the mypyc transport, :mod:`gpuhit.native`); ``make uncompile``
removes them. Pure Python is the default; ``gpuhit serve``'s banner says which is running. The
extension carries a SHA-256 of the sources it was built from, and :func:`load` refuses one built
from another version of them (Python would otherwise run the old code silently).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from gpuhit.errors import ConfigError
from gpuhit.native import ROOT, SPEEDUPS_SOURCES, sources_sha256

SOURCES = tuple(ROOT / s for s in SPEEDUPS_SOURCES)
SOURCE = SOURCES[0]
NAME = "gpuhit._speedups"


def verified(module: ModuleType, sources: Sequence[Path] = SOURCES) -> ModuleType:
    """``module`` when it was built from ``sources`` as they are now; ConfigError naming the fix otherwise."""
    if getattr(module, "SOURCE_SHA256", None) != sources_sha256(sources):
        raise ConfigError(f"{module.__file__} was built from another version of "
                          f"{' / '.join(p.name for p in sources)}: run `make compile` again, or `make uncompile` "
                          "for pure Python")
    return module


def load() -> ModuleType | None:
    """The built extension (checked against its source), or None when there is no build."""
    if importlib.util.find_spec(NAME) is None:
        return None
    import gpuhit._speedups as module  # type: ignore[import-not-found]

    return verified(module)


def load_file(path: Path) -> ModuleType:
    """The extension built at ``path`` (:func:`gpuhit.native.build_speedups`), checked against the
    source: for tests, which run the same inputs through it and through pure Python."""
    spec = importlib.util.spec_from_file_location(NAME, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{path} is not an extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return verified(module)


ACCEL: ModuleType | None = load()
