"""``elsi report``: every file made, PNGs valid and of the documented size, the page self-contained,
well-formed, referencing every figure, and its numbers equal to analysis.json / selections.json.

Runs are synthetic: an ``analysis.json`` (and optionally ``selections.json``) with the keys of
docs/INTERFACES.md, shaped like a real run (an entropy wave, compartments in CKA).
"""

from __future__ import annotations

import base64
import json
import math
import re
import struct
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from elsi.report import baseline_layers, build_report, default_out, fmt, pixel_size
from elsi.report.figures import chosen_path

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
FIGURES = ("entropy_wave", "pair_entropy", "cka", "transitions", "beam_tree")
BLOCK = 32


def synthetic_analysis(n: int, model: str, seed: int = 0) -> dict:
    """An analysis.json for N = n layers: a wave of entropy, three CKA compartments."""
    rng = np.random.default_rng(seed)
    pool = list(range(1, n + 1))
    x = np.asarray(pool) / n
    h = 2.6 + 0.4 * np.sin(np.pi * x) + 0.02 * rng.standard_normal(n)
    h[-1] -= 0.3
    std = 0.1 + 0.02 * rng.random(n)
    pair = np.maximum(h[:, None], h[None, :]) + 0.1 * np.abs(x[:, None] - x[None, :]) - 0.02
    np.fill_diagonal(pair, h)
    cut = [0, n // 2, n - 1]  # boundaries: split after these ids
    comp_of = np.searchsorted(np.asarray(cut), np.arange(n + 1), side="left")
    ids = np.arange(n + 1)
    cka = np.exp(-np.abs(ids[:, None] - ids[None, :]) / 6) * np.where(comp_of[:, None] == comp_of[None, :], 1.0, 0.7)
    np.fill_diagonal(cka, 1.0)
    t = [1 - cka[l, l + 1] for l in range(n)]
    comps, first = [], 0
    for b in cut:
        comps.append([first, b])
        first = b + 1
    comps.append([first, n])
    geo = {"cka": cka.round(6).tolist(), "transition": np.round(t, 6).tolist(), "boundaries": cut,
           "compartments": comps}
    log_b = math.log(BLOCK)
    return {
        "model": model, "num_layers": n, "hidden_size": 64, "layer_ids": "HF ids", "layers": pool,
        "entropy_units": "nats; *_normalized = divided by log(block)",
        "layer_entropy": h.tolist(), "layer_entropy_std": std.tolist(),
        "layer_entropy_normalized": (h / log_b).tolist(),
        "layer_entropy_mean_block": (h - 0.3).tolist(), "layer0_entropy": 2.5, "pair_entropy": pair.round(6).tolist(),
        **geo,
        "unfiltered": {"layer_entropy": (h + 0.01).tolist(), "layer_entropy_std": (std * 0.9).tolist(),
                       "layer_entropy_normalized": ((h + 0.01) / log_b).tolist(), **geo},
        "settings": {"model": model, "data": "sharegpt", "samples": 6, "max_tokens": 256, "seed": 0, "rho": 0.3,
                     "block": BLOCK, "normalize": "center-l2", "cka": "debiased", "aggregate": "block-entropy",
                     "prominence": 0.1},
        "counts": {"samples_used": 6, "samples_skipped": {"empty": 2}, "tokens_seen": 1500, "tokens_kept": 1050,
                   "tokens_in_blocks": 1024, "blocks": 32, "blocks_unfiltered": 46},
        "elapsed_s": 0.1,
    }


def synthetic_selections(a: dict, beam: int = 3) -> dict:
    """A selections.json: ELSI m = 1..3 with beams whose chosen path follows ``parent``, and the baselines."""
    n, h = a["num_layers"], a["layer_entropy"]
    log_b = math.log(BLOCK)
    order = sorted(a["layers"], key=lambda l: -h[l - 1])
    results, beams, prev = [], [], None
    for m in (1, 2, 3):
        sets = []
        for k in range(beam):
            if m == 1:
                layers, parent = [order[k]], None
            else:
                parent = prev[k % len(prev)]["layers"]
                free = [l for l in a["layers"] if l not in parent]
                layers = sorted({*parent, free[(3 * k + n // 2) % len(free)]})
            sets.append({"layers": layers, "entropy": 3.0 + 0.01 * m - 0.001 * k, "parent": parent})
        uniq = {tuple(s["layers"]): s for s in sets}
        sets = list(uniq.values())
        beams.append({"depth": m, "sets": sets})
        prev = sets
        best = sets[0]
        results.append({"method": "elsi", "m": m, "layers": best["layers"], "entropy": best["entropy"],
                        "entropy_normalized": best["entropy"] / log_b, "rank": m, "rank_exact": m < 3,
                        "optimum": {"layers": best["layers"], "entropy": best["entropy"] + 0.0005 * (m - 1)},
                        "gap": 0.0005 * (m - 1), "beams": [dict(b) for b in beams], "elapsed_s": 0.01})
    for method, layers in baseline_layers(n).items():
        e = 2.9 + 0.001 * len(layers)
        results.append({"method": method, "m": len(layers), "layers": layers, "entropy": e,
                        "entropy_normalized": e / log_b, "rank": 7, "rank_exact": True, "optimum": None, "gap": None,
                        "beams": [], "elapsed_s": 0.0})
    results[2]["tau"] = {"mt_bench": 2.5312, "qa": 2.1}
    results[-1]["tau"] = {"mt_bench": 2.25}
    return {"results": results, "chosen": {"method": "elsi", "m": 3, "layers": results[2]["layers"]}}


def make_run(root: Path, n: int, model: str, selections: bool = True, seed: int = 0) -> Path:
    run = root / model
    run.mkdir(parents=True)
    a = synthetic_analysis(n, model, seed)
    (run / "analysis.json").write_text(json.dumps(a))
    (run / "manifest.json").write_text(json.dumps({"status": "complete", "model": model, "num_layers": n,
                                                   "model_source": "memory", "versions": {"elsi": "test"}}))
    if selections:
        (run / "selections.json").write_text(json.dumps(synthetic_selections(a)))
    return run


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the IHDR chunk, after checking the PNG signature."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


class Tables(HTMLParser):
    """Rows of text of every <table class=...> in the page, keyed by (class, data-run)."""

    def __init__(self):
        super().__init__()
        self.tables: dict[tuple[str, str], list[list[str]]] = {}
        self.cur = None
        self.row = None
        self.cell = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "table":
            self.cur = self.tables.setdefault((attrs.get("class"), attrs.get("data-run")), [])
        elif tag == "tr" and self.cur is not None:
            self.row = []
        elif tag in ("td", "th") and self.row is not None:
            self.cell = ""

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self.cell is not None:
            self.row.append(self.cell)
            self.cell = None
        elif tag == "tr" and self.row is not None:
            self.cur.append(self.row)
            self.row = None
        elif tag == "table":
            self.cur = None

    def handle_data(self, data):
        if self.cell is not None:
            self.cell += data


def page_tables(html: str) -> dict:
    p = Tables()
    p.feed(html)
    return p.tables


def check_page_embeds(html: str, out: Path, files: list[str]) -> None:
    """Every figure is referenced by name and embedded byte for byte."""
    ET.fromstring(html.encode("utf-8"))  # well-formed (XHTML syntax)
    for rel in files:
        name = Path(rel).name
        assert rel in html, f"{rel} not referenced in the page"
        embedded = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"[^>]*data-file="' + re.escape(name) + '"',
                              html)
        assert any(base64.b64decode(e) == (out / rel).read_bytes() for e in embedded), f"{rel} not embedded"
    assert 'src="http' not in html and "<script" not in html  # self-contained


def test_single_run_with_selections(tmp_path):
    run = make_run(tmp_path, 6, "tiny-six")
    a = json.loads((run / "analysis.json").read_text())
    sel = json.loads((run / "selections.json").read_text())
    paths = build_report([run])
    out = run / "report"
    assert default_out([run]) == out
    expected = [f"{f}.png" for f in FIGURES] + ["selection.md", "index.html"]
    assert sorted(paths) == sorted(expected)
    for f in FIGURES:
        assert (out / f"{f}.png").exists()
        assert png_size(out / f"{f}.png") == pixel_size(f), f
    html = (out / "index.html").read_text()
    check_page_embeds(html, out, [f"{f}.png" for f in FIGURES])
    # Header: model, N, samples, tokens, settings.
    for text in ("tiny-six", "layers N", "6 (skipped: empty: 2)", "1500 / 1050 / 1024", "rho=0.3", "block=32"):
        assert text in html, text

    tables = page_tables(html)
    layers = tables[("layers", "tiny-six")]
    header, rows = layers[0], layers[1:]
    assert len(rows) == a["num_layers"] + 1
    col = {h: i for i, h in enumerate(header)}
    assert rows[0][col["H (nats)"]] == fmt(a["layer0_entropy"])
    for i, l in enumerate(a["layers"]):
        r = rows[l]
        assert r[0] == str(l)
        assert r[col["H (nats)"]] == fmt(a["layer_entropy"][i])
        assert r[col["std"]] == fmt(a["layer_entropy_std"][i])
        assert r[col["H / log B"]] == fmt(a["layer_entropy_normalized"][i])
        assert r[col["H mean-block"]] == fmt(a["layer_entropy_mean_block"][i])
        assert r[col["H unfiltered"]] == fmt(a["unfiltered"]["layer_entropy"][i])
    for l in range(a["num_layers"]):
        assert rows[l][col["T(l) = 1 − CKA(l, l+1)"]] == fmt(a["transition"][l])

    sel_rows = tables[("selection", "tiny-six")]
    header, rows = sel_rows[0], sel_rows[1:]
    assert header[-2:] == ["τ mt_bench", "τ qa"]
    assert len(rows) == len(sel["results"])
    shown = {(r[0], int(r[1])): r for r in rows}
    for res in sel["results"]:
        r = shown[(res["method"], res["m"])]
        assert r[2] == "[" + ", ".join(map(str, res["layers"])) + "]"
        assert r[3] == fmt(res["entropy"]) and r[4] == fmt(res["entropy_normalized"])
        assert r[5].lstrip("≈") == str(res["rank"]) and r[5].startswith("≈") == (res["rank_exact"] is False)
        assert r[6] == fmt(res["gap"])
        assert r[-2] == fmt((res.get("tau") or {}).get("mt_bench"), 3)
    assert 'class="chosen"' in html
    md = (out / "selection.md").read_text()
    chosen = sel["results"][2]
    line = next(l for l in md.splitlines() if "**elsi** (chosen)" in l)
    assert [c.strip() for c in line.strip("|").split("|")][1:3] == ["3", shown[("elsi", 3)][2]]
    assert fmt(chosen["entropy"]) in md and "2.531" in md


def test_without_selections_marks_baselines(tmp_path):
    run = make_run(tmp_path, 6, "no-select", selections=False)
    a = json.loads((run / "analysis.json").read_text())
    a["settings"]["aggregate"] = "mean-block"  # no std across samples: figures drop the band
    a["layer_entropy_std"] = a["unfiltered"]["layer_entropy_std"] = [None] * 6
    (run / "analysis.json").write_text(json.dumps(a))
    out = tmp_path / "rep"
    paths = build_report([run], out)
    assert "beam_tree.png" not in paths and not (out / "beam_tree.png").exists()
    for f in ("entropy_wave", "pair_entropy", "cka", "transitions"):
        assert png_size(out / f"{f}.png") == pixel_size(f)
    html = (out / "index.html").read_text()
    check_page_embeds(html, out, [f"{f}.png" for f in FIGURES if f != "beam_tree"])
    assert f"elsi select --run {run} --method all" in html
    assert baseline_layers(6) == {"eagle2": [6]}  # [2, 3, 3] collides
    assert baseline_layers(30) == {"eagle2": [30], "eagle3": [2, 15, 27]}
    rows = {r[0]: r for r in page_tables(html)[("selection", "no-select")][1:]}
    assert rows["eagle2"][2] == "[6]" and rows["eagle2"][3] == fmt(a["layer_entropy"][5])
    assert "eagle3" not in rows  # no distinct [2, N//2, N-3] for N = 6
    assert "elsi select --run" in (out / "selection.md").read_text()


def test_several_runs_side_by_side(tmp_path):
    small = make_run(tmp_path, 6, "model-a", seed=1)
    big = make_run(tmp_path, 18, "model-b", selections=False, seed=2)
    paths = build_report([small, big])
    out = small / "report-compare"
    assert png_size(out / "compare_depth.png") == pixel_size("compare_depth")
    for label in ("model-a", "model-b"):
        for f in ("entropy_wave", "pair_entropy", "cka", "transitions"):
            assert png_size(out / label / f"{f}.png") == pixel_size(f)
    assert "model-a/beam_tree.png" in paths and "model-b/beam_tree.png" not in paths
    html = paths["index.html"].read_text()
    check_page_embeds(html, out, [p for p in paths if p.endswith(".png")])
    tables = page_tables(html)
    assert {k[1] for k in tables if k[0] == "layers"} == {"model-a", "model-b"}
    assert len(tables[("layers", "model-b")]) == 1 + 19
    assert "--cols: 2" in html
    md = paths["selection.md"].read_text()
    assert "## model-a" in md and "## model-b" in md


def test_chosen_path_follows_parents(tmp_path):
    a = synthetic_analysis(6, "x")
    res = synthetic_selections(a)["results"][2]
    path = chosen_path(res)
    assert len(path) == 3 and path[-1] == tuple(res["layers"])
    for parent, child in zip(path, path[1:]):
        assert set(parent) < set(child)


def test_cli_report(tmp_path, capsys):
    from elsi.cli import main

    run = make_run(tmp_path, 6, "cli-run")
    out = tmp_path / "cli-out"
    assert main(["report", str(run), "--out", str(out)]) == 0
    assert (out / "index.html").exists() and (out / "beam_tree.png").exists()
    assert str(out / "index.html") in capsys.readouterr().out
    assert main(["report", str(tmp_path / "missing")]) == 2
    with pytest.raises(SystemExit):
        main(["report"])  # the run directories are required
