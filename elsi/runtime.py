"""Where elsi runs: the device (resolved once, at the entry point), its bf16 speed, and torch.distributed.

Every stage reads these from here; none of them depends on a model or a stage.
"""

from __future__ import annotations

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
