"""``elsi generate`` (one answer, plain or speculative) and ``elsi bench`` (Spec-Bench)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from elsi.cli.common import Command, Runtime, print_json
from elsi.config import opt
from elsi.decode import DecodeConfig, TargetRunner, TreeConfig, generate, load_drafter, stop_tokens
from elsi.decode.drafters import check_draft_spec
from elsi.engines.vllm import VllmBenchConfig
from elsi.models import DEFAULT_MODEL, load_target
from elsi.runtime import machine_info
from elsi.specbench import BenchConfig, encode_chat, run_bench, summary_rows
from elsi.specbench.runner import progress_path
from elsi.text import md_table


@dataclass(frozen=True)
class GenerateArgs:
    """The target, the draft and the prompt."""

    model: str = opt(DEFAULT_MODEL, "target: alias, HF model directory, .gguf file or hub id")
    draft: str = opt("", "draft directory, 'random' (untrained EAGLE3 draft) or 'target' (perfect drafter); "
                         "empty = plain decoding, one token per step")
    prompt: str = opt("", "the user message")
    prompt_file: str = opt("", "read the user message from this file")
    raw: bool = opt(False, "send the prompt as is, without the chat template")
    seed: int = opt(0, "seed of the sampling generator")
    json: bool = opt(False, "print JSON: tokens, text, steps, accepted length per step, tokens/s")


def _prompt_text(args: GenerateArgs) -> str:
    """The user message, checked before anything loads: exactly one non-empty source."""
    if args.prompt and args.prompt_file:
        raise ValueError("give exactly one of --prompt and --prompt-file, not both")
    if args.prompt_file:
        path = Path(args.prompt_file)
        if not path.is_file():
            raise FileNotFoundError(f"prompt file not found: {path}")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"prompt file {path} is not UTF-8 text ({err})") from err
        if not text.strip():
            raise ValueError(f"prompt file {path} is empty: write the user message into it")
        return text
    if not args.prompt.strip():
        raise ValueError(f"the prompt is empty (--prompt {args.prompt!r}): give exactly one of --prompt and "
                         "--prompt-file with the user message")
    return args.prompt


def generate_cmd(args: GenerateArgs, dcfg: DecodeConfig, tree: TreeConfig, rt: Runtime) -> int:
    text = _prompt_text(args)
    check_draft_spec(args.draft, args.model, rt.trust_remote_code)  # a draft for another target fails before loading
    device, dtype = rt.setup()
    target = load_target(args.model, device, dtype, rt.trust_remote_code)
    drafter, info = load_drafter(args.draft, target, args.seed)
    ids = encode_chat(target.tokenizer, [("user", text)], raw=args.raw)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    g = generate(TargetRunner.from_target(target), ids, dcfg, drafter, tree,
                 stop_tokens(target.model, target.tokenizer), gen)
    out_text = target.tokenizer.decode(g.tokens, skip_special_tokens=True)
    if args.json:
        print_json({"text": out_text, **g.to_json(), "draft": info, "tree": tree.__dict__ if drafter else None,
                    "decode": dcfg.__dict__})
        return 0
    print(out_text)
    tau = f", tau {g.tau:.2f}" if drafter is not None else ""
    print(f"[{len(g.tokens)} tokens in {g.steps} steps{tau}, {g.tokens_per_s:.1f} tokens/s, stop: {g.stop}]",
          file=sys.stderr)
    return 0


def vllm_bench_cmd(cfg: BenchConfig, vcfg: VllmBenchConfig, rt: Runtime, draft_cfg) -> int:
    """``elsi bench --engine vllm``: every check that needs no model comes first (``draft_cfg``: the
    draft's ``DraftConfig``, already checked against the model by ``check_draft_spec``)."""
    from elsi.engines import check_for_engine
    from elsi.engines.vllm import (agreement_rows, check_vllm_eagle3, engine_rows, require_float32, run_vllm_bench,
                                   vllm_python, write_results)

    python = vllm_python()
    if cfg.draft in ("random", "target"):
        raise ValueError(f"--engine vllm serves a draft directory, not --draft {cfg.draft}")
    if not cfg.plain and not cfg.draft:
        raise ValueError("elsi bench --engine vllm --no-plain times nothing without a --draft")
    if draft_cfg is not None:
        check_for_engine(draft_cfg.layer_ids, draft_cfg.target_num_layers, "vllm")
        extra = sorted(p.name for p in Path(cfg.draft).glob("*.safetensors") if p.name != "model.safetensors")
        if extra:
            raise ValueError(f"--draft {cfg.draft} holds {extra} besides model.safetensors: vLLM loads every "
                             "*.safetensors of a draft directory; move them out")
    device, dtype = rt.setup()
    require_float32(dtype, "--engine vllm")
    target = load_target(cfg.model, device, dtype, rt.trust_remote_code)
    if cfg.draft:
        check_vllm_eagle3(target.model, python)

    def show(what: str, done: int, total: int) -> None:
        print(f"\r{what}: [{done}/{total}]", end="\n" if done == total else "", file=sys.stderr, flush=True)

    progress = progress_path(cfg.out) if cfg.out else None  # finished configurations survive an interruption
    res = run_vllm_bench(target, cfg.draft or None, cfg, vcfg, threads=rt.threads, on_answer=show, progress=progress,
                         plain=cfg.plain)  # --no-plain: the speculative runs only (τ and its agreement)
    from elsi.collect.collector import package_versions

    res = {"command": "elsi bench " + " ".join(sys.argv[2:]) if len(sys.argv) > 1 else "elsi bench",
           "draft": cfg.draft or None, "vllm_python": str(python), "versions": package_versions(),
           "machine": machine_info(), **res}
    header, rows = engine_rows(res)
    print(md_table(header, rows))
    if res["tau_agreement"]:
        header, rows = agreement_rows(res)
        print(md_table(header, rows))
    bad = [c for c in res["states_check"] if not c["ok"]]
    for c in res["states_check"]:
        print(f"k={c['k']}: the states vLLM hands the draft at {c['vllm_layer_ids']} "
              + ("are" if c["ok"] else "are NOT") + f" Hugging Face's hidden_states at the draft's {c['layer_ids']} "
              f"(relative error {', '.join(f'{e:.1e}' for e in c['rel_err'])}; nearest neighbour "
              f"{', '.join(f'{e:.1e}' for e in c['rel_err_nearest_neighbour'])})", file=sys.stderr if bad else sys.stdout)
    if cfg.out:
        print(f"wrote {write_results(res, cfg.out)}")
        progress.unlink(missing_ok=True)
    if bad:
        print(f"error: vLLM feeds the draft other states than it was trained on (k = {[c['k'] for c in bad]}): its τ "
              "measures a misfed draft", file=sys.stderr)
        return 1
    return 0


def bench_cmd(cfg: BenchConfig, vcfg: VllmBenchConfig, rt: Runtime) -> int:
    draft_cfg = check_draft_spec(cfg.draft, cfg.model, rt.trust_remote_code)  # another target's draft fails here
    if vcfg.engine == "vllm":
        return vllm_bench_cmd(cfg, vcfg, rt, draft_cfg)
    if cfg.exact and vcfg.engine != "elsi":
        raise ValueError(f"--exact replays elsi's engine; it does not apply to --engine {vcfg.engine}")
    device, dtype = rt.setup()
    target = load_target(cfg.model, device, dtype, rt.trust_remote_code)
    drafter, info = load_drafter(cfg.draft, target, cfg.seed)
    if cfg.exact:
        return exact_bench(cfg, target, drafter.draft, info)
    if drafter is None:
        print("elsi bench: no --draft: timing plain decoding and transformers generate only", file=sys.stderr)

    def show(a, done: int, total: int, kept: bool) -> None:
        print(f"\r[{done}/{total}] {a.subtask} q{a.question_id}: {a.tokens_per_s:.1f} tok/s"
              f"{' (kept from an interrupted run)' if kept else ''}", end="",
              file=sys.stderr, flush=True)

    progress = progress_path(cfg.out) if cfg.out else None  # finished questions survive an interruption
    if progress is not None and progress.is_file():
        print(f"elsi bench: going on from {progress} (its questions are kept where the settings, the draft's "
              "weights and the kind of machine are the same)", file=sys.stderr)
    res = run_bench(target, drafter, cfg, on_answer=show, progress=progress)
    print(file=sys.stderr)
    from elsi.collect.collector import package_versions

    code = _report({"draft": info, "versions": package_versions(), **res}, summary_rows, cfg.out)
    if progress is not None:
        progress.unlink(missing_ok=True)
    return code


def _report(res: dict, rows, out: str) -> int:
    """Print a benchmark's table (``rows(res)`` -> header, rows) and write its JSON, with the command and the
    machine, to ``out`` (when given)."""
    res = {"command": "elsi bench " + " ".join(sys.argv[2:]) if len(sys.argv) > 1 else "elsi bench",
           "machine": machine_info(), **res}
    header, body = rows(res)
    print(md_table(header, body))
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res, indent=1))
        print(f"wrote {path}")
    return 0


