"""The gateway's request path compiled to C with mypyc, and the C speedups (optional), and the guard against a stale build.

Why: per request, the gateway's cost is CPython's: ~100 Python calls and ~3,700 bytecodes for a new
2k-token prompt, each call a frame, argument boxing and attribute look-ups by name, spread over the
router, the policy, hashing, the prompt memo, the metrics and the KV-event subscriber (none above 7%).
mypyc compiles type-annotated modules to C extensions in which calls between compiled functions,
attribute access on compiled classes and local arithmetic are C. Compiling the three transport
modules cut the instructions per non-streamed chat request from 408 k to 352 k (callgrind, 500
requests at c=1; ``analysis/results/router-speed-native-2026-11-24.md``). Compiling the routing
path too (:data:`MODULES`) leaves ~1,600 of a streamed new 2k-token prompt's ~3,700 bytecodes
interpreted, and its CPU per request under load drops (c=64: 0.225 -> 0.189 ms in one paired run);
at c=1 the cost is mostly the kernel's wake-ups and CPython's object work, which compiling does not
remove (``analysis/results/router-speed-mypyc-2026-11-26.md``). The hub (``gateway/http/app.py``),
its mixins and everything else stay Python.

``make compile`` (``python -m gpuhit.native build``) also builds the C speedups
(``gpuhit/_speedups.c``, :mod:`gpuhit.speedups`: the token-id and KV-event parsers, which carry
their own source digest). It compiles :data:`MODULES` in place: one ``.so`` beside each source,
plus mypyc's shared runtime ``gateway/http/compiled__mypyc*.so`` and a stamp (:data:`STAMP`, beside
the runtime) with each source's SHA-256. Python imports an extension module before the source of
the same name, so a compiled module edited afterwards would silently run its old code: each package
holding a compiled module (``gateway``, ``engines``, ``policies``) checks the stamp when it is
imported (:func:`check`) and refuses to load a stale or partial build, naming the
fix. ``make uncompile`` (``python -m gpuhit.native clean``) removes the build; pure Python is the
default everywhere (``make test`` runs it). Compiled classes check argument types at run time (a
``FastServer`` parameter must get a ``FastServer``) and neither they nor compiled modules' globals
can be monkeypatched.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from gpuhit.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]  # the checkout: mypyc names modules by their path from here
# The compiled modules, by path from the checkout: the fast transport, and the request's routing path
# (router, LPWL, block hashing, prompt memo, metrics, the hash check, the KV index, the KV-event
# subscriber's ZMTP). Not engines/kv_event_codec.py: mypyc drops a msgspec.Struct subclass's class
# keywords (tag, array_like, frozen), which its typed decoders depend on.
MODULES = (
    "gateway/http/fast.py", "gateway/http/fast_upstream.py", "gateway/http/forward_deadlines.py",
    "gateway/http/prompt.py", "gateway/router.py", "gateway/metrics.py", "gateway/hash_check.py",
    "gateway/kv_index.py", "policies/lpwl.py", "engines/hashing.py", "engines/vllm/zmtp.py",
)
RUNTIME_DIR = "gateway/http"  # mypyc's shared runtime, gateway/http/compiled__mypyc*.so, and the stamp
GROUP = "compiled"
STAMP = "native.sha256.json"
SPEEDUPS = "_speedups"  # gpuhit/_speedups.c, _blockset.c and _sha256.c -> gpuhit/_speedups.*.so
SPEEDUPS_SOURCES = ("gpuhit/_speedups.c", "gpuhit/_blockset.c", "gpuhit/_sha256.c")  # one extension (its module init in the first)


def sha256_of(path: Path) -> str:
    """A file's SHA-256 (hex): what the stamp records and the C speedups carry of their source."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _extensions(root: Path, source: str) -> list[Path]:
    """The extension files built from ``source`` (a path from ``root`` ending in .py)."""
    path = root / source
    return sorted(path.parent.glob(f"{path.stem}.*.so"))


def _built(root: Path) -> dict[str, list[Path]]:
    """The compiled extension files under ``root``, by source (the runtime under its own name)."""
    runtime = f"{RUNTIME_DIR}/{GROUP}__mypyc.py"  # not a source: names the runtime's files
    return {m: found for m in (*MODULES, runtime) if (found := _extensions(root, m))}


def _stray(root: Path, built: dict[str, list[Path]]) -> list[Path]:
    """Extension files beside a source in the compiled packages that :data:`MODULES` does not name
    (``built``: :func:`_built`'s answer): left by a build of another version (a module compiled then,
    not now). Python would import one against a runtime it was not built with."""
    known = {p for found in built.values() for p in found}
    packages = sorted({m.split("/", 1)[0] for m in MODULES})
    return sorted(p for pkg in packages for p in (root / pkg).rglob("*.so")
                  if p not in known and p.with_name(p.name.split(".", 1)[0] + ".py").is_file())


