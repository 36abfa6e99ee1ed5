"""Replayer, the top layer: the trace model and loaders, exact token synthesis, the closed-loop
driver, and the ``gpuhit`` command line (:mod:`replayer.cli`), which loads every package's commands
and so sits above all of them.

Imports run one way, checked by ``lint-imports`` (``[tool.importlinter]`` in pyproject.toml):
``replayer`` -> ``analysis`` -> ``gateway`` -> ``policies`` -> ``engines`` -> ``gpuhit``.
"""
