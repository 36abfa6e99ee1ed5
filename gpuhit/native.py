"""The fast transport compiled to C with mypyc, and the C speedups (optional), and the guard against a stale build.

Why: per request, the gateway's cost on short requests is CPython's: ~150 Python calls, each a
frame, argument boxing and attribute look-ups by name. mypyc compiles type-annotated modules to C
extensions in which calls between compiled functions, attribute access on compiled classes and
local arithmetic are C. Compiling the three transport modules (:data:`MODULES`) cut the
instructions per non-streamed chat request from 408 k to 352 k (callgrind, 500 requests at c=1;
``analysis/results/router-speed-native-2026-11-24.md``). The rest of the gateway stays Python.

``make compile`` (``python -m gpuhit.native build``) also builds the C speedups
(``gpuhit/_speedups.c``, :mod:`gpuhit.speedups`: the token-id and KV-event parsers, which carry
their own source digest). It compiles the transport in place: one ``.so``
beside each source, plus mypyc's shared runtime ``gateway/http/compiled__mypyc*.so`` and a stamp
(:data:`STAMP`) with each source's SHA-256. Python imports an extension module before the source
of the same name, so a compiled module edited afterwards would silently run its old code: the
``gateway.http`` package checks the stamp at import (:func:`check`) and refuses to load a stale or partial build,
naming the fix. ``make uncompile`` (``python -m gpuhit.native clean``) removes the build; pure Python is the
default everywhere (``make test`` runs it). Compiled classes check argument types at run time
(a ``FastServer`` parameter must get a ``FastServer``) and cannot be monkeypatched.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

from gpuhit.errors import ConfigError

HERE = Path(__file__).resolve().parents[1] / "gateway" / "http"  # the compiled modules' package
MODULES = ("fast", "fast_upstream", "forward_deadlines")  # gateway/http/<name>.py
GROUP = "compiled"  # mypyc's shared runtime: gateway/http/compiled__mypyc*.so
STAMP = "native.sha256.json"
SPEEDUPS = "_speedups"  # gpuhit/_speedups.c -> gpuhit/_speedups.*.so


def sha256_of(path: Path) -> str:
    """A file's SHA-256 (hex): what the stamp records and the C speedups carry of their source."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _built(directory: Path) -> list[Path]:
    """The compiled extension files in ``directory`` (modules and the shared runtime)."""
    names = (*MODULES, f"{GROUP}__mypyc")
    return sorted(p for n in names for p in directory.glob(f"{n}.*.so"))


def check(directory: Path = HERE) -> bool:
    """True when the compiled modules are in ``directory`` and were built from its current sources;
    False when there is no build. ConfigError for a stale or partial one (an edited source, a
    missing module or stamp): running old code unannounced is worse than not starting."""
    built = _built(directory)
    if not built:
        return False
    fix = "run `make compile` again, or `make uncompile` for the pure-Python transport"
    stamp = directory / STAMP
    try:
        recorded = json.loads(stamp.read_text())
    except (OSError, ValueError):
        raise ConfigError(f"compiled transport modules in {directory} without a readable {STAMP}: {fix}") from None
    missing = [m for m in MODULES if not any(p.name.startswith(f"{m}.") for p in built)]
    if missing:
        raise ConfigError(f"partial compiled transport in {directory} (no {', '.join(missing)}): {fix}")
    changed = [m for m in MODULES if recorded.get(f"{m}.py") != sha256_of(directory / f"{m}.py")]
    if changed:
        raise ConfigError(f"{', '.join(f'{m}.py' for m in changed)} changed since the transport was compiled: {fix}")
    return True


def compiled() -> bool:
    """Whether the running fast transport is the compiled one (for ``gpuhit serve``'s banner)."""
    from gateway.http import fast

    return not fast.__file__.endswith(".py")


def describe(transport: str) -> str:
    """What of the build runs, for ``gpuhit serve``'s banner: ``, compiled`` (the fast transport) and
    ``, C speedups`` (:mod:`gpuhit.speedups`), each only when in use."""
    from gpuhit import speedups

    return (", compiled" if transport == "fast" and compiled() else "") + (", C speedups" if speedups.ACCEL else "")


def _speedups_extension(root: Path, absolute: bool = False):  # -> setuptools.Extension
    """The C speedups' extension, carrying its source's digest (:func:`gpuhit.speedups.load` compares
    it at import). ``root``: the checkout, the current directory while setuptools builds it unless
    ``absolute``."""
    from setuptools import Extension

    c_source = root / "gpuhit" / f"{SPEEDUPS}.c"
    return Extension(f"gpuhit.{SPEEDUPS}", [str(c_source if absolute else c_source.relative_to(root))],
                     extra_compile_args=["-O3"], define_macros=[("SOURCE_SHA256", f'"{sha256_of(c_source)}"')])


def build_speedups(out: Path) -> Path:
    """Compile only the C speedups into ``out`` (not in place: tests load it from there) and return
    the extension file. Needs setuptools and a C compiler."""
    from setuptools import setup

    cwd = Path.cwd()
    try:
        os.chdir(out)  # not the checkout: setuptools would read its pyproject.toml
        setup(name="gpuhit-speedups", ext_modules=[_speedups_extension(HERE.parents[1], absolute=True)],
              script_args=["-q", "build_ext", "--build-temp", str(out / "tmp"), "--build-lib", str(out)])
    finally:
        os.chdir(cwd)
    return next((out / "gpuhit").glob(f"{SPEEDUPS}.*.so"))


def build(directory: Path = HERE) -> None:
    """Compile :data:`MODULES` in place with mypyc (needs ``mypy`` and a C compiler) and write the stamp."""
    try:
        from mypyc.build import mypycify
        from setuptools import setup
    except ImportError as exc:
        raise ConfigError(f"compiling the transport needs mypy's mypyc and setuptools ({exc}): "
                          "pip install 'gpuhit[native]'") from None
    clean(directory)
    root = directory.parents[1]  # the checkout: mypyc names modules by their path from here
    sources = [str((directory / f"{m}.py").relative_to(root)) for m in MODULES]
    # Only the compiled modules are type-checked strictly; what they import is read for types
    # (--follow-imports=silent), as the rest of the gateway is not written for mypy.
    opts = ["--ignore-missing-imports", "--follow-imports=silent"]
    cwd = Path.cwd()
    try:
        os.chdir(root)
        setup(name="gpuhit-native", ext_modules=[*mypycify([*opts, *sources], group_name=f"gateway.http.{GROUP}",
                                                            opt_level="3"), _speedups_extension(root)],
              script_args=["build_ext", "--inplace", "--build-temp", "build/native", "--build-lib", "build/native"])
    finally:
        os.chdir(cwd)
    (directory / STAMP).write_text(json.dumps({f"{m}.py": sha256_of(directory / f"{m}.py") for m in MODULES},
                                              indent=1) + "\n")
    check(directory)
    print(f"compiled {', '.join(sources)} ({len(_built(directory))} extension files) and gpuhit/{SPEEDUPS}.c")


def clean(directory: Path = HERE) -> None:
    """Remove the compiled modules, the runtime, the stamp and the C speedups (back to pure Python)."""
    for p in [*_built(directory), *(directory.parents[1] / "gpuhit").glob(f"{SPEEDUPS}.*.so")]:
        p.unlink()
    (directory / STAMP).unlink(missing_ok=True)
    shutil.rmtree(directory.parents[1] / "build" / "native", ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["build"]:
        build()
    elif args == ["clean"]:
        clean()
        print("compiled transport and C speedups removed: pure Python")
    else:
        print("usage: python -m gpuhit.native build|clean", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
