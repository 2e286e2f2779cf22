"""Regeneration in batches of similar prompt length against batches in stream order (issue 15).

`--regenerate` answers the training prompts with the target, batch by batch. A batch is left-padded to its
longest prompt and every decoding step attends over that width, so one long prompt makes its whole batch
slow. The feature pass now sorts each shard's prompts by length into the batches
(``elsi.draft.regenerate.regenerate_sorted``). This bench answers the same ShareGPT first prompts (the feature
pass's stream order) both ways, in one run, and records the answered tokens per second of each and how many
answers are identical (batch composition moves float sums, so a near-tie may flip a token).

    .venv/bin/python bench/regen_speed.py [--prompts 64] [--batch 16] [--max-new 96] [--threads 2]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from elsi.data.conversations import iter_tokenized, load_dataset
from elsi.draft.regenerate import first_prompt_tokens, leaves_room, regenerate_batch, regenerate_sorted
from elsi.io import write_json
from elsi.models import load_target
from elsi.runtime import machine_info


def answer_tokens(target, samples) -> int:
    tok = target.tokenizer
    return sum(len(tok(c, add_special_tokens=False)["input_ids"]) for s in samples for r, c in s.messages
               if r == "assistant")


def generated_widths(lengths: list[int], batch: int, max_tokens: int) -> list[int]:
    """The width each batch of ``batch`` prompts (of these token lengths, in this order) generates at: its longest
    prompt that regeneration answers. A prompt that leaves no room for an answer (``leaves_room``) is skipped and
    pads nothing (0 for a batch of such prompts only)."""
    fits = [n if leaves_room(n, max_tokens) else 0 for n in lengths]
    return [max(fits[k: k + batch]) for k in range(0, len(fits), batch)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/results/regen_speed.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(args.model, dtype=torch.float32)
    samples = []
    for _, s, ids in iter_tokenized(load_dataset("sharegpt"), target.tokenizer, args.max_tokens, 0):
        if not isinstance(ids, str) and len(ids) >= 4:
            samples.append(s)
        if len(samples) == args.prompts:
            break
    lengths = [first_prompt_tokens(s, target.tokenizer) for s in samples]
    regenerate_batch(target, samples[:2], args.max_tokens, 4, 1)  # warm-up
    runs = {}
    load_start = machine_info()["load_average"]
    for name in ("stream_order", "sorted"):
        t0 = time.perf_counter()
        if name == "sorted":
            out = regenerate_sorted(target, samples, args.batch, args.max_tokens, args.max_new, 1)
        else:
            out = [a for k in range(0, len(samples), args.batch)
                   for a in regenerate_batch(target, samples[k: k + args.batch], args.max_tokens, args.max_new, 1)]
        dt = time.perf_counter() - t0
        n = answer_tokens(target, out)
        runs[name] = {"seconds": dt, "answer_tokens": n, "tokens_per_s": n / dt, "answers": out}
        print(f"{name}: {dt:.1f} s, {n} answer tokens, {n / dt:.1f} tok/s", flush=True)
    same = sum(a.messages == b.messages for a, b in zip(runs["stream_order"]["answers"], runs["sorted"]["answers"]))
    widths = {"stream_order": generated_widths(lengths, args.batch, args.max_tokens),
              "sorted": generated_widths(sorted(lengths), args.batch, args.max_tokens)}
    too_long = sum(not leaves_room(n, args.max_tokens) for n in lengths)
    rec = {"command": "python bench/regen_speed.py " + " ".join(
               f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out") + f" --out {args.out}",
           "model": args.model, "dtype": "float32", "prompts": len(samples), "batch": args.batch,
           "max_new_tokens": args.max_new, "prompt_tokens": {"mean": sum(lengths) / len(lengths), "max": max(lengths),
                             "skipped_too_long": too_long},
           "batch_widths": widths,
           "runs": {k: {kk: vv for kk, vv in v.items() if kk != "answers"} for k, v in runs.items()},
           "speedup": runs["sorted"]["tokens_per_s"] / runs["stream_order"]["tokens_per_s"],
           "identical_answers": same,
           "machine": {**machine_info(), "load_average_start": load_start, "threads": args.threads}}
    write_json(Path(args.out), rec)
    print(f"sorted / stream order: {rec['speedup']:.2f}x; {same} of {len(samples)} answers identical; "
          f"batch widths {widths}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
