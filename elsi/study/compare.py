"""Studies of several model families side by side, and the paper's claims tested on them.

Input: finished studies (``study.json``, ``elsi.study.summary``) and the analyses their sets were
selected on (``analysis.json``: CKA, compartments). Output (``compare_studies``): per model the CKA
structure and the gains of the selected sets, and one verdict per claim of the paper, each
"supported", "contradicted" or "not resolvable at this scale", with the numbers it rests on.

The paper's claims (Goel et al., "Surfing the Activation Wave", as issue 16 quotes them; ``PAPER``):
1. ``m3_gain``: ELSI m = 3 gains +1.6 to +2.2 % τ over EAGLE-3's [2, N//2, N-3].
2. ``m1_parity``: ELSI m = 1 matches EAGLE-3.
3. ``where``: the largest gains fall on translation and summarization.
4. ``compartments``: the gains are large where the CKA structure has several compartments (Qwen3-4B)
   and small where broad high-CKA regions make layer choice matter little (Llama-3.1-8B).

Rules (on the pooled condition of each study; Δ in % of eagle3's τ; CI = the study's question-bootstrap
95 % interval of Δτ; "spread" = the study's seed-to-seed spread, the largest min-max range of τ over
seeds of any set):
1. supported: CI above 0 and Δ beyond the spread; contradicted: CI below the paper's smallest gain
   (1.6 %) and the spread smaller than that gain too (the paper's effect would show); otherwise not
   resolvable.
2. supported: CI inside ±1.6 % (closer than the smallest gain the paper reports); contradicted: CI
   excludes 0 and Δ beyond the spread; otherwise not resolvable.
3. supported: translation and summarization have the two largest Δ and both CIs lie above 0;
   contradicted: both their CIs lie below 0, or another subtask's CI lies above both of theirs;
   otherwise not resolvable.
4. (two models or more) the models ordered by how compartmentalised their CKA is (compartments of two
   or more layers; ties: lower mean CKA of adjacent layers first). Supported: the most
   compartmentalised model's m = 3 gain is supported and the least one's is not (its CI reaches 0 or
   below); contradicted: the reverse; otherwise not resolvable.
5. Studies with the exact τ (issue 30) are judged on temperature 0, every tree size pooled, all of
   Spec-Bench, with the 95 % interval of Δ% from a hierarchical bootstrap over paired seeds and questions
   (``summary.delta_pct_interval``); written before any powered run (the pilot of two seeds,
   bench/results/study3-pilot-smollm2-135m, then measured a half-width of 0.35 points on 120 questions).
   If the interval's half-width exceeds ±0.8 points (``TARGET_HALF_WIDTH``), every claim on that model is
   not resolvable, with the width and the seeds (or, where the question part alone is wider, the seeds and
   questions: ``summary.reach_plan``) that would reach it. Otherwise:
   m3_gain: contradicted when the interval lies below +1.6 %; supported when it lies above 0 and reaches
   +1.6 %. m1_parity: supported when |Δ| < 1.6 %, contradicted otherwise. where: supported as in 3,
   contradicted otherwise. compartments: as in 4, on these verdicts.
   Completed after both powered runs (issue 30 allows "not resolvable" only where the width target is
   missed, and rule 4 left open the case of neither model gaining, which is what the runs found): when
   every model's interval meets the target, compartments is supported as in 4 and contradicted otherwise
   (the most compartmentalised model shows no gain, or the least one gains as well). Under rule 4 alone
   the two powered studies of issue 30 would read "not resolvable".
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from elsi.io import read_json
from elsi.report.study import load_study
from elsi.stats.sampling import spearman
from elsi.study.summary import TARGET_HALF_WIDTH, _clean, claims_condition, need_words
from elsi.text import md_table, num

PAPER = {
    "m3_gain": {"claim": "ELSI m=3 beats EAGLE-3 by +1.6 to +2.2 % τ", "low_pct": 1.6, "high_pct": 2.2},
    "m1_parity": {"claim": "ELSI m=1 matches EAGLE-3"},
    "where": {"claim": "the largest gains are on translation and summarization",
              "subtasks": ("translation", "summarization")},
    "compartments": {"claim": "gains where the CKA structure has several compartments (Qwen3-4B), little "
                              "difference where broad high-CKA regions dominate (Llama-3.1-8B)"},
}
SUPPORTED, CONTRADICTED, UNRESOLVED = "supported", "contradicted", "not resolvable at this scale"


def cka_structure(analysis: dict) -> dict:
    """The CKA structure of an analysis: its compartments, how many span two or more layers, the largest
    one's share of the layers, and the mean CKA of adjacent and of all distinct layer pairs."""
    cka = np.asarray(analysis["cka"], dtype=np.float64)  # (L, L) over analysis["layer_ids"]
    comps = [list(c) for c in analysis["compartments"]]
    sizes = [c[1] - c[0] + 1 for c in comps]
    n = cka.shape[0]
    off = cka[~np.eye(n, dtype=bool)]
    return {"compartments": comps, "multi_layer_compartments": sum(s >= 2 for s in sizes),
            "largest_share": max(sizes) / sum(sizes), "boundaries": list(analysis["boundaries"]),
            "mean_adjacent_cka": float(np.mean(np.diag(cka, 1))), "mean_cka": float(off.mean()),
            "num_layers": int(analysis["num_layers"])}


