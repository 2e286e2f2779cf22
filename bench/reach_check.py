"""Does a small study's forecast hold? Check ``seeds_needed`` and ``reach`` on a powered study's own records.

    .venv/bin/python bench/reach_check.py STUDY [--set elsi:3] [--ref eagle3] [--pilots 1000] [--draws 2000]
                                                [--out JSON]

STUDY: a finished study with the exact τ (bench/results/study3-MODEL: 8 paired seeds of eagle3, elsi:3 and elsi:1
on all 480 Spec-Bench questions). Its drafts are the population; the condition is the claims' one (temperature 0,
every tree size pooled). Each pilot is a small study drawn from it the way the temperature-1 studies are designed
(2 paired seeds of the 8, 3 questions per subtask) and summarized as a study summarizes itself
(``elsi.study.summary.delta_pct_interval``): its question SD and seed SD, and its plan to reach the half-width target
±0.8 points (``seeds_needed`` at its 18 questions, or, where seeds alone cannot, ``reach``: seeds and at most the
population's questions, as a study plans within Spec-Bench's).
Each plan is then checked against the truth: the half-width 1.96 × SD of Δ% = 100 (τ_set / τ_ref − 1) over
``--draws`` studies of the plan's size drawn from the population (paired seeds with replacement from the 8, questions
with replacement from the 480). Also the pilot's forecast of the half-width at the population's own size (8 seeds,
480 questions) against the truth there. Beside the study's two-part split (question part, seed part) the same figures
for a three-part one (``three_parts``: question, seed × question and seed variance, the middle one shrinking with
seeds and questions both), to see which a study should plan with. Writes JSON (default
bench/results/reach_check_MODEL.json) and prints a table.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

from elsi.io import write_json
from elsi.runtime import machine_info
from elsi.stats.sampling import pooled_tau, resample_weights
from elsi.study.plan import load_plan
from elsi.study.sofar import finished_drafts
from elsi.study.summary import (TARGET_HALF_WIDTH, cheapest_plan, condition_questions, delta_pct_interval,
                                draft_stats)
from elsi.text import md_table

PER_SUBTASK = 3  # the temperature-1 studies' questions per subtask (bench/study3_t1.sh)
PILOT_SEEDS = 2  # and their paired seeds


def population(study: Path, name: str, ref: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], list[str]]:
    """Accepted and steps per (seed, question) of ``name`` and ``ref`` at temperature 0, every tree size pooled ->
    ({set: (S, Q)}, {set: (S, Q)}, the questions' subtasks (Q,)); only the seeds both sets have."""
    plan = load_plan(study)
    benches, _ = finished_drafts(study, plan)
    subtask_of = condition_questions([b["answers"] for b in benches.values()], 0.0, None)
    if not subtask_of:
        raise ValueError(f"{study}: no temperature-0 answers of the exact τ, so no population to draw from")
    qids = list(subtask_of)
    seeds = sorted({sd for n, sd in benches if n == name} & {sd for n, sd in benches if n == ref})
    if len(seeds) < 3:
        raise ValueError(f"{study}: {name} and {ref} share {len(seeds)} finished seed(s); a population needs 3 or more")
    acc, steps = {}, {}
    for n in (name, ref):
        st = [draft_stats(benches[(n, sd)]["answers"], qids, subtask_of, 0.0, None, {}, {}) for sd in seeds]
        acc[n], steps[n] = np.stack([s["accepted"] for s in st]), np.stack([s["steps"] for s in st])  # (S, Q)
    return acc, steps, [subtask_of[q] for q in qids]


def delta_pct(acc: dict, steps: dict, name: str, ref: str, w: np.ndarray, pick: np.ndarray) -> np.ndarray:
    """Δ% of many designs: ``w`` (D, Q) how often each question is drawn, ``pick`` (D, S) the paired seeds drawn ->
    (D,); τ of a set = the mean over the drawn seeds of each draft's pooled τ (as the study's summary)."""
    tau = {}
    for n in (name, ref):
        per = (w @ acc[n].T) / (w @ steps[n].T)  # (D, S_all): every draft's pooled τ on each design's questions
        tau[n] = np.take_along_axis(per, pick, axis=1).mean(1)  # (D,)
    return 100.0 * (tau[name] / tau[ref] - 1.0)


def truth_half_width(acc: dict, steps: dict, name: str, ref: str, seeds: int, questions: int, draws: int,
                     rng: np.random.Generator) -> float:
    """1.96 × the SD of Δ% over ``draws`` designs of ``seeds`` paired seeds and ``questions`` questions, each drawn with
    replacement from the population."""
    n_s, n_q = acc[name].shape
    idx = rng.integers(0, n_q, size=(draws, questions))  # (D, questions)
    w = np.zeros((draws, n_q))
    np.add.at(w, (np.arange(draws)[:, None], idx), 1.0)  # (D, Q) counts
    pick = rng.integers(0, n_s, size=(draws, seeds))  # (D, seeds)
    return 1.96 * float(np.std(delta_pct(acc, steps, name, ref, w, pick), ddof=1))


def three_parts(stats: dict, seeds: list[int], name: str, ref: str, w: np.ndarray) -> tuple[float, float, float]:
    """Var(Δ%) at S seeds and Q questions modelled as a / Q + b / (S Q) + c / S (question, seed × question, seed
    parts), solved from one small study (``w`` (R, Q) its question resamples): the question bootstrap's variance of
    each seed's Δ% alone ((a + b) / Q) and of the seeds' mean ((a + b / S) / Q), and the seeds' Δ% variance
    (c + b / Q) -> (a, b, c), each at least 0."""
    def d(x, y):
        return 100.0 * (x / y - 1.0)

    tau = {(n, sd): pooled_tau(w, stats[(n, sd)]["accepted"], stats[(n, sd)]["steps"]) for n in (name, ref)
           for sd in seeds}  # each (R,)
    n_s, n_q = len(seeds), w.shape[1]
    v_each = float(np.mean([np.var(d(tau[(name, sd)], tau[(ref, sd)]), ddof=1) for sd in seeds]))
    v_mean = float(np.var(d(np.mean([tau[(name, sd)] for sd in seeds], 0),
                            np.mean([tau[(ref, sd)] for sd in seeds], 0)), ddof=1))
    per = [d(stats[(name, sd)]["accepted"].sum() / stats[(name, sd)]["steps"].sum(),
             stats[(ref, sd)]["accepted"].sum() / stats[(ref, sd)]["steps"].sum()) for sd in seeds]
    b = max(0.0, (v_each - v_mean) * n_q * n_s / (n_s - 1))
    return max(0.0, v_mean * n_q - b / n_s), b, max(0.0, float(np.var(per, ddof=1)) - b / n_q)


def three_part_plan(a: float, b: float, c: float, seeds: int, most_questions: int) -> dict | None:
    """The fewest seeds × questions with 1.96² (a / Q + b / (S Q) + c / S) ≤ target², S ≥ ``seeds``, Q at most
    ``most_questions`` (``cheapest_plan``, the study's search, with this split's question part)."""
    return cheapest_plan(lambda s: a + b / s, c, seeds, most_questions=most_questions)


def pilot(acc: dict, steps: dict, subtasks: list[str], name: str, ref: str, rng: np.random.Generator,
          seed: int) -> dict:
    """One small study drawn from the population (``PILOT_SEEDS`` distinct seeds, ``PER_SUBTASK`` distinct questions
    per subtask), summarized by ``delta_pct_interval`` as a study would."""
    n_s = acc[name].shape[0]
    seeds = sorted(rng.choice(n_s, size=PILOT_SEEDS, replace=False).tolist())
    qs = []
    for sub in dict.fromkeys(subtasks):
        pool = [i for i, s in enumerate(subtasks) if s == sub]
        qs += sorted(rng.choice(pool, size=PER_SUBTASK, replace=False).tolist())
    stats = {(n, sd): {"accepted": acc[n][sd, qs], "steps": steps[n][sd, qs]} for n in (name, ref) for sd in seeds}
    w = resample_weights(len(qs), 1000, seed)
    got = delta_pct_interval(stats, {name: seeds, ref: seeds}, name, ref, w, most_questions=len(subtasks))
    return {"seeds": seeds, "questions": len(qs), **{k: got[k] for k in ("pct_half_width", "question_sd", "seed_sd",
                                                                        "seeds_needed", "reach")},
            "three_parts": three_parts(stats, seeds, name, ref, w)}


def quantiles(x: list[float]) -> dict:
    """The 10th, 50th and 90th percentiles of ``x`` (None each where it is empty)."""
    if not x:
        return {"median": None, "p10": None, "p90": None}
    p10, med, p90 = np.percentile(x, [10, 50, 90])
    return {"median": float(med), "p10": float(p10), "p90": float(p90)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("study", help="a finished study with the exact τ, or its records in bench/results")
    ap.add_argument("--set", default="elsi:3", help="the selected set (default elsi:3)")
    ap.add_argument("--ref", default="eagle3", help="the default it is compared with (default eagle3)")
    ap.add_argument("--pilots", type=int, default=1000, help="small studies drawn (default 1000)")
    ap.add_argument("--draws", type=int, default=2000, help="designs drawn for each true half-width (default 2000)")
    ap.add_argument("--out", default="", help="JSON output (default bench/results/reach_check_MODEL.json)")
    args = ap.parse_args()
    for opt in ("pilots", "draws"):
        if getattr(args, opt) < 2:
            ap.error(f"--{opt} must be 2 or more, got {getattr(args, opt)}")
    study = Path(args.study)
    t0 = time.time()
    try:
        acc, steps, subtasks = population(study, args.set, args.ref)
    except (ValueError, KeyError, FileNotFoundError) as e:
        print(f"reach_check: {e}", file=sys.stderr)
        return 2
    n_s, n_q = acc[args.set].shape
    rng = np.random.default_rng(0)  # the pilots
    truth: dict[tuple[int, int], float] = {}

    def true_half(s: int, q: int) -> float:  # its own draws for each size: the same whatever the pilots ask
        if (s, q) not in truth:
            truth[(s, q)] = truth_half_width(acc, steps, args.set, args.ref, s, q, args.draws,
                                             np.random.default_rng([1, s, q]))
        return truth[(s, q)]

    full = true_half(n_s, n_q)
    everything = {(n, sd): {"accepted": acc[n][sd], "steps": steps[n][sd]} for n in (args.set, args.ref)
                  for sd in range(n_s)}
    a, b, c = three_parts(everything, list(range(n_s)), args.set, args.ref, resample_weights(n_q, 1000, 0))
    population_3 = {"a": a, "b": b, "c": c, "half_width": 1.96 * math.sqrt(a / n_q + b / (n_s * n_q) + c / n_s)}
    rows = []
    for k in range(args.pilots):
        p = pilot(acc, steps, subtasks, args.set, args.ref, rng, seed=k)
        plan = ({"seeds": p["seeds_needed"], "questions": p["questions"]} if p["seeds_needed"] else p["reach"])
        p["plan"] = plan
        p["truth_at_plan"] = true_half(plan["seeds"], plan["questions"]) if plan else None
        p["forecast_full"] = (1.96 * math.sqrt(p["question_sd"] ** 2 * p["questions"] / n_q + p["seed_sd"] ** 2 / n_s)
                              if p["question_sd"] is not None and p["seed_sd"] is not None else None)
        a, b, c = p["three_parts"]
        p["forecast_full_3"] = 1.96 * math.sqrt(a / n_q + b / (n_s * n_q) + c / n_s)
        p["plan_3"] = three_part_plan(a, b, c, PILOT_SEEDS, n_q)
        p["truth_at_plan_3"] = true_half(p["plan_3"]["seeds"], p["plan_3"]["questions"]) if p["plan_3"] else None
        rows.append(p)
    planned = [r for r in rows if r["plan"]]
    planned3 = [r for r in rows if r["plan_3"]]
    at_plan = [r["truth_at_plan"] for r in planned]
    res = {
        "command": "python bench/reach_check.py " + " ".join(sys.argv[1:]),
        "study": str(study), "set": args.set, "ref": args.ref, "target_half_width": TARGET_HALF_WIDTH,
        "population": {"seeds": n_s, "questions": n_q, "condition": "T = 0, every tree size pooled (exact τ)"},
        "pilot_design": {"seeds": PILOT_SEEDS, "questions_per_subtask": PER_SUBTASK, "bootstrap": 1000},
        "draws": args.draws,
        "truth_full": full,
        "three_parts_on_population": population_3,  # solved on every seed and question: the split's own fit
        "summary": {
            "pilots": len(rows),
            "with_seeds_needed": sum(bool(r["seeds_needed"]) for r in rows),
            "with_reach": sum(bool(r["reach"]) for r in rows),
            "without_plan": len(rows) - len(planned),
            "plan_reached": sum(h <= TARGET_HALF_WIDTH for h in at_plan),
            "truth_at_plan": quantiles(at_plan),
            "plan_drafts_x_questions": quantiles([2 * r["plan"]["seeds"] * r["plan"]["questions"] for r in planned]),
            "forecast_full_over_truth": quantiles([r["forecast_full"] / full for r in rows if r["forecast_full"]]),
            "pilot_half_width": quantiles([r["pct_half_width"] for r in rows if r["pct_half_width"] is not None]),
            "three_part": {
                "plans": len(planned3),
                "plan_reached": sum(r["truth_at_plan_3"] <= TARGET_HALF_WIDTH for r in planned3),
                "truth_at_plan": quantiles([r["truth_at_plan_3"] for r in planned3]),
                "plan_drafts_x_questions": quantiles([2 * r["plan_3"]["seeds"] * r["plan_3"]["questions"]
                                                      for r in planned3]),
                "forecast_full_over_truth": quantiles([r["forecast_full_3"] / full for r in rows]),
            },
        },
        "pilots_shown": rows[:10],  # the first of them in full; the command draws the same ones again
        "seconds": time.time() - t0,
        "machine": machine_info(),
    }
    model = load_plan(study).model
    out = Path(args.out or f"bench/results/reach_check_{model}.json")
    write_json(out, res)
    s = res["summary"]
    q = lambda d, f="{:.2f}": " / ".join(f.format(d[k]) if d[k] is not None else "–" for k in ("p10", "median", "p90"))  # noqa: E731
    print(f"{study}: {args.set} − {args.ref}, population {n_s} paired seeds × {n_q} questions; {len(rows)} pilots of "
          f"{PILOT_SEEDS} seeds × {PER_SUBTASK} questions per subtask")
    t3 = s["three_part"]
    print(md_table(["figure (p10 / median / p90)", "the study's two parts", "three parts"], [
        ["pilot's own half-width (points)", q(s["pilot_half_width"]), ""],
        ["true half-width at the pilot's plan", q(s["truth_at_plan"]), q(t3["truth_at_plan"])],
        ["plan's drafts × questions (both sets)", q(s["plan_drafts_x_questions"], "{:.0f}"),
         q(t3["plan_drafts_x_questions"], "{:.0f}")],
        [f"forecast at {n_s} × {n_q} / truth there ({full:.3f})", q(s["forecast_full_over_truth"]),
         q(t3["forecast_full_over_truth"])],
        [f"plans truly reaching ±{TARGET_HALF_WIDTH}", f"{s['plan_reached']} of {len(planned)}",
         f"{t3['plan_reached']} of {t3['plans']}"],
    ]))
    print(f"the study's plans: {s['with_seeds_needed']} seeds_needed, {s['with_reach']} reach, {s['without_plan']} "
          f"none; three parts solved on the whole population: half-width {population_3['half_width']:.3f} at "
          f"{n_s} × {n_q} (truth {full:.3f})")
    print(f"wrote {out} ({res['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
