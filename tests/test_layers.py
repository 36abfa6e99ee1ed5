"""The import layers and the no-cycle rule hold: ``lint-imports`` on this checkout, with the contracts
in pyproject.toml's ``[tool.importlinter]`` (the same check ``make lint`` runs)."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import importlinter  # noqa: F401  (the test extra installs it: a missing tool fails here, never skips)

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("gpuhit", "engines", "policies", "gateway", "analysis", "replayer")


def _lint_imports(tree: pathlib.Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` on ``tree`` (put first on the path, whatever gpuhit the venv has installed)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]))
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", code, "--no-cache"], cwd=tree, env=env, check=False,
                          capture_output=True, text=True, timeout=240)


def test_every_import_contract_is_kept():
    res = _lint_imports(ROOT)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert "0 broken" in res.stdout, res.stdout[-4000:]


def test_an_upward_import_is_refused(tmp_path):
    """The contracts are not vacuous: a copy of the tree where a policy imports the gateway fails."""
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.so", "results"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "policies" / "upward.py").write_text("from gateway import router  # noqa: F401\n", encoding="utf-8")
    res = _lint_imports(tmp_path)
    assert res.returncode == 1, res.stdout[-4000:] + res.stderr[-2000:]
    assert "policies is not allowed to import gateway" in res.stdout
    assert "policies.upward -> gateway.router" in res.stdout
