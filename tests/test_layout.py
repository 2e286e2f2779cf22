"""The layout is the pipeline: no module of elsi imports a stage above its own.

Stages, lowest first: the top-level modules (``elsi/config.py``, ``elsi/text.py``, ``elsi/io.py``,
``elsi/runtime.py``), then ``models``, ``data``, ``collect``, ``stats``, ``select``, ``report``, ``draft``,
``decode``, ``specbench``, ``engines``, ``study``, ``cli``. A module may import its own stage and any lower one.
Every import counts, at any depth (inside a function too) and relative ones resolved. ``elsi/__main__.py``
(``python -m elsi``) is the CLI's entry point and so belongs to the ``cli`` stage.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "elsi"
STAGES = ("top-level", "models", "data", "collect", "stats", "select", "report", "draft", "decode", "specbench",
          "engines", "study", "cli")
ENTRY_POINTS = {"elsi.__main__": "cli"}  # modules outside a stage's folder that belong to that stage


def module_name(path: Path) -> str:
    """``elsi/draft/train.py`` -> ``elsi.draft.train``; a package's ``__init__.py`` -> the package."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def stage_of(module: str) -> str:
    """The stage of an ``elsi`` module (``elsi.draft.train`` -> ``draft``; ``elsi.io`` -> ``top-level``)."""
    if module in ENTRY_POINTS:
        return ENTRY_POINTS[module]
    parts = module.split(".")
    if len(parts) > 1 and (PACKAGE / parts[1]).is_dir():
        return parts[1]  # a subpackage; one outside STAGES is reported by test_every_subpackage_is_a_stage
    return "top-level"


def imported_modules(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The ``elsi`` modules an import statement of ``module`` names (``from elsi import io`` -> ``elsi.io``)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = module.split(".") if is_package else module.split(".")[:-1]
        if node.level:
            base = base[:len(base) - (node.level - 1)]
            source = ".".join([*base, node.module] if node.module else base)
        else:
            source = node.module or ""
        names = [f"{source}.{alias.name}" for alias in node.names] if source == "elsi" else [source]
    else:
        return []
    return [n for n in names if n == "elsi" or n.startswith("elsi.")]


def upward_imports() -> list[str]:
    """Every import of a module of a higher stage, as "path:line: module (stage) imports name (stage)"."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        own = stage_of(module)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            for name in imported_modules(node, module, path.name == "__init__.py"):
                theirs = stage_of(name)
                if theirs in STAGES and own in STAGES and STAGES.index(theirs) > STAGES.index(own):
                    out.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {module} (stage {own}) imports "
                               f"{name} (stage {theirs}, above it)")
    return out


def test_every_subpackage_is_a_stage():
    packages = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
    assert [p for p in packages if p not in STAGES] == [], "a subpackage of elsi without a place in STAGES"


def test_no_module_imports_a_stage_above_its_own():
    upward = upward_imports()
    assert not upward, "imports of a higher stage (move the function down to the lowest stage that uses it):\n" + \
        "\n".join(upward)


def test_the_check_sees_imports_at_any_depth(tmp_path):
    """The parser behind the check: a function-level import, a relative one and ``from elsi import x`` all count."""
    code = "def f():\n    from ..cli import main\n    from elsi import study\n    import elsi.engines.rules\n"
    found = [n for node in ast.walk(ast.parse(code)) for n in imported_modules(node, "elsi.models.load", False)]
    assert found == ["elsi.cli", "elsi.study", "elsi.engines.rules"]
    assert [stage_of(n) for n in found] == ["cli", "study", "engines"]
    assert stage_of("elsi.io") == stage_of("elsi.config") == "top-level" and stage_of("elsi.__main__") == "cli"
