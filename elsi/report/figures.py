"""The report's figures: one function per figure, each taking loaded dicts and returning the saved path.

Inputs are the documented JSON files (docs/INTERFACES.md): ``analysis`` is a run's
``analysis.json``, ``result`` one entry of ``selections.json["results"]``. Layer ids are
Hugging Face hidden-state ids (0 = embeddings, pool 1..N). Every figure is written at a
fixed pixel size (``SIZES`` x ``DPI``), so the page's layout and the tests can rely on it.
Colours: the Okabe-Ito palette for lines and marks, viridis / cividis / a blue-orange
diverging map for heatmaps (all colour-blind safe).
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib import colors as mcolors  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from elsi.report.study import seeds_phrase  # noqa: E402
from elsi.text import num  # noqa: E402

DPI = 120
# Figure sizes in inches; the PNG is (width * DPI) x (height * DPI) pixels.
SIZES: dict[str, tuple[float, float]] = {
    "entropy_wave": (10.0, 5.5),
    "pair_entropy": (12.0, 5.6),
    "cka": (7.5, 6.5),
    "transitions": (10.0, 4.2),
    "beam_tree": (10.0, 6.0),
    "compare_depth": (10.0, 7.0),
    "study_tau_entropy": (12.0, 7.0),
    "models_tau_entropy": (12.0, 5.0),
}

# Okabe-Ito: colour-blind safe qualitative palette.
OKABE_ITO = {
    "black": "#000000", "orange": "#E69F00", "sky": "#56B4E9", "green": "#009E73",
    "yellow": "#F0E442", "blue": "#0072B2", "vermillion": "#D55E00", "purple": "#CC79A7",
    "grey": "#999999",
}
MARK_STYLE = {  # label prefix -> (colour, marker)
    "eagle2": (OKABE_ITO["sky"], "s"),
    "eagle3": (OKABE_ITO["green"], "^"),
    "ELSI": (OKABE_ITO["vermillion"], "*"),
}
STUDY_STYLE = {  # set method -> (colour, marker) in the study's plot
    "eagle2": (OKABE_ITO["sky"], "s"), "eagle3": (OKABE_ITO["green"], "^"), "elsi": (OKABE_ITO["vermillion"], "*"),
    "elsi-c": (OKABE_ITO["orange"], "P"), "exhaustive": (OKABE_ITO["purple"], "D"),
    "low-entropy": (OKABE_ITO["grey"], "v"), "uniform": (OKABE_ITO["blue"], "o"), "layers": (OKABE_ITO["black"], "X"),
}
RUN_COLOURS = [OKABE_ITO[c] for c in ("blue", "vermillion", "green", "purple", "orange", "sky")]

plt.rcParams.update({
    "font.size": 10, "axes.titlesize": 11, "axes.labelsize": 10, "legend.fontsize": 9,
    "xtick.labelsize": 8, "ytick.labelsize": 9, "axes.spines.top": False, "axes.spines.right": False,
})


def pixel_size(name: str) -> tuple[int, int]:
    """(width, height) in pixels of the PNG written for figure ``name``."""
    w, h = SIZES[name]
    return round(w * DPI), round(h * DPI)


def _new(name: str, **kw) -> Figure:
    return plt.figure(figsize=SIZES[name], dpi=DPI, layout="constrained", **kw)


def _save(fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, format="png", metadata={"Software": None})
    plt.close(fig)
    return path


def _ticks(ids: list[int], max_ticks: int = 32) -> list[int]:
    """Layer ids to label: all of them, or every k-th counted back from the last id when there are many."""
    step = max(1, math.ceil(len(ids) / max_ticks))
    return list(ids[len(ids) - 1::-step])[::-1]


def _style(label: str) -> tuple[str, str]:
    for prefix, style in MARK_STYLE.items():
        if label.startswith(prefix):
            return style
    return OKABE_ITO["purple"], "D"


def entropy_wave(analysis: dict, marks: dict[str, list[int]], path: str | Path) -> Path:
    """Per-layer entropy (mean ± 1 std across samples), filtered (rho) and unfiltered, with layer sets marked.

    ``marks`` maps a label (``eagle2``, ``eagle3``, ``ELSI ...``) to its layer ids; each
    set is drawn as one row of a strip under the curve and as faint lines in the plot.
    """
    ids = list(analysis["layers"])  # pool ids 1..N
    x = np.asarray(ids)
    s = analysis["settings"]
    unf = analysis.get("unfiltered", {})
    fig = _new("entropy_wave")
    rows = max(1, len(marks))
    gs = fig.add_gridspec(2, 1, height_ratios=[5, 0.42 * rows + 0.3])
    ax = fig.add_subplot(gs[0])
    rug = fig.add_subplot(gs[1], sharex=ax)
    curves = [
        (analysis["layer_entropy"], analysis.get("layer_entropy_std"), OKABE_ITO["blue"], "-", 0.25,
         f"filtered (rho = {s.get('rho')})"),
        (unf.get("layer_entropy"), unf.get("layer_entropy_std"), OKABE_ITO["orange"], "--", 0.14,
         "unfiltered (rho = 0)"),
    ]
    handles, labels = [], []
    for mean, std, colour, ls, alpha, label in curves:
        if mean is None:
            continue
        m = np.asarray(mean, dtype=float)
        (line,) = ax.plot(x, m, ls, color=colour, lw=2, marker="o", ms=3.5)
        handle, text = line, label + ": mean"
        if std is not None and all(v is not None for v in std):
            sd = np.asarray(std, dtype=float)
            band = ax.fill_between(x, m - sd, m + sd, color=colour, alpha=alpha, lw=0)
            handle, text = (band, line), label + ": mean ± 1 std"
        handles.append(handle)
        labels.append(text)
    if analysis.get("layer0_entropy") is not None:
        (dot,) = ax.plot([0], [analysis["layer0_entropy"]], "o", mfc="white", color=OKABE_ITO["blue"], ms=6)
        handles.append(dot)
        labels.append("id 0 (embeddings, not in the pool)")
    for label, layers in marks.items():
        colour, _ = _style(label)
        for l in layers:
            ax.axvline(l, color=colour, lw=1, alpha=0.45, zorder=0)
    ax.set_ylabel("matrix entropy (nats)")
    block = s.get("block")
    if block:
        sec = ax.secondary_yaxis("right", functions=(lambda v: v / math.log(block), lambda v: v * math.log(block)))
        sec.set_ylabel(f"normalised: / log({block})")
    ax.set_title(f"{analysis['model']}: entropy of each hidden layer across depth (the activation wave)\n"
                 "bands: ±1 std across samples", pad=24)
    ax.legend(handles, labels, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncols=len(handles), frameon=False,
              fontsize=8.5)
    ax.grid(alpha=0.25)
    ax.tick_params(labelbottom=False)
    # Strip: one row per marked layer set.
    for r, (label, layers) in enumerate(marks.items()):
        colour, marker = _style(label)
        y = rows - 1 - r
        rug.plot(layers, [y] * len(layers), marker, color=colour, ms=9 if marker == "*" else 7, mec="black", mew=0.5)
        for l in layers:
            rug.annotate(str(l), (l, y), xytext=(6, -3), textcoords="offset points", fontsize=7)
    rug.set_yticks(range(rows), [f"{lab}  {list(ls)}" for lab, ls in reversed(list(marks.items()))] if marks else [""])
    rug.set_ylim(-0.6, rows - 0.4)
    rug.spines["left"].set_visible(False)
    rug.tick_params(axis="y", length=0)
    rug.grid(axis="x", alpha=0.25)
    all_ids = [0, *ids]
    rug.set_xticks(_ticks(all_ids))
    rug.set_xlim(-0.7, ids[-1] + 0.7)
    rug.set_xlabel("layer id (Hugging Face hidden-state index; 0 = embeddings)")
    return _save(fig, path)


def pair_gain(analysis: dict) -> np.ndarray:
    """Gain of each pair over its better singleton: H({a, b}) - max(H(a), H(b)), in nats; diagonal 0."""
    pair = np.asarray(analysis["pair_entropy"], dtype=float)  # (P, P), P = |pool|
    single = np.diag(pair)
    return pair - np.maximum(single[:, None], single[None, :])


def pair_entropy(analysis: dict, path: str | Path) -> Path:
    """Heatmap of the entropy of every pair, and of its gain over its better singleton."""
    ids = list(analysis["layers"])
    pair = np.asarray(analysis["pair_entropy"], dtype=float)
    gain = pair_gain(analysis)
    off = ~np.eye(len(ids), dtype=bool)
    fig = _new("pair_entropy")
    axes = fig.subplots(1, 2)
    extent = (ids[0] - 0.5, ids[-1] + 0.5, ids[-1] + 0.5, ids[0] - 0.5)
    im = axes[0].imshow(pair, cmap="viridis", extent=extent, interpolation="nearest")
    fig.colorbar(im, ax=axes[0], shrink=0.85, label="entropy of the pair (nats)")
    axes[0].set_title("H({a, b}): entropy of the concatenated pair\n(diagonal: the single layer)")
    g = np.where(off, gain, np.nan)
    lim = max(np.nanmax(np.abs(g)), 1e-9) if off.any() else 1.0
    cmap = plt.get_cmap("PuOr_r").with_extremes(bad="#dddddd")
    im = axes[1].imshow(g, cmap=cmap, norm=mcolors.TwoSlopeNorm(0.0, -lim, lim), extent=extent, interpolation="nearest")
    fig.colorbar(im, ax=axes[1], shrink=0.85, label="gain (nats)")
    title = "gain: H({a, b}) − max(H(a), H(b))"
    if off.any():
        i, j = np.unravel_index(np.nanargmax(g), g.shape)
        for ax in axes:
            ax.plot([ids[j], ids[i]], [ids[i], ids[j]], "o", mfc="none", mec=OKABE_ITO["vermillion"], ms=10, mew=2)
        title += f"\n○ best pair ({ids[min(i, j)]}, {ids[max(i, j)]}): gain {g[i, j]:+.4f} nats"
    axes[1].set_title(title)
    for ax in axes:
        t = _ticks(ids, 16)
        ax.set_xticks(t)
        ax.set_yticks(t)
        ax.set_xlabel("layer id b")
        ax.set_ylabel("layer id a")
    fig.suptitle(f"{analysis['model']}: uneven gains when two layers are concatenated", fontsize=12)
    return _save(fig, path)


def cka(analysis: dict, path: str | Path) -> Path:
    """CKA of every two layers (ids 0..N) with the transition boundaries and compartments drawn over it."""
    mat = np.asarray(analysis["cka"], dtype=float)  # (N+1, N+1)
    n1 = mat.shape[0]
    ids = list(range(n1))
    fig = _new("cka")
    ax = fig.subplots()
    im = ax.imshow(mat, cmap="cividis", vmin=max(0.0, float(np.nanmin(mat))), vmax=1.0,
                   extent=(-0.5, n1 - 0.5, n1 - 0.5, -0.5), interpolation="nearest")
    fig.colorbar(im, ax=ax, shrink=0.85, label=f"linear CKA ({analysis['settings'].get('cka', '')} HSIC; unitless)")
    for b in analysis.get("boundaries", []):
        for line in (ax.axvline, ax.axhline):
            line(b + 0.5, color="white", lw=1.2, ls="--")
    for first, last in analysis.get("compartments", []):
        ax.add_patch(Rectangle((first - 0.5, first - 0.5), last - first + 1, last - first + 1, fill=False,
                               ec=OKABE_ITO["vermillion"], lw=2.2))
    t = _ticks(ids, 32)
    ax.set_xticks(t)
    ax.set_yticks(t)
    ax.tick_params(axis="x", labelrotation=90 if len(t) > 20 else 0)
    ax.set_xlabel("layer id (0 = embeddings)")
    ax.set_ylabel("layer id")
    ax.set_title(f"{analysis['model']}: CKA between layers\n"
                 f"dashed: boundaries {analysis.get('boundaries', [])} (split after id); boxes: compartments")
    return _save(fig, path)


def transitions(analysis: dict, path: str | Path) -> Path:
    """Transition score T_l = 1 - CKA(l, l+1), filtered and unfiltered, with boundaries and compartments."""
    t = np.asarray(analysis["transition"], dtype=float)  # (N,), T[l] for l = 0..N-1
    n = len(t)
    xs = np.arange(n) + 0.5  # between l and l+1
    fig = _new("transitions")
    ax = fig.subplots()
    for k, (first, last) in enumerate(analysis.get("compartments", [])):
        ax.axvspan(first - 0.5, last + 0.5, color="#e8e8e8" if k % 2 else "white", zorder=0)
    unf = analysis.get("unfiltered", {})
    ax.plot(xs, t, "-", color=OKABE_ITO["blue"], lw=2, marker="o", ms=3.5, zorder=3,
            label=f"filtered (rho = {analysis['settings'].get('rho')})")
    if unf.get("transition") is not None:
        ax.plot(xs, unf["transition"], "--", color=OKABE_ITO["orange"], lw=1.5, marker="s", ms=3,
                label="unfiltered (rho = 0)")
    bounds = analysis.get("boundaries", [])
    if bounds:
        ax.plot(np.asarray(bounds) + 0.5, t[bounds], "v", color=OKABE_ITO["vermillion"], ms=9, mec="black", mew=0.5,
                label="boundary (peak of T)", zorder=5)
        for b in bounds:
            ax.annotate(f"{b}|{b + 1}", (b + 0.5, t[b]), xytext=(0, 8), textcoords="offset points", ha="center",
                        fontsize=8)
    ax.set_xticks(_ticks(list(range(n + 1))))
    ax.set_xlim(-0.5, n + 0.5)
    ax.set_ylim(0, max(float(np.nanmax(t)), float(np.nanmax(unf.get("transition", [0])))) * 1.18 + 1e-9)
    ax.set_xlabel("layer id (T is drawn between l and l+1)")
    ax.set_ylabel("T = 1 − CKA(l, l+1) (unitless)")
    ax.set_title(f"{analysis['model']}: transition score across depth; shaded bands = compartments")
    ax.legend(loc="upper center", ncols=3, framealpha=0.9)
    ax.grid(axis="y", alpha=0.25)
    return _save(fig, path)


def chosen_path(result: dict) -> list[tuple[int, ...]]:
    """The chain of beam sets (depth 1..m) that ends in the result's layers, following ``parent``."""
    by_depth = {d["depth"]: {tuple(sorted(s["layers"])): s for s in d["sets"]} for d in result.get("beams", [])}
    if not by_depth:
        return []
    cur = tuple(sorted(result["layers"]))
    depth = len(cur)
    path = []
    while cur is not None and depth >= 1:
        node = by_depth.get(depth, {}).get(cur)
        if node is None:
            break
        path.append(cur)
        parent = node.get("parent")
        cur = tuple(sorted(parent)) if parent else None
        depth -= 1
    return path[::-1]


