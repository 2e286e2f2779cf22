"""A study's results: τ per set, subtask and condition, noise, rank correlation with entropy, study.md.

Definitions (docs/design.md, "Speculative decoding"):
- τ of a draft on a group of answers = accepted tokens / target steps, pooled over all the
  group's steps (Spec-Bench's rule); "all" pools every subtask.
- A set's τ = the mean over its seeds' drafts (plan.json gives each set its seeds: every
  ``--seeds`` for the ``--multi-seed-sets``, the first for the others); the seed-to-seed spread
  is their min-max range, measured only where a set has more than one seed. A gap between two
  sets is compared with the largest such range of its condition (the study's seed noise,
  whichever sets it was measured on).
- Δ% vs eagle3 (eagle2) = 100 (τ_set / τ_eagle3 - 1), on τ all.
- Speed-up vs plain of an answer = its tokens/s over the tokens/s of the study's plain answer
  to the same question at the same temperature, timed on the same machine (``bench/baseline.json``,
  one more per machine a study went on on; ``elsi.runtime.timing_key``); mean over answers.
  A draft benchmarked where no baseline was timed has none (its τ stands: τ does not depend on speed).
- Spearman's ρ between set entropy and τ all, across sets (average ranks for ties).
- Bootstrap: the Spec-Bench questions are resampled with replacement (``bootstrap`` times,
  fixed seed; the same resamples for every set, seed and condition); each resample gives every
  set's pooled τ (mean over its seeds), hence ρ and each gap; intervals = 2.5 and 97.5 percentiles.

Conditions: every (temperature, tree size) of the study, and "all" pooling them.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable

import numpy as np

from elsi.data.spec_bench import load_questions
from elsi.runtime import machine_label, timing_key
from elsi.stats.sampling import interval, mean, pooled_tau, resample_weights, spearman
from elsi.study.plan import StudyPlan, live_temperatures
from elsi.text import layer_list, num

REFERENCES = ("eagle3", "eagle2")  # the defaults a study compares against
SELECTED = ("elsi", "elsi-c", "exhaustive")  # methods whose sets the entropy criterion chose


# ---------------------------------------------------------------------------------------------
# Aggregation


def _clean(x):
    """JSON-safe number: NaN -> None."""
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else x


def _tps(a: dict) -> float:
    return a["new_tokens"] / a["time_s"] if a["time_s"] > 0 else 0.0


def _timed(a: dict) -> bool:
    """Whether an answer was decoded (and timed): the exact evaluator's answers (``exact``) were not."""
    return not a.get("exact")


def condition_label(temperature: float | None, tree_nodes: int | None) -> str:
    if temperature is None:
        return "all conditions pooled"
    if tree_nodes is None:
        return f"T = {temperature:g}, every tree size pooled"
    return f"T = {temperature:g}, {tree_nodes} node{'s' if tree_nodes != 1 else ''}"


def _in_condition(a: dict, temperature, tree_nodes) -> bool:
    return a["method"] == "spec" and (temperature is None or (
        a["temperature"] == temperature and (tree_nodes is None or a["tree_nodes"] == tree_nodes)))


def condition_questions(drafts: list[list[dict]], temperature, tree_nodes) -> dict[int, str]:
    """The questions of one condition (question id -> subtask, in first-seen order) over every draft's answers:
    the exact τ covers more questions than the temperatures decoded live."""
    out: dict[int, str] = {}
    for answers in drafts:
        for a in answers:
            if _in_condition(a, temperature, tree_nodes):
                out.setdefault(a["question_id"], a["subtask"])
    return out


# Half-width (percentage points) of the 95 % interval of Δ% that decides a claim (issue 30): the paper's smallest
# reported gain, +1.6 %, is then either inside the interval or excluded by it.
TARGET_HALF_WIDTH = 0.8
MOST_SEEDS = 256  # the most paired seeds a plan to reach it may ask for (``reach_plan``)


