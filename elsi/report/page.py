"""``selection.md`` and ``index.html``: the report's text, tables and one self-contained page.

Both take the run dicts prepared by ``elsi.report.build`` (``label``, ``dir``, ``analysis``,
``manifest``, ``selections``, ``rows``, ``chosen``, ``marks``, ``beam``, ``figures``). The page
embeds every PNG as base64, escapes every text, and is well-formed XML (XHTML syntax), so
it opens in any browser and parses with any XML parser. Numbers are written by ``fmt``.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path

from elsi.report.figures import pair_gain, pixel_size
from elsi.report.study import NOTE, condition_table, seeds_phrase, spearman_line, study_markdown
from elsi.text import layer_list, md_table, num

SELECT_HINT = "run `elsi select --run {dir} --method all`"
TABLE_NOTE = ("Entropy of the set's concatenated states in nats, and divided by log B (block size). rank: 1 = best of "
              "all sets of size m (exhaustive search; ≈ when ranked on a subsample of blocks); gap = optimum − "
              "entropy (nats); τ = mean accepted length per Spec-Bench subtask, when a study measured it.")


def fmt(x, digits: int = 4) -> str:
    """A number as the report writes it: ``digits`` decimals, ``–`` for None or NaN (``elsi.text.num``); ints as is."""
    return str(x) if isinstance(x, int) else num(x, digits)


def _esc(x) -> str:
    return html.escape(str(x), quote=True)


# ---------------------------------------------------------------------------------------------
# Facts and tables (shared by the markdown and the page)


def run_facts(run: dict) -> list[tuple[str, str]]:
    """The header of one run: model, N, samples, tokens and every setting, as (name, value) text pairs."""
    a = run["analysis"]
    man = run.get("manifest") or {}
    c = a.get("counts", {})
    s = a.get("settings", {})
    skipped = c.get("samples_skipped", {})
    skipped_txt = ", ".join(f"{k}: {v}" for k, v in skipped.items()) if isinstance(skipped, dict) else str(skipped)
    facts = [
        ("model", str(a.get("model"))),
        ("source", str(man.get("model_source", "–"))),
        ("layers N", str(a.get("num_layers"))),
        ("hidden size", str(a.get("hidden_size"))),
        ("samples used", f"{c.get('samples_used', '–')} (skipped: {skipped_txt or 'none'})"),
        ("unusable records in the data", ", ".join(f"{k}: {v}" for k, v in c.get("data_records_unusable", {}).items())
         or "none"),
        ("tokens seen / kept / in blocks", f"{c.get('tokens_seen', '–')} / {c.get('tokens_kept', '–')} / "
                                           f"{c.get('tokens_in_blocks', '–')}"),
        ("blocks (filtered / unfiltered)", f"{c.get('blocks', '–')} / {c.get('blocks_unfiltered', '–')}"),
        ("settings", ", ".join(f"{k}={v}" for k, v in s.items())),
        ("entropy units", str(a.get("entropy_units", "nats"))),
        ("layer ids", str(a.get("layer_ids", "Hugging Face hidden-state ids; 0 = embeddings"))),
        ("run directory", str(run["dir"])),
    ]
    if man.get("versions"):
        facts.append(("versions", ", ".join(f"{k} {v}" for k, v in man["versions"].items())))
    return facts


def tau_keys(rows: list[dict]) -> list[str]:
    """Subtasks that have a τ in any result, in order of first appearance."""
    keys: list[str] = []
    for r in rows:
        for k in (r.get("tau") or {}):
            if k not in keys:
                keys.append(k)
    return keys


def _is_chosen(row: dict, chosen: dict | None) -> bool:
    return bool(chosen) and row["method"] == chosen["method"] and row["m"] == chosen["m"]


def selection_table(run: dict) -> tuple[list[str], list[list[str]], list[bool]]:
    """(header, rows of text, chosen flags): every method × m with layers, entropy, rank, gap and τ."""
    taus = tau_keys(run["rows"])
    header = ["method", "m", "layers", "entropy (nats)", "H / log B", "rank", "gap (nats)", "optimum",
              *[f"τ {k}" for k in taus]]
    rows, flags = [], []
    for r in run["rows"]:
        opt = r.get("optimum")
        rows.append([
            r["method"], str(r["m"]), layer_list(r["layers"]), fmt(r.get("entropy")), fmt(r.get("entropy_normalized")),
            ("≈" if r.get("rank_exact") is False else "") + fmt(r.get("rank")), fmt(r.get("gap")),
            f"{layer_list(opt['layers'])} {fmt(opt['entropy'])}" if opt else "–",
            *[fmt((r.get("tau") or {}).get(k), 3) for k in taus],
        ])
        flags.append(_is_chosen(r, run.get("chosen")))
    return header, rows, flags


def left_out(run: dict) -> list[str]:
    """What ``elsi select --method all`` left out of the table, each with why (selections.json ``skipped``)."""
    sel = run.get("selections") or {}
    return [f"{s['method']} (m = {s['m']}): {s['why']}" for s in sel.get("skipped", [])]


def layer_table(analysis: dict) -> tuple[list[str], list[list[str]]]:
    """Per-layer numbers of ``analysis.json`` as text: one row per id 0..N."""
    a = analysis
    unf = a.get("unfiltered", {})
    n = a["num_layers"]
    comp = {l: k for k, (first, last) in enumerate(a.get("compartments", [])) for l in range(first, last + 1)}
    header = ["id", "H (nats)", "std", "H / log B", "H mean-block", "H unfiltered", "std unfiltered",
              "T(l) = 1 − CKA(l, l+1)", "compartment"]

    def at(key: str, src: dict, i: int):
        vals = src.get(key)
        return vals[i] if vals is not None and i < len(vals) else None

    rows = []
    t = a.get("transition", [])
    for l in range(n + 1):
        i = a["layers"].index(l) if l in a["layers"] else None
        if i is None:
            vals = [a.get("layer0_entropy") if l == 0 else None, None, None, None, None, None]
        else:
            vals = [at("layer_entropy", a, i), at("layer_entropy_std", a, i), at("layer_entropy_normalized", a, i),
                    at("layer_entropy_mean_block", a, i), at("layer_entropy", unf, i), at("layer_entropy_std", unf, i)]
        rows.append([str(l), *map(fmt, vals), fmt(t[l]) if l < len(t) else "–", fmt(comp.get(l))])
    return header, rows


def summary(run: dict) -> str:
    """One sentence: the chosen set against eagle3 (or how to get a choice)."""
    a = run["analysis"]
    c = run.get("chosen")
    by = {(r["method"], r["m"]): r for r in run["rows"]}
    e3 = next((r for r in run["rows"] if r["method"] == "eagle3"), None)
    e3_txt = f"eagle3 {layer_list(e3['layers'])} has H = {fmt(e3.get('entropy'))} nats" if e3 else ""
    if not c:
        return (f"{a['model']}: no layer selection yet ({SELECT_HINT.format(dir=run['dir'])}); "
                f"baselines from N = {a['num_layers']}: "
                + ", ".join(f"{k} {layer_list(v)}" for k, v in run["marks"].items() if k in ("eagle2", "eagle3"))
                + (f"; {e3_txt}." if e3_txt else "."))
    r = by.get((c["method"], c["m"]), {})
    txt = (f"{a['model']}: {c['method']} chose layers {layer_list(c['layers'])} (m = {c['m']}), "
           f"H = {fmt(r.get('entropy'))} nats ({fmt(r.get('entropy_normalized'))} of log B)")
    if r.get("rank") is not None:
        txt += f", rank {r['rank']} among all sets of size {c['m']}"
    return txt + (f"; {e3_txt}." if e3_txt else ".")


def captions(run: dict) -> dict[str, str]:
    """A short sentence per figure, with the numbers it shows."""
    a = run["analysis"]
    ids, h = a["layers"], a["layer_entropy"]
    top = max(range(len(h)), key=lambda i: h[i])
    low = min(range(len(h)), key=lambda i: h[i])
    gain = pair_gain(a)
    pairs = sorted(((gain[i, j], ids[i], ids[j]) for i in range(len(ids)) for j in range(i + 1, len(ids))),
                   reverse=True)
    best = ", ".join(f"({x}, {y}) {g:+.4f}" for g, x, y in pairs[:3])
    worst = pairs[-1] if pairs else None
    t = a["transition"]
    bounds = a.get("boundaries", [])
    out = {
        "entropy_wave": (
            f"Matrix entropy of each hidden layer, mean over samples with a ±1 std band (nats; right axis: / log "
            f"{a['settings'].get('block')}). Filtered keeps the tokens the model is unsure about (rho = "
            f"{a['settings'].get('rho')}); unfiltered uses all. Highest at id {ids[top]} ({fmt(h[top])} nats), lowest "
            f"at id {ids[low]} ({fmt(h[low])}). The strip below marks the eagle2, eagle3 and chosen layers."),
        "pair_entropy": (
            "Left: entropy of every concatenated pair. Right: its gain over the better of its two layers; gains are "
            f"uneven, so which layers are combined matters. Largest gains: {best}"
            + (f"; smallest: ({worst[1]}, {worst[2]}) {worst[0]:+.4f}." if worst else ".")),
        "cka": (
            f"Linear CKA between all layers (ids 0..{a['num_layers']}). Bright blocks are compartments of similar "
            f"layers: {', '.join(f'{x}–{y}' for x, y in a.get('compartments', []))}; dashed lines are the transition "
            f"boundaries {layer_list(bounds)}."),
        "transitions": (
            "Transition score between consecutive layers; its peaks are the boundaries "
            + (", ".join(f"{b}|{b + 1} (T = {fmt(t[b])})" for b in bounds) or "(none)")
            + ". Shaded bands alternate between compartments."),
    }
    if run.get("beam"):
        b = run["beam"]
        out["beam_tree"] = (
            f"The {b['method']} beam search for m = {b['m']}: each column is a search depth (set size), each box a set "
            f"kept in the beam with its entropy; edges join a set to its extension. Highlighted: the path to "
            f"{layer_list(b['layers'])} (H = {fmt(b['entropy'])} nats).")
    else:
        out["beam_tree"] = f"No beam search yet: {SELECT_HINT.format(dir=run['dir'])}."
    return out


# ---------------------------------------------------------------------------------------------
# selection.md


def selection_markdown(runs: list[dict], study: dict | None = None) -> str:
    """The selection table of each run, with its header facts, as markdown (then the study's, if any)."""
    parts = ["# ELSI layer selection", ""]
    for run in runs:
        header, rows, flags = selection_table(run)
        rows = [[("**" + r[0] + "** (chosen)") if f else r[0], *r[1:]] for r, f in zip(rows, flags)]
        parts += [f"## {run['analysis']['model']}", "", summary(run), ""]
        parts += [f"- {k}: {v}" for k, v in run_facts(run)]
        parts += ["", md_table(header, rows), ""]
        parts += [*(f"Not in the table: {w}." for w in left_out(run)), ""] if left_out(run) else []
        if run.get("selections") is None:
            parts += [f"Only the baselines are known; {SELECT_HINT.format(dir=run['dir'])} for ELSI, ELSI-C, "
                      "exhaustive ranks and gaps.", ""]
    parts += [f"{TABLE_NOTE} Layer ids are Hugging Face hidden-state ids (0 = embeddings).", ""]
    if study is not None:
        parts += [study_markdown(study)]
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------------
# index.html

CSS = """
body { font-family: system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif; margin: 0 auto; padding: 1.2em 2em;
       max-width: 1500px; color: #1a1a1a; line-height: 1.45; }
h1 { margin-bottom: 0.2em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: 0.2em; margin-top: 1.8em; }
.lead { font-size: 1.05em; color: #333; }
.grid { display: grid; gap: 1.2em; grid-template-columns: repeat(var(--cols), minmax(0, 1fr)); }
figure { margin: 0; } figure img { max-width: 100%; height: auto; border: 1px solid #e3e3e3; }
nav { font-size: 0.92em; } nav a { margin-right: 0.9em; color: #0072B2; }
figcaption { font-size: 0.92em; color: #333; margin-top: 0.3em; }
.file { color: #777; font-family: monospace; font-size: 0.9em; }
dl.facts { display: grid; grid-template-columns: max-content auto; gap: 0.15em 1em; font-size: 0.92em; }
dl.facts dt { font-weight: 600; } dl.facts dd { margin: 0; word-break: break-all; }
table { border-collapse: collapse; font-size: 0.88em; margin: 0.5em 0; }
th, td { border: 1px solid #d0d0d0; padding: 0.2em 0.55em; text-align: right; }
th { background: #f3f3f3; } td.text { text-align: left; }
tr.chosen td { background: #fde9d9; font-weight: 600; }
.note { background: #fff8e1; border-left: 4px solid #E69F00; padding: 0.4em 0.8em; }
code { background: #f3f3f3; padding: 0 0.25em; }
details summary { cursor: pointer; color: #0072B2; }
"""


def _img(path: Path, name: str, alt: str) -> str:
    data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
    w, h = pixel_size(name)
    return (f'<img src="data:image/png;base64,{data}" alt="{_esc(alt)}" width="{w}" height="{h}" '
            f'data-file="{_esc(Path(path).name)}" />')


def _figure(run: dict, name: str, rel: str, text: str) -> str:
    path = run["figures"].get(name)
    if path is None:
        return f'<div class="note">{_esc(text)}</div>'
    alt = f"{name} of {run['analysis']['model']}"
    return (f'<figure id="{_esc(run["label"])}-{name}">{_img(path, name, alt)}'
            f'<figcaption>{_esc(text)} <span class="file">{_esc(rel)}</span></figcaption></figure>')


def _html_table(header: list[str], rows: list[list[str]], cls: str, label: str, flags: list[bool] | None = None,
                text_cols: tuple[int, ...] = ()) -> str:
    head = "".join(f"<th>{_esc(h)}</th>" for h in header)
    body = []
    for k, r in enumerate(rows):
        tr_cls = ' class="chosen"' if flags and flags[k] else ""
        cells = "".join(f'<td class="text">{_esc(c)}</td>' if i in text_cols else f"<td>{_esc(c)}</td>"
                        for i, c in enumerate(r))
        body.append(f"<tr{tr_cls}>{cells}</tr>")
    return (f'<table class="{cls}" data-run="{_esc(label)}"><thead><tr>{head}</tr></thead>'
            f'<tbody>{"".join(body)}</tbody></table>')


SECTIONS = [  # (figure name, title)
    ("entropy_wave", "1. The activation wave: entropy across depth"),
    ("pair_entropy", "2. Concatenating two layers: uneven gains"),
    ("cka", "3. Geometry: CKA compartments"),
    ("transitions", "4. Transitions between consecutive layers"),
    ("beam_tree", "5. How ELSI searched: the beam across depths"),
]


def study_html(study: dict, figure: Path | None, rel: str) -> str:
    """The study's section: its verdict, the τ-against-entropy figure and one τ table per condition."""
    parts = [
        '<h2 id="sec-study">8. The study: trained drafts, τ and set entropy</h2>',
        f"<p>One EAGLE3 draft per layer set and seed ({_esc(seeds_phrase(study))}) of {_esc(study['model'])}, all "
        f"trained on the same data with the same budget ({_esc(study['settings']['train']['time_budget'])}) and "
        f"settings, then benchmarked on Spec-Bench ({_esc(study['questions'])} questions: "
        f"{_esc(', '.join(study['subtasks']))}).</p>",
        "<ul>" + "".join(f"<li>{_esc(v)}</li>" for v in study["verdict"]) + "</ul>",
    ]
    if figure is not None:
        parts.append(f'<figure id="study_tau_entropy">{_img(figure, "study_tau_entropy", "tau against set entropy")}'
                     "<figcaption>τ of each trained draft against the entropy of its layer set; one panel per "
                     "condition (temperature, tree size), the pooled one first. Small points: one draft per seed; "
                     f'large marks: the set\'s mean. <span class="file">{_esc(rel)}</span></figcaption></figure>')
    for cond in study["conditions"]:
        header, rows = condition_table(cond, study["subtasks"])
        parts += [f"<h3>τ, {_esc(cond['label'])}</h3>",
                  _html_table(header, rows, "study", cond["label"], text_cols=(0, 1)),
                  f"<p>{_esc(spearman_line(cond))}</p>"]
    parts.append(f'<p class="note">{_esc(NOTE)}</p>')
    return "\n".join(parts)


def index_html(runs: list[dict], out: Path, compare: Path | None = None, command: str = "", study: dict | None = None,
               study_figure: Path | None = None) -> str:
    """The whole report as one self-contained XHTML page (PNG figures embedded as base64); with ``study``
    (a study.json dict) a section with its tables and ``study_figure``."""
    out = Path(out)
    cols = len(runs)
    grid = lambda items: f'<div class="grid" style="--cols: {cols}">{"".join(items)}</div>'  # noqa: E731
    models = ", ".join(r["analysis"]["model"] for r in runs)
    caps = {r["label"]: captions(r) for r in runs}
    rel = lambda p: Path(p).relative_to(out).as_posix() if Path(p).is_relative_to(out) else str(p)  # noqa: E731
    parts = [
        '<?xml version="1.0" encoding="utf-8"?>',
        "<!DOCTYPE html>",
        '<html xmlns="http://www.w3.org/1999/xhtml" lang="en"><head><meta charset="utf-8" />',
        f"<title>ELSI report: {_esc(models)}</title><style>{CSS}</style></head><body>",
        f"<h1>ELSI report: {_esc(models)}</h1>",
        '<p class="lead">Which hidden layers should an EAGLE3 draft model be conditioned on? ELSI picks the set '
        "whose concatenated hidden states carry the most information (matrix entropy), guided by where the "
        "geometry of the representation changes (CKA). Layer ids are Hugging Face hidden-state ids "
        "(0 = embeddings, 1..N = the outputs of the decoder layers); entropy is in nats.</p>",
        grid(f'<section><h3>{_esc(r["analysis"]["model"])}</h3><p><b>{_esc(summary(r))}</b></p><dl class="facts">'
             + "".join(f"<dt>{_esc(k)}</dt><dd>{_esc(v)}</dd>" for k, v in run_facts(r)) + "</dl></section>"
             for r in runs),
    ]
    if compare is not None:
        parts += [
            '<h2 id="sec-compare">0. The models side by side</h2>',
            f'<figure id="compare_depth">{_img(compare, "compare_depth", "models on a normalised depth axis")}'
            "<figcaption>Normalised entropy (/ log B, ±1 std band) and transition score of each model against "
            "normalised depth l / N, so that models of different depth line up; stars mark each model's selected "
            f'layers, triangles its boundaries. <span class="file">{_esc(rel(compare))}</span></figcaption></figure>',
        ]
    toc = ([("compare", "0. Side by side")] if compare is not None else []) + [(n, t) for n, t in SECTIONS] + [
        ("selection", "6. Layer sets"), ("layers", "7. Per-layer numbers")] + (
        [("study", "8. Study: τ and entropy")] if study is not None else [])
    parts.insert(5, "<nav>" + "".join(f'<a href="#sec-{n}">{_esc(t)}</a>' for n, t in toc) + "</nav>")
    for name, title in SECTIONS:
        parts.append(f'<h2 id="sec-{name}">{_esc(title)}</h2>')
        parts.append(grid(_figure(r, name, rel(r["figures"][name]) if name in r["figures"] else "",
                                  caps[r["label"]][name]) for r in runs))
    parts.append('<h2 id="sec-selection">6. Layer sets: every method and size</h2>')
    parts.append(f"<p>{_esc(TABLE_NOTE)} The chosen row is highlighted.</p>")
    blocks = []
    for r in runs:
        header, rows, flags = selection_table(r)
        note = ("" if r.get("selections") is not None else
                f'<p class="note">Only the baselines (computed from N = {r["analysis"]["num_layers"]}) are known: '
                f"<code>{_esc(SELECT_HINT.format(dir=r['dir']).removeprefix('run ').strip('`'))}</code> "
                "adds ELSI, ELSI-C, the exhaustive optimum, ranks and gaps.</p>")
        note += "".join(f'<p class="note">Not in the table: {_esc(w)}.</p>' for w in left_out(r))
        blocks.append(f'<section><h3>{_esc(r["analysis"]["model"])}</h3>{note}'
                      f"{_html_table(header, rows, 'selection', r['label'], flags, text_cols=(0, 2, 7))}</section>")
    parts.append(grid(blocks))
    parts.append('<h2 id="sec-layers">7. Per-layer numbers</h2><p>The values'
                 " of <code>analysis.json</code> behind the figures "
                 "(T(l) is the transition between ids l and l+1; compartments numbered from 0).</p>")
    parts.append(grid(
        f'<section><details open="open"><summary>{_esc(r["analysis"]["model"])}: {r["analysis"]["num_layers"] + 1} '
        f"ids</summary>{_html_table(*layer_table(r['analysis']), 'layers', r['label'])}</details></section>"
        for r in runs))
    if study is not None:
        parts.append(study_html(study, study_figure, rel(study_figure) if study_figure else ""))
    files = sorted({rel(p) for r in runs for p in r["figures"].values()} | ({rel(compare)} if compare else set())
                   | ({rel(study_figure)} if study_figure else set()))
    parts.append("<h2>How this page was made</h2><p>"
                 + (f"Command: <code>{_esc(command)}</code>. " if command else "")
                 + "Figures (also written next to this page): "
                 + ", ".join(f'<span class="file">{_esc(f)}</span>' for f in files)
                 + '; the tables are in <span class="file">selection.md</span>.</p>')
    parts.append("</body></html>\n")
    return "\n".join(parts)


__all__ = ["captions", "fmt", "index_html", "layer_table", "left_out", "run_facts", "selection_markdown", "selection_table",
           "study_html", "summary"]