def beam_tree(result: dict, path: str | Path, model: str = "") -> Path:
    """The ELSI beam across depths: one column per depth, each node a set with its entropy; the chosen path highlighted.

    ``result`` is a ``selections.json`` result with non-empty ``beams``.
    """
    beams = result.get("beams") or []
    if not beams:
        raise ValueError(f"result {result.get('method')} m={result.get('m')} has no beams to draw")
    on_path = set(chosen_path(result))
    fig = _new("beam_tree")
    ax = fig.subplots()
    pos: dict[tuple[int, ...], tuple[float, float]] = {}
    width = max(len(d["sets"]) for d in beams)
    ents = [s["entropy"] for d in beams for s in d["sets"]]
    norm = mcolors.Normalize(min(ents), max(ents))
    cmap = plt.get_cmap("viridis")
    for d in beams:
        sets = sorted(d["sets"], key=lambda s: -s["entropy"])  # best at the top
        for r, s in enumerate(sets):
            pos[tuple(sorted(s["layers"]))] = (d["depth"], r)
    for d in beams:  # edges first, under the nodes
        for s in d["sets"]:
            key = tuple(sorted(s["layers"]))
            parent = tuple(sorted(s["parent"])) if s.get("parent") else None
            if parent in pos:
                hot = key in on_path and parent in on_path
                (x0, y0), (x1, y1) = pos[parent], pos[key]
                ax.plot([x0, x1], [y0, y1], color=OKABE_ITO["vermillion"] if hot else "#b0b0b0",
                        lw=3 if hot else 0.8, zorder=1 if not hot else 2)
    for d in beams:
        for s in d["sets"]:
            key = tuple(sorted(s["layers"]))
            x, y = pos[key]
            hot = key in on_path
            ax.text(x, y, f"{{{', '.join(map(str, key))}}}\n{s['entropy']:.4f}", ha="center", va="center",
                    fontsize=7.5 if len(beams) <= 5 else 6.5, zorder=3,
                    color="white" if norm(s["entropy"]) < 0.55 else "black",
                    bbox=dict(boxstyle="round,pad=0.3", fc=cmap(norm(s["entropy"])),
                              ec=OKABE_ITO["vermillion"] if hot else "#555555", lw=2.5 if hot else 0.6))
    sm = plt.cm.ScalarMappable(norm=norm, cmap=cmap)
    fig.colorbar(sm, ax=ax, shrink=0.8, label="set entropy (nats)")
    ax.set_xlim(0.6, len(beams) + 0.4)
    ax.set_ylim(width - 0.5, -0.6)
    ax.set_xticks([d["depth"] for d in beams], [f"depth {d['depth']}\n({len(d['sets'])} sets)" for d in beams])
    ax.set_yticks(range(width), [f"#{r + 1}" for r in range(width)])
    ax.set_ylabel("rank within the beam (by entropy)")
    ax.set_xlabel("set size (search depth)")
    for side in ("left", "bottom"):
        ax.spines[side].set_visible(False)
    ax.tick_params(length=0)
    title = f"{model}: " if model else ""
    ax.set_title(f"{title}{result['method']} beam search, m = {result['m']}: each box a set kept in the beam, "
                 f"edges: set → its extension\nhighlighted: the path to {list(result['layers'])} "
                 f"(H = {result['entropy']:.4f} nats)")
    return _save(fig, path)