def delta_pct_interval(stats: dict[tuple[str, int], dict], seeds: dict[str, list[int]], name: str, ref: str,
                       weights: np.ndarray, seed: int = 0, most_questions: int | None = None) -> dict:
    """Δ% = 100 (τ_name / τ_ref - 1) with intervals that combine seed-to-seed and question sampling.

    Paired seeds: seed s of both sets (same data order and initialisation where shapes allow). Hierarchical
    bootstrap: each resample draws the paired seeds with replacement and the questions with replacement
    (``weights`` (R, Q), the same question draws for both sets), τ = the mean over the drawn seeds of each
    draft's pooled τ. Also a paired t-interval over the seeds' own Δ% (all questions), and, splitting the
    variance of Δ% into a question part (the question bootstrap of the seed mean) and a seed part (the
    seeds' Δ% variance / S), the seeds that would bring the half-width to ``TARGET_HALF_WIDTH`` at this many
    questions (``seeds_needed``), and where seeds alone cannot (the question part alone is wider), the seeds and
    questions that would (``reach``: ``reach_plan``, with at most ``most_questions``, the benchmark's questions).
    """
    from scipy import stats as st

    paired = [sd for sd in seeds[name] if sd in seeds[ref]]
    out = {"paired_seeds": paired, "pct_ci_low": None, "pct_ci_high": None, "pct_half_width": None,
           "t_ci_low": None, "t_ci_high": None, "question_sd": None, "seed_sd": None, "seeds_needed": None,
           "reach": None}
    if not paired:
        return out
    a = np.stack([pooled_tau(weights, stats[(name, sd)]["accepted"], stats[(name, sd)]["steps"]) for sd in paired])
    b = np.stack([pooled_tau(weights, stats[(ref, sd)]["accepted"], stats[(ref, sd)]["steps"]) for sd in paired])
    n_s, n_r = a.shape  # (S, R)
    pick = np.random.default_rng(seed + 1).integers(0, n_s, size=(n_r, n_s))  # (R, S) seeds drawn per resample
    ta = np.take_along_axis(a.T, pick, axis=1).mean(1)  # (R,)
    tb = np.take_along_axis(b.T, pick, axis=1).mean(1)
    lo, hi = interval(100.0 * (ta / tb - 1.0))
    out.update(pct_ci_low=lo, pct_ci_high=hi, pct_half_width=None if lo is None else (hi - lo) / 2)
    per_seed = []
    for sd in paired:
        x, y = stats[(name, sd)], stats[(ref, sd)]
        per_seed.append(100.0 * ((x["accepted"].sum() / x["steps"].sum()) / (y["accepted"].sum() / y["steps"].sum()) - 1))
    q = 100.0 * (a.mean(0) / b.mean(0) - 1.0)  # (R,) questions resampled, every seed kept
    q = q[np.isfinite(q)]
    q_sd = float(np.std(q, ddof=1)) if q.size > 1 else None
    out["question_sd"] = q_sd
    if n_s > 1:
        m, sd_s = float(np.mean(per_seed)), float(np.std(per_seed, ddof=1))
        half = float(st.t.ppf(0.975, n_s - 1)) * sd_s / math.sqrt(n_s)
        out.update(t_ci_low=m - half, t_ci_high=m + half, seed_sd=sd_s)
        if q_sd is not None:
            room = (TARGET_HALF_WIDTH / 1.96) ** 2 - q_sd ** 2  # variance left for the seed part
            out["seeds_needed"] = (math.ceil(sd_s ** 2 / room) if room > 0 else None)
            if room <= 0:
                out["reach"] = reach_plan(q_sd, sd_s, weights.shape[1], n_s, most_questions=most_questions)
    return out


def cheapest_plan(question_part: Callable[[int], float], seed_part: float, seeds: int,
                  most_seeds: int = MOST_SEEDS, most_questions: int | None = None) -> dict | None:
    """The paired seeds S (at least ``seeds``, at most ``most_seeds``) and questions Q (at most ``most_questions``;
    None: any number) with the fewest S·Q such that 1.96² (``question_part``(S) / Q + ``seed_part`` / S) ≤
    ``TARGET_HALF_WIDTH``², where ``question_part``(S) is the question part's variance times the questions at S seeds
    -> {"seeds", "questions"}, or None where no such S and Q are."""
    target = (TARGET_HALF_WIDTH / 1.96) ** 2
    best = None
    for s in range(max(seeds, 1), most_seeds + 1):
        room = target - seed_part / s  # variance left for the question part
        if room <= 0:
            continue
        q = max(1, math.ceil(question_part(s) / room))
        if most_questions is not None and q > most_questions:
            continue
        if best is None or s * q < best["seeds"] * best["questions"]:
            best = {"seeds": s, "questions": q}
    return best


