"""``elsi export`` (a layer set or a draft, for vLLM, SGLang, SpecForge or speculators) and
``elsi upgrade-draft`` (rewrite a draft config written before the engine fix)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from elsi.config import opt
from elsi.cli.common import Command
from elsi.decode.drafters import check_draft_spec
from elsi.engines import FORMATS, check_for_engine, export_fragment
from elsi.engines.configs import upgrade_draft
from elsi.models import DEFAULT_MODEL, model_num_layers, resolve_model
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
    model: str = opt(DEFAULT_MODEL, "the target (its N checks the ids; --format speculators: the verifier)")
    format: str = opt("vllm", "engine whose numbering or checkpoint format to write", choices=EXPORT_FORMATS)
    run: str = opt("", "run directory whose chosen selection --layers chosen refers to")
    out: str = opt("", "write the fragment to this file (default: print); --format speculators: the "
                       "checkpoint directory (required)")

    def __post_init__(self) -> None:
        if self.format == "speculators" and not (self.draft and self.out):
            raise ValueError("--format speculators writes a checkpoint: give --draft DIR and --out OUT_DIR")
        if self.layers and self.draft:
            raise ValueError("give --layers or --draft, not both")
        if not (self.layers or self.draft):
            raise ValueError("nothing to export: give --layers IDS (or 'chosen' with --run) or --draft DIR")


def export(args: ExportArgs) -> int:
    n = model_num_layers(args.model)
    if args.draft:
        layers = check_draft_spec(args.draft, args.model).layer_ids
    elif args.layers == "chosen":
        if not args.run:
            raise ValueError("--layers chosen needs --run RUN_DIR")
        layers = chosen_layers(args.run)
    else:
        layers = parse_layers(args.layers, n)
    if args.format == "speculators":
        from elsi.engines.speculators import export_speculators

        check_for_engine(layers, n, "vllm")  # speculators checkpoints are vLLM's format
        out = export_speculators(args.draft, args.out, resolve_model(args.model))
        print(f"wrote {out}/config.json, model.safetensors (speculators format; "
              f"eagle_aux_hidden_state_layer_ids {list(layers)}, vLLM numbering)", file=sys.stderr)
        return 0
    frag = export_fragment(tuple(layers), n, args.format, args.model)
    text = json.dumps(frag, indent=1) + "\n"
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    print(f"note: {frag['_elsi_note']}", file=sys.stderr)
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
    Command("export", "write a layer set's config fragment for vLLM, SGLang or SpecForge, or a draft as a "
                      "speculators checkpoint", (ExportArgs,), export),
    Command("upgrade-draft", "rewrite an older elsi draft's config.json (and fc_norm tensors) for SGLang and SpecForge",
            (UpgradeArgs,), upgrade),
]
