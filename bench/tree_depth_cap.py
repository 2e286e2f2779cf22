"""A one-node draft tree with and without the depth cap of ``build_tree`` (commit 9ff60b2).

``build_tree`` expands no deeper than the tree has nodes: a node below depth ``tree_nodes`` could never survive
the rerank. Before, ``--tree-nodes 1`` with the paper's depth 6 drafted five passes a step whose candidates were
all thrown away. This bench times one step's tree building on a real draft both ways, interleaved (median of
--repeats): capped = ``TreeConfig(1, depth, top_k)``; uncapped = the expansion the old code did, reproduced by
``TreeConfig(depth, depth, top_k)`` (the same ``depth - 1`` passes; its rerank keeps ``depth`` nodes instead of
1, a negligible difference), and checks that both keep the same first node.

    .venv/bin/python bench/tree_depth_cap.py --model gemma3-270m --draft DRAFT_DIR [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from elsi.decode.drafters import load_drafter
from elsi.decode.engine import TargetRunner
from elsi.decode.tree import TreeConfig, build_tree
from elsi.io import write_json
from elsi.models import load_target
from elsi.runtime import machine_info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--draft", required=True, help="a trained draft directory of --model")
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--top-k", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/results/tree_depth_cap.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(args.model, dtype=torch.float32)
    drafter, _ = load_drafter(args.draft, target)
    runner = TargetRunner.from_target(target)
    ids = target.tokenizer("Translate into German: the weather is fine and the river is calm today.",
                           return_tensors="pt").input_ids[0]
    layers = tuple(drafter.feature_layers)
    shapes = {"capped": TreeConfig(1, args.depth, args.top_k),
              "uncapped": TreeConfig(args.depth, args.depth, args.top_k)}
    times: dict[str, list[float]] = {k: [] for k in shapes}
    first: dict[str, int] = {}
    with torch.inference_mode():
        hidden, feats = runner.forward(ids, torch.arange(len(ids)), runner.new_cache(), None, layers)
        root = int(runner.logits(hidden[-1:])[0].argmax())
        prompt = torch.cat([ids, ids.new_tensor([root])])
        for rep in range(args.repeats + 2):  # two warm-up rounds
            for name, cfg in shapes.items():
                session = drafter.start()
                root_logits = session.commit(prompt, feats)  # a fresh session: no rows fed by the other shape
                t0 = time.perf_counter()
                tree = build_tree(root, root_logits, session.expand, cfg, token_ids=session.token_ids)
                if rep >= 2:
                    times[name].append(time.perf_counter() - t0)
                first[name] = int(tree.tokens[1])
    if first["capped"] != first["uncapped"]:
        raise SystemExit(f"the capped tree keeps token {first['capped']}, the full expansion {first['uncapped']}")
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    ratio = med["uncapped"] / med["capped"]
    print(f"{args.model}, one-node tree, depth {args.depth}, top-k {args.top_k}: uncapped {med['uncapped']:.2f} ms, "
          f"capped {med['capped']:.2f} ms a step ({ratio:.1f}x less); the same first node")
    write_json(Path(args.out), {"command": "python " + " ".join(sys.argv), "model": args.model, "draft": args.draft,
                                "depth": args.depth, "top_k": args.top_k, "repeats": args.repeats,
                                "ms_per_step": med, "ratio": ratio, "same_first_node": True,
                                "machine": machine_info()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
