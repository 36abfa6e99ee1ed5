"""Ray stays optional: the default (local pool) never imports it, and --ray without it fails clearly."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from replayer.cli import main

TINY = ["replay", "--max-sessions", "1", "--max-requests", "5", "--policies", "lpwl", "--no-plots", "--json"]


def test_local_replay_does_not_import_ray(tmp_path):
    code = textwrap.dedent(f"""
        import sys
        from replayer.cli import main
        assert main({TINY + ["--out", str(tmp_path / "out")]!r}) == 0
        assert "ray" not in sys.modules, "the local executor imported ray"
    """)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_ray_flag_without_ray_says_how_to_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails as if it were not installed
    assert main(TINY + ["--out", str(tmp_path / "out"), "--ray"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'gpuhit[ray]'" in err
    assert err.count("\n") == 1  # one clear line, no traceback
    assert not (tmp_path / "out").exists()  # refused before any results folder is made
