"""The optional C speedups (``gpuhit/_speedups.c`` and ``_blockset.c``, one extension): how they are
built, loaded, and refused when stale.

What they speed up, each the one fast path of a stage whose reference gives the same answers:
``parse_uint_array`` (``_tokenids.c``), a completions body's token-id array parsed straight into
uint64 (:class:`gateway.http.token_ids.TokenIdParser`; the reference is numpy's); ``kv_batch``
(``_kvbatch.c``), a vLLM KV-event batch decoded with its token ids skipped
(:class:`engines.kv_event_codec.BatchDecoder`; the reference is msgspec's); ``sha256_blocks``, vLLM's
sha256 block-hash chain (:class:`engines.hashing.BlockHasher`; the hashing is OpenSSL's);
``text_chunk_hashes``, the approximate chained hashes of a text's chunks
(:func:`gateway.http.prompt.text_chunk_hashes` with hashlib's BLAKE2b; the C calls OpenSSL's);
``BlockSet`` (``_blockset.c``), the precise KV index's set of block hashes
(:class:`gateway.kv_index.PreciseKVIndex`); and ``usage_object`` (``_usage.c``), the usage object
of a non-streamed answer (:class:`gateway.http.usage.UsageReader`; the reference is
``usage_from_tail`` with orjson); and ``RequestParts`` (``_reqparts.c``), a client request's target,
header fields and body as httptools hands them over
(:class:`gateway.http.request_parts.RequestParts`, the reference, in Python). The three parsers answer None for anything outside the
strict shape they read, and the reference then decides (each stage counts these fallbacks).
Whoever builds a gateway decides once whether to use them (:func:`load`) and passes them to the
parts that take them; nothing reads them from a global.

``make compile`` (``python -m gpuhit.speedups build``) builds the extension in place;
``make uncompile`` (``python -m gpuhit.speedups clean``) removes it. The extension carries a SHA-256
of the sources it was built from, and :func:`load` refuses one built from another version of them
(Python would otherwise run the old code silently).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from gpuhit.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]  # the checkout
NAME = "gpuhit._speedups"
SOURCES = tuple(ROOT / "gpuhit" / f for f in ("_speedups.c", "_tokenids.c", "_kvbatch.c", "_blockset.c", "_usage.c",
                                                 "_reqparts.c"))  # init: the first


def sources_sha256(paths: Sequence[Path] = SOURCES) -> str:
    """One digest of several source files, in order: what the extension carries of its sources."""
    return hashlib.sha256("".join(hashlib.sha256(p.read_bytes()).hexdigest() for p in paths).encode()).hexdigest()


def verified(module: ModuleType, sources: Sequence[Path] = SOURCES) -> ModuleType:
    """``module`` when it was built from ``sources`` as they are now; ConfigError naming the fix otherwise."""
    if getattr(module, "SOURCE_SHA256", None) != sources_sha256(sources):
        raise ConfigError(f"{module.__file__} was built from another version of "
                          f"{' / '.join(p.name for p in sources)}: run `make compile` again, or `make uncompile` "
                          "for pure Python")
    return module


def load() -> ModuleType | None:
    """The built extension (checked against its sources), or None when there is no build."""
    if importlib.util.find_spec(NAME) is None:
        return None
    import gpuhit._speedups as module  # type: ignore[import-not-found]

    return verified(module)


def load_file(path: Path) -> ModuleType:
    """The extension built at ``path`` (:func:`build`), checked against the sources: for tests,
    which run the same inputs through it and through the reference implementations."""
    spec = importlib.util.spec_from_file_location(NAME, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{path} is not an extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return verified(module)


def build(out: Path | None = None, sources: Sequence[Path] = SOURCES) -> Path:
    """Compile the extension (needs setuptools, a C compiler, Python's headers and OpenSSL's) into
    ``out``, or in place beside its sources when None; returns the extension file. A failed build
    is a ConfigError naming what it needs (the compiler's own message is printed above it), never
    a silent fall back to pure Python."""
    try:
        from setuptools import Extension, setup
    except ImportError as exc:
        raise ConfigError(f"building the C speedups needs setuptools ({exc})") from None
    ext = Extension(NAME, [str(p) for p in sources], libraries=["crypto"], extra_compile_args=["-O3"],
                    define_macros=[("SOURCE_SHA256", f'"{sources_sha256(sources)}"')])
    target = ROOT if out is None else out
    tmp = (ROOT / "build" / "speedups") if out is None else out / "tmp"
    cwd = Path.cwd()
    try:
        os.chdir(target)  # not the checkout when building elsewhere: setuptools would read its pyproject.toml
        setup(name="gpuhit-speedups", ext_modules=[ext],
              script_args=["-q", "build_ext", "--build-temp", str(tmp), "--build-lib", str(target)])
    except SystemExit as exc:  # how setup() reports a failed compile or link
        raise ConfigError(f"building the C speedups failed ({exc}): they need a C compiler, Python's headers "
                          "and OpenSSL's (openssl/evp.h and libcrypto: Debian's libssl-dev, Fedora's "
                          "openssl-devel); the compiler's message is above") from None
    finally:
        os.chdir(cwd)
    return next((target / "gpuhit").glob("_speedups.*.so"))


def clean() -> None:
    """Remove the in-place build (back to pure Python)."""
    for p in (ROOT / "gpuhit").glob("_speedups.*.so"):
        p.unlink()
    shutil.rmtree(ROOT / "build" / "speedups", ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["build"]:
        print(f"built {build().relative_to(ROOT)}")
    elif args == ["clean"]:
        clean()
        print("C speedups removed: pure Python")
    else:
        print("usage: python -m gpuhit.speedups build|clean", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