def _gap(cond: dict, name: str, ref: str = "eagle3") -> dict | None:
    return next((g for g in cond["gaps"] if g["set"] == name and g["vs"] == ref), None)


def _pct(x: float | None, base: float) -> float | None:
    return None if x is None else 100.0 * x / base


def gain(cond: dict, name: str, ref: str = "eagle3") -> dict | None:
    """A selected set against ``ref`` in one condition, in % of the reference's τ (overall, and per subtask
    in % of that subtask's τ); None when the study has no such pair."""
    g = _gap(cond, name, ref)
    if g is None:
        return None
    ref_tau = next(r["tau"] for r in cond["sets"] if r["name"] == ref)  # {subtask: τ}
    # rules (5): an exact-τ condition, judged on the interval over paired seeds and questions (issue 30)
    powered = bool(cond.get("exact")) and g.get("pct_half_width") is not None
    subs = {}
    for s, x in g.get("subtasks", {}).items():
        if powered:  # Δ% intervals over seeds and questions
            subs[s] = {"delta_pct": x["delta_pct"], "ci_low_pct": x.get("pct_ci_low"), "ci_high_pct": x.get("pct_ci_high")}
        else:
            subs[s] = {"delta_pct": x["delta_pct"],
                       "ci_low_pct": _pct(x["ci_low"], ref_tau[s]) if ref_tau.get(s) else None,
                       "ci_high_pct": _pct(x["ci_high"], ref_tau[s]) if ref_tau.get(s) else None}
    base = g["tau_ref"]
    out = {"set": name, "vs": ref, "tau": g["tau"], "tau_ref": base, "delta_pct": g["delta_pct"],
           "ci_low_pct": _pct(g["ci_low"], base), "ci_high_pct": _pct(g["ci_high"], base),
           "seed_spread_pct": _pct(g["seed_spread"], base), "beyond_seed_spread": g["beyond_seed_spread"],
           "subtasks": subs, "half_width": None}
    if powered:
        out.update(ci_low_pct=g["pct_ci_low"], ci_high_pct=g["pct_ci_high"], half_width=g["pct_half_width"],
                   paired_seeds=len(g["paired_seeds"]), seeds_needed=g.get("seeds_needed"), reach=g.get("reach"),
                   t_ci_low_pct=g.get("t_ci_low"), t_ci_high_pct=g.get("t_ci_high"))
    return out


def _width_missed(g: dict) -> str | None:
    """Why a powered interval cannot decide (its half-width over ``TARGET_HALF_WIDTH``), or None."""
    if g["half_width"] <= TARGET_HALF_WIDTH:
        return None
    need = need_words(g)
    return (f": the interval's half-width {num(g['half_width'], 2)} points over {g['paired_seeds']} paired seeds "
            f"misses the target ±{TARGET_HALF_WIDTH}{need}")


def _gain_numbers(g: dict) -> str:
    """A gain in words: Δ % [interval], seed spread % (powered: the interval over paired seeds and questions)."""
    if g.get("half_width") is not None:
        return (f"Δ {num(g['delta_pct'], 2, True)} % [{num(g['ci_low_pct'], 2, True)}, "
                f"{num(g['ci_high_pct'], 2, True)}] (95 %, {g['paired_seeds']} paired seeds × questions; "
                f"half-width {num(g['half_width'], 2)})")
    return (f"Δ {num(g['delta_pct'], 2, True)} % [{num(g['ci_low_pct'], 2, True)}, "
            f"{num(g['ci_high_pct'], 2, True)}], seed spread {num(g['seed_spread_pct'], 2)} %")


