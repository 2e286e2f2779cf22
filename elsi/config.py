"""Typed config dataclasses are the single source of every CLI option and default.

A field declared with ``opt(default, "help", ...)`` becomes ``--field-name`` on the
commands that use its dataclass; the help text and default are written once, here.
A field declared with ``affects_result=False`` (where output goes, how often to checkpoint,
whether to compile) is left out of the settings a saved result is matched against
(``result_free``, ``result_settings``); one declared with ``added=VALUE`` came after results
were saved, and a saved record without it was made with VALUE (``added_settings``).
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any


def opt(default: Any = dataclasses.MISSING, help: str = "", affects_result: bool = True,
        added: Any = dataclasses.MISSING, **meta) -> Any:
    """A dataclass field with CLI metadata (``choices``, ``nargs``, ``flag``, ``positional``).

    ``affects_result=False``: the option does not change what a run computes (an output path, a
    checkpoint interval, compilation), so ``result_settings`` leaves it out of the settings a saved
    result must match. ``added``: the value every record saved before the option existed was made with.
    """
    if not affects_result:
        meta["affects_result"] = False
    if added is not dataclasses.MISSING:
        meta["added"] = added
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda d=default: list(d), metadata={"help": help, **meta})
    return dataclasses.field(default=default, metadata={"help": help, **meta})


def like(cls: type, name: str, default: Any = dataclasses.MISSING, help_suffix: str = "") -> Any:
    """A field declared like ``cls.name``: the same help and marks (``affects_result``, ``added``), and the same
    default unless ``default`` is given."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if default is dataclasses.MISSING:
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
    return opt(default, f.metadata["help"] + help_suffix, **{k: v for k, v in f.metadata.items() if k != "help"})


def at_least(cfg: Any, **bounds: float) -> None:
    """Validate fields of a config against lower bounds, in the order given: ValueError naming the first field
    below its bound, ``"beam must be >= 1, got 0"``."""
    for name, low in bounds.items():
        value = getattr(cfg, name)
        if value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")


def result_free(cls: type) -> tuple[str, ...]:
    """The fields of config dataclass ``cls`` (or of an instance's class) declared ``affects_result=False``,
    in declaration order."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("affects_result") is False)


def result_settings(cfg: Any, drop: tuple[str, ...] = ()) -> dict:
    """``dataclasses.asdict(cfg)`` without its result-free fields (``result_free``) and ``drop``: the settings a
    saved result is matched against, in field order."""
    skip = set(result_free(cfg)) | set(drop)
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in skip}


def added_settings(cls: type) -> dict[str, Any]:
    """{field: value} of the fields of ``cls`` declared with ``added=``: what a record saved before the field
    existed was made with (fill them in where a saved record lacks the key, then compare)."""
    return {f.name: f.metadata["added"] for f in dataclasses.fields(cls) if "added" in f.metadata}


def settings_diff(old: Any, new: Any, where: str, path: str = "") -> list[str]:
    """Each leaf of two nested settings dicts that differs, as "key.sub: <old> in <where>, <new> now"."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in sorted(set(old) | set(new), key=str):
            p = f"{path}.{k}" if path else str(k)
            if k not in old:
                out.append(f"{p}: absent in {where}, {new[k]!r} now")
            elif k not in new:
                out.append(f"{p}: {old[k]!r} in {where}, absent now")
            else:
                out.extend(settings_diff(old[k], new[k], where, p))
        return out
    return [] if old == new else [f"{path}: {old!r} in {where}, {new!r} now"]


def _base_type(tp) -> tuple[type, bool]:
    """(element type, is_list) of an annotation like ``int``, ``list[float]``, ``str | None``."""
    origin = typing.get_origin(tp)
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if origin in (list, tuple):
        return args[0], True
    if args and origin is not None:  # Optional / Union
        return _base_type(args[0])
    return tp, False


def argparse_text(text: str) -> str:
    """``text`` as argparse's ``help=`` takes it: argparse %-formats help (``%(default)s``), so a plain ``%`` (as in
    "95 % interval") is doubled to print as written."""
    return text.replace("%", "%%")


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """Add one option per field of ``cls`` to ``parser`` (the field's name with dashes)."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__, (cls.__doc__ or "").strip().splitlines()[0])
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.init:
            continue
        meta = f.metadata
        tp, is_list = _base_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        help_text = meta.get("help", "")
        if default not in (None, "", [], dataclasses.MISSING) and not isinstance(default, bool):
            help_text += f" (default: {default if not isinstance(default, list) else ' '.join(map(str, default))})"
        kwargs: dict[str, Any] = {"help": argparse_text(help_text), "dest": f.name}
        names = [meta.get("flag", "--" + f.name.replace("_", "-"))]
        if meta.get("positional"):
            kwargs.pop("dest")
            names = [f.name]
        if tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
            kwargs["default"] = default
        else:
            kwargs["type"] = tp
            kwargs["default"] = default
            if "choices" in meta:
                kwargs["choices"] = meta["choices"]
            if is_list:
                kwargs["nargs"] = meta.get("nargs", "+")
            elif meta.get("positional") and "nargs" in meta:
                kwargs["nargs"] = meta["nargs"]
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and not meta.get("positional"):
                kwargs["required"] = True
        group.add_argument(*names, **kwargs)


def from_args(cls: type, ns: argparse.Namespace, _skip: tuple[str, ...] = (), **overrides):
    """Build ``cls`` from parsed arguments (fields absent from ``ns`` or in ``_skip`` keep their defaults)."""
    vals = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)
            if f.init and f.name not in _skip and hasattr(ns, f.name)}
    vals.update(overrides)
    return cls(**vals)
