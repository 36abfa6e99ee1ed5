"""The ``gpuhit`` command line (``python -m replayer.cli``).

It names a module of every package, so it lives in the top package, never in the ground (``gpuhit/``).

Each package contributes its subcommands through a ``register(subparsers)`` function in a module
listed in :data:`COMMAND_MODULES`; a subcommand sets ``func(args) -> int`` on its parser. Every
command that prints a table also takes ``--json`` and then prints one JSON document on stdout.
Errors from the :mod:`gpuhit.errors` hierarchy are printed as one clear line (exit code 2).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from gpuhit import __version__
from gpuhit.errors import GpuhitError

COMMAND_MODULES: tuple[str, ...] = (
    "replayer.cli_trace",  # gpuhit trace stats|convert
    "replayer.cli_replay",  # gpuhit replay
    "replayer.cli_sweep",  # gpuhit sweep
    "replayer.cli_experiment",  # gpuhit experiment tiers|knee|ab, gpuhit emulate-check
    "replayer.cli_emulate",  # gpuhit emulate
    "gateway.cli",  # gpuhit serve, gpuhit vllm-cmd
    "replayer.cli_attention",  # gpuhit attention ...
    "analysis.cli_compare",  # gpuhit compare
    "analysis.lost_hits",  # gpuhit lost-hits
    "analysis.fairness",  # gpuhit fairness
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpuhit",
        description="GPU-hit-first LLM routing: gateway, closed-loop trace replayer, emulated vLLM engine.",
    )
    parser.add_argument("--version", action="version", version=f"gpuhit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and (name == exc.name or name.startswith(exc.name + ".")):
                # that command family is not installed/built: its commands are simply absent
                continue
            raise
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0 if args.command is None else 2
    try:
        return int(args.func(args) or 0)
    except GpuhitError as exc:
        print(f"gpuhit: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("gpuhit: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