def reach_plan(question_sd: float, seed_sd: float, questions: int, seeds: int, most_seeds: int = MOST_SEEDS,
               most_questions: int | None = None) -> dict | None:
    """The paired seeds S and questions Q that bring the half-width of Δ% to ``TARGET_HALF_WIDTH`` with the fewest
    drafts × questions (what live decoding costs), at least the ``seeds`` measured: an estimate that takes the
    question part's variance as ``question_sd``² × ``questions`` / Q (questions drawn alike) and the seed part's as
    ``seed_sd``² / S, i.e. the smallest S·Q with 1.96² (question_sd² questions / Q + seed_sd² / S) ≤ target²
    (``cheapest_plan``). None where no S up to ``most_seeds`` would with at most ``most_questions`` questions."""
    return cheapest_plan(lambda _: question_sd ** 2 * questions, seed_sd ** 2, seeds, most_seeds, most_questions)


def draft_stats(answers: list[dict], qids: list[int], subtask_of: dict[int, str], temperature, tree_nodes,
                plain: dict, hf: dict) -> dict:
    """One draft's figures in one condition: accepted and steps per question (Q,), τ per subtask and
    all, tokens/s and speed-ups (over its decoded answers only: None where the exact evaluator gave them all)."""
    group = [a for a in answers if _in_condition(a, temperature, tree_nodes)]
    timed = [a for a in group if _timed(a)]
    pos = {q: i for i, q in enumerate(qids)}
    acc = np.zeros(len(qids))
    steps = np.zeros(len(qids))
    for a in group:
        if a["question_id"] not in pos:
            raise ValueError(f"question {a['question_id']} answered by a draft but not by the baseline: "
                             "the benchmarks of this study disagree; rerun with --restart")
        acc[pos[a["question_id"]]] += a["accepted"]
        steps[pos[a["question_id"]]] += a["steps"]
    tau = {}
    for sub in dict.fromkeys(subtask_of[q] for q in qids):
        mask = np.array([subtask_of[q] == sub for q in qids])
        s = steps[mask].sum()
        tau[sub] = float(acc[mask].sum() / s) if s else None
    key = lambda a: (a["question_id"], a["temperature"])  # noqa: E731
    return {
        "accepted": acc, "steps": steps, "tau": tau,
        "tau_all": float(acc.sum() / steps.sum()) if steps.sum() else None,
        "tokens_per_s": mean([_tps(a) for a in timed]),
        "speedup_vs_plain": mean([_tps(a) / _tps(plain[key(a)]) for a in timed
                                   if key(a) in plain and _tps(plain[key(a)]) > 0]),
        "speedup_vs_hf": mean([_tps(a) / _tps(hf[key(a)]) for a in timed if key(a) in hf and _tps(hf[key(a)]) > 0]),
    }


def seeds_tau(w: np.ndarray, stats: dict[tuple[str, int], dict], seeds: dict[str, list[int]], name: str) -> np.ndarray:
    """A set's pooled τ in every resample (R, Q) counts ``w``, mean over its seeds' drafts -> (R,)."""
    return np.mean([pooled_tau(w, stats[(name, sd)]["accepted"], stats[(name, sd)]["steps"]) for sd in seeds[name]],
                   axis=0)


