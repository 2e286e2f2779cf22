"""``elsi export`` (a layer set or a draft, for vLLM, SGLang, SpecForge or speculators) and
``elsi upgrade-draft`` (rewrite a draft config written before the engine fix)."""

from __future__ import annotations

import json
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

from elsi.config import opt
from elsi.cli.common import Command
from elsi.decode.drafters import check_draft_spec
from elsi.draft.compat import upgrade_draft
from elsi.engines import FORMATS, check_for_engine, export_fragment
from elsi.engines.configs import DEFAULT_M
from elsi.models import resolve_model
from elsi.select import chosen_layers
from elsi.stats.analysis import parse_layers

EXPORT_FORMATS = (*FORMATS, "speculators")


@dataclass(frozen=True)
class ExportArgs:
    """A layer set (or a trained draft) and the engine to write it for."""

    layers: str = opt("", "layer ids (elsi numbering, e.g. 2,15,27), or 'chosen' with --run; "
                          "default: the layers of --draft")
    draft: str = opt("", "a trained elsi draft directory: its layers (any format), or the whole "
                         "checkpoint (--format speculators)")
    model: str = opt("", "the target (its N checks the ids; --format speculators: the verifier); default: the model "
                         "--run or --draft records (needed with --layers IDS alone); one that contradicts the "
                         "record is an error")
    format: str = opt("vllm", "engine whose numbering or checkpoint format to write (dflash: "
                              "dflash_config.target_layer_ids of DFlash-style drafts)", choices=EXPORT_FORMATS)
    run: str = opt("", "run directory whose chosen selection --layers chosen refers to")
    m: int = opt(0, "--layers chosen: the size of the run's selection to export (0 = the format's default: 5 for "
                    "dflash, the chosen selection's otherwise); another size than the chosen one takes the same "
                    "method's selection of that size from selections.json")
    out: str = opt("", "write the fragment to this file (default: print); --format speculators: the "
                       "checkpoint directory (required)")

    def __post_init__(self) -> None:
        if self.format == "speculators" and not (self.draft and self.out):
            raise ValueError("--format speculators writes a checkpoint: give --draft DIR and --out OUT_DIR")
        if self.layers and self.draft:
            raise ValueError("give --layers or --draft, not both")
        if not (self.layers or self.draft):
            raise ValueError("nothing to export: give --layers IDS (or 'chosen' with --run) or --draft DIR")
        if self.m < 0:
            raise ValueError(f"m must be >= 0, got {self.m}")


@dataclass(frozen=True)
class ExportTarget:
    """The model an export is checked against, and where that choice came from."""

    model: str  # the model's spec ("" where only the draft's recorded shape is known)
    num_layers: int
    hidden_size: int
    family: str  # HF model_type ("" = unknown)
    source: str  # "--model", "the run", "the draft"


def _contradiction(model: str, shape: tuple[int, int], rec_model: str, rec_shape: tuple[int, int], what: str) -> None:
    """ValueError where --model's (N, hidden) differs from what ``what`` records; a warning where only the names do."""
    if shape != rec_shape:
        raise ValueError(f"--model {model} (N = {shape[0]}, hidden {shape[1]}) contradicts {what}, which records "
                         f"{rec_model or 'a target'} (N = {rec_shape[0]}, hidden {rec_shape[1]}): drop --model, or "
                         "export from a run or draft of that model")
    if rec_model and rec_model != model:
        warnings.warn(f"--model {model} is not the model {what} records ({rec_model}); both have N = {shape[0]} and "
                      f"hidden size {shape[1]}: the export names {model}", stacklevel=3)


def _recorded_shape_default(facts, trust_remote_code: bool) -> ExportTarget:
    """A speculators export of a draft that records its target's shape but not its name (a draft saved without
    training.json): the default model only where its N, hidden size and vocabulary are the draft's, with a warning."""
    from elsi.engines.check import model_facts
    from elsi.models import DEFAULT_MODEL

    n, d, fam = model_facts(DEFAULT_MODEL, trust_remote_code)
    own = facts.config["elsi"]["draft_config"]
    from transformers import AutoConfig

    vocab = int(AutoConfig.from_pretrained(resolve_model(DEFAULT_MODEL)).get_text_config().vocab_size)
    if (n, d, vocab) != (facts.target_layers, facts.target_hidden, int(own["vocab_size"])):
        raise ValueError(f"{facts.path} records no target model (no training.json), only N = {facts.target_layers}, "
                         f"hidden {facts.target_hidden}: pass --model, the verifier the speculators checkpoint names")
    warnings.warn(f"{facts.path} records no target model (no training.json); its N = {n}, hidden size {d} and "
                  f"vocabulary {vocab} are {DEFAULT_MODEL}'s, the verifier named: pass --model to name another",
                  stacklevel=3)
    return ExportTarget(DEFAULT_MODEL, n, d, fam, f"the draft's recorded shape ({facts.path})")


