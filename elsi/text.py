"""How elsi writes numbers, layer lists and tables as text (the CLI's output, selection.md, study.md, the page)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def num(x, digits: int = 3, signed: bool = False, missing: str = "–") -> str:
    """``x`` with ``digits`` decimals (``signed``: with its sign, ``+0.120``); ``missing`` for None, NaN and ±inf."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return missing
    return f"{x:+.{digits}f}" if signed else f"{x:.{digits}f}"


def layer_list(layers: Sequence[int] | None, missing: str = "–") -> str:
    """Layer ids as ``[2, 15, 27]``; ``missing`` for None."""
    return missing if layers is None else "[" + ", ".join(str(l) for l in layers) + "]"


def md_table(header: Sequence, rows: Sequence[Sequence]) -> str:
    """A GitHub-markdown table of ``header`` and ``rows`` (each cell written with ``str``), its columns padded
    to one width, so that it reads in a terminal too."""
    cells = [[str(c) for c in r] for r in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells[1:])])


__all__ = ["layer_list", "md_table", "num"]
