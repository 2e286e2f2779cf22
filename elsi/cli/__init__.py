"""The ``elsi`` command line: one sub-command per pipeline stage.

Options come from the typed config dataclasses of each stage (``elsi.config.opt``);
each sub-command lives in a module of this package and is listed in ``COMMAND_MODULES``.
Printing, progress bars and exit codes belong here, not in the stages.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading
import warnings

from elsi.cli.common import Command, build_configs, writing
from elsi.config import add_dataclass_args, argparse_text

# Modules defining ``COMMANDS: list[Command]``, in pipeline order.
COMMAND_MODULES = ("elsi.cli.analyze", "elsi.cli.select", "elsi.cli.engines", "elsi.cli.check", "elsi.cli.draft",
                   "elsi.cli.decode", "elsi.cli.study", "elsi.cli.report")


def commands() -> list[Command]:
    out: list[Command] = []
    for name in COMMAND_MODULES:
        out.extend(importlib.import_module(name).COMMANDS)
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="elsi",
        description="Choose, train and prove the target layers an EAGLE3 draft is conditioned on.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for cmd in commands():
        # argparse %-formats a sub-command's help (its line in `elsi --help`), not its description
        p = sub.add_parser(cmd.name, help=argparse_text(cmd.help), description=cmd.help)
        for cls in cmd.configs:
            add_dataclass_args(p, cls, skip=cmd.skip.get(cls, ()))
        p.set_defaults(_command=cmd)
    return parser


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"elsi: warning: {message}", file=file or sys.stderr)


def _terminate(signum, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM stops a command as Ctrl-C does: finished work saved


def main(argv: list[str] | None = None) -> int:
    warnings.showwarning = _show_warning
    parser = build_parser()
    ns = parser.parse_args(argv)
    cmd: Command = ns._command
    main_thread = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
    try:
        configs = build_configs(cmd, ns)
        with writing(cmd, configs):  # a second writer of the same output is refused here, before anything loads
            return int(cmd.run(*configs) or 0)
    except (ValueError, FileNotFoundError) as err:
        print(f"elsi {cmd.name}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\nelsi {cmd.name}: interrupted; finished work is saved, rerun the same command to continue", file=sys.stderr)
        return 130
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, old)


__all__ = ["COMMAND_MODULES", "build_parser", "commands", "main"]