def compare_depth(runs: list[dict], path: str | Path) -> Path:
    """Several models on a normalised depth axis (l / N): normalised entropy ± std, and the transition score.

    ``runs``: one dict per model with ``label``, ``analysis`` and ``chosen`` (layer ids, may be empty).
    """
    fig = _new("compare_depth")
    ax, bx = fig.subplots(2, 1, sharex=True, height_ratios=[3, 2])
    for k, run in enumerate(runs):
        a = run["analysis"]
        n = a["num_layers"]
        colour = RUN_COLOURS[k % len(RUN_COLOURS)]
        x = np.asarray(a["layers"], dtype=float) / n
        log_b = math.log(a["settings"]["block"])
        m = np.asarray(a["layer_entropy_normalized"], dtype=float)
        ax.plot(x, m, "-", color=colour, lw=2, marker="o", ms=3, label=f"{run['label']} (N = {n})")
        std = a.get("layer_entropy_std")
        if std is not None and all(v is not None for v in std):
            sd = np.asarray(std, dtype=float) / log_b
            ax.fill_between(x, m - sd, m + sd, color=colour, alpha=0.15, lw=0)
        chosen = [l for l in run.get("chosen", []) if l in a["layers"]]
        if chosen:
            idx = [a["layers"].index(l) for l in chosen]
            ax.plot(np.asarray(chosen) / n, m[idx], "*", color=colour, ms=15, mec="black", mew=0.7,
                    label=f"{run['label']} selected {chosen}")
        t = np.asarray(a["transition"], dtype=float)
        bx.plot((np.arange(len(t)) + 0.5) / n, t, "-", color=colour, lw=1.8, label=run["label"])
        bounds = a.get("boundaries", [])
        if bounds:
            bx.plot((np.asarray(bounds) + 0.5) / n, t[bounds], "v", color=colour, ms=8, mec="black", mew=0.5)
    ax.set_ylabel("entropy / log(block) (unitless)")
    ax.set_title("models side by side on a normalised depth axis (± 1 std band across samples; ★ selected layers)",
                 pad=8 + 15 * len(runs))
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), fontsize=8, ncols=2, frameon=False)
    ax.grid(alpha=0.25)
    bx.set_ylabel("T = 1 − CKA(l, l+1)")
    bx.set_xlabel("normalised depth l / N (0 = embeddings, 1 = final hidden state)")
    bx.set_xticks(np.linspace(0, 1, 11))
    bx.set_xlim(-0.02, 1.02)
    bx.set_title("transition score (▼ boundaries), same colours", fontsize=9)
    bx.grid(alpha=0.25)
    return _save(fig, path)