def summarize_condition(sets: list[dict], seeds: dict[str, list[int]], stats: dict[tuple[str, int], dict],
                        weights: np.ndarray | None, temperature, tree_nodes,
                        subtasks: dict[str, np.ndarray] | None = None, most_questions: int | None = None) -> dict:
    """Rows (one per set), Spearman's ρ between entropy and τ all, and the selected sets' gaps (each
    also per subtask, where ``subtasks`` maps a subtask to its questions' mask (Q,) bool). ``most_questions``: the
    benchmark's questions in these subtasks, the most a plan to narrow an interval (``reach``) may ask for.

    ``seeds``: each set's seeds, by name (sets may have different numbers); ``stats``: ``draft_stats``
    of every (set name, seed).
    """
    rows, boot = [], {}
    for s in sets:
        per = [stats[(s["name"], seed)] for seed in seeds[s["name"]]]
        taus = [p["tau_all"] for p in per if p["tau_all"] is not None]
        subs = list(per[0]["tau"])
        row = {
            "name": s["name"], "method": s["method"], "layers": s["layers"], "entropy": s["entropy"],
            "seeds": list(seeds[s["name"]]),
            "tau": {k: mean([p["tau"][k] for p in per if p["tau"][k] is not None]) for k in subs},
            "tau_all": mean(taus), "tau_seeds": [p["tau_all"] for p in per],
            "tau_min": min(taus) if taus else None, "tau_max": max(taus) if taus else None,
            "tau_std": float(np.std(taus, ddof=1)) if len(taus) > 1 else None,
            "tokens_per_s": mean([p["tokens_per_s"] for p in per if p["tokens_per_s"] is not None]),
            "speedup_vs_plain": mean([p["speedup_vs_plain"] for p in per if p["speedup_vs_plain"] is not None]),
            "speedup_vs_hf": mean([p["speedup_vs_hf"] for p in per if p["speedup_vs_hf"] is not None]),
        }
        rows.append(row)
        if weights is not None:
            boot[s["name"]] = seeds_tau(weights, stats, seeds, s["name"])  # (R,)
    by = {r["name"]: r for r in rows}
    for r in rows:
        r["delta_pct"] = {ref: (100.0 * (r["tau_all"] / by[ref]["tau_all"] - 1.0)
                                if r["tau_all"] is not None and by[ref]["tau_all"] else None)
                          for ref in REFERENCES if ref in by}
    # Spearman between set entropy and τ, on the means and on every resample.
    known = [r for r in rows if r["tau_all"] is not None]
    rho = spearman([r["entropy"] for r in known], [r["tau_all"] for r in known]) if len(known) >= 2 else math.nan
    lo = hi = None
    if weights is not None and len(known) >= 2:
        ent = [r["entropy"] for r in known]
        mat = np.stack([boot[r["name"]] for r in known], axis=1)  # (R, sets)
        rhos = np.array([spearman(ent, row) if np.isfinite(row).all() else math.nan for row in mat])  # (R,)
        lo, hi = interval(rhos)
    spear = {"rho": _clean(rho), "ci_low": lo, "ci_high": hi, "sets": len(known),
             "resamples": 0 if weights is None else int(weights.shape[0])}
    # The selected sets against the defaults. The noise scale of every gap is the largest
    # seed-to-seed range measured in this condition (any set with more than one seed).
    ranges = [x["tau_max"] - x["tau_min"] for x in rows if len(x["tau_seeds"]) > 1 and x["tau_max"] is not None]
    spread = max(ranges) if ranges else None
    gaps = []
    for r in rows:
        if r["method"] not in SELECTED:
            continue
        for ref in REFERENCES:
            if ref not in by or r["tau_all"] is None or by[ref]["tau_all"] is None:
                continue
            b = by[ref]
            delta = r["tau_all"] - b["tau_all"]
            g_lo = g_hi = None
            if weights is not None:
                g_lo, g_hi = interval(boot[r["name"]] - boot[ref])
            gaps.append({"set": r["name"], "layers": r["layers"], "vs": ref, "vs_layers": b["layers"],
                         "tau": r["tau_all"], "tau_ref": b["tau_all"], "delta": delta,
                         "delta_pct": r["delta_pct"][ref], "seed_spread": spread,
                         "beyond_seed_spread": None if spread is None else abs(delta) > spread,
                         "ci_low": g_lo, "ci_high": g_hi,
                         **(delta_pct_interval(stats, seeds, r["name"], ref, weights, most_questions=most_questions)
                            if weights is not None else {}),
                         "subtasks": subtask_gaps(r, b, stats, seeds, weights, subtasks or {})})
    return {"temperature": temperature, "tree_nodes": tree_nodes, "label": condition_label(temperature, tree_nodes),
            "sets": rows, "spearman": spear, "gaps": gaps}


