"""A study's text (``elsi study``'s study.md, and the study's section of the report), from its study.json.

The study computes study.json (``elsi.study.summary``); the report reads it back (``load_study``) and
renders it with the functions here, as ``elsi study`` does when it writes study.md.
"""

from __future__ import annotations

from pathlib import Path

from elsi.io import read_json
from elsi.text import layer_list, md_table, num

STUDY_JSON = "study.json"  # a finished study's results, in its directory


def load_study(study_dir: str | Path) -> dict:
    """A finished study's study.json; FileNotFoundError naming the directory otherwise."""
    path = Path(study_dir) / STUDY_JSON
    if not path.is_file():
        raise FileNotFoundError(f"{study_dir} has no {STUDY_JSON}: run `elsi study --out {study_dir}` first")
    return read_json(path, fix=f"rerun the same `elsi study --out {study_dir}` command (it rewrites {STUDY_JSON} from "
                               "the finished benchmarks)")


def seeds_phrase(study: dict) -> str:
    """The study's seeds in words: ``seeds [0, 1]`` when every set has them all, else per group of sets,
    ``seeds [0, 1] for eagle3, elsi:3; [0] for eagle2, elsi:2``."""
    return seeds_words({s["name"]: s.get("seeds", study["seeds"]) for s in study["sets"]})


def seeds_words(seeds: dict[str, list[int]]) -> str:
    """Each set's seeds (by name) in words, as ``seeds_phrase``."""
    groups: dict[tuple[int, ...], list[str]] = {}
    for name, v in seeds.items():
        groups.setdefault(tuple(v), []).append(name)
    if len(groups) == 1:
        return f"seeds {list(next(iter(groups)))}"
    return "seeds " + "; ".join(f"{list(k)} for {', '.join(v)}" for k, v in groups.items())


def condition_table(cond: dict, subtasks: list[str]) -> tuple[list[str], list[list[str]]]:
    """(header, rows of text) of one condition: a row per set."""
    refs = list(dict.fromkeys(ref for r in cond["sets"] for ref in r["delta_pct"]))  # the defaults compared against
    header = ["set", "layers", "H (nats)", *[f"τ {s}" for s in subtasks], "τ all", "τ seeds min–max",
              *[f"Δ% vs {ref}" for ref in refs], "tok/s", "vs plain"]
    rows = []
    for r in cond["sets"]:
        seeds = (f"{num(r['tau_min'])}–{num(r['tau_max'])}" if len(r["tau_seeds"]) > 1 else "1 seed")
        rows.append([r["name"], layer_list(r["layers"]), num(r["entropy"], 4),
                     *[num(r["tau"].get(s)) for s in subtasks], num(r["tau_all"]), seeds,
                     *[num(r["delta_pct"].get(ref), 1, True) for ref in refs], num(r["tokens_per_s"], 1),
                     num(r["speedup_vs_plain"], 2) + ("×" if r["speedup_vs_plain"] else "")])
    return header, rows


def spearman_line(cond: dict) -> str:
    sp = cond["spearman"]
    ci = (f", 95% bootstrap interval [{num(sp['ci_low'], 2)}, {num(sp['ci_high'], 2)}] over {sp['resamples']} "
          "resamples of the questions" if sp["ci_low"] is not None else "")
    return f"Spearman ρ(set entropy, τ all) = {num(sp['rho'], 2)} across {sp['sets']} sets{ci}."


NOTE = ("τ = accepted tokens per target step (the drafted tokens accepted + the target's own), pooled over all "
        "steps of a subtask (Spec-Bench's rule); τ all pools every subtask. A set's τ is the mean over its seeds; "
        "\"τ seeds min–max\" is the seed-to-seed spread (\"1 seed\": not measured). Δ% = 100 (τ all / τ all of "
        "the default − 1). tok/s and the speed-up against plain decoding are means over answers; the plain answers "
        "were timed once per machine the study ran on (bench/baseline*.json), and each draft's speed-up is against "
        "its own machine's, so machine load between runs shows in them. H = the set's matrix entropy as "
        "`elsi select` reports it.")


def _budget(train: dict) -> str:
    limit = str(train["time_budget"]).strip().lower()
    txt = "no time limit" if limit in ("", "0", "none") else f"budget {train['time_budget']}"
    return txt + (f", at most {train['max_steps']} steps" if train.get("max_steps") else "")


