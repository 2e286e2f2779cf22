"""Training checkpoints, to resume a draft's training where it stopped.

``resume/checkpoint.safetensors`` (in a subdirectory: vLLM and SGLang load every ``*.safetensors`` file at
the top of a draft directory) holds the draft's and the optimizer's tensors, with the step, data position,
curves, optimizer hyper-parameters and settings as JSON in the header, and the file's checksum
(``elsi.io.save_tensors``); no pickle. ``Interrupt`` turns Ctrl-C into a checkpoint of a
finished step. Older checkpoints: ``elsi.draft.compat``.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import torch

from elsi.draft.model import Eagle3Draft
from elsi.io import RunError, load_tensors, save_tensors

CHECKPOINT = "resume/checkpoint.safetensors"  # under the draft directory
CHECKPOINT_FORMAT = 1


def checkpoint_tensors(draft: Eagle3Draft, opt_: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """The draft's and the optimizer's state as flat tensors (``draft.NAME``, ``optimizer.PARAM.KEY``) and
    the optimizer's JSON part (param groups, non-tensor state values)."""
    tensors = {f"draft.{k}": v.detach() for k, v in draft.state_dict().items()}
    sd = opt_.state_dict()
    extra: dict[str, dict] = {}
    for pid, st in sd["state"].items():
        for key, val in st.items():
            if isinstance(val, torch.Tensor):
                tensors[f"optimizer.{pid}.{key}"] = val.detach()
            else:
                extra.setdefault(str(pid), {})[key] = val
    groups = [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in sd["param_groups"]]
    return tensors, {"param_groups": groups, "state_extra": extra}


def restore_checkpoint(tensors: dict[str, torch.Tensor], optim_json: dict, draft: Eagle3Draft,
                       opt_: torch.optim.Optimizer) -> None:
    """Load ``checkpoint_tensors``' output back into ``draft`` and ``opt_`` (same values, bit for bit)."""
    draft.load_state_dict({k[len("draft."):]: v for k, v in tensors.items() if k.startswith("draft.")}, strict=True)
    state: dict[int, dict] = {}
    for name, val in tensors.items():
        if name.startswith("optimizer."):
            _, pid, key = name.split(".", 2)
            state.setdefault(int(pid), {})[key] = val
    for pid, extra in optim_json.get("state_extra", {}).items():
        state.setdefault(int(pid), {}).update(extra)
    groups = [{k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in optim_json["param_groups"]]
    opt_.load_state_dict({"state": state, "param_groups": groups})


def save_checkpoint(path: Path, draft: Eagle3Draft, opt_: torch.optim.Optimizer, settings: dict, state: dict) -> None:
    """Write ``resume/checkpoint.safetensors`` atomically (tensors + JSON header + checksum)."""
    tensors, optim_json = checkpoint_tensors(draft, opt_)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_tensors(path, tensors, {"format": CHECKPOINT_FORMAT, "settings": settings, "state": state,
                                 "optimizer": optim_json})


def load_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """Tensors and JSON header of a checkpoint, checked against its checksum; RunError (a ValueError) naming
    the file otherwise."""
    fix = "rerun the same command with --restart to start this draft over (or choose another --out)"
    tensors, meta = load_tensors(path, fix=fix)
    if not isinstance(meta, dict) or meta.get("format") != CHECKPOINT_FORMAT or "state" not in meta:
        raise RunError(f"{path} is not an elsi training checkpoint of format {CHECKPOINT_FORMAT}; {fix}")
    return tensors, meta


class Interrupt:
    """Turns SIGINT (Ctrl-C) or SIGTERM (``kill``; a job started in the background ignores SIGINT) during the
    training loop into a flag read at the end of each step, so that the checkpoint written on the way out is
    that of a finished step. A second signal interrupts at once."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.requested = False
        self._old: dict = {}

    def _handler(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> Interrupt:
        if threading.current_thread() is threading.main_thread():
            self._old = {sig: signal.signal(sig, self._handler) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


__all__ = ["CHECKPOINT", "CHECKPOINT_FORMAT", "Interrupt", "checkpoint_tensors", "load_checkpoint", "restore_checkpoint",
           "save_checkpoint"]