def study_tau_entropy(study: dict, path: str | Path) -> Path:
    """τ against set entropy (a study's ``study.json``): one panel per condition, the pooled one first.

    Each seed's draft is a small point (a line spans their range); the set's mean a large mark, labelled;
    the panel title gives Spearman's ρ and its bootstrap interval.
    """
    conds = [study["conditions"][-1], *study["conditions"][:-1]]
    cols = min(3, len(conds))
    fig = _new("study_tau_entropy")
    axes = fig.subplots(math.ceil(len(conds) / cols), cols, squeeze=False)
    for ax, cond in zip(axes.flat, conds):
        _tau_entropy_panel(ax, cond, cond["label"])
    for ax in list(axes.flat)[len(conds):]:
        ax.axis("off")
    note = textwrap.fill(f"small points: one draft per seed, {seeds_phrase(study)} (line: their range); "
                         "large marks: the set's mean", width=110)
    fig.suptitle(f"{Path(study['model']).name}: τ of the trained drafts against the entropy of their layer set\n"
                 + note)
    return _save(fig, path)


def models_tau_entropy(studies: list[dict], path: str | Path) -> Path:
    """τ against set entropy, one panel per model (each study's pooled condition): the paper's
    figure of τ against entropy per model. Marks as in ``study_tau_entropy``."""
    fig = _new("models_tau_entropy")
    axes = fig.subplots(1, len(studies), squeeze=False)
    for ax, study in zip(axes.flat, studies):
        cond = study["conditions"][-1]
        _tau_entropy_panel(ax, cond, f"{Path(study['model']).name} (N = {study['num_layers']}), {cond['label']}")
    fig.suptitle("τ of the trained drafts against the entropy of their layer set, per model "
                 "(small points: one draft per seed; large marks: the set's mean)")
    return _save(fig, path)