def _judge_gain(g: dict | None, name: str, rule: Callable[[dict, bool], tuple[str, str]]) -> tuple[str, str]:
    """The steps rules 1, 2 and 5 share: not resolvable where ``name`` or eagle3 is missing, there is no bootstrap,
    or a powered interval misses ``TARGET_HALF_WIDTH``; else ``rule(g, powered)`` -> (verdict, the words that
    follow the gain's numbers)."""
    if g is None or g["ci_low_pct"] is None:
        return UNRESOLVED, f"{name} or eagle3 missing, or no bootstrap"
    txt = _gain_numbers(g)
    powered = g.get("half_width") is not None  # powered rules (5)
    missed = _width_missed(g) if powered else None
    if missed:
        return UNRESOLVED, txt + missed
    verdict, why = rule(g, powered)
    return verdict, txt + why


def _m3_rule(g: dict, powered: bool) -> tuple[str, str]:
    low = PAPER["m3_gain"]["low_pct"]
    if powered:
        if g["ci_high_pct"] < low:
            return CONTRADICTED, f": the paper's smallest gain, {low} %, lies above the interval"
        if g["ci_low_pct"] > 0:
            return SUPPORTED, f": a gain above 0, {low} % inside the interval or below it"
        return UNRESOLVED, ""
    if g["ci_low_pct"] > 0 and g["beyond_seed_spread"]:
        return SUPPORTED, ""
    spread = g["seed_spread_pct"]
    if g["ci_high_pct"] < low and spread is not None and spread < low:
        return CONTRADICTED, f": a gain of {low} % lies outside the interval and above the seed noise"
    return UNRESOLVED, ""


def _m1_rule(g: dict, powered: bool) -> tuple[str, str]:
    margin = PAPER["m3_gain"]["low_pct"]
    if powered:
        if abs(g["delta_pct"]) < margin:
            return SUPPORTED, f" (|Δ| under {margin} %)"
        return CONTRADICTED, f" (|Δ| of {margin} % or more)"
    if -margin < g["ci_low_pct"] and g["ci_high_pct"] < margin:
        return SUPPORTED, f" (inside ±{margin} %)"
    if (g["ci_low_pct"] > 0 or g["ci_high_pct"] < 0) and g["beyond_seed_spread"]:
        return CONTRADICTED, ""
    return UNRESOLVED, ""


def judge_m3(g: dict | None) -> tuple[str, str]:
    """Claim 1 (rules 1 and 5) on elsi:3's gain over eagle3 (``gain``): (verdict, the numbers it rests on)."""
    return _judge_gain(g, "elsi:3", _m3_rule)


def judge_m1(g: dict | None) -> tuple[str, str]:
    """Claim 2 (rules 2 and 5) on elsi:1's gain over eagle3 (``gain``): (verdict, the numbers it rests on)."""
    return _judge_gain(g, "elsi:1", _m1_rule)


def judge_where(g: dict | None) -> tuple[str, str]:
    want = PAPER["where"]["subtasks"]
    if g is None or not g["subtasks"] or any(s not in g["subtasks"] for s in want):
        return UNRESOLVED, "elsi:3 or eagle3 missing, or translation/summarization not benchmarked"
    subs = {s: x for s, x in g["subtasks"].items() if x["delta_pct"] is not None and x["ci_low_pct"] is not None}
    if any(s not in subs for s in want):
        return UNRESOLVED, "no interval for translation or summarization"
    order = sorted(subs, key=lambda s: -subs[s]["delta_pct"])
    txt = "; ".join(f"{s} {num(subs[s]['delta_pct'], 1, True)} % [{num(subs[s]['ci_low_pct'], 1, True)}, "
                    f"{num(subs[s]['ci_high_pct'], 1, True)}]" for s in order)
    if set(order[:2]) == set(want) and all(subs[s]["ci_low_pct"] > 0 for s in want):
        return SUPPORTED, txt
    if g.get("half_width") is not None and _width_missed(g) is None:  # powered rules (5): decided
        return CONTRADICTED, txt
    others_above = [s for s in subs if s not in want
                    and all(subs[s]["ci_low_pct"] > subs[w]["ci_high_pct"] for w in want)]
    if all(subs[s]["ci_high_pct"] < 0 for s in want) or others_above:
        return CONTRADICTED, txt
    return UNRESOLVED, txt


