"""Exact τ (elsi.specbench.exact) against live decoding: speed on all of Spec-Bench, and agreement.

    .venv/bin/python bench/exact_tau.py --draft DRAFT_DIR [--model smollm2-135m] [--live-questions 2]
        [--out bench/results/exact_tau.json]

1. The target's greedy answers to every Spec-Bench question (480, both mt_bench turns, <= 128 new
   tokens), cached (made here when missing; their time is reported apart and not in the ratio).
2. Exact τ for the chain (one drafted token: the study's "1 node"), 30 and 60 nodes (depth 6, top-k 10)
   on all of them, timed twice: as the model's first draft (the target's forward over every answer
   turn, its states kept on disk at every layer: ``elsi.specbench.states``) and as any later draft of
   the model (every seed and layer set of a study), which reads its layers from those states.
3. Live decoding (``elsi.specbench.run_bench``, speculative only, as the study's benchmark runs it) of the
   same draft and trees on ``--live-questions`` per subtask, timed; its τ next to the exact τ on the
   same questions.
Ratios: scored tokens per minute (answer tokens x tree shapes) of each pass of 2. over those of 3. Run
alone. The states go to a fresh directory beside the model's cache and, when the model has none yet,
become its cache.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from elsi.decode import TreeConfig, load_drafter
from elsi.models import load_target
from elsi.runtime import machine_info
from elsi.specbench import BenchConfig, run_bench
from elsi.specbench.answers import greedy_answers
from elsi.specbench.exact import exact_tau
from elsi.specbench.states import AnswerStates

TREES = [TreeConfig(1, 6, 10), TreeConfig(30, 6, 10), TreeConfig(60, 6, 10)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft", required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--live-questions", type=int, default=2, help="questions per subtask decoded live")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/results/exact_tau.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    target = load_target(a.model)
    drafter, info = load_drafter(a.draft, target)
    draft = drafter.draft
    t0 = time.perf_counter()
    answers = greedy_answers(target, ["all"], 80, a.max_new_tokens,
                             on_progress=lambda d, n: print(f"\ranswers {d}/{n}", end="", file=sys.stderr))
    answers_s = time.perf_counter() - t0
    print(file=sys.stderr)
    home = AnswerStates(target).dir
    home.parent.mkdir(parents=True, exist_ok=True)
    fresh = Path(tempfile.mkdtemp(prefix=".bench-", dir=home.parent))
    passes = {}
    for name in ("first_draft", "later_draft"):
        states = AnswerStates(target, root=fresh)
        res = exact_tau(target, draft, answers, TREES, a.max_new_tokens, states=states,
                        on_progress=lambda d, n: print(f"\rexact ({name}) {d}/{n}", end="", file=sys.stderr))
        print(file=sys.stderr)
        passes[name] = res
    if home.exists():
        shutil.rmtree(fresh)
    else:
        os.replace(fresh, home)
    res = passes["first_draft"]
    assert [t["overall"] for t in res["trees"]] == [t["overall"] for t in passes["later_draft"]["trees"]]
    scored = res["answer_tokens"] * len(TREES)
    rate = {k: scored / r["seconds"] * 60 for k, r in passes.items()}
    bench = BenchConfig(model=a.model, draft=a.draft, questions_per_subtask=a.live_questions,
                        max_new_tokens=a.max_new_tokens, temperature=[0.0], tree_nodes=[t.tree_nodes for t in TREES],
                        hf_generate=False, plain=False)
    t1 = time.perf_counter()
    live = run_bench(target, drafter, bench)
    live_s = time.perf_counter() - t1
    live_tokens = sum(x["new_tokens"] for x in live["answers"])
    live_rate = live_tokens / live_s * 60
    # the exact τ on the live run's questions, pooled as the live run pools them
    agree = []
    ids = {x["question_id"] for x in live["answers"]}
    for t, run in zip(res["trees"], live["runs"]):
        rows = [q for q in t["questions"] if q["question_id"] in ids]
        steps, acc = sum(q["steps"] for q in rows), sum(q["accepted"] for q in rows)
        agree.append({"tree_nodes": t["tree"]["tree_nodes"], "tau_live": run["overall"]["tau"],
                      "tau_exact_same_questions": acc / steps, "steps_live": run["overall"]["steps"],
                      "steps_exact": steps, "tau_exact_all": t["overall"]["tau"],
                      "tau_exact_all_positions": t["overall"]["tau_all_positions"]})
    out = {
        "command": "python " + " ".join(sys.argv), "machine": machine_info(), "model": a.model, "draft": info,
        "answers": {"turns": res["answer_turns"], "tokens": res["answer_tokens"], "seconds_if_made_here": answers_s,
                    "greedy_flips": res["greedy_flips"]},
        "exact": {"scored_tokens": scored,
                  **{k: {"seconds": r["seconds"], "target_forwards": r["target_forwards"],
                         "scored_tokens_per_min": rate[k]} for k, r in passes.items()},
                  "trees": [{"tree": t["tree"], "overall": t["overall"], "subtasks": t["subtasks"]}
                            for t in res["trees"]]},
        "live": {"questions": len(ids), "seconds": live_s, "scored_tokens": live_tokens,
                 "scored_tokens_per_min": live_rate},
        "ratio_scored_tokens_per_min": {k: r / live_rate for k, r in rate.items()},
        "agreement": agree,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"exact: {res['answer_turns']} turns, {res['answer_tokens']} answer tokens x {len(TREES)} trees; live: "
          f"{live_tokens} tokens in {live_s:.0f} s ({live_rate:.0f} tok/min); load {os.getloadavg()[0]:.2f}")
    for k, r in passes.items():
        print(f"  {k}: {r['seconds']:.0f} s, {r['target_forwards']} target forwards, {rate[k]:.0f} scored tok/min, "
              f"{rate[k] / live_rate:.1f}x live")
    for row in agree:
        print(row)


if __name__ == "__main__":
    main()