def check(root: Path = ROOT) -> bool:
    """True when the compiled modules are under ``root`` and were built from its current sources;
    False when there is no build. ConfigError for a stale or partial one (an edited source, a
    missing module or stamp): running old code unannounced is worse than not starting. The packages
    holding compiled modules ask through :func:`check_once`."""
    built = _built(root)
    fix = "run `make compile` again, or `make uncompile` for pure Python"
    stray = _stray(root, built)
    if stray:
        names = ", ".join(str(p.relative_to(root)) for p in stray)
        raise ConfigError(f"compiled modules from another build under {root} ({names}): {fix}")
    if not built:
        return False
    stamp = root / RUNTIME_DIR / STAMP
    try:
        recorded = json.loads(stamp.read_text())
    except (OSError, ValueError):
        raise ConfigError(f"compiled modules under {root} without a readable {stamp.relative_to(root)}: {fix}") from None
    missing = [m for m in (*MODULES, f"{RUNTIME_DIR}/{GROUP}__mypyc.py") if m not in built]
    if missing:
        raise ConfigError(f"partial compiled build under {root} (no {', '.join(missing)}): {fix}")
    changed = [m for m in MODULES if recorded.get(m) != sha256_of(root / m)]
    if changed:
        raise ConfigError(f"{', '.join(changed)} changed since it was compiled: {fix}")
    return True


_checked_root: bool | None = None  # check(ROOT)'s answer in this process, once asked


def check_once() -> bool:
    """:func:`check` of this checkout, answered once per process: ``gateway``, ``engines`` and
    ``policies`` each ask at import, before any of their modules loads, and the answer (~1.3 ms of
    globs and hashes) cannot change between them. :func:`build` and :func:`clean` forget it."""
    global _checked_root
    if _checked_root is None:
        _checked_root = check(ROOT)
    return _checked_root


def compiled() -> bool:
    """Whether the running fast transport (and with it :data:`MODULES`) is compiled (``gpuhit serve``'s banner)."""
    from gateway.http import fast

    return not fast.__file__.endswith(".py")


def describe(transport: str) -> str:
    """What of the build runs, for ``gpuhit serve``'s banner: ``, compiled`` (the fast transport) and
    ``, C speedups`` (:mod:`gpuhit.speedups`), each only when in use."""
    from gpuhit import speedups

    return (", compiled" if transport == "fast" and compiled() else "") + (", C speedups" if speedups.ACCEL else "")


def sources_sha256(paths: Sequence[Path]) -> str:
    """One digest of several source files, in order: what the C speedups carry of their sources."""
    return hashlib.sha256("".join(sha256_of(p) for p in paths).encode()).hexdigest()


def _speedups_extension(root: Path, absolute: bool = False):  # -> setuptools.Extension
    """The C speedups' extension, carrying its sources' digest (:func:`gpuhit.speedups.load` compares
    it at import). ``root``: the checkout, the current directory while setuptools builds it unless
    ``absolute``."""
    from setuptools import Extension

    sources = [root / s for s in SPEEDUPS_SOURCES]
    return Extension(f"gpuhit.{SPEEDUPS}", [str(p if absolute else p.relative_to(root)) for p in sources],
                     extra_compile_args=["-O3"], define_macros=[("SOURCE_SHA256", f'"{sources_sha256(sources)}"')])


def build_speedups(out: Path) -> Path:
    """Compile only the C speedups into ``out`` (not in place: tests load it from there) and return
    the extension file. Needs setuptools and a C compiler."""
    from setuptools import setup

    cwd = Path.cwd()
    try:
        os.chdir(out)  # not the checkout: setuptools would read its pyproject.toml
        setup(name="gpuhit-speedups", ext_modules=[_speedups_extension(ROOT, absolute=True)],
              script_args=["-q", "build_ext", "--build-temp", str(out / "tmp"), "--build-lib", str(out)])
    finally:
        os.chdir(cwd)
    return next((out / "gpuhit").glob(f"{SPEEDUPS}.*.so"))


def build(root: Path = ROOT) -> None:
    """Compile :data:`MODULES` in place with mypyc (needs ``mypy`` and a C compiler) and write the stamp."""
    try:
        from mypyc.build import mypycify
        from setuptools import setup
    except ImportError as exc:
        raise ConfigError(f"compiling needs mypy's mypyc and setuptools ({exc}): "
                          "pip install 'gpuhit[native]'") from None
    clean(root)  # forgets check_once's answer
    # Only the compiled modules are type-checked strictly; what they import is read for types
    # (--follow-imports=silent), as the rest of the gateway is not written for mypy.
    opts = ["--ignore-missing-imports", "--follow-imports=silent"]
    cwd = Path.cwd()
    try:
        os.chdir(root)
        group = f"{RUNTIME_DIR.replace('/', '.')}.{GROUP}"
        setup(name="gpuhit-native", ext_modules=[*mypycify([*opts, *MODULES], group_name=group,
                                                            opt_level="3"), _speedups_extension(root)],
              script_args=["build_ext", "--inplace", "--build-temp", "build/native", "--build-lib", "build/native"])
    finally:
        os.chdir(cwd)
    (root / RUNTIME_DIR / STAMP).write_text(json.dumps({m: sha256_of(root / m) for m in MODULES}, indent=1) + "\n")
    check(root)
    print(f"compiled {', '.join(MODULES)} ({sum(map(len, _built(root).values()))} extension files) "
          f"and {' + '.join(SPEEDUPS_SOURCES)}")


def clean(root: Path = ROOT) -> None:
    """Remove the compiled modules, the runtime, the stamp and the C speedups (back to pure Python)."""
    built = _built(root)
    for p in [*(p for found in built.values() for p in found), *_stray(root, built),
              *(root / "gpuhit").glob(f"{SPEEDUPS}.*.so")]:
        p.unlink()
    (root / RUNTIME_DIR / STAMP).unlink(missing_ok=True)
    shutil.rmtree(root / "build" / "native", ignore_errors=True)
    global _checked_root
    _checked_root = None


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
