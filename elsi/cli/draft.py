"""``elsi train-draft`` (target features -> EAGLE3 draft) and ``elsi eval-draft`` (Spec-Bench, offline)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from elsi.cli.common import Command, Runtime, check_inputs, is_main_process, print_json
from elsi.data import load_dataset
from elsi.decode.drafters import check_draft_spec
from elsi.draft.evaluate import EvalConfig, evaluate_draft, subtask_list, trained_depth
from elsi.draft.features import FeatureConfig, Progress as FeatureProgress, build_features, parse_layers
from elsi.draft.model import Eagle3Draft
from elsi.draft.train import Progress, TrainConfig, parse_duration, train_draft
from elsi.engines import warn_engines
from elsi.io import write_json
from elsi.models import load_target
from elsi.specbench.answers import greedy_answers
from elsi.specbench.exact import ExactConfig, exact_rows, exact_tau
from elsi.specbench.states import AnswerStates
from elsi.text import md_table


def train(fcfg: FeatureConfig, tcfg: TrainConfig, rt: Runtime) -> int:
    """Under torchrun: rank 0 builds the feature cache, every rank trains its share (DDP), rank 0 prints."""
    check_inputs(fcfg.model, fcfg.data)  # a bad --model or --data fails here, before anything loads
    device, dtype = rt.setup(bulk=True)
    main = is_main_process()
    torch.manual_seed(fcfg.seed)  # the one global seed (HF internals); the draft's own randomness is injected
    target = load_target(fcfg.model, device, dtype, rt.trust_remote_code)
    layers = parse_layers(tcfg.layers, target.num_layers)
    if main:
        warn_engines(layers, target.num_layers)  # per engine: would it serve this layer set as trained?
    dataset = load_dataset(fcfg.data)

    bar = tqdm(total=fcfg.samples, desc="target features", unit="sample", file=sys.stderr, dynamic_ncols=True,
               disable=not main)

    def show_features(p: FeatureProgress) -> None:
        bar.n = p.samples_done
        bar.set_postfix_str(f"{p.stage}, {p.tokens / max(p.elapsed_s, 1e-9):.0f} tok/s", refresh=True)

    store = build_features(target, dataset, fcfg, layers, on_progress=show_features)
    bar.n = min(len(store), fcfg.samples)
    bar.refresh()
    bar.close()
    if main:
        print(f"features: {min(len(store), fcfg.samples)} conversations, {store.num_tokens} tokens cached in "
              f"{store.path}", file=sys.stderr)

    budget = parse_duration(tcfg.time_budget)
    # the bar counts what ends training: optimizer steps under --max-steps (or with no time budget), else seconds
    by_steps = bool(tcfg.max_steps) or budget == float("inf")
    unit = "step" if by_steps else "s"
    tbar = tqdm(total=(tcfg.max_steps or None) if by_steps else int(budget), desc="train", unit=unit, file=sys.stderr,
                dynamic_ncols=True, bar_format="{l_bar}{bar}| {n:.0f}/{total_fmt} " + unit + " [{postfix}]",
                disable=not main)
    held = [None]

    def show(p: Progress) -> None:
        if p.note or p.info:
            tbar.write(p.note or p.info, file=sys.stderr)
            return
        if p.heldout_acc is not None:
            held[0] = p.heldout_acc
        done = p.step if by_steps else p.elapsed_s
        tbar.n = min(done, tbar.total or done)
        h = f" held {held[0]:.3f}" if held[0] is not None else ""
        tbar.set_postfix_str(f"step {p.step} ep {p.epoch:.2f} loss {p.loss:.3f} acc {p.acc:.3f}{h} "
                             f"lr {p.lr:.1e} {p.tokens / max(p.elapsed_s, 1e-9):.0f} tok/s", refresh=False)
        tbar.refresh()

    rec = train_draft(target, store, tcfg, fcfg.seed, device, samples=fcfg.samples,
                      on_progress=show if main else None)
    tbar.close()
    if not main:
        return 0
    h = rec["heldout"]
    rows = [[d, f"{m:.4f}", f"{mi:.4f}", f"{l:.3f}"] for d, m, mi, l in
            zip(h["depth"], h["match"], h["match_in_vocab"], h["loss"])]
    print(md_table(["depth", "top-1 match", "match (in vocab)", "loss"], rows))
    print(f"held-out: chain acceptance length {h['accept_length_chain']:.3f} "
          f"(product formula {h['accept_length_product']:.3f}); "
          f"{rec['steps']} steps, {rec['epochs']:.2f} epochs, {rec['train_tokens_per_s']:.0f} training tokens/s")
    print(f"wrote {tcfg.out}/model.safetensors, config.json, training.json")
    return 0


def evaluate(cfg: EvalConfig, xcfg: ExactConfig, rt: Runtime) -> int:
    check_inputs(cfg.model)
    if not (Path(cfg.draft) / "config.json").is_file():
        raise FileNotFoundError(f"no draft in {cfg.draft} (config.json missing): train one with "
                                f"`elsi train-draft --out {cfg.draft}`")
    check_draft_spec(cfg.draft, cfg.model, rt.trust_remote_code)  # another target's draft fails before any model loads
    device, dtype = rt.setup()
    target = load_target(cfg.model, device, dtype, rt.trust_remote_code)
    draft = Eagle3Draft.from_pretrained(cfg.draft, target.adapter.embed_tokens(target.model), target.num_layers)
    depth = cfg.depth or trained_depth(cfg.draft)
    bar = tqdm(desc="target answers", unit="turn", file=sys.stderr, dynamic_ncols=True)
    answers = greedy_answers(target, subtask_list(cfg.subtasks), cfg.questions, cfg.max_new, cfg.gen_batch,
                             path=cfg.answers or None, on_progress=_bar_update(bar))
    bar.close()
    res = evaluate_draft(target, draft, answers, depth)
    res.update({"model": cfg.model, "draft": cfg.draft, "questions_per_subtask": cfg.questions,
                "max_new": cfg.max_new})
    if xcfg.exact:
        bar = tqdm(desc="exact tau", unit="turn", file=sys.stderr, dynamic_ncols=True)
        res["exact"] = exact_tau(target, draft.to(device), answers, xcfg.trees(), cfg.max_new,
                                 on_progress=_bar_update(bar), states=AnswerStates(target, keep=xcfg.keep_states))
        bar.close()
    if cfg.out:
        Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
        write_json(Path(cfg.out), res)
    if cfg.json:
        print_json(res)
        return 0
    names = list(res["subtasks"]) + ["all"]
    rows = []
    for name in names:
        r = res["subtasks"][name] if name != "all" else res["all"]
        rows.append([name, *(f"{m:.3f}" for m in r["match"]), f"{r['accept_length_chain']:.3f}",
                     f"{r['accept_length_product']:.3f}"])
    print(md_table(["subtask", *(f"d{d}" for d in range(1, depth + 1)), "tau (chain)", "tau (product)"], rows))
    if xcfg.exact:
        ex = res["exact"]
        print(f"\nexact τ at temperature 0 ({ex['answer_turns']} answer turns, {ex['answer_tokens']} tokens; "
              f"{ex['greedy_flips']} near ties the answers' batched generation rounded otherwise):")
        print(md_table(*exact_rows(ex)))
    print(json.dumps({"draft": cfg.draft, "depth1_match": res["all"]["match"][0],
                      "accept_length_chain": res["all"]["accept_length_chain"],
                      **({"exact_tau": {str(t["tree"]["tree_nodes"]): t["overall"]["tau"]
                                        for t in res["exact"]["trees"]}} if xcfg.exact else {})}))
    if cfg.out:
        print(f"wrote {cfg.out}")
    return 0


def _bar_update(bar):
    def show(done: int, total: int) -> None:
        bar.total = total
        bar.n = done
        bar.refresh()

    return show


COMMANDS = [
    Command("train-draft", "train an EAGLE3-style draft on any target layer set (features cached on disk)",
            (FeatureConfig, TrainConfig, Runtime), train,
            writes=lambda fcfg, tcfg, rt: [(tcfg.out, "the draft directory")]),
    Command("eval-draft", "teacher-forced draft match rates on Spec-Bench, and the exact τ of tree decoding at "
                          "temperature 0 (no decoding loop)",
            (EvalConfig, ExactConfig, Runtime), evaluate),
]