def _tau_entropy_panel(ax, cond: dict, title: str) -> None:
    """One condition's sets: each seed's τ (small points, a line over their range) and the set's mean
    (a large labelled mark) against set entropy; Spearman's ρ in the title."""
    for r in cond["sets"]:
        colour, marker = STUDY_STYLE.get(r["method"], (OKABE_ITO["black"], "o"))
        seeds = [t for t in r["tau_seeds"] if t is not None]
        if len(seeds) > 1:
            ax.vlines(r["entropy"], min(seeds), max(seeds), color=colour, alpha=0.5, lw=1.5)
        ax.plot([r["entropy"]] * len(seeds), seeds, "o", color=colour, alpha=0.6, ms=4.5, mew=0)
        if r["tau_all"] is not None:
            ax.plot([r["entropy"]], [r["tau_all"]], marker, color=colour, ms=13 if marker == "*" else 9,
                    mec="black", mew=0.6, zorder=3)
            ax.annotate(r["name"], (r["entropy"], r["tau_all"]), xytext=(5, 4), textcoords="offset points",
                        fontsize=7.5)
    sp = cond["spearman"]
    rho = num(sp["rho"], 2)
    ci = f" [{sp['ci_low']:.2f}, {sp['ci_high']:.2f}]" if sp.get("ci_low") is not None else ""
    ax.set_title(f"{title}\nSpearman ρ = {rho}{ci}", fontsize=9.5)
    ax.set_xlabel("set entropy (nats)")
    ax.set_ylabel("τ (mean accepted length)")
    ax.grid(alpha=0.25)
    ax.margins(x=0.15, y=0.15)


__all__ = [
    "DPI", "SIZES", "beam_tree", "chosen_path", "cka", "compare_depth", "entropy_wave", "pair_entropy",
    "models_tau_entropy", "pair_gain", "pixel_size", "study_tau_entropy", "transitions",
]
