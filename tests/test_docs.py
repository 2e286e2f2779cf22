"""The documentation holds together: links resolve, and the README's command table lists every command.

- Every relative link ``[text](path)`` or ``[text](path#anchor)`` in README.md, docs/*.md and
  bench/results/README.md names a file or directory of the repository; an anchor into a Markdown file
  names one of its headings (GitHub's slugs). Links inside fenced code blocks and inline code are not
  links; ``http(s)://`` and ``mailto:`` links are not checked (no network).
- Every sub-command of ``elsi`` (read from the parser, so a new command fails here until the README
  lists it) appears in the first column of the README's command table, and the table names no
  command the parser lacks.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from elsi.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "results" / "README.md"]
LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)\)")  # [text](target), text may hold [..]
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with inline code spans blanked."""
    out, fenced = [], False
    for i, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((i, re.sub(r"`[^`]*`", lambda m: "`" + " " * (len(m.group()) - 2) + "`", line)))
    return out


def github_slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (letters of any script, digits,
    ``_`` and ``-`` kept), spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, with GitHub's -1, -2 suffixes for repeats."""
    seen: dict[str, int] = {}
    out = set()
    text = path.read_text(encoding="utf-8")
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = HEADING.match(line)
        if fenced or not m:
            continue
        slug = github_slug(m.group(2))
        n = seen.get(slug, 0)
        out.add(slug if n == 0 else f"{slug}-{n}")
        seen[slug] = n + 1
    return out


def links(path: Path) -> list[tuple[int, str]]:
    return [(i, m.group(1)) for i, line in prose_lines(path.read_text(encoding="utf-8")) for m in LINK.finditer(line)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    assert doc.exists(), f"{doc} is missing"
    bad = []
    for line, target in links(doc):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            bad.append(f"{doc.relative_to(ROOT)}:{line}: {target} -> {dest} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{doc.relative_to(ROOT)}:{line}: {target}: no heading with anchor #{anchor} in "
                       f"{dest.relative_to(ROOT)}")
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_docs_have_links_to_check():
    """The link check is not vacuous: the README links to every page of docs/."""
    readme = {target.partition("#")[0] for _, target in links(ROOT / "README.md")}
    missing = [p.name for p in DOCS if p.parent.name == "docs" and f"docs/{p.name}" not in readme]
    assert not missing, f"README.md does not link to {missing}"


def readme_commands() -> list[str]:
    """Names in the first column of the table under README's '## Commands' heading."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    m = re.search(r"^## Commands\s*$(.*?)(?=^## )", text, flags=re.M | re.S)
    assert m, "README.md has no '## Commands' section"
    names = []
    for line in m.group(1).splitlines():
        cell = re.match(r"^\|\s*`([a-z][a-z0-9-]*)`\s*\|", line)
        if cell:
            names.append(cell.group(1))
    return names


def parser_commands() -> list[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return list(sub.choices)


def test_readme_command_table_lists_every_command():
    table, parser = readme_commands(), parser_commands()
    assert parser, "the elsi parser has no sub-commands"
    missing = [c for c in parser if c not in table]
    extra = [c for c in table if c not in parser]
    assert not missing, f"README.md's command table lacks {missing} (commands of `elsi --help`)"
    assert not extra, f"README.md's command table names {extra}, which `elsi --help` does not have"
