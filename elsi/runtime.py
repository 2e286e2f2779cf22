"""Where elsi runs: the device (resolved once, at the entry point), its bf16 speed, the machine as records name it
(``machine_info``: whose timings compare, ``timing_key``), and torch.distributed.

Every stage reads these from here; none of them depends on a model or a stage.
"""

from __future__ import annotations

import json
import os
import platform

import torch


def resolve_device(device: str | None) -> torch.device:
    """``None``/"auto" -> CUDA when present, else CPU. Resolved once at the entry point."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def fast_bf16(device: torch.device) -> tuple[bool, str]:
    """Whether ``device`` multiplies bfloat16 matrices natively (and so faster than float32), and why.

    CUDA: compute capability >= 8 (Ampere and later). CPU: AMX tiles (``amx_bf16``) or AVX512-BF16;
    without them PyTorch emulates bf16 products in float32 arithmetic, several times slower.
    """
    if device.type == "cuda":
        ok = torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
        return ok, f"CUDA device {torch.cuda.get_device_name(device) if ok else device}: native bf16 = {ok}"
    if device.type == "cpu":
        amx = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
        avx = bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)())
        return amx or avx, f"CPU: AMX tiles {amx}, AVX512-BF16 {avx}"
    return False, f"{device.type}: bf16 speed unknown"


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``; elsewhere what ``platform`` knows)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict:
    """The machine a record was made on (a benchmark, a draft's training), with its load average (1, 5, 15 minutes)
    when the record is made: other jobs on the cores slow every timed figure. ``cpu_bf16``: whether the CPU
    multiplies bf16 natively (AMX or AVX512-BF16; without, bf16 is emulated and slower than float32), the figures'
    largest lever."""
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu": cpu_name(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_bf16": fast_bf16(torch.device("cpu"))[1], "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


TIMING_FIELDS = ("cpu", "cpu_capability", "cpu_count", "torch_threads", "cuda")


def timing_key(machine: dict | None) -> str:
    """What makes two records' timings comparable: ``machine_info``'s hardware and thread count, as one string
    (records made before a field existed have None there, alike; the load average is not part of it)."""
    m = machine or {}
    return json.dumps({k: m.get(k) for k in TIMING_FIELDS}, sort_keys=True)


def machine_label(machine: dict | None) -> str:
    """A machine in words: its GPU or CPU (or processor, in records older than the CPU's name) and threads."""
    m = machine or {}
    return f"{m.get('cuda') or m.get('cpu') or m.get('processor') or 'unknown'}, {m.get('torch_threads')} threads"


def dist_info() -> tuple[int, int]:
    """(rank, world size) under torch.distributed (torchrun), else (0, 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def barrier() -> None:
    """Wait for every process of torch.distributed's group; nothing without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