def exact_bench(cfg: BenchConfig, target, draft, info: dict) -> int:
    """``elsi bench --exact``: τ at temperature 0 of every --tree-nodes from the target's cached answers."""
    from elsi.specbench.answers import greedy_answers
    from elsi.specbench.exact import exact_rows, exact_tau

    def show(what: str):
        return lambda done, total: print(f"\r{what} [{done}/{total}]", end="", file=sys.stderr, flush=True)

    answers = greedy_answers(target, cfg.subtasks, cfg.questions_per_subtask, cfg.max_new_tokens,
                             on_progress=show("target answers"))
    trees = [TreeConfig(n, cfg.depth, cfg.top_k) for n in cfg.tree_nodes]
    res = exact_tau(target, draft, answers, trees, cfg.max_new_tokens, on_progress=show("exact τ"))
    print(file=sys.stderr)
    from dataclasses import asdict

    return _report({"draft": info, "settings": asdict(cfg), **res}, exact_rows, cfg.out)


COMMANDS = [
    Command("generate", "answer one prompt with lossless tree speculative decoding (or plainly, without --draft)",
            (GenerateArgs, DecodeConfig, TreeConfig, Runtime), generate_cmd),
    Command("bench", "Spec-Bench: tau per subtask and speed-ups against plain decoding and transformers generate",
            (BenchConfig, VllmBenchConfig, Runtime), bench_cmd,
            writes=lambda cfg, vcfg, rt: [(cfg.out, "the benchmark results")] if cfg.out else []),
]
