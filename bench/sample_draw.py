"""One sampled token: ``elsi.decode.verify.draw`` (inverse CDF) against ``torch.multinomial(p, 1)``.

Every step of decoding at temperature > 0 draws one token from the target's distribution (the bonus token
of a tree step, or the token of a plain step). On CPU, ``torch.multinomial`` costs milliseconds on a large
vocabulary; ``draw`` is one float64 cumulative sum and a binary search. This bench times both on softmax
distributions of each vocabulary size (SmolLM2's 49,152 and Gemma-3's 262,144; random logits of scale 3,
about as peaked as a chat model's), interleaved, median of --repeats, and prints multinomial's time over
draw's. Run it alone: other jobs on the cores change both.

    .venv/bin/python bench/sample_draw.py [--vocab 49152 262144] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from elsi.decode.verify import draw
from elsi.io import write_json
from elsi.runtime import machine_info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[49152, 262144])
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/results/sample_draw.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    results = []
    for V in args.vocab:
        p = torch.softmax(torch.randn(V, generator=g) * 3, dim=-1)  # (V,)
        fns = {"multinomial": lambda: int(torch.multinomial(p, 1, generator=g)), "draw": lambda: draw(p, g)}
        times: dict[str, list[float]] = {k: [] for k in fns}
        for rep in range(args.repeats + 5):  # five warm-up rounds
            for name, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                if rep >= 5:
                    times[name].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        row = {"vocab": V, "ms": med, "multinomial_over_draw": med["multinomial"] / med["draw"]}
        results.append(row)
        print(f"V {V}: multinomial {med['multinomial']:.3f} ms, draw {med['draw']:.3f} ms "
              f"({row['multinomial_over_draw']:.1f}x)")
    write_json(Path(args.out), {"command": "python " + " ".join(sys.argv), "repeats": args.repeats,
                                "machine": machine_info(), "results": results})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