def subtask_gaps(row: dict, ref: dict, stats: dict[tuple[str, int], dict], seeds: dict[str, list[int]],
                 weights: np.ndarray | None, subtasks: dict[str, np.ndarray]) -> dict[str, dict]:
    """A set's gap to a default on each subtask: Δτ, Δ% and the bootstrap interval of Δτ, from the same
    resamples of all questions with the other subtasks' questions left out (None where a side has no steps)."""
    out = {}
    for sub, mask in subtasks.items():
        t, t_ref = row["tau"].get(sub), ref["tau"].get(sub)
        if t is None or t_ref is None:
            out[sub] = {"delta": None, "delta_pct": None, "ci_low": None, "ci_high": None}
            continue
        lo = hi = None
        pct = {}
        if weights is not None:
            w = weights * mask  # (R, Q): this subtask's questions only
            lo, hi = interval(seeds_tau(w, stats, seeds, row["name"]) - seeds_tau(w, stats, seeds, ref["name"]))
            p = delta_pct_interval(stats, seeds, row["name"], ref["name"], w)
            pct = {k: p[k] for k in ("pct_ci_low", "pct_ci_high", "pct_half_width")}
        out[sub] = {"delta": t - t_ref, "delta_pct": 100.0 * (t / t_ref - 1.0) if t_ref else None,
                    "ci_low": lo, "ci_high": hi, **pct}
    return out


def vllm_rows(vllm: dict[tuple[str, int], dict]) -> list[dict]:
    """One row per (set, seed, k) of the vLLM runs (``elsi.engines.vllm.run_vllm_bench`` results, keyed
    (set name, seed)): both engines' τ, overall and per subtask, their bootstrap agreement and how many
    answers vLLM's chain gave token for token as elsi's."""
    rows = []
    for (name, seed), rec in vllm.items():
        served = {r["k"]: r for r in rec["runs"] if r["method"] == "vllm_spec"}
        for a in rec["tau_agreement"]:
            o = a["overall"]
            rows.append({"set": name, "seed": seed, "k": a["k"], "tau_elsi": o["tau_elsi"], "tau_vllm": o["tau_vllm"],
                         "diff": o["diff"], "ci_low": o["ci_low"], "ci_high": o["ci_high"], "agree": o["agree"],
                         "questions": a["questions"], "steps_equal": a["steps_equal"],
                         "answers_equal": served.get(a["k"], {}).get("greedy_equal_elsi_spec"),
                         "subtasks": {sub: {"tau_elsi": x["tau_elsi"], "tau_vllm": x["tau_vllm"]}
                                      for sub, x in a["subtasks"].items()}})
    return rows


def training_rows(sets: list[dict], trained: dict[tuple[str, int], dict]) -> list[dict]:
    """Per set, its drafts' training: steps, seconds and held-out depth-1 match per seed (in the set's seed
    order; None where a training.json lacks it) and their mean."""
    rows = []
    for s in sets:
        recs = [trained.get((s["name"], sd)) or {} for sd in s["seeds"]]
        held = [r["heldout"]["match"][0] if r.get("heldout") else None for r in recs]
        known = [h for h in held if h is not None]
        rows.append({"name": s["name"], "seeds": s["seeds"], "steps": [r.get("steps") for r in recs],
                     "train_seconds": [r.get("train_seconds") for r in recs], "heldout_match": held,
                     "heldout_mean": mean(known)})
    return rows


def condition_seeds(seeds: dict[str, list[int]], benches: dict[tuple[str, int], dict], temperatures: list[float],
                    tree_nodes: int | None) -> dict[str, list[int]]:
    """Each set's seeds whose drafts have answers at every one of ``temperatures`` (and ``tree_nodes``, None: any
    size), by name: the seeds a condition is over. Every seed where every draft was decoded at every temperature;
    with ``--live-seeds`` the live temperatures (and every condition pooled) have only the seeds decoded live, so
    that no set's τ there mixes drafts measured on different answers."""
    def has(k, t):
        return any(_in_condition(a, t, tree_nodes) for a in benches[k]["answers"])
    return {name: [sd for sd in v if all(has((name, sd), t) for t in temperatures)] for name, v in seeds.items()}


def _by_question(baseline: dict, method: str) -> dict:
    return {(a["question_id"], a["temperature"]): a for a in baseline["answers"] if a["method"] == method}


