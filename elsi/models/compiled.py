"""The target's forward under ``torch.compile`` for the long passes over calibration and training data.

In eager mode a bf16 forward on a CPU spends most of its time outside the matrix products: the
norms, rotary embeddings and activations run as separate element-wise kernels over (tokens, d)
tensors, several of them in float32 and back (a profile of SmolLM2's feature pass: ``mul``, ``cat``,
``copy_``, ``add``, ``pow``, ``neg`` over 60 % of operator time, ``mm`` 16 %). Inductor fuses them
into a few vectorised loops, so the AMX products dominate again (``bench/bf16.py --stages features``).

A compiled forward is numerically a different program from the eager one: the fused loops keep
intermediate values in float32 where eager rounds each op to bf16, so bf16 features move by about
bf16's rounding (the bench reports the agreement of each with the float32 forward). Decoding never
compiles: its one-token steps are not where the time goes and its exactness is checked against the
eager target.

Compiling costs tens of seconds (once per process and shape family: shapes are dynamic), so ``auto``
compiles only passes long enough to repay it; ``on`` where Inductor cannot build kernels (no C++
compiler for a CPU, no Triton for CUDA) is an error; a compilation that fails at run time under
``auto`` warns and the pass goes on in eager mode.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import warnings

import torch
from torch import nn

MODES = ("auto", "on", "off")
AUTO_MIN_SAMPLES = 256  # auto: a pass over fewer conversations is not worth the compilation


def compile_support(device: torch.device) -> tuple[bool, str]:
    """Whether Inductor can build kernels for ``device`` here, and why not."""
    if device.type == "cuda":
        ok = importlib.util.find_spec("triton") is not None
        return ok, "" if ok else "Triton is not installed"
    if device.type == "cpu":
        cxx = os.environ.get("CXX") or next((c for c in ("g++", "c++", "clang++") if shutil.which(c)), None)
        return cxx is not None, "" if cxx else "no C++ compiler (g++, c++ or clang++ on PATH, or $CXX)"
    return False, f"torch.compile is not used on {device.type}"


def want_compile(mode: str, device: torch.device, samples: int) -> bool:
    """Resolve ``mode`` (auto, on, off) for a pass over ``samples`` conversations on ``device``."""
    if mode not in MODES:
        raise ValueError(f"--compile must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "off":
        return False
    ok, why = compile_support(device)
    if mode == "on" and not ok:
        raise ValueError(f"--compile on: torch.compile cannot build kernels here: {why}; pass --compile off")
    return ok and (mode == "on" or samples >= AUTO_MIN_SAMPLES)


class Forward:
    """``model(**inputs)``, compiled when asked: the first call compiles (with dynamic shapes, so that
    conversations of other lengths reuse the kernels). ``strict`` (``--compile on``): a compilation
    failure is raised; otherwise it warns once and every call runs in eager mode."""

    def __init__(self, model: nn.Module, compiled: bool, strict: bool = False) -> None:
        self.model = model
        self.strict = strict
        self.fn = torch.compile(model, dynamic=True) if compiled else None

    @property
    def compiled(self) -> bool:
        return self.fn is not None

    def __call__(self, **inputs):
        if self.fn is not None:
            try:
                return self.fn(**inputs)
            except Exception as e:  # Dynamo/Inductor failures have many types; eager below re-raises real errors
                if self.strict:
                    raise
                warnings.warn(f"torch.compile failed ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                              "the pass goes on uncompiled (--compile off skips the attempt)", stacklevel=2)
                self.fn = None
        return self.model(**inputs)