def export_target(args: ExportArgs, trust_remote_code: bool = False) -> ExportTarget:
    """The target an export is for, from the record of --run or --draft, never a default: --model alone where
    nothing records one; a --model whose N or hidden size contradicts the record is an error naming both."""
    from elsi.collect.store import MANIFEST
    from elsi.engines.check import model_facts, read_draft
    from elsi.io import read_json
    from elsi.models.load import check_model

    given = None
    if args.model:
        check_model(args.model)
        given = model_facts(args.model, trust_remote_code)
    if args.draft:
        facts = read_draft(args.draft)
        rec = facts.target_model
        if rec and not given:
            n, d, fam = model_facts(rec, trust_remote_code)
            return ExportTarget(rec, n, d, fam, f"the draft ({facts.path})")
        if given:
            if facts.target_layers and facts.target_hidden:
                _contradiction(args.model, given[:2], rec, (facts.target_layers, facts.target_hidden),
                               f"the draft {facts.path}")
            return ExportTarget(args.model, *given, "--model")
        if facts.target_layers and facts.target_hidden:
            if args.format == "speculators":  # the checkpoint names its verifier
                return _recorded_shape_default(facts, trust_remote_code)
            return ExportTarget("", facts.target_layers, facts.target_hidden, "", f"the draft ({facts.path})")
        raise ValueError(f"{facts.path} records no target: pass --model")
    if args.run:
        path = Path(args.run) / MANIFEST
        if not path.is_file():
            raise FileNotFoundError(f"--run {args.run}: no {MANIFEST} (not a run directory of `elsi analyze`)")
        man = read_json(path)
        rec, shape = man.get("model", ""), (int(man["num_layers"]), int(man["hidden_size"]))
        if given:
            _contradiction(args.model, given[:2], rec, shape, f"the run {args.run}")
            return ExportTarget(args.model, *given, "--model")
        try:
            fam = model_facts(rec, trust_remote_code)[2]
        except (ValueError, OSError):  # the run's model is not at hand here: its recorded shape is enough
            fam = ""
        return ExportTarget(rec, *shape, fam, f"the run ({args.run})")
    if given:
        return ExportTarget(args.model, *given, "--model")
    raise ValueError("--layers IDS alone names no target: pass --model (its N checks the ids and the note names it), "
                     "or export from --run or --draft")


def export(args: ExportArgs) -> int:
    tgt = export_target(args)
    n = tgt.num_layers
    if args.draft:
        from elsi.draft.model import read_draft_config

        layers = read_draft_config(args.draft, n, tgt.hidden_size).layer_ids
        if tgt.model:
            check_draft_spec(args.draft, tgt.model)  # its recorded N and hidden size against the model's
    elif args.layers == "chosen":
        if not args.run:
            raise ValueError("--layers chosen needs --run RUN_DIR")
        layers = chosen_layers(args.run, args.m or DEFAULT_M.get(args.format, 0))
    else:
        layers = parse_layers(args.layers, n)
    if args.format == "speculators":
        from elsi.engines.speculators import export_speculators

        check_for_engine(layers, n, "speculators")  # vLLM reads the checkpoint's top-level ids, fc for 3 states
        out = export_speculators(args.draft, args.out, resolve_model(tgt.model))
        print(f"wrote {out}/config.json, model.safetensors (speculators format; "
              f"eagle_aux_hidden_state_layer_ids {list(layers)}, vLLM numbering; verifier {tgt.model} from "
              f"{tgt.source})", file=sys.stderr)
        return 0
    name = tgt.model or f"the target {tgt.source} records"
    frag = export_fragment(tuple(layers), n, args.format, name, tgt.family)
    text = json.dumps(frag, indent=1) + "\n"
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    print(f"note: {frag['_elsi_note']} (the target from {tgt.source})", file=sys.stderr)
    return 0


@dataclass(frozen=True)
class UpgradeArgs:
    """The draft to rewrite in place."""

    draft: str = opt(help="an elsi draft directory written before SGLang/SpecForge ids were shifted by one")


def upgrade(args: UpgradeArgs) -> int:
    changed = upgrade_draft(args.draft)
    if changed:
        print(f"rewrote {args.draft}: {', '.join(changed)}", file=sys.stderr)
    else:
        print(f"{args.draft} is already current", file=sys.stderr)
    return 0


COMMANDS = [
    Command("export", "write a layer set's config fragment for vLLM, SGLang, SpecForge or DFlash-style drafts, or a "
                      "draft as a speculators checkpoint", (ExportArgs,), export),
    Command("upgrade-draft", "rewrite an older elsi draft's config.json (and fc_norm tensors) for SGLang and SpecForge",
            (UpgradeArgs,), upgrade),
]
