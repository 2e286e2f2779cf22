"""Collection and draft training across 2 processes (gloo, CPU) equal the single-process runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from elsi.collect.store import GRAMS, MANIFEST
from elsi.io import load_tensors


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


DRAFT_SAMPLES = 14  # 11 training conversations: with batch 2 each epoch ends on a batch of 1 (rank 1 idles)


def _draft_target():
    from conftest import make_tiny_target

    t = make_tiny_target(num_layers=6, hidden=32, seed=1)
    with torch.no_grad():  # a peaked (learnable) next-token distribution, as in test_draft_train
        t.model.lm_head.weight.mul_(60.0)
    return t


def _draft_cfg(out: Path, **kw):
    from elsi.draft.train import TrainConfig

    # float32 products: the comparison is of DDP's arithmetic (equal up to summation order, ~1e-7); in bf16 the
    # rows each rank multiplies round differently from the single process's batch, and AdamW amplifies that
    base = dict(layers="1,3,6", out=str(out), draft_vocab=150, ttt=2, lr=1e-2, warmup_steps=3, epochs=100.0,
                max_steps=8, time_budget="0", batch_size=2, heldout=0.2, eval_every="0",
                checkpoint_every="0.000001s", train_dtype="float32")
    base.update(kw)
    return TrainConfig(**base)


def _draft_features_cfg(data: str, features_dir: Path):
    from elsi.draft.features import FeatureConfig

    return FeatureConfig(model="tiny", data=data, samples=DRAFT_SAMPLES, max_tokens=64, features_dir=str(features_dir))


def _train_worker(rank: int, world: int, init_file: str, data: str, tmp: str) -> None:
    """Rank r: the batch-size error, then features (rank 0 builds), then training interrupted at step 3 and resumed."""
    sys.path.insert(0, str(Path(__file__).parent))
    from elsi.data import load_dataset
    from elsi.draft.features import build_features
    from elsi.draft.train import train_draft

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    tmp_ = Path(tmp)
    res: dict = {"losses": {}}
    try:
        target = _draft_target()
        cpu = torch.device("cpu")
        store = build_features(target, load_dataset(data), _draft_features_cfg(data, tmp_ / "feat"), (1, 3, 6))
        try:
            train_draft(target, store, _draft_cfg(tmp_ / "small", batch_size=1), seed=3, device=cpu)
        except ValueError as e:
            res["error"] = str(e)

        class Stop(Exception):
            pass

        def record(p):
            if p.note:
                res["note"] = p.note
                return
            res["losses"][p.step] = p.step_loss
            if p.step == 3 and "note" not in res:
                raise Stop  # on both ranks at the same step, after the step's checkpoint

        cfg = _draft_cfg(tmp_ / "ddp")
        try:
            train_draft(target, store, cfg, seed=3, device=cpu, samples=DRAFT_SAMPLES, on_progress=record)
        except Stop:
            pass
        rec = train_draft(target, store, cfg, seed=3, device=cpu, samples=DRAFT_SAMPLES, on_progress=record)
        res["steps"], res["tokens"] = rec["steps"], rec["train_tokens_seen"]
        (tmp_ / f"rank{rank}.json").write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()


def test_two_process_draft_training_equals_single_process(tiny_data, tmp_path):
    from safetensors.torch import load_file

    from elsi.draft.cache import FeatureStore
    from elsi.draft.train import train_draft

    torch.set_num_threads(1)
    mp.spawn(_train_worker, args=(2, str(tmp_path / "init"), str(tiny_data), str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for res in ranks:
        assert "batch_size 1 is smaller than the world size 2" in res["error"]
        assert "resumed" in res["note"] and "step 3" in res["note"]

    ref_losses: dict[int, float] = {}
    store = FeatureStore(tmp_path / "feat")  # the cache rank 0 built
    rec = train_draft(_draft_target(), store, _draft_cfg(tmp_path / "single"), seed=3, device=torch.device("cpu"),
                      samples=DRAFT_SAMPLES, on_progress=lambda p: ref_losses.setdefault(p.step, p.step_loss))
    want = [ref_losses[k] for k in range(1, 9)]
    assert want[-1] < 0.95 * want[0]  # the loss moves
    for res in ranks:  # every rank logs the global batch's loss
        got = [res["losses"][str(k)] for k in range(1, 9)]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=0)
        assert (res["steps"], res["tokens"]) == (8, rec["train_tokens_seen"])
    got_w = load_file(str(tmp_path / "ddp" / "model.safetensors"))
    ref_w = load_file(str(tmp_path / "single" / "model.safetensors"))
    assert got_w.keys() == ref_w.keys()
    for k in ref_w:
        torch.testing.assert_close(got_w[k], ref_w[k], rtol=1e-4, atol=1e-5, msg=k)
    ddp_rec = json.loads((tmp_path / "ddp" / "training.json").read_text())
    assert ddp_rec["heldout"]["match"] == pytest.approx(rec["heldout"]["match"], abs=0.02)