def judge_compartments(models: list[dict]) -> tuple[str, str]:
    """Claim 4 (rules 4 and 5) across the models (``model_entry``): (verdict, the numbers it rests on)."""
    if len(models) < 2:
        return UNRESOLVED, "one model only"
    key = lambda m: (-m["cka"]["multi_layer_compartments"], m["cka"]["mean_adjacent_cka"])  # noqa: E731
    ranked = sorted(models, key=key)
    most, least = ranked[0], ranked[-1]
    txt = "; ".join(f"{m['model']}: {m['cka']['multi_layer_compartments']} compartments of ≥ 2 layers, mean "
                    f"adjacent CKA {num(m['cka']['mean_adjacent_cka'], 3)}, "
                    f"elsi:3 {m['verdicts']['m3_gain']['verdict']}"
                    for m in ranked)
    if key(most) == key(least):
        return UNRESOLVED, txt + " (the same CKA structure)"
    gains = [m["verdicts"]["m3_gain"]["verdict"] == SUPPORTED for m in (most, least)]
    reach0 = [m["gain_m3"] is not None and m["gain_m3"]["ci_low_pct"] is not None and m["gain_m3"]["ci_low_pct"] <= 0
              for m in (most, least)]
    if gains[0] and reach0[1]:
        return SUPPORTED, txt
    if gains[1] and reach0[0]:
        return CONTRADICTED, txt
    if all(_powered_decided(m["gain_m3"]) for m in models):  # rule 5: every interval meets the width target
        why = ("no gain on the most compartmentalised model" if not gains[0]
               else "the least compartmentalised model gains as well")
        return CONTRADICTED, f"{txt} ({why})"
    return UNRESOLVED, txt


def _powered_decided(g: dict | None) -> bool:
    """Whether a gain comes from a powered study whose interval meets ``TARGET_HALF_WIDTH`` (rule 5 decides)."""
    return g is not None and g.get("half_width") is not None and _width_missed(g) is None


def heldout_summary(study: dict) -> dict:
    """The drafts' held-out depth-1 match per set (mean over seeds), Spearman's ρ with set entropy, and
    elsi:3 and elsi:1 against eagle3 next to the seed-to-seed spread of that match (None without
    training records)."""
    held = {r["name"]: r for r in study.get("training", []) if r["heldout_mean"] is not None}
    sets = [s for s in study["sets"] if s["name"] in held]
    if len(sets) < 2:
        return {"rho": None, "sets": len(sets), "by_set": {}, "spread": None, "gaps": {}}
    ranges = [max(h) - min(h) for h in (held[s["name"]]["heldout_match"] for s in sets) if len(h) > 1
              and None not in h]
    ref = held.get("eagle3", {}).get("heldout_mean")
    gaps = {n: held[n]["heldout_mean"] - ref for n in ("elsi:3", "elsi:1") if n in held and ref is not None}
    return {"rho": _clean(spearman([s["entropy"] for s in sets], [held[s["name"]]["heldout_mean"] for s in sets])),
            "sets": len(sets), "by_set": {s["name"]: held[s["name"]]["heldout_mean"] for s in sets},
            "spread": max(ranges) if ranges else None, "gaps": gaps}


def model_entry(study: dict, analysis: dict) -> dict:
    """One model's figures: CKA structure, gains (pooled and per condition), seed spread, Spearman ρ."""
    pooled = claims_condition(study)
    m3, m1 = gain(pooled, "elsi:3"), gain(pooled, "elsi:1")
    entry = {
        "model": study["model"], "num_layers": study["num_layers"], "cka": cka_structure(analysis),
        "sets": [{"name": r["name"], "layers": r["layers"], "entropy": r["entropy"], "tau_all": r["tau_all"],
                  "tau_seeds": r["tau_seeds"], "delta_pct": r["delta_pct"]} for r in pooled["sets"]],
        "spearman": pooled["spearman"], "gain_m3": m3, "gain_m1": m1,
        "conditions": [{"label": c["label"], "gain_m3": gain(c, "elsi:3"), "gain_m1": gain(c, "elsi:1"),
                        "spearman": c["spearman"]} for c in study["conditions"]],
        "vllm": study.get("vllm", []), "heldout": heldout_summary(study),
    }
    entry["verdicts"] = {name: dict(zip(("verdict", "numbers"), judge(g)))
                         for name, judge, g in (("m3_gain", judge_m3, m3), ("m1_parity", judge_m1, m1),
                                                ("where", judge_where, m3))}
    return entry


def compare_studies(studies: list[dict], analyses: list[dict]) -> dict:
    """comparison.json's dict from the studies and, in the same order, the analyses they selected on."""
    if len(studies) != len(analyses):
        raise ValueError(f"{len(studies)} studies but {len(analyses)} analyses")
    models = [model_entry(s, a) for s, a in zip(studies, analyses)]
    verdict, numbers = judge_compartments(models)
    return {"paper": PAPER, "models": models,
            "compartments": {"verdict": verdict, "numbers": numbers}}


