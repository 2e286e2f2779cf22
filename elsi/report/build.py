"""``build_report``: load one or more run directories and write every figure, ``selection.md`` and ``index.html``.

One run: ``RUN_DIR/report/{entropy_wave,pair_entropy,cka,transitions,beam_tree}.png``, ``selection.md``,
``index.html``. Several runs: one sub-folder of figures per model, ``compare_depth.png`` (the
models on a normalised depth axis) and one page that puts the models side by side.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from elsi.report import figures, page
from elsi.report.study import load_study
from elsi.select.run import SELECTIONS
from elsi.select.search import baseline

REPORT_DIR = "report"
COMPARE_DIR = "report-compare"
METHOD_ORDER = ("elsi", "elsi-c", "exhaustive", "eagle3", "eagle2", "uniform", "low-entropy")  # table order within m


def baseline_layers(num_layers: int) -> dict[str, list[int]]:
    """The EAGLE baselines in hidden-state ids (eagle3 left out where [2, N//2, N-3] collides)."""
    out = {"eagle2": list(baseline("eagle2", num_layers, 1, ()))}
    try:
        out["eagle3"] = sorted(baseline("eagle3", num_layers, 3, ()))
    except ValueError:
        pass  # N < 7: no distinct eagle3 set to mark
    return out


def _read(path: Path, fix: str) -> dict:
    from elsi.io import read_json

    return read_json(path, fix=fix)


def load_run(run_dir: str | Path) -> dict:
    """A run's ``analysis.json`` (required), ``manifest.json`` and ``selections.json`` (optional).

    Raises FileNotFoundError naming the directory when it has no ``analysis.json``.
    """
    run_dir = Path(run_dir)
    ana = run_dir / "analysis.json"
    if not ana.exists():
        raise FileNotFoundError(f"{run_dir} has no analysis.json: run `elsi analyze --out {run_dir}` first")
    man = run_dir / "manifest.json"
    sel = run_dir / SELECTIONS
    again = f"rerun `elsi analyze --out {run_dir}` with the run's settings (it recomputes analysis.json from the Gram tensor)"
    out = {
        "dir": run_dir,
        "analysis": _read(ana, again),
        "manifest": _read(man, f"delete {run_dir} and run `elsi analyze` again") if man.exists() else None,
        "selections": _read(sel, f"delete it and rerun `elsi select --run {run_dir}`") if sel.exists() else None,
    }
    check_grams(run_dir, out["analysis"], out["manifest"])
    return out


def check_grams(run_dir: Path, analysis: dict, manifest: dict | None) -> None:
    """The run's Gram tensor (when present) against its checksum, and analysis.json against it; RunError naming
    the file and the command that rebuilds it."""
    grams = run_dir / "grams.safetensors"
    if not grams.is_file():
        return
    from elsi.collect.store import analyze_command
    from elsi.io import RunError, verify_tensors

    settings = (manifest or {}).get("settings") or analysis.get("settings", {})
    digest = verify_tensors(grams, fix=f"rebuild it with `{analyze_command(run_dir, settings)}`")
    if digest is not None and analysis.get("grams_sha256") not in (None, digest):
        raise RunError(f"{run_dir / 'analysis.json'} was computed from another Gram tensor than {grams}; rerun "
                       f"`{analyze_command(run_dir, settings)}` (it recomputes analysis.json)")


def _score(run_dir: Path, analysis: dict, layers: list[int]) -> float | None:
    """Entropy of a layer set from the run's Gram tensor (same aggregate as the analysis); None without it."""
    if len(layers) == 1:
        return analysis["layer_entropy"][analysis["layers"].index(layers[0])]
    if len(layers) == 2:
        a, b = (analysis["layers"].index(l) for l in layers)
        return analysis["pair_entropy"][a][b]
    if not (run_dir / "grams.safetensors").exists():
        return None
    from elsi.stats.analysis import GramRun  # torch is only needed here

    run = GramRun(run_dir)
    if analysis.get("settings", {}).get("aggregate") == "mean-block":
        return run.mean_block_entropy([layers])[0]
    return run.entropy(layers).mean


def selection_rows(run: dict) -> list[dict]:
    """Every (method, m) result to tabulate, sorted by m then method.

    Without ``selections.json`` only the baselines are known: their entropy comes from the
    analysis (singletons and pairs) or the Gram tensor; rank and gap are then None.
    """
    if run["selections"] is not None:
        results = list(run["selections"].get("results", []))
    else:
        ana = run["analysis"]
        log_b = math.log(ana["settings"]["block"])
        results = []
        for method, layers in baseline_layers(ana["num_layers"]).items():
            h = _score(run["dir"], ana, layers)
            results.append({
                "method": method, "m": len(layers), "layers": layers, "entropy": h,
                "entropy_normalized": None if h is None else h / log_b, "rank": None, "optimum": None,
                "gap": None, "beams": [],
            })
    order = {m: k for k, m in enumerate(METHOD_ORDER)}
    return sorted(results, key=lambda r: (r["m"], order.get(r["method"], len(order)), r["method"]))


def chosen(run: dict) -> dict | None:
    """``selections.json["chosen"]`` ({method, m, layers}) or None."""
    sel = run["selections"]
    return sel.get("chosen") if sel else None


def _method_label(method: str) -> str:
    return {"elsi": "ELSI", "elsi-c": "ELSI-C"}.get(method, method)


def marks(run: dict) -> dict[str, list[int]]:
    """Layer sets marked on the entropy wave: eagle2, eagle3 and the chosen (ELSI) set when known."""
    out = dict(baseline_layers(run["analysis"]["num_layers"]))
    c = chosen(run)
    if c:
        out[f"{_method_label(c['method'])} (chosen, m={c['m']})"] = sorted(c["layers"])
    return out


def beam_result(run: dict) -> dict | None:
    """The result whose beam is drawn: the chosen one if it has beams, else the ELSI result of largest m."""
    sel = run["selections"]
    if not sel:
        return None
    results = [r for r in sel.get("results", []) if r.get("beams")]
    c = chosen(run)
    if c:
        for r in results:
            if r["method"] == c["method"] and r["m"] == c["m"]:
                return r
    elsi = sorted((r for r in results if r["method"] == "elsi"), key=lambda r: -r["m"])
    return (elsi or results or [None])[0]


def _labels(runs: list[dict]) -> list[str]:
    """A file-safe, unique label per run (its model name)."""
    out: list[str] = []
    for run in runs:
        base = re.sub(r"[^A-Za-z0-9._-]+", "-", str(run["analysis"].get("model", run["dir"].name))).strip("-") or "run"
        label, k = base, 2
        while label in out:
            label, k = f"{base}-{k}", k + 1
        out.append(label)
    return out


def default_out(run_dirs: list[str | Path]) -> Path:
    """``RUN_DIR/report`` for one run; ``FIRST_RUN_DIR/report-compare`` for several."""
    first = Path(run_dirs[0])
    return first / (REPORT_DIR if len(run_dirs) == 1 else COMPARE_DIR)


def attach_study(runs: list[dict], study: dict) -> None:
    """Give the selection rows of the study's run the study's τ (pooled over its conditions, mean over seeds).

    The study's run is the one whose directory is the study's ``run`` (or the only run); a row
    gets τ when a study set has its method, size and layers.
    """
    mine = [r for r in runs if Path(r["dir"]).resolve() == Path(study["run"]).resolve()]
    if not mine and len(runs) == 1:
        mine = runs
    pooled = {(s["method"], len(s["layers"]), tuple(s["layers"])): s for s in study["conditions"][-1]["sets"]}
    for run in mine:
        for row in run["rows"]:
            s = pooled.get((row["method"], row["m"], tuple(row["layers"])))
            if s is not None:
                row["tau"] = {**s["tau"], "all": s["tau_all"]}


def build_report(run_dirs: list[str | Path], out: str | Path | None = None, command: str = "",
                 study: str | Path | None = None) -> dict[str, Path]:
    """Write the report of one or more runs; return {file name relative to ``out``: path}.

    ``command`` (optional) is shown on the page as the command that made it. ``study``: a
    finished study directory (``elsi study``); the page and selection.md gain its tables and
    the τ-against-entropy figure, and its run's selection rows its τ.
    """
    if not run_dirs:
        raise ValueError("build_report needs at least one run directory")
    out = Path(out) if out else default_out(run_dirs)
    runs = [load_run(d) for d in run_dirs]
    study_data = None
    if study:
        study_data = load_study(study)
    several = len(runs) > 1
    written: dict[str, Path] = {}
    for run, label in zip(runs, _labels(runs)):
        ana = run["analysis"]
        sub = out / label if several else out
        run.update(label=label, rows=selection_rows(run), chosen=chosen(run), marks=marks(run), beam=beam_result(run))
        figs = {
            "entropy_wave": figures.entropy_wave(ana, run["marks"], sub / "entropy_wave.png"),
            "pair_entropy": figures.pair_entropy(ana, sub / "pair_entropy.png"),
            "cka": figures.cka(ana, sub / "cka.png"),
            "transitions": figures.transitions(ana, sub / "transitions.png"),
        }
        if run["beam"] is not None:
            figs["beam_tree"] = figures.beam_tree(run["beam"], sub / "beam_tree.png", model=ana["model"])
        run["figures"] = figs
        written.update({p.relative_to(out).as_posix(): p for p in figs.values()})
    study_fig = None
    if study_data is not None:
        attach_study(runs, study_data)
        study_fig = figures.study_tau_entropy(study_data, out / "study_tau_entropy.png")
        written["study_tau_entropy.png"] = study_fig
    compare = None
    if several:
        compare = figures.compare_depth(
            [{"label": r["label"], "analysis": r["analysis"], "chosen": (r["chosen"] or {}).get("layers", [])}
             for r in runs],
            out / "compare_depth.png",
        )
        written["compare_depth.png"] = compare
    md = out / "selection.md"
    md.write_text(page.selection_markdown(runs, study=study_data))
    written["selection.md"] = md
    html = out / "index.html"
    html.write_text(page.index_html(runs, out, compare=compare, command=command, study=study_data,
                                    study_figure=study_fig))
    written["index.html"] = html
    return written


__all__ = ["attach_study", "baseline_layers", "beam_result", "build_report", "chosen", "default_out", "load_run",
           "marks", "selection_rows"]
