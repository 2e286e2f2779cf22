"""Does live drafting propose what the draft predicts teacher-forced? (SmolLM2-135M, Spec-Bench)

For one question per subtask, decode with one drafted token per step (``--depth 1 --top-k 1``),
record the draft's proposal after every commit, then run the target once over the final
sequence and the draft once over all of it (teacher forcing). Counts how many live proposals
equal the teacher-forced prediction for the same position, and compares the live acceptance
rate with the teacher-forced match over the whole answer (the positions differ: a step after
an accepted token skips one).

    .venv/bin/python bench/draft_consistency.py --draft runs/draft-sg-2-15-27 [--max-new-tokens 64]

Writes bench/results/draft_consistency.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from elsi.data.spec_bench import load_questions
from elsi.decode import EagleDrafter, TargetRunner, load_drafter
from elsi.decode.engine import DecodeConfig, generate, stop_tokens
from elsi.decode.tree import TreeConfig
from elsi.models import load_target
from elsi.specbench.runner import encode_chat


def recording(drafter, log: list[tuple[int, int]]):
    """``drafter.start`` wrapped so that every commit logs (committed rows, proposed target id)."""
    start = drafter.start

    def wrapped():
        session = start()
        commit = session.commit

        def logged(tokens, feats):
            logits = commit(tokens, feats)
            log.append((session.committed, int(session.token_ids[logits.argmax()])))
            return logits

        session.commit = logged
        return session

    return wrapped


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/results/draft_consistency.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(args.model)
    drafter, info = load_drafter(args.draft, target)
    runner = TargetRunner.from_target(target)
    eos = stop_tokens(target.model, target.tokenizer)
    draft = drafter.draft
    rows = []
    for q in load_questions(None, 1):
        prompt = encode_chat(target.tokenizer, [("user", q.turns[0])])
        log: list[tuple[int, int]] = []
        live = EagleDrafter(draft)  # a fresh drafter per question, its sessions recorded into this log
        live.start = recording(live, log)
        g = generate(runner, prompt, DecodeConfig(max_new_tokens=args.max_new_tokens), live,
                     TreeConfig(tree_nodes=1, depth=1, top_k=1), eos)
        seq = prompt + g.tokens
        with torch.inference_mode():
            ids = torch.tensor(seq)
            _, feats = runner.forward(ids, torch.arange(len(seq)), runner.new_cache(), None, draft.layer_ids)
            n = len(seq) - 1
            logits, _ = draft(ids[1:][None], draft.fuse(feats[:n][None]), torch.arange(n)[None])
            forced = draft.to_target_ids(logits[0].argmax(-1)).tolist()  # row i predicts seq[i + 2]
        checked = [(c, p) for c, p in log if c + 1 < len(seq)]  # proposal for seq[c + 1]
        same = sum(p == forced[c - 1] for c, p in checked)
        accepted = sum(p == seq[c + 1] for c, p in checked)
        answer = range(len(prompt) - 1, len(seq) - 2)  # rows predicting the answer's tokens after the first
        match = sum(forced[i] == seq[i + 2] for i in answer)
        rows.append({"question_id": q.question_id, "subtask": q.subtask, "steps": len(checked),
                     "live_equals_forced": same, "live_accepted": accepted, "forced_positions": len(answer),
                     "forced_match": match})
        print(f"{q.subtask:16s} live proposals = teacher-forced: {same}/{len(checked)}; live acceptance "
              f"{accepted / max(1, len(checked)):.3f}, teacher-forced match {match / max(1, len(answer)):.3f}")
    tot = {k: sum(r[k] for r in rows) for k in ("steps", "live_equals_forced", "live_accepted", "forced_positions",
                                                 "forced_match")}
    res = {"command": "python bench/draft_consistency.py " + " ".join(sys.argv[1:]), "draft": info,
           "max_new_tokens": args.max_new_tokens, "questions": rows, "total": tot,
           "live_acceptance": tot["live_accepted"] / max(1, tot["steps"]),
           "forced_match": tot["forced_match"] / max(1, tot["forced_positions"])}
    print(f"all: {tot['live_equals_forced']}/{tot['steps']} equal; live acceptance {res['live_acceptance']:.3f}, "
          f"teacher-forced match {res['forced_match']:.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
