"""Collection across 2 processes (gloo, CPU) equals the single-process run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from elsi.collect.store import GRAMS, MANIFEST, load_tensors


def _worker(rank: int, world: int, init_file: str, data: str, run_dir: str) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from conftest import make_tiny_target

    from elsi.collect.collector import CollectConfig, collect
    from elsi.data import load_dataset

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        cfg = CollectConfig(model="tiny", data=data, samples=6, max_tokens=128, block=8, rho=0.3)
        collect(make_tiny_target(), load_dataset(data), cfg, Path(run_dir))
    finally:
        dist.destroy_process_group()


def test_two_process_collection_equals_single_process(tiny_run, tiny_data, tmp_path):
    run_dir = tmp_path / "ddp"
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(tiny_data), str(run_dir)), nprocs=2, join=True)
    got_man = json.loads((run_dir / MANIFEST).read_text())
    ref_man = json.loads((tiny_run / MANIFEST).read_text())
    assert got_man["samples"] == ref_man["samples"]  # same samples, same order
    assert got_man["counts"] == ref_man["counts"]
    got, _ = load_tensors(run_dir / GRAMS)
    ref, _ = load_tensors(tiny_run / GRAMS)
    assert got.keys() == ref.keys()
    for k in ref:
        if k.startswith("block_sample"):
            assert torch.equal(got[k], ref[k]), k
        else:
            assert torch.allclose(got[k], ref[k], atol=1e-6, rtol=1e-9), k
    assert not (run_dir / "shards").exists()
