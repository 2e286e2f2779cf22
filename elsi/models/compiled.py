"""``torch.compile`` for the long passes, on request: the target's forward over training data
(``--compile``), the draft's unrolled forward in training (``--train-compile``).

Inductor fuses the element-wise work of a forward (norms, rotary embeddings, activations, casts)
into a few vectorised loops. Measured on this project's 2-core AMX CPU, alone
(``bench/results/bf16_compile.json``, ``bf16_train_compile.json``), that buys little where the
matrix products dominate (+2.5 % for the bf16 feature pass, nothing for training), and compilation
costs tens of seconds per process, so both are off by default.

A compiled forward is numerically another program: fused loops keep intermediates in float32 where
eager rounds each bf16 op, so bf16 features move by about bf16's rounding (the bench reports each
one's agreement with the float32 forward). Decoding never compiles: its exactness is checked
against the eager target.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Callable

import torch


def compile_support(device: torch.device) -> tuple[bool, str]:
    """Whether Inductor can build kernels for ``device`` here, and why not."""
    if device.type == "cuda":
        ok = importlib.util.find_spec("triton") is not None
        return ok, "" if ok else "Triton is not installed"
    if device.type == "cpu":
        cxx = os.environ.get("CXX") or next((c for c in ("g++", "c++", "clang++") if shutil.which(c)), None)
        return cxx is not None, "" if cxx else "no C++ compiler (g++, c++ or clang++ on PATH, or $CXX)"
    return False, f"torch.compile is not used on {device.type}"


def compiled(fn: Callable, on: bool, device: torch.device, flag: str) -> Callable:
    """``fn`` (a module or a function) under ``torch.compile`` with dynamic shapes (conversations of other
    lengths reuse the kernels; the first call compiles) when ``on``, else ``fn`` itself. ``on`` where
    Inductor cannot build kernels is a clear error naming ``flag`` (the option that asked for it)."""
    if not on:
        return fn
    ok, why = compile_support(device)
    if not ok:
        raise ValueError(f"{flag}: torch.compile cannot build kernels here: {why}; leave {flag} out")
    return torch.compile(fn, dynamic=True)