def load_pair(study_dir: str | Path, run_dir: str | Path | None = None) -> tuple[dict, dict]:
    """A study's study.json and its analysis (``run_dir``, default the study's own ``run``)."""
    study = load_study(study_dir)
    run = Path(run_dir or study["run"])
    path = run / "analysis.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the analysis of study {study_dir} ({study['run']}); pass its run "
                                "directory with --runs")
    return study, read_json(path)


def comparison_markdown(cmp: dict) -> str:
    """comparison.md: the paper's claims against each model, the CKA structure, the gains per condition."""
    models = cmp["models"]
    names = [Path(m["model"]).name for m in models]
    rows = []
    for key in ("m3_gain", "m1_parity", "where"):
        rows.append([PAPER[key]["claim"], *[f"**{m['verdicts'][key]['verdict']}**: {m['verdicts'][key]['numbers']}"
                                             for m in models]])
    rows.append([PAPER["compartments"]["claim"], *[f"**{cmp['compartments']['verdict']}**" if i == 0 else "(across models)"
                                                   for i in range(len(models))]])
    parts = ["# The paper's claims on these models", "",
             md_table(["claim (paper)", *names], rows), "",
             f"Compartments, across models: {cmp['compartments']['numbers']}.", "",
             "## CKA structure and gains", "",
             md_table(["model", "N", "compartments", "≥ 2 layers", "largest share", "mean adjacent CKA", "mean CKA",
                       "elsi:3 vs eagle3 (Δ %, CI)", "elsi:1 vs eagle3", "seed spread %", "Spearman ρ (CI)",
                       "held-out: elsi:3 − eagle3, elsi:1 − eagle3 (seed spread)", "held-out ρ"],
                      [[n, str(m["num_layers"]), " ".join(f"{a}–{b}" for a, b in m["cka"]["compartments"]),
                        str(m["cka"]["multi_layer_compartments"]), num(m["cka"]["largest_share"], 2),
                        num(m["cka"]["mean_adjacent_cka"], 3), num(m["cka"]["mean_cka"], 3),
                        _gain_cell(m["gain_m3"]), _gain_cell(m["gain_m1"]),
                        num((m["gain_m3"] or {}).get("seed_spread_pct"), 2),
                        f"{num(m['spearman']['rho'], 2)} [{num(m['spearman']['ci_low'], 2)}, "
                        f"{num(m['spearman']['ci_high'], 2)}]",
                        f"{num(m['heldout']['gaps'].get('elsi:3'), 4, True)}, "
                        f"{num(m['heldout']['gaps'].get('elsi:1'), 4, True)} ({num(m['heldout']['spread'], 4)})",
                        num(m["heldout"]["rho"], 2)]
                       for n, m in zip(names, models)]), ""]
    for n, m in zip(names, models):
        parts += [f"## {n}: elsi:3 and elsi:1 against eagle3, per condition", "",
                  md_table(["condition", "elsi:3 Δ % (CI)", "elsi:1 Δ % (CI)", "Spearman ρ"],
                           [[c["label"], _gain_cell(c["gain_m3"]), _gain_cell(c["gain_m1"]),
                             num(c["spearman"]["rho"], 2)] for c in m["conditions"]]), ""]
    powered = any((c.get(k) or {}).get("half_width") is not None for m in models for c in m["conditions"]
                  for k in ("gain_m3", "gain_m1"))
    ci = ("the 95 % interval, over paired seeds and questions (hierarchical bootstrap) where τ is exact, over "
          "questions elsewhere" if powered else "the question-bootstrap 95 % interval")
    parts += [f"Δ % = 100 (τ / τ of eagle3 − 1); CI: {ci}; the seed spread is the "
              "largest min-max range of τ over a set's seeds, in % of eagle3's τ. Held-out: the drafts' depth-1 "
              "top-1 match on held-out conversations (mean over seeds; spread: the largest min-max range over a "
              "set's seeds); ρ: Spearman's between set entropy and that match. Verdict rules: "
              "`elsi/study/compare.py`.", ""]
    return "\n".join(parts)


def _gain_cell(g: dict | None) -> str:
    if g is None:
        return "–"
    return f"{num(g['delta_pct'], 2, True)} [{num(g['ci_low_pct'], 2, True)}, {num(g['ci_high_pct'], 2, True)}]"


__all__ = ["PAPER", "cka_structure", "compare_studies", "comparison_markdown", "gain", "judge_compartments",
           "judge_m1", "judge_m3", "judge_where", "load_pair", "model_entry"]
