"""Collection: filter and block edge cases, Grams against a naive computation, resume."""

from __future__ import annotations

import json

import pytest
import torch

from elsi.collect.collector import CollectConfig, collect
from elsi.collect.grams import blocks_of, filter_positions, kept_count, normalize_blocks, token_entropy, unpack
from elsi.collect.store import GRAMS, MANIFEST
from elsi.data import load_dataset, tokenize
from elsi.io import RunError, load_tensors
from elsi.stats.analysis import GramRun


def test_token_entropy_matches_definition():
    logits = torch.randn(7, 50)
    p = torch.softmax(logits.double(), -1)
    ref = -(p * p.log()).sum(-1)
    assert torch.allclose(token_entropy(logits, chunk=3).double(), ref, atol=1e-5)


def test_filter_drops_lowest_entropy_ties_earlier_first():
    #                 pos0  1    2    3    4    5    6
    ent = torch.tensor([0.0, 0.5, 0.2, 0.2, 0.9, 0.2, 0.7])
    # n = 6 usable, rho = 0.5 -> drop 3: the three 0.2's (positions 2, 3, 5)
    assert filter_positions(ent, 0.5).tolist() == [1, 4, 6]
    # rho = 0.34 -> drop floor(2.04) = 2: positions 2 and 3 (ties: earlier first)
    assert filter_positions(ent, 0.34).tolist() == [1, 4, 5, 6]
    assert filter_positions(ent, 0.0).tolist() == [1, 2, 3, 4, 5, 6]  # position 0 never used
    assert filter_positions(torch.tensor([1.0]), 0.3).tolist() == []
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="rho"):
            filter_positions(ent, bad)


def test_blocks_drop_remainder_and_count():
    pos = torch.arange(1, 12)  # 11 kept positions
    assert blocks_of(pos, 4).tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert blocks_of(pos[:3], 4).shape == (0, 4)
    assert kept_count(11, 0.3) == 10 - 3
    assert kept_count(1, 0.3) == 0


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="rho must be in"):
        CollectConfig(rho=1.5)
    with pytest.raises(ValueError, match="samples must be"):
        CollectConfig(samples=0)
    with pytest.raises(ValueError, match="normalize"):
        CollectConfig(normalize="zscore")


def test_grams_equal_naive_computation(tiny_target, tiny_run):
    run = GramRun(tiny_run)
    man = json.loads((tiny_run / MANIFEST).read_text())
    first = man["samples"][0]
    ds = load_dataset(man["settings"]["data"])
    ids = tokenize(ds.samples[first["index"]], tiny_target.tokenizer, man["settings"]["max_tokens"])
    assert len(ids) == first["tokens"]
    with torch.no_grad():
        out = tiny_target.model(torch.tensor([ids]), output_hidden_states=True)
    p = torch.softmax(out.logits[0].double(), -1)
    ent = -(p * p.log()).sum(-1)  # (T,)
    n = len(ids) - 1
    drop = int(0.3 * n)
    order = sorted(range(1, len(ids)), key=lambda t: (float(ent[t]), t))
    kept = sorted(set(range(1, len(ids))) - set(order[:drop]))
    b = run.block
    blocks = [kept[i : i + b] for i in range(0, len(kept) - b + 1, b)]
    assert len(blocks) == first["blocks"]
    g = unpack(run.packed[run.block_sample == 0].double(), b)  # (nb, N+1, B, B)
    for bi, blk in enumerate(blocks):
        for layer in (0, 3, 8):
            z = out.hidden_states[layer][0, blk].double()
            z = normalize_blocks(z[None], "center-l2")[0]
            assert torch.allclose(g[bi, layer], z @ z.T, atol=1e-5)


class Kill(Exception):
    """Stands for a SIGKILL: nothing after it runs (no flush)."""


def _cfg(data, **kw):
    return CollectConfig(model="tiny", data=str(data), samples=6, max_tokens=128, block=8, rho=0.3, **kw)


def test_resume_after_ctrl_c_and_kill_gives_identical_run(tiny_target, tiny_data, tiny_run, tmp_path):
    ds = load_dataset(str(tiny_data))
    run_dir = tmp_path / "r"
    calls = []

    def ctrl_c_after_3(p):
        calls.append(p.samples_done)
        if p.samples_done == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        collect(tiny_target, ds, _cfg(tiny_data), run_dir, on_progress=ctrl_c_after_3, flush_every=100)
    man = json.loads((run_dir / MANIFEST).read_text())
    assert man["status"] == "collecting"
    assert len(list((run_dir / "shards").glob("rank-0/shard-*.safetensors"))) == 1  # Ctrl-C flushed 3 samples

    def kill_at_4(p):
        if p.samples_done == 4:
            raise Kill

    with pytest.raises(Kill):  # sample 4 is still pending (flush_every=2): lost, like a SIGKILL
        collect(tiny_target, ds, _cfg(tiny_data), run_dir, on_progress=kill_at_4, flush_every=2)
    forwards = []
    orig = tiny_target.model.forward

    def counting_forward(*a, **k):
        forwards.append(1)
        return orig(*a, **k)

    tiny_target.model.forward = counting_forward
    try:
        man = collect(tiny_target, ds, _cfg(tiny_data), run_dir)
    finally:
        tiny_target.model.forward = orig
    assert len(forwards) == 3  # samples 4 (lost), 5 and 6; the 3 finished ones are not recomputed
    ref = json.loads((tiny_run / MANIFEST).read_text())
    assert man["samples"] == ref["samples"]  # same samples, same order, none twice
    assert man["counts"] == ref["counts"]
    got, _ = load_tensors(run_dir / GRAMS)
    want, _ = load_tensors(tiny_run / GRAMS)
    for k in want:
        assert torch.allclose(got[k], want[k], atol=1e-6), k
    # finished run: reused without any forward; other settings: a clear error
    tiny_target.model.forward = None
    try:
        assert collect(tiny_target, ds, _cfg(tiny_data), run_dir)["status"] == "complete"
    finally:
        tiny_target.model.forward = orig
    with pytest.raises(RunError, match="rho: run has 0.3, asked 0.2"):
        collect(tiny_target, ds, CollectConfig(model="tiny", data=str(tiny_data), samples=6, max_tokens=128,
                                               block=8, rho=0.2), run_dir)


