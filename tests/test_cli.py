"""``elsi --help`` and ``elsi COMMAND --help`` print every command's and every option's help as written.

argparse %-formats help strings, so a plain ``%`` in a help text ("95 % interval") once made
``elsi select --help`` a TypeError. The reference is the source of each text: a command's ``help``
(``elsi.cli.common.Command``) and each option's ``opt(default, "help")`` in its config dataclass.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from elsi.cli import commands, main


def _squeezed(text: str) -> str:
    """``text`` without whitespace: argparse re-wraps help to the terminal's width (and breaks at hyphens)."""
    return re.sub(r"\s+", "", text)


def _help_of(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def test_elsi_help_lists_every_command_with_its_help(capsys):
    out = _help_of([], capsys)
    for cmd in commands():
        assert cmd.name in out
        assert _squeezed(cmd.help) in _squeezed(out), cmd.name


@pytest.mark.parametrize("cmd", commands(), ids=lambda c: c.name)
def test_every_command_help_prints_each_option_help(cmd, capsys):
    out = _help_of([cmd.name], capsys)
    flat = _squeezed(out)
    options = 0
    for cls in cmd.configs:
        for f in dataclasses.fields(cls):
            if f.name in cmd.skip.get(cls, ()) or not f.init:
                continue
            flag = f.name if f.metadata.get("positional") else f.metadata.get("flag", "--" + f.name.replace("_", "-"))
            assert flag in out, (cmd.name, flag)
            assert _squeezed(f.metadata.get("help", "")) in flat, (cmd.name, flag, f.metadata.get("help"))
            options += 1
    assert options > 0, cmd.name
