"""``elsi check-draft``: the layers each engine would feed a draft, and (with ``--model``) whether the draft was
trained on them (``elsi.engines.check``)."""

from __future__ import annotations

import json
import sys
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

from elsi.cli.common import Command, Runtime, print_json
from elsi.config import opt
from elsi.engines.rules import ENGINE_NAMES
from elsi.text import md_table


@dataclass(frozen=True)
class CheckDraftConfig:
    """The draft to check and, for the empirical check, the target and its answers."""

    draft: str = opt(help="draft directory: elsi's, SpecForge's, EAGLE's, speculators' (Eagle3Speculator) or "
                          "DFlash-style (dflash_config.target_layer_ids)")
    model: str = opt("", "the target (alias, HF directory, .gguf or hub id): runs the empirical check on its "
                         "answers; default: only the engines' readings, for the target the draft records")
    subtasks: str = opt("all", "Spec-Bench subtasks of the empirical check (comma-separated, or all)")
    questions_per_subtask: int = opt(2, "questions per subtask of the empirical check")
    max_new_tokens: int = opt(64, "tokens per answer of the target's cached greedy answers")
    margin: float = opt(0.02, "acceptance an engine's feeding may lose against the best candidate before it fails "
                              "(the loss must also be significant: paired McNemar z >= 2 on the same positions)")
    scan: bool = opt(False, "also try every layer set of the draft's size from 1..N-1 (one draft pass per set and "
                            "answer): finds the trained layers of a draft whose config lost them")
    json: bool = opt(False, "print JSON")
    out: str = opt("", "also write the JSON to this file")

    def __post_init__(self) -> None:
        if self.questions_per_subtask < 1:
            raise ValueError(f"questions_per_subtask must be >= 1, got {self.questions_per_subtask}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.margin < 1:
            raise ValueError(f"margin must be in [0, 1), got {self.margin}")


def _target_of(facts, model: str, trust_remote_code: bool) -> tuple[str, int, int, str]:
    """(model, N, hidden, HF model_type) to check against: --model, else the target the draft records."""
    from elsi.engines.check import model_facts
    from elsi.models.load import check_model

    if model:
        check_model(model)
        n, d, family = model_facts(model, trust_remote_code)
        if facts.target_model and facts.target_model != model:
            warnings.warn(f"the draft records its target as {facts.target_model!r}; checking against --model "
                          f"{model!r}", stacklevel=2)
        return model, n, d, family
    if facts.target_model:
        try:
            check_model(facts.target_model)
        except (ValueError, FileNotFoundError) as err:
            raise ValueError(f"{facts.path} records its target as {facts.target_model!r}, which is not at hand "
                             f"({err}): pass --model") from None
        n, d, family = model_facts(facts.target_model, trust_remote_code)
        return facts.target_model, n, d, family
    if facts.target_layers and facts.target_hidden:
        return "", facts.target_layers, facts.target_hidden, ""
    raise ValueError(f"{facts.path} does not record its target's number of layers: pass --model (the target)")


def check_draft(cfg: CheckDraftConfig, rt: Runtime) -> int:
    from elsi.engines.check import (
        candidate_feedings,
        check_fits,
        empirical_verdict,
        feeding_acceptance,
        load_for_check,
        read_draft,
        static_check,
        verdict,
    )

    facts = read_draft(cfg.draft)  # bad input fails here and in check_fits, before any model loads
    model, n, d, family = _target_of(facts, cfg.model, rt.trust_remote_code)
    check_fits(facts, n, d, model or "the recorded target")
    static = static_check(facts, n, d, family)
    m = static["m"]
    report = {"command": _command(cfg), "draft": str(facts.path), "format": facts.kind, "model": model or None,
              "num_layers": n,
              "hidden_size": d, "family": family or None, **static, "empirical": None,
              "settings": {k: v for k, v in asdict(cfg).items() if k not in ("json", "out")}}
    empirical = None
    if cfg.model and facts.kind != "dflash":
        from elsi.models import load_target
        from elsi.specbench.answers import greedy_answers

        device, dtype = rt.setup()
        target = load_target(cfg.model, device, dtype, rt.trust_remote_code)
        draft = load_for_check(facts, target, m)
        cands = candidate_feedings(facts, static, n, m, cfg.scan)
        subtasks = [s.strip() for s in cfg.subtasks.split(",") if s.strip()] or ["all"]
        print(f"empirical check: {len(cands)} feedings on the target's greedy answers to {cfg.questions_per_subtask} "
              f"question(s) per subtask (<= {cfg.max_new_tokens} tokens)", file=sys.stderr)
        answers = greedy_answers(target, subtasks, cfg.questions_per_subtask, cfg.max_new_tokens)
        acc = feeding_acceptance(target, draft, answers, list(cands))
        empirical = empirical_verdict(static, cands, acc, cfg.margin)
        empirical["answers"] = len(answers)
        report["empirical"] = empirical
    elif cfg.model:
        report["empirical_skipped"] = "elsi cannot run DFlash-style drafts: only the engines' readings are checked"
    result, reasons = verdict(static, empirical)
    report["verdict"], report["reasons"] = result, reasons
    if cfg.out:
        Path(cfg.out).write_text(json.dumps(report, indent=1) + "\n")
    if cfg.json:
        print_json(report)
    else:
        _print(report)
    return 0 if result == "pass" else 1


def _command(cfg: CheckDraftConfig) -> str:
    """The command line of these settings (the options that differ from their defaults)."""
    from dataclasses import fields

    parts = ["elsi check-draft"]
    for f in fields(cfg):
        v = getattr(cfg, f.name)
        if f.name in ("json", "out") or v == f.default:
            continue
        flag = "--" + f.name.replace("_", "-")
        parts.append(flag if v is True else f"--no-{flag[2:]}" if v is False else f"{flag} {v}")
    return " ".join(parts)


def _ids(v) -> str:
    return "-" if v is None else "[" + ", ".join("pre-norm h_N" if i is None else str(i) for i in v) + "]"


def _print(r: dict) -> None:
    rec = r["recorded"]
    print(f"draft {r['draft']} ({r['format']}), fc over {r['m']} target state(s); recorded layers: "
          f"{_ids(rec['ids']) + ' (' + rec['source'] + ')' if rec else 'none'}")
    print(f"target: {r['model'] or 'the recorded one'}, N = {r['num_layers']}, hidden {r['hidden_size']}"
          f"{', ' + r['family'] if r['family'] else ''}; ids are HF hidden_states indices (h_0 = embeddings)")
    emp = r["empirical"] or {}
    rows = []
    for e, row in r["engines"].items():
        a = (emp.get("engines") or {}).get(e, {}).get("acceptance")
        rows.append([ENGINE_NAMES[e], _ids(row["fed"]), row["source"] or "-", "yes" if row["loads"] else "NO",
                     "-" if a is None else f"{a:.3f}"])
    print(md_table(["engine", "feeds", "from", "loads", "acceptance"], rows))
    for f in r["flags"]:
        print(f"{f['level']}: {f['text']}")
    if emp:
        print(f"\nteacher-forced depth-1 acceptance on {emp['answers']} answer turns "
              f"({emp['feedings'][0]['scored']} positions); zero feed {emp['zero_feed']:.3f}:")
        rows = [[_ids(f["ids"]), ", ".join(f["labels"]), f"{f['acceptance']:.3f}"] for f in emp["feedings"][:12]]
        print(md_table(["feeding", "candidate", "acceptance"], rows))
        if len(emp["feedings"]) > 12:
            print(f"({len(emp['feedings']) - 12} more in --json)")
        close = f" (not told apart from: {', '.join(map(_ids, emp['close']))})" if emp["close"] else ""
        print(f"evidently trained for: {_ids(emp['evident']) if emp['evident'] else 'none of these feedings'}{close}")
    if r.get("empirical_skipped"):
        print(r["empirical_skipped"])
    print(f"verdict: {r['verdict'].upper()}")
    for why in r["reasons"]:
        print(f"  - {why}")


COMMANDS = [
    Command("check-draft", "which target layers each engine (vLLM, SGLang, SpecForge, speculators) would feed a draft, "
                           "and with --model whether it was trained on them", (CheckDraftConfig, Runtime), check_draft),
]