def summarize_study(plan: StudyPlan, benches: dict[tuple[str, int], dict], baseline: dict | list[dict],
                    bootstrap: int = 1000, seed: int = 0, vllm: dict[tuple[str, int], dict] | None = None,
                    trained: dict[tuple[str, int], dict] | None = None) -> dict:
    """study.json's dict from the plan, every draft's benchmark (keyed (set name, seed)) and the baseline's, or
    the baselines of every machine the study ran on (the first gives the questions; each draft's speed-ups are
    against the one of its own machine, ``timing_key``); ``vllm``: the vLLM runs of ``--vllm-sets``, ``trained``:
    each draft's training.json (same keys)."""
    bench = plan.settings["bench"]
    seeds = plan.draft_seeds
    sets = plan.set_entries()  # as plan.json has them, each with its seeds
    baselines = [baseline] if isinstance(baseline, dict) else list(baseline)
    timed: dict[str, tuple[dict, dict, dict]] = {}  # timing key -> that machine, its (plain, hf) answers by question
    for b in baselines:
        timed.setdefault(timing_key(b.get("machine")),
                         (b.get("machine"), _by_question(b, "plain"), _by_question(b, "hf_generate")))
    base = [a for a in baselines[0]["answers"] if a["method"] == "plain"] if baselines else []
    exact = plan.exact  # temperature 0 from the exact evaluator (more questions)
    on_bench = Counter(q.subtask for q in load_questions())  # Spec-Bench's questions per subtask: what a plan may ask
    conditions = [(t, n) for t in bench["temperature"] for n in bench["tree_nodes"]]
    if exact and len(bench["tree_nodes"]) > 1:
        conditions.append((0.0, None))  # the claims' condition: every tree size of the exact τ pooled
    conditions.append((None, None))
    live = live_temperatures(plan.settings)
    out = []
    drafts = [(s.name, sd) for s, sd in plan.drafts]
    where = {k: timing_key(benches[k].get("machine")) for k in drafts}
    all_subtasks: dict[str, None] = {}
    for t, n in conditions:
        subtask_of = condition_questions([benches[k]["answers"] for k in drafts], t, n)
        if not exact:  # the baseline's questions, in its order (as every study before the exact τ)
            subtask_of = {a["question_id"]: a["subtask"] for a in base} or subtask_of
        qids = list(subtask_of)
        all_subtasks.update(dict.fromkeys(subtask_of.values()))
        weights = resample_weights(len(qids), bootstrap, seed) if bootstrap and qids else None
        masks = {sub: np.array([subtask_of[q] == sub for q in qids]) for sub in dict.fromkeys(subtask_of.values())}
        stats = {k: draft_stats(benches[k]["answers"], qids, subtask_of, t, n, *timed.get(where[k], (None, {}, {}))[1:])
                 for k in drafts}
        held = condition_seeds(seeds, benches, [t] if t is not None else bench["temperature"], n)
        most = sum(on_bench[sub] for sub in masks) if masks else None  # Spec-Bench's questions in these subtasks
        cond = summarize_condition([s for s in sets if held[s["name"]]], held, stats, weights, t, n, masks, most)
        cond["questions"] = len(qids)
        cond["seeds_decoded"] = None if held == seeds else {k: v for k, v in held.items() if v}
        cond["exact"] = bool(exact) and (t == 0.0 or (t is None and not live))  # every τ of it from the evaluator
        cond["mixed"] = bool(exact) and t is None and bool(live)  # exact τ at T = 0 with live decoding at the others
        out.append(cond)
    speeds = []
    for key, (machine, plain, hf) in timed.items():
        for t in bench["temperature"]:
            speeds.append({"temperature": t, "machine": machine_label(machine),
                           "drafts": [f"{name} s{sd}" for name, sd in drafts if where[(name, sd)] == key],
                           "plain_tokens_per_s": mean([_tps(a) for a in plain.values() if a["temperature"] == t]),
                           "hf_tokens_per_s": mean([_tps(a) for a in hf.values() if a["temperature"] == t])})
    on_answers: dict[str, list[str]] = {}  # the exact τ's answers digest -> the drafts measured on those answers
    for name, sd in drafts:
        if benches[(name, sd)].get("answers_digest"):
            on_answers.setdefault(benches[(name, sd)]["answers_digest"], []).append(f"{name} s{sd}")
    untimed = [f"{name} s{sd} ({machine_label(benches[(name, sd)].get('machine'))})" for name, sd in drafts
               if where[(name, sd)] not in timed and any(_timed(a) for a in benches[(name, sd)]["answers"])]
    study = {
        "model": plan.model, "run": plan.settings["run"], "num_layers": plan.num_layers,
        "sets": sets, "seeds": plan.seeds, "subtasks": list(all_subtasks),
        "questions": max((c["questions"] for c in out), default=0),
        "bootstrap": {"resamples": bootstrap, "seed": seed, "unit": "Spec-Bench question",
                      "seeds": "paired seeds, drawn with replacement with the questions (Δ% intervals)"},
        "exact": exact,
        "settings": plan.settings, "baseline": speeds, "without_baseline": untimed,
        "exact_answers": [{"digest": d, "drafts": v} for d, v in on_answers.items()], "conditions": out,
        "vllm": vllm_rows(vllm or {}),
        "training": training_rows(sets, trained or {}),
    }
    study["verdict"] = verdict(study)
    return study