def study_markdown(study: dict) -> str:
    """study.md: the sets, one table per condition with its Spearman line, the verdict, the baseline speeds."""
    s = study["settings"]
    b, f, t = s["bench"], s["features"], s["train"]
    parts = [
        f"# Layer-set study: {study['model']}", "",
        f"Sets selected on `{study['run']}`; one draft per set and seed ({seeds_phrase(study)}) trained on "
        f"{f['data']} ({f['samples']} conversations, ≤ {f['max_tokens']} tokens), {_budget(t)} each, "
        f"same hyper-parameters; Spec-Bench {', '.join(study['subtasks'])} ({study['questions']} questions), "
        f"≤ {b['max_new_tokens']} new tokens per turn, tree depth {b['depth']}, top-k {b['top_k']}.", "",
        "## Verdict", "", *[f"- {v}" for v in study["verdict"]], "",
        "## Sets", "",
        md_table(["set", "method", "m", "layers", "H (nats)", "H / log B"],
                 [[x["name"], x["method"], str(x["m"]), layer_list(x["layers"]), num(x["entropy"], 4),
                   num(x["entropy_normalized"], 4)] for x in study["sets"]]), "",
    ]
    if any(r["heldout_mean"] is not None for r in study.get("training", [])):
        parts += ["## Drafts: training and held-out match", "",
                  md_table(["set", "seeds", "steps", "seconds", "held-out depth-1 match per seed", "mean"],
                           [[r["name"], ", ".join(map(str, r["seeds"])), ", ".join("–" if x is None else str(x)
                                                                               for x in r["steps"]),
                             ", ".join(num(x, 0) for x in r["train_seconds"]),
                             ", ".join(num(x, 4) for x in r["heldout_match"]), num(r["heldout_mean"], 4)]
                            for r in study["training"]]), "",
                  "Held-out: the draft's top-1 agreement with the target's next token on conversations held out "
                  "from training (the split depends on the seed: drafts of one seed share it).", ""]
    for cond in study["conditions"]:
        kind = ("exact τ: no decoding loop" if cond.get("exact") else
                "exact τ at T = 0, decoded at the other temperatures" if cond.get("mixed") else "decoded")
        if cond.get("seeds_decoded"):  # --live-seeds: the condition is over the seeds decoded live only
            kind += f", over {seeds_words(cond['seeds_decoded'])} only"
        how = f" ({cond['questions']} questions, {kind})" if "questions" in cond else ""
        parts += [f"## τ, {cond['label']}{how}", "", md_table(*condition_table(cond, study["subtasks"])), "",
                  spearman_line(cond), ""]
    if study.get("vllm"):
        parts += ["## vLLM serving the same drafts (chains, T = 0)", "",
                  md_table(["set", "seed", "k", "τ elsi", "τ vLLM", "vLLM − elsi [95% CI]", "answers equal",
                            *[f"τ {s} elsi / vLLM" for s in study["subtasks"]]],
                           [[r["set"], str(r["seed"]), str(r["k"]), num(r["tau_elsi"]), num(r["tau_vllm"]),
                             f"{num(r['diff'], 3, True)} [{num(r['ci_low'], 3, True)}, {num(r['ci_high'], 3, True)}]",
                             "–" if r["answers_equal"] is None else f"{r['answers_equal']}/{r['questions']}",
                             *[f"{num(r['subtasks'].get(s, {}).get('tau_elsi'), 2)} / "
                               f"{num(r['subtasks'].get(s, {}).get('tau_vllm'), 2)}" for s in study["subtasks"]]]
                            for r in study["vllm"]]), "",
                  "τ of both engines counts emitted tokens per verification step; \"answers equal\": vLLM's "
                  "greedy answer token for token as elsi's (lossless: elsi's equals plain greedy decoding).", ""]
    if study.get("command"):
        parts += [f"Made by `{study['command']}`.", ""]
    if study["baseline"]:
        several = len({x.get("machine") for x in study["baseline"]}) > 1
        parts += ["## Baseline speed", "",
                  md_table(["T", "plain tok/s", "HF generate tok/s"]
                           + (["machine", "drafts benchmarked there"] if several else []),
                           [[f"{x['temperature']:g}", num(x["plain_tokens_per_s"], 1), num(x["hf_tokens_per_s"], 1)]
                            + ([x["machine"], ", ".join(x["drafts"])] if several else []) for x in study["baseline"]]),
                  ""]
    elif study.get("exact"):
        parts += ["No temperature was decoded live, so nothing was timed: the exact τ has no speed (τ does not "
                  "depend on it; `elsi bench` times a draft).", ""]
    if study.get("without_baseline"):
        parts += ["No plain decoding was timed where these drafts were benchmarked, so they have no speed-up (their "
                  "τ stands): " + "; ".join(study["without_baseline"]) + ".", ""]
    if len(study.get("exact_answers") or []) > 1:
        parts += ["**The exact τ was computed on different sets of the target's greedy answers** (made on machines "
                  "whose float rounding flipped near ties differently; carry one set: docs/study.md): "
                  + "; ".join(f"{x['digest']}: {', '.join(x['drafts'])}" for x in study["exact_answers"])
                  + ". A gap between drafts of different answers also measures the answers.", ""]
    parts += [NOTE, ""]
    return "\n".join(parts)


__all__ = ["NOTE", "STUDY_JSON", "condition_table", "load_study", "seeds_phrase", "seeds_words", "spearman_line",
           "study_markdown"]
