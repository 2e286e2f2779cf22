"""Pieces shared by the sub-commands: the command table entry, runtime options, output."""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

import torch

from elsi.config import from_args, opt
from elsi.io import lock
from elsi.runtime import resolve_device

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Command:
    """One sub-command: its name, help, the config dataclasses that make its options, and its body."""

    name: str
    help: str
    configs: tuple[type, ...]
    run: Callable[..., int | None]  # called with one instance per config class, in order
    # Fields of a config class that get no option (the command sets them itself); a skipped field
    # keeps its default, a required one is given "" (the instance is then a template).
    skip: Mapping[type, tuple[str, ...]] = field(default_factory=dict)
    # What the command writes and later reads back or resumes, from its configs (called like ``run``):
    # (path, what it is) pairs, each locked (``elsi.io.lock``) before the command starts, so that
    # a second process writing the same output is refused before any model loads.
    writes: Callable[..., list[tuple[str | Path, str]]] | None = None


@dataclass(frozen=True)
class Runtime:
    """Where and how the target runs."""

    device: str = opt("auto", "cuda, cpu, or auto (CUDA when present; under torchrun: cuda:LOCAL_RANK)")
    device_map: str = opt("", "Hugging Face device map for a target larger than one device, e.g. auto")
    dtype: str = opt("auto", "weights dtype of the target; auto: bfloat16 for the bulk passes over calibration and "
                             "training data (analyze, train-draft) where the device multiplies bf16 natively "
                             "(AMX/AVX512-BF16 CPUs, CUDA >= sm80), float32 otherwise and for decoding and "
                             "evaluation, whose one-token steps bf16 slows down", choices=("auto", *DTYPES))
    threads: int = opt(0, "CPU threads for torch (0 = torch's default)")
    trust_remote_code: bool = opt(False, "allow model code from the hub (off unless asked)")

    def setup(self, bulk: bool = False) -> tuple[torch.device, torch.dtype]:
        """Resolve device and dtype once at the entry point; join torchrun's process group;
        quiet library chatter. ``bulk``: the command's target work is long-sequence forwards (where
        ``--dtype auto`` takes bf16 on fast hardware), not decoding."""
        if self.threads > 0:
            torch.set_num_threads(self.threads)
        device = resolve_device(self.device)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            import torch.distributed as dist

            if not dist.is_initialized():
                dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
            if device.type == "cuda" and self.device == "auto":
                device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
                torch.cuda.set_device(device)
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        return device, self.resolve_dtype(device, bulk)

    def resolve_dtype(self, device: torch.device, bulk: bool = False) -> torch.dtype:
        """The target's dtype on ``device`` (``bulk``: for long-sequence forwards, see ``setup``); an explicit
        bfloat16 where it is emulated warns."""
        if self.dtype in ("bfloat16", "auto"):
            from elsi.runtime import fast_bf16

            fast, why = fast_bf16(device)
            if self.dtype == "auto":
                return torch.bfloat16 if bulk and fast else torch.float32
            if not fast:
                warnings.warn(f"--dtype bfloat16: {why}; PyTorch emulates bf16 products there, several times slower "
                              "than float32 (use --dtype float32 unless memory is the limit)", stacklevel=3)
        return DTYPES[self.dtype]


def check_inputs(model: str | None = None, data: str | None = None) -> None:
    """Validate ``--model`` and ``--data`` before anything heavy loads: one clear error per bad value."""
    from elsi.data import data_path
    from elsi.models.load import check_model

    if model is not None:
        check_model(model)
    if data is not None:
        data_path(data)


def is_main_process() -> bool:
    """Rank 0 (or no torch.distributed): the process that prints and writes reports."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


@contextmanager
def writing(cmd: Command, configs: list) -> Iterator[None]:
    """Hold the lock of every output ``cmd`` writes (``Command.writes``) while the block runs; a busy one is
    ``BusyError``. Under torchrun rank 0 holds them for every rank (``RANK`` is set before any group exists)."""
    with ExitStack() as stack:
        if cmd.writes is not None and os.environ.get("RANK", "0") == "0":
            for path, what in cmd.writes(*configs):
                stack.enter_context(lock(path, what))
        yield


def build_configs(cmd: Command, ns: argparse.Namespace) -> list:
    out = []
    for cls in cmd.configs:
        skipped = cmd.skip.get(cls, ())
        blank = {f.name: "" for f in fields(cls) if f.name in skipped
                 and f.default is MISSING and f.default_factory is MISSING}
        out.append(from_args(cls, ns, _skip=skipped, **blank))
    return out


def print_json(obj) -> None:
    json.dump(obj, sys.stdout, indent=1)
    sys.stdout.write("\n")
