"""vLLM on this CPU with and without Intel OpenMP in LD_PRELOAD (issue 31, item 5), in one run.

    .venv/bin/python bench/vllm_preload.py --draft DRAFT_DIR [--model smollm2-135m] [--questions-per-subtask 2]
        [--max-new-tokens 64] [--spec-tokens 1 2 3] [--out bench/results/vllm_preload.json]

vLLM's CPU worker warns that speculative decoding without Intel OpenMP (``libiomp5.so``, pip's
``intel-openmp``) in ``LD_PRELOAD`` is much slower. Each configuration (vLLM plain, and EAGLE3 with each
k) is served twice in a row, once as vLLM starts by itself (``--vllm-preload none``) and once with the
library preloaded (``iomp``), on the same Spec-Bench questions at temperature 0 (one warm-up question
first); tokens/s per configuration and the ratio iomp / none, and whether both gave the same tokens.
Run alone (2 cores): the load average is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from elsi.data.spec_bench import load_questions
from elsi.decode import stop_tokens
from elsi.engines.vllm import VllmWorker, iomp_library, preload_env, vllm_method
from elsi.models import load_target
from elsi.runtime import machine_info
from elsi.specbench.runner import answer


def serve(target, draft: str | None, k: int, preload: str, questions, max_new: int, threads: int) -> dict:
    """One vLLM process: warm-up, then every question -> tokens/s (total tokens over total time), tokens."""
    eos = stop_tokens(target.model, target.tokenizer)
    with VllmWorker(target.source, draft, k, threads=threads, preload=preload) as w:
        m = vllm_method(w, max_new, eos)
        gen = torch.Generator().manual_seed(0)
        answer(m, "warm-up", questions[0], target.tokenizer, 0.0, k, gen)
        toks, new, secs = [], 0, 0.0
        for q in questions:
            out: list[int] = []

            def recorded(ids, g):
                r = m(ids, g)
                out.extend(r[0])  # every turn's tokens
                return r

            a = answer(recorded, "vllm", q, target.tokenizer, 0.0, k, gen)
            new, secs = new + a.new_tokens, secs + a.time_s
            toks.append(out)
    return {"tokens_per_s": new / secs, "new_tokens": new, "seconds": secs, "tokens": toks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft", required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--questions-per-subtask", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--spec-tokens", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/results/vllm_preload.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    lib = iomp_library()
    if lib is None or not preload_env("iomp"):
        sys.exit("no Intel OpenMP to preload here (x86 CPU, no CUDA, libiomp5.so in vLLM's environment: make vllm)")
    target = load_target(a.model)
    questions = load_questions(["all"], a.questions_per_subtask)
    rows = []
    for draft, k in [(None, None)] + [(a.draft, k) for k in a.spec_tokens]:
        row = {"method": "vllm_plain" if draft is None else "vllm_spec", "k": k}
        for preload in ("none", "iomp"):
            r = serve(target, draft, k or 1, preload, questions, a.max_new_tokens, a.threads)
            row[preload] = {key: r[key] for key in ("tokens_per_s", "new_tokens", "seconds")}
            row.setdefault("_tokens", []).append(r["tokens"])
            print(f"{row['method']} k={k} {preload}: {r['tokens_per_s']:.1f} tok/s", file=sys.stderr)
        row["iomp_over_none"] = row["iomp"]["tokens_per_s"] / row["none"]["tokens_per_s"]
        row["same_tokens"] = row["_tokens"][0] == row["_tokens"][1]
        del row["_tokens"]
        rows.append(row)
    out = {"command": "python " + " ".join(sys.argv), "machine": machine_info(), "model": a.model, "draft": a.draft,
           "iomp": str(lib), "questions": len(questions), "max_new_tokens": a.max_new_tokens, "runs": rows,
           "load_average_end": os.getloadavg()}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    for r in rows:
        print(f"{r['method']:10s} k={r['k'] or '-'}: none {r['none']['tokens_per_s']:.1f} tok/s, iomp "
              f"{r['iomp']['tokens_per_s']:.1f} tok/s, ratio {r['iomp_over_none']:.2f}x, same tokens {r['same_tokens']}")


if __name__ == "__main__":
    main()