def test_corrupt_run_files_give_clear_errors(tiny_run, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_run, bad)
    data = (bad / GRAMS).read_bytes()
    (bad / GRAMS).write_bytes(data[: len(data) // 2])
    with pytest.raises(RunError, match="corrupt or truncated"):
        GramRun(bad)
    (bad / MANIFEST).write_text("{\"status\": ")
    with pytest.raises(RunError, match="corrupt"):
        GramRun(bad)
    with pytest.raises(RunError, match="not an elsi run directory"):
        GramRun(tmp_path / "nothing")


def test_unfinished_run_is_refused(tiny_target, tiny_data, tmp_path):
    def stop(p):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        collect(tiny_target, load_dataset(str(tiny_data)), _cfg(tiny_data), tmp_path / "u", on_progress=stop)
    with pytest.raises(RunError, match="not finished"):
        GramRun(tmp_path / "u")


def test_short_samples_are_skipped_and_counted(tiny_target, tmp_path):
    data = tmp_path / "d.jsonl"
    rows = [{"text": "the cat"}, {"text": ""}, {"messages": []},
            {"text": " ".join(["the cat sat on a mat"] * 30)}]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = CollectConfig(model="tiny", data=str(data), samples=5, max_tokens=64, block=8)
    man = collect(tiny_target, load_dataset(str(data)), cfg, tmp_path / "s")
    assert man["counts"]["samples_used"] == 1
    assert man["counts"]["samples_skipped"] == {"too_short": 1}
    assert man["counts"]["data_records_unusable"] == {"empty": 2}
    assert "note" in man["counts"]


def test_collection_on_tiny_gemma3(tiny_data, tmp_path):
    from conftest import make_tiny_gemma3

    target = make_tiny_gemma3()
    assert target.adapter.name == "gemma3"
    assert target.adapter.layer_types(target.model)[-1] == "full_attention"
    cfg = CollectConfig(model="tiny-gemma3", data=str(tiny_data), samples=3, max_tokens=96, block=8)
    man = collect(target, load_dataset(str(tiny_data)), cfg, tmp_path / "g")
    run = GramRun(tmp_path / "g")
    assert run.num_layers == 4 and run.packed.shape[1:] == (5, 36)
    assert man["counts"]["samples_used"] == 3
    assert 0 < run.entropy((1, 4)).normalized <= 1


def test_a_run_begun_in_float32_is_not_finished_in_bf16(tiny_target, tiny_data, tmp_path):
    """Resuming with the target in another precision would mix two precisions' Grams: a clear error, nothing lost."""
    import copy
    import dataclasses

    ds = load_dataset(str(tiny_data))
    run_dir = tmp_path / "r"

    def ctrl_c_after_2(p):
        if p.samples_done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        collect(tiny_target, ds, _cfg(tiny_data), run_dir, on_progress=ctrl_c_after_2, flush_every=100)
    assert json.loads((run_dir / MANIFEST).read_text())["target_dtype"] == "float32"
    bf16 = dataclasses.replace(tiny_target, model=copy.deepcopy(tiny_target.model).to(torch.bfloat16))
    with pytest.raises(RunError, match=r"partly collected with the target in float32.*bfloat16.*--dtype float32"):
        collect(bf16, ds, _cfg(tiny_data), run_dir)
    shards = list((run_dir / "shards").glob("rank-0/shard-*.safetensors"))
    assert len(shards) == 1  # the finished samples are still there
    man = collect(tiny_target, ds, _cfg(tiny_data), run_dir)  # ... and the same precision finishes the run
    assert man["status"] == "complete" and man["target_dtype"] == "float32"


def test_dtype_auto_is_bf16_for_bulk_passes_only_where_bf16_is_native(monkeypatch):
    import elsi.runtime as runtime
    from elsi.cli.common import Runtime

    monkeypatch.setattr(runtime, "fast_bf16", lambda device: (True, "test: native"))
    assert Runtime(device="cpu").setup(bulk=True)[1] == torch.bfloat16  # analyze, train-draft
    assert Runtime(device="cpu").setup()[1] == torch.float32  # decoding and evaluation
    assert Runtime(device="cpu", dtype="float32").setup(bulk=True)[1] == torch.float32
    monkeypatch.setattr(runtime, "fast_bf16", lambda device: (False, "CPU: AMX tiles False, AVX512-BF16 False"))
    assert Runtime(device="cpu").setup(bulk=True)[1] == torch.float32
    with pytest.warns(UserWarning, match="emulates bf16"):
        assert Runtime(device="cpu", dtype="bfloat16").setup(bulk=True)[1] == torch.bfloat16
