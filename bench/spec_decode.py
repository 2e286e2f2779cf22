"""Spec-Bench on SmolLM2-135M: plain decoding vs transformers ``generate``, speculative decoding
vs both, a sweep of tree sizes, and where a speculative step's time goes.

    .venv/bin/python bench/spec_decode.py [--draft random|DRAFT_DIR] [--questions-per-subtask 2]
        [--max-new-tokens 64] [--tree-nodes 8 16 30 60] [--shapes 6:10 4:4 5:1 2:2:1,3]

``--shapes DEPTH:TOP_K[:N,...] ...``: tree shapes, each run at every ``--tree-nodes`` or at its
own node counts N (``k = 1`` is chain drafting, where the node count is capped by the depth);
the method of a run is labelled ``spec d<depth> k<top_k>``.

Writes bench/results/spec_decode.json (settings, versions, machine, per-run and per-subtask
tau, tokens/s, speed-ups, ms per step by phase) and prints the ratios. Methods run interleaved
per question, warm-up excluded. Also times one target forward over n tree tokens against a
one-token step (the price of verifying a bigger tree on this hardware). ``--draft random`` is an
untrained EAGLE3 draft: its tau is ~1, so it measures the engine's overhead, not a speed-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from elsi.collect.collector import package_versions
from elsi.decode import TargetRunner, crop_cache, load_drafter
from elsi.decode.tree import additive_mask
from elsi.models import load_target
from elsi.runtime import machine_info
from elsi.specbench import BenchConfig, run_bench, summary_rows
from elsi.specbench.runner import Answer, summarize


def forward_curve(runner: TargetRunner, sizes: list[int], context: int = 300, reps: int = 7) -> dict[int, float]:
    """Median ms of one target forward over n causal tree tokens after a ``context``-token cache."""
    out = {}
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        ids = torch.randint(100, 10000, (context,), generator=g)
        cache = runner.new_cache()
        runner.forward(ids, torch.arange(context), cache)
        for n in sizes:
            x = torch.randint(100, 10000, (n,), generator=g)
            pos = torch.arange(context, context + n)
            mask = None if n == 1 else additive_mask(torch.ones(n, n, dtype=torch.bool).tril(), context, pos, pos,
                                                     runner.dtype)
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                runner.forward(x, pos, cache, mask)
                ts.append(time.perf_counter() - t0)
                crop_cache(cache, context)
            out[n] = 1000 * statistics.median(ts)
    return out


def parse_shape(spec: str, default_nodes: list[int]) -> tuple[int, int, list[int]]:
    """'DEPTH:TOP_K' or 'DEPTH:TOP_K:N1,N2' -> (depth, top_k, node counts); a chain caps N at its depth."""
    parts = spec.split(":")
    if len(parts) not in (2, 3):
        raise SystemExit(f"bad --shapes entry {spec!r}: use DEPTH:TOP_K or DEPTH:TOP_K:N1,N2")
    try:
        depth, top_k = int(parts[0]), int(parts[1])
        nodes = [int(n) for n in parts[2].split(",")] if len(parts) == 3 else list(default_nodes)
    except ValueError:
        raise SystemExit(f"bad --shapes entry {spec!r}: DEPTH, TOP_K and N are integers") from None
    if top_k == 1:
        nodes = [min(n, depth) for n in nodes]
    return depth, top_k, sorted(set(nodes))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft", default="random")
    ap.add_argument("--subtasks", nargs="+", default=["all"])
    ap.add_argument("--questions-per-subtask", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--tree-nodes", type=int, nargs="+", default=[8, 16, 30, 60])
    ap.add_argument("--shapes", nargs="+", default=["6:10"], help="tree shapes DEPTH:TOP_K")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default="bench/results/spec_decode.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    target = load_target(args.model)
    drafter, info = load_drafter(args.draft, target)
    runner = TargetRunner.from_target(target)
    shapes = [parse_shape(s, args.tree_nodes) for s in args.shapes]  # (depth, top_k, node counts)
    sizes = {n for *_, ns in shapes for n in ns}
    curve = forward_curve(runner, [1] + sorted({n + 1 for n in sizes} | {5, 9, 17, 33}))
    answers: list[Answer] = []
    cfg = None
    for i, (depth, top_k, nodes) in enumerate(shapes):
        # One call per shape; the baselines (generate, plain) only in the first.
        c = BenchConfig(model=args.model, draft=args.draft, subtasks=args.subtasks,
                        questions_per_subtask=args.questions_per_subtask, max_new_tokens=args.max_new_tokens,
                        temperature=[0.0], tree_nodes=nodes, depth=depth, top_k=top_k, hf_generate=i == 0,
                        plain=i == 0)
        cfg = cfg or c

        def show(a, done, total, kept, label=f"d{depth} k{top_k}"):
            print(f"\r{label} [{done}/{total}] {a.subtask} q{a.question_id}", end="", file=sys.stderr, flush=True)

        part = run_bench(target, drafter, c, on_answer=show)
        for a in part["answers"]:
            if a["method"] == "spec":
                a["method"] = f"spec d{depth} k{top_k}"
            answers.append(Answer(**a))
    print(file=sys.stderr)
    res = summarize(answers, cfg)
    res["settings"]["shapes"] = args.shapes
    res = {"command": "python bench/spec_decode.py " + " ".join(sys.argv[1:]), "draft": info,
           "versions": package_versions(), "machine": machine_info(),
           "forward_ms_by_tokens": {str(k): v for k, v in curve.items()}, **res}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))

    from elsi.text import md_table

    header, rows = summary_rows(res)
    print(f"draft: {info['kind']}")
    print(md_table(header, rows))
    print("target forward, ms by tokens: " + ", ".join(f"{k}: {v:.1f}" for k, v in curve.items()))
    for r in res["runs"]:
        o = r["overall"]
        if r["method"] == "plain":
            print(f"plain decoding / transformers generate: {o['speedup_vs_hf']:.3f}")
        if r["method"].startswith("spec"):
            ms = ", ".join(f"{k} {v:.1f}" for k, v in o["ms_per_step"].items())
            print(f"{r['method']} {r['tree_nodes']:>3} nodes: x{o['speedup_vs_plain']:.3f} vs plain, "
                  f"x{o['speedup_vs_hf']:.3f} vs generate, tau {o['tau']:.2f}; ms/step: {ms}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