# ---------------------------------------------------------------------------------------------
# Text


FEW_SEEDS = 4  # under this many paired seeds the hierarchical bootstrap cannot draw the seed-to-seed part


def gap_side(g: dict) -> int | None:
    """Which side of 0 a gap lies on beyond its noise: +1 (the selected set beats the default), -1 (loses to it),
    0 (level within the noise), None (no noise measured: one seed and no bootstrap, so only the point estimate).

    The noise read: from ``FEW_SEEDS`` paired seeds the interval of Δ% over paired seeds and questions alone (as
    ``elsi.study.compare``'s rule 5 reads a powered study); under that the bootstrap cannot redraw the seed part, so
    that interval or, without it, the question-bootstrap interval of the gap, and the seed-to-seed spread beside it
    (as its rule 1), each where measured. Every check read must put the gap on the side of its point estimate."""
    delta = g["delta"]
    if g.get("pct_ci_low") is not None:
        ci = [(g["pct_ci_low"], g["pct_ci_high"])]
        spread = g["seed_spread"] is not None and len(g.get("paired_seeds") or []) < FEW_SEEDS
    else:
        ci = [(g["ci_low"], g["ci_high"])] if g["ci_low"] is not None else []
        spread = g["seed_spread"] is not None
    if not ci and not spread:
        return None
    side = (delta > 0) - (delta < 0)
    clear = (side != 0 and all(lo > 0 if side > 0 else hi < 0 for lo, hi in ci)
             and (not spread or bool(g["beyond_seed_spread"])))
    return side if clear else 0


GAP_WORDS = {1: "beats", -1: "loses to", 0: "is level with"}  # beyond the noise (``gap_side``)
POINT_WORDS = {1: "is ahead of", -1: "is behind", 0: "ties with"}  # no noise measured: the point estimate alone


def need_words(g: dict) -> str:
    """What would bring a too-wide Δ% interval to the target: more paired seeds, or (``reach``) seeds and questions."""
    if g.get("seeds_needed"):
        return f"; about {g['seeds_needed']} paired seeds would reach it"
    r = g.get("reach")
    if ("reach" in g and r is None and g.get("seeds_needed") is None and g.get("seed_sd") is not None
            and g.get("question_sd") is not None):  # planned and found none (records before ``reach`` have no key)
        return f"; no number of seeds up to {MOST_SEEDS} reaches it on this benchmark's questions (an estimate)"
    if r:
        n = g.get("paired_seeds")
        n = len(n) if isinstance(n, list) else n  # study.json lists them, comparison.json counts them
        return (f"; more seeds alone cannot reach it (the question part alone is wider), about {r['seeds']} paired "
                f"seeds on {r['questions']} questions would (an estimate from {n} seeds' spread, the question part "
                f"shrinking as 1 / questions)")
    return ""


