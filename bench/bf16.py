"""bfloat16 against float32, stage by stage, on the same inputs in one run (issue: bf16 on the AMX units).

Stages (``--stages``; each alternates the two precisions per input so machine load hits both alike,
warm-up excluded, medians reported):
- ``collect``: ``elsi analyze``'s per-sample work (forward with all hidden states, token entropy,
  filter, blocks, Grams) with the target in fp32 and in bf16: tokens/s, and the per-layer mean
  block entropy of each (max |difference| over layers, nats).
- ``features``: the feature pass of ``train-draft`` (``target_features``: forward, hidden states
  stored fp16): tokens/s, relative error of the bf16 features against the fp32 ones (both fp16),
  agreement of the target's argmax (the hard label).
- ``compile``: the feature pass as ``train-draft`` runs it: float32 and bf16 eager and bf16 under
  ``--compile``, alternated per sample after the compilation (its seconds reported): tokens/s and
  speed-ups over float32, the argmax agreement and feature error of each against float32, and the
  operator shares of the eager bf16 forward (torch.profiler, ``--profile-samples`` samples). (A float32
  compiled variant interleaved with these slowed the eager bf16 one by 40 %: left out.)
- ``regen``: ``--regenerate``'s batched greedy generation of answers: tokens/s, how many answers
  are identical and where the first differing token falls.
- ``train``: draft training steps from the same initial weights on the same conversations, fp32
  against ``--train-dtype bfloat16`` autocast (fp32 master weights), each eager and compiled
  (``--train-compile``): scored tokens/s and the loss curves (step by step) and their held-out
  match after the same number of steps.
- ``analyze``: the whole main job, ``elsi analyze`` (``--analyze-samples``, default 200, as ``make run``)
  then ``elsi select --method all``, once with ``--dtype float32`` and once with ``bfloat16``, each
  from an empty run directory in a subprocess: wall time and tokens/s of each, then
  ``--compare-runs`` of the two (entropy differences, every method's selections).
- ``profile``: where a bf16 draft-training step's time goes: ``--profile-steps`` steps of
  ``ttt_loss`` + backward + AdamW on conversations of ``--features-dir`` under torch.profiler,
  the operators' self time (share of the total).
``--compare-runs FP32_RUN BF16_RUN``: two finished ``elsi analyze`` runs (``--dtype float32`` and
``bfloat16``): per-layer entropy differences and each run's ELSI m=3 set.

    .venv/bin/python bench/bf16.py --stages collect features regen train --threads 2 --out bench/results/bf16.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from elsi.collect.collector import _forward, package_versions
from elsi.collect.grams import block_grams, blocks_of, filter_positions, kept_count, token_entropy, unpack
from elsi.data import iter_tokenized, load_dataset
from elsi.draft.forward import target_features
from elsi.draft.regenerate import regenerate_batch
from elsi.models.compiled import compiled
from elsi.models import load_target
from elsi.runtime import machine_info
from elsi.stats.entropy import kernel_entropy


def _samples(target, n: int, max_tokens: int = 1024) -> list[list[int]]:
    out = []
    for _, _, ids in iter_tokenized(load_dataset("sharegpt"), target.tokenizer, max_tokens, 0):
        if isinstance(ids, list) and kept_count(len(ids), 0.3) >= 32:
            out.append(ids)
        if len(out) >= n:
            break
    return out


def _alternate(fns: dict, inputs: list, warmup: int) -> dict[str, list[float]]:
    """Seconds per input of each fn, alternating which runs first; the first ``warmup`` inputs untimed."""
    times = {k: [] for k in fns}
    names = list(fns)
    for i, x in enumerate(inputs):
        for name in (names if i % 2 == 0 else names[::-1]):
            t0 = time.perf_counter()
            fns[name](x)
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return times


def _layer_entropy(target, ids: list[int]) -> torch.Tensor:
    """Per-layer mean block entropy of one sample (nats), as ``collect`` forms it: (N+1,)."""
    logits, hidden = _forward(target, ids)
    blocks = blocks_of(filter_positions(token_entropy(logits), 0.3), 32)
    grams, _ = block_grams(hidden, blocks, "center-l2")  # (nb, L, 528) packed
    g = unpack(grams.double(), 32)  # (nb, L, B, B)
    k = g / g.diagonal(dim1=-2, dim2=-1).sum(-1)[..., None, None]
    return kernel_entropy(k).mean(0)  # (L,)


def stage_collect(t32, t16, samples, warmup):
    work = lambda t: (lambda ids: _layer_entropy(t, ids))  # noqa: E731
    times = _alternate({"float32": work(t32), "bfloat16": work(t16)}, samples, warmup)
    timed = samples[warmup:]
    tokens = sum(map(len, timed))
    e32 = torch.stack([_layer_entropy(t32, ids) for ids in timed]).mean(0)
    e16 = torch.stack([_layer_entropy(t16, ids) for ids in timed]).mean(0)
    tps = {k: tokens / sum(v) for k, v in times.items()}
    return {"samples": len(timed), "tokens": tokens, "tokens_per_s": tps, "speedup": tps["bfloat16"] / tps["float32"],
            "layer_entropy_max_abs_diff_nats": float((e32 - e16).abs().max()),
            "layer_entropy_float32": e32.tolist(), "layer_entropy_bfloat16": e16.tolist()}


def _against(refs, target, samples, layers, forward=None) -> tuple[list[float], float]:
    """Per sample, the relative error of ``target``'s cached-layer states against the reference features
    ``refs`` (``target_features`` of the float32 target on the same ``samples``; position 0 excluded), and
    the share of positions where the two argmax labels agree."""
    rel, agree, n = [], 0, 0
    for (a32, _, s32), ids in zip(refs, samples):
        (a, _, st), = target_features(target, [ids], layers, forward)
        rel.append(float((st[1:].float() - s32[1:].float()).norm() / s32[1:].float().norm()))
        agree += int((a == a32).sum())
        n += a32.numel()
    return rel, agree / n


def stage_features(t32, t16, samples, warmup, layers):
    times = _alternate({"float32": lambda ids: target_features(t32, [ids], layers),
                        "bfloat16": lambda ids: target_features(t16, [ids], layers)}, samples, warmup)
    timed = samples[warmup:]
    rel, agree = _against([target_features(t32, [ids], layers)[0] for ids in timed], t16, timed, layers)
    tokens = sum(map(len, timed))
    tps = {k: tokens / sum(v) for k, v in times.items()}
    return {"samples": len(timed), "tokens": tokens, "layers": list(layers), "tokens_per_s": tps,
            "speedup": tps["bfloat16"] / tps["float32"], "feature_relative_error_median": statistics.median(rel),
            "feature_relative_error_max": max(rel), "argmax_agreement": agree}


def stage_compile(t32, t16, samples, warmup, layers, profile_samples):
    from torch.profiler import profile

    cpu = torch.device("cpu")
    fwd = {"float32": None, "bfloat16": None,  # target_features' default: the eager decoder
           "bfloat16_compiled": compiled(t16.adapter.decoder(t16.model), True, cpu, "bench")}
    target = {k: (t16 if k.startswith("bfloat16") else t32) for k in fwd}
    compile_s = {}
    t0 = time.perf_counter()  # the first call compiles: timed apart
    target_features(t16, [samples[0]], layers, fwd["bfloat16_compiled"])
    compile_s["bfloat16_compiled"] = time.perf_counter() - t0
    times = _alternate({k: (lambda ids, k=k: target_features(target[k], [ids], layers, fwd[k])) for k in fwd},
                       samples, warmup)
    timed = samples[warmup:]
    tokens = sum(map(len, timed))
    tps = {k: tokens / sum(v) for k, v in times.items()}
    refs = [target_features(t32, [ids], layers)[0] for ids in timed]  # float32's, once for every variant
    quality = {}
    for k in fwd:
        rel, agree = _against(refs, target[k], timed, layers, fwd[k])
        quality[k] = {"argmax_agreement_with_float32": agree, "feature_relative_error_median": statistics.median(rel)}
    with profile() as prof:
        for ids in timed[:profile_samples]:
            target_features(t16, [ids], layers)
    ev = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in ev)
    ops = [{"op": e.key, "share": e.self_cpu_time_total / total, "calls": e.count} for e in ev[:15]]
    return {"samples": len(timed), "tokens": tokens, "layers": list(layers), "tokens_per_s": tps,
            "speedup_vs_float32": {k: v / tps["float32"] for k, v in tps.items()},
            "speedup_of_compile": tps["bfloat16_compiled"] / tps["bfloat16"],
            "compile_and_first_call_s": compile_s, "quality": quality,
            "bfloat16_eager_profile": {"samples": min(profile_samples, len(timed)), "ops": ops}}


def stage_regen(t32, t16, batches, max_new):
    out = {}
    answers = {}
    for name, t in (("float32", t32), ("bfloat16", t16)):
        regenerate_batch(t, batches[0], 256, 8, turns=1)  # warm-up
        t0 = time.perf_counter()
        res = [regenerate_batch(t, b, 1024, max_new, turns=1) for b in batches]
        dt = time.perf_counter() - t0
        answers[name] = [s.messages[-1][1] for b in res for s in b]
        ntok = sum(len(t.tokenizer(a)["input_ids"]) for a in answers[name])
        out[name] = {"seconds": dt, "answer_tokens": ntok, "tokens_per_s": ntok / dt}
    same = [a == b for a, b in zip(answers["float32"], answers["bfloat16"])]
    first = []
    for a, b in zip(answers["float32"], answers["bfloat16"]):
        ta, tb = t32.tokenizer(a)["input_ids"], t32.tokenizer(b)["input_ids"]
        if ta != tb:
            first.append(next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb))))
    return {"answers": len(same), "identical": int(sum(same)), "first_difference_token_median":
            statistics.median(first) if first else None, "max_new_tokens": max_new, **out,
            "speedup": out["bfloat16"]["tokens_per_s"] / out["float32"]["tokens_per_s"]}


def stage_train(target, features_dir: str, layers: str, steps: int, batch_size: int, out_root: Path) -> dict:
    """The same draft training run (same init, data order and steps) with float32 and bf16-autocast matmuls,
    each eager and with the unrolled forward compiled (``--train-compile``). ``train_tokens_per_s`` counts the
    whole run (the compilation in the first step included); ``steady_tokens_per_s`` from step 10 on."""
    from elsi.draft.cache import FeatureStore
    from elsi.draft.train import TrainConfig, train_draft

    store = FeatureStore(features_dir)
    out = {}
    for name, dt, comp in (("float32", "float32", False), ("bfloat16", "bfloat16", False),
                           ("bfloat16_compiled", "bfloat16", True), ("float32_compiled", "float32", True)):
        cfg = TrainConfig(layers=layers, out=str(out_root / f"train-{name}"), max_steps=steps, time_budget="0",
                          epochs=100.0, batch_size=batch_size, eval_every="0", checkpoint_every="0", restart=True,
                          train_dtype=dt, train_compile=comp)
        rec = train_draft(target, store, cfg, 0, torch.device("cpu"))
        c10, end = next(c for c in rec["curve"] if c["step"] >= 10), rec["curve"][-1]
        out[name] = {"train_tokens_per_s": rec["train_tokens_per_s"], "train_seconds": rec["train_seconds"],
                     "steady_tokens_per_s": (end["tokens"] - c10["tokens"]) / (end["elapsed_s"] - c10["elapsed_s"]),
                     "compiled": rec["train_compiled"], "steps": rec["steps"], "heldout_match": rec["heldout"]["match"],
                     "curve": [{k: c[k] for k in ("step", "loss", "acc")} for c in rec["curve"]]}
        print(json.dumps({name: {k: v for k, v in out[name].items() if k != "curve"}}), file=sys.stderr)
    base = out["float32"]
    return {"features_dir": features_dir, "layers": layers, "steps": steps, "batch_size": batch_size, **out,
            "speedup": out["bfloat16"]["train_tokens_per_s"] / base["train_tokens_per_s"],
            "speedup_vs_float32": {k: v["train_tokens_per_s"] / base["train_tokens_per_s"] for k, v in out.items()},
            "heldout_match_difference_depth1": out["bfloat16"]["heldout_match"][0] - base["heldout_match"][0],
            "heldout_match_difference_depth1_vs_float32": {k: v["heldout_match"][0] - base["heldout_match"][0]
                                                           for k, v in out.items()}}


def stage_analyze(model: str, samples: int, threads: int, root: Path) -> dict:
    """The main job (analyze + select) in fp32 and in bf16, each from scratch in its own process."""
    import shutil
    import subprocess

    elsi = [sys.executable, "-m", "elsi"]
    out, runs = {}, {}
    for dt in ("float32", "bfloat16"):
        run = root / f"analyze-{dt}"
        shutil.rmtree(run, ignore_errors=True)
        t0 = time.perf_counter()
        subprocess.run(elsi + ["analyze", "--model", model, "--samples", str(samples), "--dtype", dt,
                               "--out", str(run)] + (["--threads", str(threads)] if threads else []), check=True)
        t1 = time.perf_counter()
        subprocess.run(elsi + ["select", "--run", str(run), "--method", "all"], check=True, stdout=subprocess.DEVNULL)
        t2 = time.perf_counter()
        man = json.loads((run / "manifest.json").read_text())
        out[dt] = {"analyze_wall_s": t1 - t0, "select_wall_s": t2 - t1, "tokens_seen": man["counts"]["tokens_seen"],
                   "tokens_per_s": man["counts"]["tokens_seen"] / (t1 - t0)}
        runs[dt] = run
        print(json.dumps({dt: out[dt]}), file=sys.stderr)
    return {"samples": samples, "note": "wall time of the whole command (model load and statistics included)", **out,
            "speedup": out["bfloat16"]["tokens_per_s"] / out["float32"]["tokens_per_s"],
            **compare_runs(runs["float32"], runs["bfloat16"])}


def stage_profile(target, features_dir: str, layers: str, steps: int) -> dict:
    """Operator self times of bf16-autocast draft training steps (batch 1, ttt 1), after 3 warm-up steps."""
    from torch.profiler import profile

    from elsi.draft.cache import FeatureStore
    from elsi.draft.model import Eagle3Draft, config_for_target, init_weights
    from elsi.draft.loss import LabelHead, make_batch, scored, ttt_loss
    from elsi.draft.vocab import build_vocab

    store = FeatureStore(features_dir)
    ids = [int(x) for x in layers.split(",")]
    pos = store.layer_index(ids)
    vocab_ids, d2t, t2d, _ = build_vocab((store.argmax(i) for i in range(min(len(store), 400))),
                                         int(target.adapter.embed_tokens(target.model).weight.shape[0]), 8192)
    draft = Eagle3Draft(config_for_target(target, ids, draft_vocab_size=len(vocab_ids)),
                        target.adapter.embed_tokens(target.model))
    init_weights(draft, torch.Generator().manual_seed(0))
    draft.set_vocab(d2t, t2d)
    draft.train()
    head = LabelHead.build(target, vocab_ids, torch.device("cpu"), torch.bfloat16)
    opt_ = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-3, fused=True)
    tokens = []

    def step(i: int) -> None:
        s = [store.sample(i, pos)]
        batch = make_batch(target, s, vocab_ids, t2d, torch.device("cpu"), label_head=head, score=scored(s, "reply"))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _, _ = ttt_loss(draft, batch, 1)
        opt_.zero_grad()
        loss.backward()
        opt_.step()
        tokens.append(int(batch.input_ids.shape[1]))

    for i in range(3):
        step(i)
    t0 = time.perf_counter()
    with profile() as prof:
        for i in range(3, 3 + steps):
            step(i)
    wall = time.perf_counter() - t0
    ev = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in ev)
    return {"features_dir": features_dir, "steps": steps, "mean_tokens_per_step": statistics.mean(tokens[3:]),
            "wall_ms_per_step_profiled": 1000 * wall / steps,
            "ops": [{"op": e.key, "self_ms_per_step": e.self_cpu_time_total / 1000 / steps,
                     "share": e.self_cpu_time_total / total, "calls_per_step": e.count / steps} for e in ev[:20]]}


def compare_runs(a: Path, b: Path) -> dict:
    ja, jb = (json.loads((p / "analysis.json").read_text()) for p in (a, b))
    ea, eb = torch.tensor(ja["layer_entropy"]), torch.tensor(jb["layer_entropy"])
    sel = {}
    for p in (a, b):
        s = json.loads((p / "selections.json").read_text()) if (p / "selections.json").exists() else {"results": []}
        sel[str(p)] = {f"{r['method']}:{r['m']}": r["layers"] for r in s["results"]}
    return {"runs": [str(a), str(b)], "layer_entropy_max_abs_diff_nats": float((ea - eb).abs().max()),
            "argmax_layer": [int(ea.argmax()) + 1, int(eb.argmax()) + 1], "selections": sel,
            "selections_differing": sorted(k for k in sel[str(a)] if sel[str(a)][k] != sel[str(b)].get(k))}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--stages", nargs="*", default=["collect", "features", "regen"])
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--layers", default="2,15,27")
    ap.add_argument("--regen-batches", type=int, default=2, help="batches of 8 prompts")
    ap.add_argument("--regen-new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--compare-runs", nargs=2, default=None)
    ap.add_argument("--analyze-samples", type=int, default=200, help="analyze stage: --samples of elsi analyze")
    ap.add_argument("--features-dir", default="runs/features-sg400", help="train stage: a feature cache")
    ap.add_argument("--train-steps", type=int, default=300)
    ap.add_argument("--train-batch", type=int, default=1)
    ap.add_argument("--profile-steps", type=int, default=10)
    ap.add_argument("--profile-samples", type=int, default=3, help="compile stage: samples of the bf16 profile")
    ap.add_argument("--out", default="bench/results/bf16.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    res = {"command": "python bench/bf16.py " + " ".join(sys.argv[1:]),
           "machine": {**machine_info(), "threads": torch.get_num_threads(),
                       "load_average_start": os.getloadavg()},
           "versions": package_versions(), "stages": {}}
    if args.compare_runs:
        res["compare_runs"] = compare_runs(*map(Path, args.compare_runs))
    stages = [s for s in args.stages if s not in ("train", "analyze", "profile")]
    if stages:
        t32 = load_target(args.model, "cpu", torch.float32)
        t16 = load_target(args.model, "cpu", torch.bfloat16)
        samples = _samples(t32, args.samples + args.warmup)
        layers = [int(x) for x in args.layers.split(",")]
        if "collect" in stages:
            res["stages"]["collect"] = stage_collect(t32, t16, samples, args.warmup)
            print(json.dumps({"collect": {k: v for k, v in res["stages"]["collect"].items() if "layer_entropy_" not in k or "diff" in k}}), file=sys.stderr)
        if "features" in stages:
            res["stages"]["features"] = stage_features(t32, t16, samples, args.warmup, layers)
            print(json.dumps({"features": res["stages"]["features"]}), file=sys.stderr)
        if "compile" in stages:
            res["stages"]["compile"] = stage_compile(t32, t16, samples, args.warmup, layers, args.profile_samples)
            print(json.dumps({"compile": {k: v for k, v in res["stages"]["compile"].items()
                                          if k != "bfloat16_eager_profile"}}), file=sys.stderr)
        if "regen" in stages:
            prompts = [s for s in load_dataset("sharegpt").samples
                       if s.text is None and any(r == "user" for r, _ in s.messages)][: 8 * args.regen_batches]
            batches = [prompts[i:i + 8] for i in range(0, len(prompts), 8)]
            res["stages"]["regen"] = stage_regen(t32, t16, batches, args.regen_new)
            print(json.dumps({"regen": res["stages"]["regen"]}), file=sys.stderr)
    if "analyze" in args.stages:
        res["stages"]["analyze"] = stage_analyze(args.model, args.analyze_samples, args.threads, Path("runs/bench-bf16"))
    if "train" in args.stages:
        t32 = load_target(args.model, "cpu", torch.float32)
        res["stages"]["train"] = stage_train(t32, args.features_dir, args.layers, args.train_steps, args.train_batch,
                                             Path("runs/bench-bf16"))
    if "profile" in args.stages:
        t32 = load_target(args.model, "cpu", torch.float32)
        res["stages"]["profile"] = stage_profile(t32, args.features_dir, args.layers, args.profile_steps)
        for o in res["stages"]["profile"]["ops"][:12]:
            print(f"{o['share']:6.1%} {o['self_ms_per_step']:7.1f} ms/step  {o['op']}", file=sys.stderr)
    res["machine"]["load_average_end"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