def gap_sentence(g: dict) -> str:
    """One plain sentence: does the selected set beat the default, by how much, beyond the noise (``gap_side``)?"""
    side = gap_side(g)
    word = GAP_WORDS[side] if side is not None else POINT_WORDS[(g["delta"] > 0) - (g["delta"] < 0)]
    within = " within the noise" if side == 0 else ""
    txt = (f"{g['set']} {layer_list(g['layers'])} {word} {g['vs']} {layer_list(g['vs_layers'])}{within}: "
           f"τ {num(g['tau'])} vs {num(g['tau_ref'])} ({num(g['delta_pct'], 1, True)}%)")
    if g["seed_spread"] is None:
        txt += "; seed-to-seed noise not measured (one seed each)"
    else:
        word = "larger than" if g["beyond_seed_spread"] else "within"
        txt += f"; the gap {num(g['delta'], 3, True)} is {word} the seed-to-seed spread ({num(g['seed_spread'])})"
    if g["ci_low"] is not None:
        excl = g["ci_low"] > 0 or g["ci_high"] < 0
        txt += (f"; question-bootstrap 95% interval of the gap [{num(g['ci_low'], 3, True)}, "
                f"{num(g['ci_high'], 3, True)}]{', which excludes 0' if excl else ''}")
    if g.get("pct_ci_low") is not None:
        met = g["pct_half_width"] <= TARGET_HALF_WIDTH
        need = "" if met else need_words(g)
        n = len(g["paired_seeds"])
        txt += (f"; 95% interval of Δ% over {n} paired seed{'s' if n != 1 else ''} and the questions "
                f"[{num(g['pct_ci_low'], 2, True)}, {num(g['pct_ci_high'], 2, True)}] (half-width "
                f"{num(g['pct_half_width'], 2)} points, target ≤ {TARGET_HALF_WIDTH}{need})")
    if g.get("t_ci_low") is not None:  # two seeds or more: the seeds' own Δ%, every question
        n = len(g["paired_seeds"])
        few = ("; with so few seeds the bootstrap cannot draw the seed-to-seed part, which this interval and the "
               "seed-to-seed spread measure" if n < FEW_SEEDS else "")
        txt += (f"; paired t-interval over the {n} seeds alone [{num(g['t_ci_low'], 2, True)}, "
                f"{num(g['t_ci_high'], 2, True)}]{few}")
    return txt + "."


def claims_condition(study: dict) -> dict:
    """The condition the paper's claims are judged on: temperature 0 with every tree size pooled where the exact
    τ gives it (all of Spec-Bench), else every condition pooled (the studies before it)."""
    return next((c for c in study["conditions"] if c.get("exact") and c["tree_nodes"] is None),
                study["conditions"][-1])


def verdict(study: dict) -> list[str]:
    """Plain sentences on the claims' condition (``claims_condition``): the Spearman line, each selected set
    against each default, and a count."""
    pooled = claims_condition(study)
    sp = pooled["spearman"]
    out = []
    if sp["rho"] is not None:
        ci = (f" (95% bootstrap interval [{num(sp['ci_low'], 2)}, {num(sp['ci_high'], 2)}])"
              if sp["ci_low"] is not None else "")
        out.append(f"Across the {sp['sets']} sets, set entropy and τ have Spearman ρ = {num(sp['rho'], 2)}{ci}.")
    gaps = pooled["gaps"]
    out += [gap_sentence(g) for g in gaps]
    for ref in REFERENCES:
        mine = [g for g in gaps if g["vs"] == ref]
        if not mine:
            continue
        sides = [gap_side(g) for g in mine]
        if all(side is None for side in sides):
            ahead = sum(g["delta"] > 0 for g in mine)
            out.append(f"In all: the selected sets are ahead of {ref} in {ahead} of {len(mine)} comparisons "
                       f"(point estimates: no seed-to-seed or question noise measured).")
            continue
        unmeasured = sides.count(None)
        out.append(f"In all, beyond the noise: the selected sets beat {ref} in {sides.count(1)} of {len(mine)} "
                   f"comparisons, lose to it in {sides.count(-1)} and are level with it in {sides.count(0)}"
                   + (f" ({unmeasured} without a noise measure)" if unmeasured else "") + ".")
    if not gaps:
        out.append("No selected set (elsi, elsi-c, exhaustive) and default (eagle3, eagle2) pair to compare.")
    return out


__all__ = ["claims_condition", "condition_seeds", "delta_pct_interval", "draft_stats", "gap_sentence", "gap_side",
           "cheapest_plan", "need_words", "reach_plan", "summarize_condition", "summarize_study", "verdict", "vllm_rows"]
