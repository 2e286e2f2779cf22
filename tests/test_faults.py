"""Faults and hostile input: corrupted, truncated or planted files, bad arguments, interrupts.

Every case is one that once gave a silent wrong answer, lost work, crashed or ran a pickle: a damaged
artefact is an error naming the file and the command that rebuilds it (or, for ``elsi
analyze``, is rebuilt), a run that would train or score on nothing is an error, no pickle is
ever loaded, a bad ``--model`` fails before any data loads, a draft recorded for another target
fails before any model loads, another tool's draft loads from its standard keys, and ``analyze``, ``train-draft``
and ``study`` interrupted by SIGINT or SIGKILL at seeded random points resume to the result
of an uninterrupted run (``bench --out`` killed part way resumes at the question it was on), and two processes
writing one output never both do: a second ``analyze`` on a busy run directory is refused before any model loads,
two ``train-draft`` that need one feature cache build it once, two first conversions of a GGUF file convert it
once, and a lock left by a killed process is taken over with a notice.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_target, write_text_jsonl
from safetensors.torch import load_file

import elsi
from elsi.cli import main
from elsi.collect.collector import CollectConfig, collect
from elsi.collect.store import GRAMS, MANIFEST
from elsi.io import BusyError, RunError, load_tensors, lock, lock_path
from elsi.data import load_dataset
from elsi.draft.cache import FeatureStore
from elsi.draft.features import FeatureConfig, build_features
from elsi.draft.resume import CHECKPOINT, load_checkpoint
from elsi.draft.train import TrainConfig, train_draft
from elsi.stats.analysis import ANALYSIS, GramRun

CPU = torch.device("cpu")
LEGACY_CHECKPOINT = "checkpoint.pt"  # a pickle (older elsi): never loaded


# ---------------------------------------------------------------------------------------------
# Fixtures: a tiny saved target (N = 8) and a finished `elsi analyze` run of it, made by the CLI


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    t = make_tiny_target()
    with torch.no_grad():  # a peaked next-token distribution, which a draft can learn in a few steps
        t.model.lm_head.weight.mul_(60.0)
    d = tmp_path_factory.mktemp("fault_model")
    t.model.save_pretrained(d)
    t.tokenizer.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_text_jsonl(tmp_path_factory.mktemp("fault_data") / "text.jsonl", n=12, words=100)


def analyze_argv(model_dir: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["analyze", "--model", str(model_dir), "--data", str(data), "--samples", "6", "--max-tokens", "128",
            "--block", "8", "--out", str(out), "--device", "cpu", *extra]


@pytest.fixture(scope="module")
def run(model_dir, data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fault_run") / "run"
    assert main(analyze_argv(model_dir, data, out)) == 0
    return out


def copy_run(run: Path, dest: Path) -> Path:
    shutil.copytree(run, dest)
    return dest


def flip_bytes(path: Path, count: int = 2000) -> None:
    """XOR ``count`` bytes in the middle of a safetensors file's data section (after its header)."""
    raw = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(raw[:8], "little")
    mid = start + (len(raw) - start) // 2 - count // 2
    assert mid >= start and mid + count <= len(raw)
    for i in range(mid, mid + count):
        raw[i] ^= 0xFF
    path.write_bytes(bytes(raw))


def grams_of(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / GRAMS))


# ---------------------------------------------------------------------------------------------
# 1, 7: the Gram tensor is checked at every read; `analyze` rebuilds a damaged one


def test_flipped_bytes_in_the_gram_tensor_are_an_error_naming_file_and_rebuild_command(run, tmp_path, capsys):
    bad = copy_run(run, tmp_path / "bad")
    flip_bytes(bad / GRAMS)
    with pytest.raises(RunError, match=r"grams\.safetensors is corrupt: its contents do not match the checksum"):
        GramRun(bad)
    for argv in (["select", "--run", str(bad), "--method", "elsi", "--m", "3"],
                 ["score", "--run", str(bad), "--layers", "2,5,8"],
                 ["report", str(bad), "--out", str(tmp_path / "rep")]):
        capsys.readouterr()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert str(bad / GRAMS) in err and "elsi analyze" in err and f"--out {bad}" in err, (argv, err)
    assert not (tmp_path / "rep").exists()


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_analyze_rerun_rebuilds_a_damaged_gram_tensor(run, model_dir, data, tmp_path, capsys, damage):
    bad = copy_run(run, tmp_path / "bad")
    path = bad / GRAMS
    if damage == "flip":
        flip_bytes(path)
    else:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    capsys.readouterr()
    assert main(analyze_argv(model_dir, data, bad)) == 0
    cap = capsys.readouterr()
    assert f"{path}" in cap.err and "collecting" in cap.err and "again" in cap.err
    wrote = [line for line in cap.out.splitlines() if line.startswith("wrote ")]
    assert wrote and str(path) in wrote[0]  # only what this invocation wrote
    want, got = grams_of(run), grams_of(bad)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert json.loads((bad / ANALYSIS).read_text())["layer_entropy"] == \
        json.loads((run / ANALYSIS).read_text())["layer_entropy"]
    GramRun(bad)  # intact again


def test_analyze_on_a_finished_run_says_what_it_did_not_write(run, model_dir, data, tmp_path, capsys, monkeypatch):
    again = copy_run(run, tmp_path / "again")
    import elsi.cli.analyze

    monkeypatch.setattr(elsi.cli.analyze, "load_target", lambda *a, **k: pytest.fail("a finished run loaded the model"))
    capsys.readouterr()
    assert main(analyze_argv(model_dir, data, again)) == 0
    out = capsys.readouterr().out
    assert "wrote" not in out and "up to date" in out


def test_garbage_analysis_json_is_recomputed_by_analyze_and_named_by_report(run, model_dir, data, tmp_path, capsys):
    bad = copy_run(run, tmp_path / "bad")
    (bad / ANALYSIS).write_text('{"layers": [1, 2')
    assert main(["report", str(bad), "--out", str(tmp_path / "rep")]) == 2
    err = capsys.readouterr().err
    assert str(bad / ANALYSIS) in err and "corrupt" in err and "elsi analyze" in err
    assert main(analyze_argv(model_dir, data, bad)) == 0
    assert str(bad / ANALYSIS) in capsys.readouterr().err
    assert json.loads((bad / ANALYSIS).read_text())["cka"] == json.loads((run / ANALYSIS).read_text())["cka"]


def test_stale_analysis_json_is_named_by_report_and_recomputed_by_analyze(run, model_dir, data, tmp_path, capsys):
    from elsi.io import write_json

    stale = copy_run(run, tmp_path / "stale")
    ana = json.loads((stale / ANALYSIS).read_text())
    ana["grams_sha256"] = "0" * 64  # a well-formed analysis.json, computed from another Gram tensor
    ana["layer_entropy"] = [0.0] * len(ana["layer_entropy"])
    write_json(stale / ANALYSIS, ana, rebuild="elsi analyze")
    assert main(["report", str(stale), "--out", str(tmp_path / "rep")]) == 2
    assert "computed from another Gram tensor" in capsys.readouterr().err
    assert main(analyze_argv(model_dir, data, stale)) == 0
    assert json.loads((stale / ANALYSIS).read_text())["layer_entropy"] == \
        json.loads((run / ANALYSIS).read_text())["layer_entropy"]


def test_edited_numbers_in_json_records_are_caught(run, tmp_path, capsys):
    bad = copy_run(run, tmp_path / "bad")
    text = (bad / ANALYSIS).read_text()
    ana = json.loads(text)
    ana["pair_entropy"][0][0] += 0.25  # still valid JSON: select would preload this singleton's entropy
    (bad / ANALYSIS).write_text(json.dumps(ana, indent=1))
    for argv in (["select", "--run", str(bad), "--method", "elsi", "--m", "2"], ["report", str(bad), "--out", str(tmp_path / "r")]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert f"{bad / ANALYSIS} is corrupt: its contents do not match the checksum" in err and "elsi analyze" in err
    (bad / ANALYSIS).write_text(text)
    man = json.loads((bad / MANIFEST).read_text())
    man["settings"]["rho"] = 0.5
    (bad / MANIFEST).write_text(json.dumps(man))
    with pytest.raises(RunError, match=re.escape(str(bad / MANIFEST)) + " is corrupt: .*delete .*elsi analyze"):
        GramRun(bad)


def interrupted_collect(target, ds, cfg: CollectConfig, out: Path, at: int, flush_every: int) -> None:
    """``collect`` stopped by a Ctrl-C once ``at`` samples are done."""
    def stop(p):
        if p.samples_done == at:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        collect(target, ds, cfg, out, on_progress=stop, flush_every=flush_every)


def test_a_damaged_shard_is_an_error_naming_it(tiny_target, tiny_data, tmp_path):
    ds = load_dataset(str(tiny_data))
    cfg = CollectConfig(model="tiny", data=str(tiny_data), samples=6, max_tokens=128, block=8)
    interrupted_collect(tiny_target, ds, cfg, tmp_path / "r", at=4, flush_every=2)
    shard = sorted((tmp_path / "r" / "shards").glob("rank-0/shard-*.safetensors"))[0]
    flip_bytes(shard, 64)
    with pytest.raises(RunError, match=re.escape(str(shard)) + ".*do not match the checksum"):
        collect(tiny_target, ds, cfg, tmp_path / "r")


def test_a_failed_analyze_leaves_no_collecting_manifest(tiny_target, tiny_data, tmp_path, monkeypatch):
    ds = load_dataset(str(tiny_data))
    # No sample with a full block: nothing was made, nothing stays behind.
    cfg = CollectConfig(model="tiny", data=str(tiny_data), samples=3, max_tokens=40, block=32)
    with pytest.raises(RunError, match="no sample"):
        collect(tiny_target, ds, cfg, tmp_path / "empty")
    assert not (tmp_path / "empty").exists()
    # A forward that fails after finished shards: the manifest says failed (and why); the same command resumes.
    import elsi.collect.collector as collector

    real, calls = collector._forward, []

    def failing(*a, **k):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("device lost")
        return real(*a, **k)

    monkeypatch.setattr(collector, "_forward", failing)
    cfg = CollectConfig(model="tiny", data=str(tiny_data), samples=6, max_tokens=128, block=8)
    with pytest.raises(RuntimeError, match="device lost"):
        collect(tiny_target, ds, cfg, tmp_path / "f", flush_every=2)
    man = json.loads((tmp_path / "f" / MANIFEST).read_text())
    assert man["status"] == "failed" and "device lost" in man["error"]
    with pytest.raises(RunError, match="not finished.*device lost"):
        GramRun(tmp_path / "f")
    monkeypatch.setattr(collector, "_forward", real)
    assert collect(tiny_target, ds, cfg, tmp_path / "f")["status"] == "complete"


# ---------------------------------------------------------------------------------------------
# Data: identified by content; clear errors for directories and unknown fields


def test_data_is_identified_by_content_not_by_path(tiny_target, tiny_data, tmp_path):
    ds = load_dataset(str(tiny_data))
    cfg = CollectConfig(model="tiny", data=str(tiny_data), samples=6, max_tokens=128, block=8)
    interrupted_collect(tiny_target, ds, cfg, tmp_path / "r", at=3, flush_every=1)
    # The same file under another path is the same data: the run resumes.
    moved = tmp_path / "elsewhere" / "same.jsonl"
    moved.parent.mkdir()
    shutil.copy(tiny_data, moved)
    cfg2 = CollectConfig(model="tiny", data=str(moved), samples=6, max_tokens=128, block=8)
    assert collect(tiny_target, load_dataset(str(moved)), cfg2, tmp_path / "r")["status"] == "complete"
    # An edited file under the same name is other data: an error naming the difference, not a silent resume.
    interrupted_collect(tiny_target, load_dataset(str(moved)), cfg2, tmp_path / "r2", at=3, flush_every=1)
    with moved.open("a") as f:
        f.write(json.dumps({"id": "extra", "text": "the cat sat on a mat " * 20}) + "\n")
    with pytest.raises(RunError, match="other or edited data"):
        collect(tiny_target, load_dataset(str(moved)), cfg2, tmp_path / "r2")


def test_feature_cache_refuses_edited_data(tmp_path):
    target = make_tiny_target(num_layers=4)
    data = write_text_jsonl(tmp_path / "d.jsonl", n=6, words=40)
    cfg = FeatureConfig(model="tiny", data=str(data), samples=4, max_tokens=32, features_dir=str(tmp_path / "f"))
    build_features(target, load_dataset(str(data)), cfg, (2,))
    with data.open("a") as f:
        f.write(json.dumps({"id": "new", "text": "dogs ran far away " * 10}) + "\n")
    more = FeatureConfig(model="tiny", data=str(data), samples=6, max_tokens=32, features_dir=str(tmp_path / "f"))
    with pytest.raises(ValueError, match="other or edited data"):
        build_features(target, load_dataset(str(data)), more, (2,))
    # The default cache key follows the content: the edited file gets its own cache directory.
    assert FeatureConfig(model="tiny", data=str(data)).key("m") != FeatureConfig(model="tiny", data="sharegpt").key("m")


def test_data_directory_and_unknown_fields_are_clear_errors(model_dir, tmp_path, capsys):
    assert main(analyze_argv(model_dir, tmp_path, tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert "is a directory" in err and ".jsonl" in err and not (tmp_path / "out").exists()
    bad = tmp_path / "fields.jsonl"
    bad.write_text("\n".join(json.dumps({"prompt": "hi", "response": "yo"}) for _ in range(3)) + "\n")
    with pytest.raises(ValueError, match=r"unknown_format=3.*'conversations'.*'messages'.*'text'.*\['prompt', 'response'\]"):
        load_dataset(str(bad))


# ---------------------------------------------------------------------------------------------
# 4: a bad --model is one clear error, before any data loads


@pytest.mark.parametrize("spec,msg", [
    ("./no/such/model", "model path not found"),
    ("/no/such/dir/model", "model path not found"),
    ("missing.gguf", "model path not found"),
    ("someorg/not-a-cached-model-xyz", r"neither a local path nor in the Hugging Face cache, and offline mode is on \(HF_HUB_OFFLINE=1\)"),
    ("smollm3-135m", r"unknown model 'smollm3-135m': not an alias \(gemma3-270m, smollm2-135m\)"),
])
@pytest.mark.parametrize("command", ["analyze", "train-draft", "study", "eval-draft"])
def test_bad_model_is_one_clear_error_before_any_data_loads(command, spec, msg, data, tmp_path, monkeypatch, capsys):
    import elsi.cli.analyze
    import elsi.cli.draft
    import elsi.cli.study
    import elsi.data.conversations

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    never = lambda *a, **k: pytest.fail("loaded data or a model before checking --model")  # noqa: E731
    for mod in (elsi.cli.analyze, elsi.cli.draft, elsi.cli.study):
        monkeypatch.setattr(mod, "load_target", never)
        if hasattr(mod, "load_dataset"):
            monkeypatch.setattr(mod, "load_dataset", never)
    monkeypatch.setattr(elsi.data.conversations, "_load_dataset", never)
    argv = {"analyze": ["analyze", "--data", str(data), "--out", str(tmp_path / "r")],
            "train-draft": ["train-draft", "--data", str(data), "--layers", "2", "--out", str(tmp_path / "d")],
            "study": ["study", "--data", str(data), "--run", str(tmp_path / "r"), "--out", str(tmp_path / "s")],
            "eval-draft": ["eval-draft", "--draft", str(tmp_path / "d")]}[command]
    assert main([*argv, "--model", spec, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"elsi {command}: error: ") and re.search(msg, err), err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_eval_draft_without_a_draft_fails_before_the_model_loads(model_dir, tmp_path, monkeypatch, capsys):
    import elsi.cli.draft

    monkeypatch.setattr(elsi.cli.draft, "load_target", lambda *a, **k: pytest.fail("loaded the model first"))
    assert main(["eval-draft", "--model", str(model_dir), "--draft", str(tmp_path / "nodraft"), "--device", "cpu"]) == 2
    assert f"no draft in {tmp_path / 'nodraft'}" in capsys.readouterr().err


def test_empty_prompt_is_refused_before_the_model_loads(model_dir, tmp_path, monkeypatch, capsys):
    import elsi.cli.decode

    monkeypatch.setattr(elsi.cli.decode, "load_target", lambda *a, **k: pytest.fail("loaded the model first"))
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    for extra, msg in ([["--prompt", ""], "the prompt is empty"], [["--prompt", "   "], "the prompt is empty"],
                       [["--prompt-file", str(empty)], f"prompt file {empty} is empty"]):
        assert main(["generate", "--model", str(model_dir), "--device", "cpu", *extra]) == 2
        assert msg in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# 5, 8: a draft from another tool loads from the standard keys; a draft for another target is refused


def _saved_draft(model_dir: Path, out: Path, layers=(2, 4, 6)) -> Path:
    from transformers import AutoModelForCausalLM

    from elsi.draft.model import random_draft
    from elsi.models import Target, adapter_for

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    target = Target("tiny", str(model_dir), model, None, adapter_for(model), 8, 32)
    random_draft(target, list(layers), draft_vocab=40).save_pretrained(out)
    return out


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_a_draft_for_another_target_is_refused_before_the_model_loads(command, model_dir, tmp_path, monkeypatch,
                                                                     capsys):
    import elsi.cli.decode

    draft = _saved_draft(model_dir, tmp_path / "draft")
    cfg = json.loads((draft / "config.json").read_text())
    cfg["elsi"]["draft_config"]["target_num_layers"] = 40  # recorded for a 40-layer target
    (draft / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setattr(elsi.cli.decode, "load_target", lambda *a, **k: pytest.fail("loaded the model first"))
    extra = ["--prompt", "hi"] if command == "generate" else ["--questions-per-subtask", "1"]
    assert main([command, "--model", str(model_dir), "--draft", str(draft), "--device", "cpu", *extra]) == 2
    err = capsys.readouterr().err
    assert "trained for another target" in err and "records 40 layers (the model has 8)" in err


def test_a_draft_without_an_elsi_block_loads_instead_of_a_key_error(model_dir, tmp_path, capsys):
    draft = _saved_draft(model_dir, tmp_path / "draft")
    cfg = json.loads((draft / "config.json").read_text())
    del cfg["elsi"]  # what SpecForge, EAGLE or speculators write: the standard keys only
    (draft / "config.json").write_text(json.dumps(cfg))
    assert main(["generate", "--model", str(model_dir), "--draft", str(draft), "--device", "cpu", "--prompt", "the cat",
                 "--max-new-tokens", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["draft"]["layer_ids"] == [2, 4, 6]
    (draft / "config.json").write_text(json.dumps({"model_type": "llama"}))  # no EAGLE3 keys at all: a clear error
    assert main(["generate", "--model", str(model_dir), "--draft", str(draft), "--device", "cpu", "--prompt", "x"]) == 2
    assert "neither an elsi draft nor an EAGLE3" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# 2, 3, 6: draft training: nothing to score is an error; checkpoints are safetensors + JSON; Ctrl-C saves one


@pytest.fixture(scope="module")
def draft_target():
    t = make_tiny_target(num_layers=6, hidden=32, seed=1)
    with torch.no_grad():
        t.model.lm_head.weight.mul_(60.0)
    return t


@pytest.fixture(scope="module")
def store(draft_target, tmp_path_factory):
    d = tmp_path_factory.mktemp("fault_feat")
    data = write_text_jsonl(d / "text.jsonl", n=12, words=60)
    cfg = FeatureConfig(model="tiny", data=str(data), samples=12, max_tokens=48, features_dir=str(d / "cache"))
    return build_features(draft_target, load_dataset(str(data)), cfg, (1, 3, 6))


def train_cfg(out: Path, **kw) -> TrainConfig:
    base = dict(layers="1,3,6", out=str(out), draft_vocab=120, ttt=1, lr=1e-2, warmup_steps=2, epochs=100.0,
                max_steps=8, time_budget="0", batch_size=2, heldout=0.2, eval_every="0", checkpoint_every="2m")
    base.update(kw)
    return TrainConfig(**base)


def test_training_on_zero_scored_tokens_is_an_error(draft_target, tmp_path):
    long_user = " ".join(["the cat sat on a mat while dogs ran far away"] * 12)
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"{i} {long_user}"},
                                                       {"role": "assistant", "content": "yes"}]})
                              for i in range(6)) + "\n")
    cfg = FeatureConfig(model="tiny", data=str(data), samples=6, max_tokens=24, features_dir=str(tmp_path / "f"))
    st = build_features(draft_target, load_dataset(str(data)), cfg, (1, 3, 6))
    with pytest.raises(ValueError, match=r"training split has no position to score: none of its 4 conversations "
                                         r"has an assistant-reply token within --max-tokens 24"):
        train_draft(draft_target, st, train_cfg(tmp_path / "d"), seed=0, device=CPU)
    assert not (tmp_path / "d" / "model.safetensors").exists()
    rec = train_draft(draft_target, st, train_cfg(tmp_path / "all", loss_on="all", max_steps=2), seed=0, device=CPU)
    assert rec["train_tokens_seen"] > 0  # --loss-on all scores every position


def test_eval_draft_with_nothing_to_score_is_an_error(draft_target):
    from elsi.draft.evaluate import evaluate_draft
    from elsi.draft.model import random_draft

    draft = random_draft(draft_target, (1, 3, 6))
    answers = [{"question_id": 1, "subtask": "qa", "turn": 0, "prompt": [1, 5, 9], "answer": []}]
    with pytest.raises(ValueError, match="no answer token to score"):
        evaluate_draft(draft_target, draft, answers, 1)


def test_no_pickle_anywhere_in_the_package():
    root = Path(elsi.__file__).parent
    bad = re.compile(r"torch\.load\(|import pickle|from pickle|pickle\.loads?\(|allow_pickle\s*=\s*True|"
                     r"weights_only\s*=\s*False|import dill|import cloudpickle")
    hits = [f"{p.relative_to(root)}:{i}" for p in root.rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if bad.search(line)]
    assert hits == []


class _Payload:
    """Unpickling this creates a file: proof that a pickle was loaded."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_planted_pickle_checkpoint_is_never_loaded(draft_target, store, tmp_path):
    out = tmp_path / "d"
    out.mkdir()
    marker = tmp_path / "pwned"
    with (out / LEGACY_CHECKPOINT).open("wb") as f:
        pickle.dump({"settings": _Payload(marker)}, f)
    with pytest.raises(ValueError, match=rf"{LEGACY_CHECKPOINT} is a checkpoint of an older elsi, saved with pickle.*--restart"):
        train_draft(draft_target, store, train_cfg(out), seed=0, device=CPU)
    assert not marker.exists()
    train_draft(draft_target, store, train_cfg(out, restart=True), seed=0, device=CPU)
    assert not marker.exists() and not (out / LEGACY_CHECKPOINT).exists() and (out / CHECKPOINT).is_file()
    # The checkpoint is safetensors with a JSON header: readable with no code execution.
    tensors, meta = load_tensors(out / CHECKPOINT)
    assert meta["state"]["step"] == 8 and meta["format"] == 1 and any(k.startswith("optimizer.") for k in tensors)
    # A damaged checkpoint is an error naming it, not a silent restart or a wrong resume.
    flip_bytes(out / CHECKPOINT, 256)
    with pytest.raises(ValueError, match=re.escape(str(out / CHECKPOINT)) + ".*do not match the checksum.*--restart"):
        train_draft(draft_target, store, train_cfg(out), seed=0, device=CPU)


def test_ctrl_c_before_the_first_periodic_checkpoint_saves_one_and_resumes_exactly(draft_target, store, tmp_path):
    ref = tmp_path / "ref"
    train_draft(draft_target, store, train_cfg(ref), seed=4, device=CPU)

    def ctrl_c_at_3(p):
        if p.step == 3 and not p.note:
            raise KeyboardInterrupt

    out = tmp_path / "cut"
    with pytest.raises(KeyboardInterrupt):  # checkpoint_every 2m: no periodic checkpoint yet
        train_draft(draft_target, store, train_cfg(out), seed=4, device=CPU, on_progress=ctrl_c_at_3)
    _, meta = load_tensors(out / CHECKPOINT)
    assert meta["state"]["step"] == 3
    notes = []
    train_draft(draft_target, store, train_cfg(out), seed=4, device=CPU,
                on_progress=lambda p: notes.append(p.note) if p.note else None)
    assert any("resumed" in n and "step 3" in n for n in notes)
    a, b = load_file(str(ref / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_checkpoint_resumes_only_in_the_precision_it_was_trained_in(draft_target, store, tmp_path, monkeypatch):
    """--train-dtype auto resolves per machine (bf16 where native): the same settings on another machine must not
    finish a draft in another precision than it began in."""
    import elsi.draft.train as train_mod

    def ctrl_c_at_3(p):
        if p.step == 3 and not p.note:
            raise KeyboardInterrupt

    out = tmp_path / "cut"
    with pytest.raises(KeyboardInterrupt):
        train_draft(draft_target, store, train_cfg(out), seed=4, device=CPU, on_progress=ctrl_c_at_3)
    had = load_tensors(out / CHECKPOINT)[1]["state"]["matmul_dtype"]
    assert had == str(train_mod.matmul_dtype("auto", CPU)[0]).removeprefix("torch.")
    other = "float32" if had == "bfloat16" else "bfloat16"
    monkeypatch.setattr(train_mod, "matmul_dtype", lambda choice, device: (getattr(torch, other), None))
    with pytest.raises(ValueError, match=rf"{re.escape(str(out / CHECKPOINT))} was trained with {had} matmuls, this run "
                                         rf"would go on in {other} .*pass --train-dtype {had} .*--restart"):
        train_draft(draft_target, store, train_cfg(out), seed=4, device=CPU)
    monkeypatch.undo()
    rec = train_draft(draft_target, store, train_cfg(out), seed=4, device=CPU)
    assert rec["steps"] == 8 and rec["train_matmul_dtype"] == had and rec["data"]["features_dtype"] == store.dtype


def test_feature_cache_files_are_checked(store, tmp_path):
    bad = tmp_path / "cache"
    shutil.copytree(store.path, bad)
    fresh = FeatureStore(bad)
    assert torch.equal(fresh.sample(0, [0])["aux"], store.sample(0, [0])["aux"])
    states = bad / "shard00000.states.npy"
    raw = bytearray(states.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    states.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=re.escape(str(states)) + r" is corrupt.*delete .*rerun the same command"):
        FeatureStore(bad).sample(0, [0])
    states.write_bytes(bytes(raw[: len(raw) // 2]))
    with pytest.raises(ValueError, match=re.escape(str(states)) + r" has \d+ bytes, features.json records \d+"):
        FeatureStore(bad)
    man = json.loads((bad / "features.json").read_text())
    man["samples"][0]["offset"] += 1  # valid JSON, wrong rows
    (bad / "features.json").write_text(json.dumps(man))
    with pytest.raises(ValueError, match=r"features.json is corrupt: its contents do not match the checksum"):
        FeatureStore(bad)
    (bad / "features.json").write_text("{\"format\": 2, ")
    with pytest.raises(ValueError, match=r"features.json is corrupt.*rebuild it"):
        FeatureStore(bad)


# ---------------------------------------------------------------------------------------------
# Resume notices go to stderr


def test_resume_notice_goes_to_stderr(model_dir, data, tmp_path, monkeypatch, capsys):
    import elsi.collect.collector as collector

    real, calls = collector._forward, []

    def ctrl_c_at_3(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(collector, "_forward", ctrl_c_at_3)
    out = tmp_path / "r"
    assert main(analyze_argv(model_dir, data, out)) == 130
    monkeypatch.setattr(collector, "_forward", real)
    capsys.readouterr()
    assert main(analyze_argv(model_dir, data, out)) == 0
    cap = capsys.readouterr()
    assert "resuming: 2 samples already collected" in cap.err and "resuming" not in cap.out


# ---------------------------------------------------------------------------------------------
# SIGINT and SIGKILL at seeded random points of `analyze`, `train-draft` and `study`, in real processes


def _env(tmp: Path) -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "ELSI_CACHE": str(tmp / "elsi-cache"), "TOKENIZERS_PARALLELISM": "false"}


def _sigint_as_in_a_terminal() -> None:
    """In the child before ``exec``: SIGINT's default action. Under a test run started in the background (``&``,
    ``nohup``) SIGINT is ignored, and so in every process it starts: a Ctrl-C sent there would land on nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(argv: list[str], tmp: Path, name: str) -> tuple[subprocess.Popen, Path, Path]:
    out, err = tmp / f"{name}.out", tmp / f"{name}.err"
    proc = subprocess.Popen([sys.executable, "-m", "elsi", *argv, "--device", "cpu", "--threads", "1"],
                            stdout=out.open("w"), stderr=err.open("w"), env=_env(tmp), cwd=tmp,
                            preexec_fn=_sigint_as_in_a_terminal)
    return proc, out, err


def _run_interrupted(argv, tmp, name, sig, ready, delay: float, timeout: float = 120.0) -> tuple[int, str, str]:
    """Start ``elsi argv``, wait until ``ready(stderr so far)``, then ``delay`` seconds, then send ``sig``; checks that
    the signal landed while the command was at work: it was still running when sent, and it ended in the interrupt
    path (exit status 130 and the notice; SIGINT, SIGTERM) or killed (-9; SIGKILL). Returns (status, stdout, stderr).
    """
    proc, out, err = _start(argv, tmp, name)
    t0 = time.monotonic()
    while proc.poll() is None and not ready(err.read_text()):
        if time.monotonic() - t0 > timeout:
            proc.kill()
            proc.wait()
            pytest.fail(f"elsi {argv[0]} not ready to be interrupted after {timeout} s:\n{err.read_text()[-3000:]}")
        time.sleep(0.005)
    assert proc.poll() is None, (f"elsi {argv[0]} ended (status {proc.returncode}) before it was ready to be "
                                 f"interrupted:\n{err.read_text()[-3000:]}")
    time.sleep(delay)
    assert proc.poll() is None, (f"elsi {argv[0]} ended (status {proc.returncode}) within {delay:.2f} s of being "
                                 f"ready: {signal.Signals(sig).name} would land on nothing; give it more work")
    proc.send_signal(sig)
    proc.wait(timeout=timeout)
    rc, stdout, stderr = proc.returncode, out.read_text(), err.read_text()
    if sig == signal.SIGKILL:
        assert rc == -signal.SIGKILL, stderr[-3000:]
    else:
        assert rc == 130, stderr[-3000:]
        assert f"elsi {argv[0]}: interrupted; finished work is saved" in stderr
    return rc, stdout, stderr


def _finish(proc_out_err, timeout: float = 180.0) -> tuple[str, str]:
    proc, out, err = proc_out_err
    proc.wait(timeout=timeout)
    assert proc.returncode == 0, err.read_text()[-3000:]
    return out.read_text(), err.read_text()


def _reference(argv: list[str], tmp: Path, monkeypatch) -> None:
    """The uninterrupted run, in this process, with the subprocesses' settings (one CPU thread)."""
    monkeypatch.setenv("ELSI_CACHE", str(tmp / "elsi-cache"))
    threads = torch.get_num_threads()
    try:
        assert main([*argv, "--device", "cpu", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)


def _mtime(path: Path) -> int:
    return path.stat().st_mtime_ns if path.exists() else 0


@pytest.fixture(scope="module")
def big_data(tmp_path_factory) -> Path:
    return write_text_jsonl(tmp_path_factory.mktemp("fault_big") / "text.jsonl", n=240, words=110)


def test_analyze_killed_by_sigint_then_sigkill_resumes_to_the_same_grams(model_dir, big_data, tmp_path, monkeypatch):
    rng = random.Random(20261201)
    argv = lambda out: ["analyze", "--model", str(model_dir), "--data", str(big_data), "--samples", "240",  # noqa: E731
                        "--max-tokens", "128", "--block", "8", "--out", str(out)]
    _reference(argv(tmp_path / "ref"), tmp_path, monkeypatch)
    run_dir = tmp_path / "cut"
    shards = run_dir / "shards"
    count = lambda: len(list(shards.glob("rank-*/shard-*.safetensors")))  # noqa: E731
    status = lambda: json.loads((run_dir / MANIFEST).read_text())["status"]  # noqa: E731
    # 240 samples, a shard per 16: a signal sent a shard or two into the run lands while it collects.
    _run_interrupted(argv(run_dir), tmp_path, "int", signal.SIGINT, lambda _: count() >= 1, rng.uniform(0.0, 0.4))
    before = count()
    assert status() == "collecting" and before >= 1  # Ctrl-C while collecting: every finished sample was written
    _run_interrupted(argv(run_dir), tmp_path, "kill", signal.SIGKILL, lambda _: count() > before,
                     rng.uniform(0.0, 0.4))
    assert status() == "collecting" and count() > before  # killed while collecting, after more shards
    out, err = _finish(_start(argv(run_dir), tmp_path, "final"))
    resumed = re.search(r"resuming: (\d+) samples already collected", err)
    assert resumed and 16 < int(resumed[1]) < 240, err[-3000:]
    assert "resuming" not in out
    want, got = grams_of(tmp_path / "ref"), grams_of(run_dir)
    for k in want:
        if k.startswith("block_sum"):  # sums over shards: the shard boundaries change the summation order
            torch.testing.assert_close(got[k], want[k], rtol=1e-12, atol=1e-12)
        else:
            assert torch.equal(got[k], want[k]), k
    ref_man, man = (json.loads((d / MANIFEST).read_text()) for d in (tmp_path / "ref", run_dir))
    assert man["samples"] == ref_man["samples"] and man["counts"] == ref_man["counts"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])  # SIGTERM: `kill`, for a job started in the background
def test_train_draft_killed_by_sigint_then_sigkill_resumes_to_the_same_weights(model_dir, data, tmp_path, monkeypatch,
                                                                               sig):
    rng = random.Random(7)
    argv = lambda out, feat: ["train-draft", "--model", str(model_dir), "--data", str(data), "--samples", "12",  # noqa: E731
                              "--max-tokens", "64", "--layers", "2,5,8", "--out", str(out), "--features-dir", str(feat),
                              "--draft-vocab", "100", "--ttt", "2", "--epochs", "1000", "--max-steps", "300",
                              "--time-budget", "0", "--batch-size", "2", "--eval-every", "0",
                              "--checkpoint-every", "0.25s"]
    _reference(argv(tmp_path / "ref", tmp_path / "ref-feat"), tmp_path, monkeypatch)
    out, feat = tmp_path / "cut", tmp_path / "feat"
    ck = out / CHECKPOINT
    step = lambda: load_checkpoint(ck)[1]["state"]["step"]  # noqa: E731
    trained = lambda: (out / "training.json").exists()  # noqa: E731
    # 300 steps: a signal sent a second into training lands while it trains.
    rc, _, err = _run_interrupted(argv(out, feat), tmp_path, "int", sig,
                                  lambda e: re.search(r"step \d+ ep", e) is not None, rng.uniform(0.3, 1.0))
    assert rc == 130, err[-3000:]  # SIGTERM too ends in the interrupt path, not in a killed process (-15)
    # Ctrl-C in the training loop: the finished steps are in a checkpoint, whatever checkpoint_every
    assert ck.is_file() and 0 < step() < 300 and not trained()
    stamp, first = _mtime(ck), step()
    _run_interrupted(argv(out, feat), tmp_path, "kill", signal.SIGKILL, lambda _: _mtime(ck) != stamp,
                     rng.uniform(0.0, 0.5))
    assert first < step() < 300 and not trained()  # killed in the training loop, after a checkpoint of its own
    stdout, stderr = _finish(_start(argv(out, feat), tmp_path, "final"))
    assert "resumed from" in stderr
    assert "resumed" not in stdout  # notices go to stderr
    a, b = load_file(str(tmp_path / "ref" / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rec = json.loads((out / "training.json").read_text())
    assert rec["steps"] == 300 and rec["heldout"] == json.loads((tmp_path / "ref" / "training.json").read_text())["heldout"]


def test_study_killed_by_sigint_then_sigkill_resumes_to_the_same_results(model_dir, run, data, tmp_path, monkeypatch):
    rng = random.Random(11)
    argv = lambda out: ["study", "--model", str(model_dir), "--run", str(run), "--data", str(data),  # noqa: E731
                        "--out", str(out), "--sets", "eagle2", "elsi:2", "--seeds", "0", "--samples", "8",
                        "--max-tokens", "48", "--draft-vocab", "100", "--epochs", "1000", "--max-steps", "80",
                        "--batch-size", "2", "--train-budget", "0", "--checkpoint-every", "0.2s", "--subtasks", "qa",
                        "--questions-per-subtask", "1", "--max-new-tokens", "5", "--temperature", "0",
                        "--tree-nodes", "4", "--depth", "3", "--top-k", "2", "--warmup", "0", "--bootstrap", "0",
                        "--exact-questions-per-subtask", "0"]  # temperature 0 decoded live: the steps it counts
    _reference(argv(tmp_path / "ref"), tmp_path, monkeypatch)
    out = tmp_path / "cut"
    trained = lambda slug: (out / "drafts" / slug / "training.json").exists()  # noqa: E731
    # Ctrl-C while the first draft trains, then a kill while the second trains (80 steps each: a second or more).
    _run_interrupted(argv(out), tmp_path, "int", signal.SIGINT, lambda err: "step 3/7" in err, rng.uniform(0.0, 0.4))
    assert not trained("eagle2-s0") and not (out / "study.json").exists()
    _run_interrupted(argv(out), tmp_path, "kill", signal.SIGKILL, lambda err: "step 5/7" in err, rng.uniform(0.0, 0.4))
    assert trained("eagle2-s0") and not trained("elsi-2-s0") and not (out / "study.json").exists()
    _finish(_start(argv(out), tmp_path, "final"))
    for slug in ("eagle2-s0", "elsi-2-s0"):
        a = load_file(str(tmp_path / "ref" / "drafts" / slug / "model.safetensors"))
        b = load_file(str(out / "drafts" / slug / "model.safetensors"))
        assert all(torch.equal(a[k], b[k]) for k in a), slug
        keep = lambda res: [(x["question_id"], x["new_tokens"], x["steps"], x["accepted"])  # noqa: E731
                            for x in res["answers"]]
        ra, rb = (json.loads((d / "bench" / f"{slug}.json").read_text()) for d in (tmp_path / "ref", out))
        assert keep(ra) == keep(rb), slug
    sa, sb = (json.loads((d / "study.json").read_text()) for d in (tmp_path / "ref", out))
    tau = lambda s: [[(r["name"], r["tau_all"], r["tau"]) for r in c["sets"]] for c in s["conditions"]]  # noqa: E731
    assert tau(sa) == tau(sb)
    # Damaged records of finished work are redone, not a JSON traceback.
    (out / "bench" / "eagle2-s0.json").write_text('{"runs": [')
    (out / "drafts" / "elsi-2-s0" / "training.json").write_text("\x00\x01")
    _, err = _finish(_start(argv(out), tmp_path, "redo"))
    assert "eagle2-s0.json is corrupt" in err and "training.json is corrupt" in err
    assert tau(json.loads((out / "study.json").read_text())) == tau(sa)
    assert json.loads((out / "drafts" / "elsi-2-s0" / "training.json").read_text())["status"] == "complete"


def bench_argv(model_dir: Path, draft: Path, out: Path) -> list[str]:
    return ["bench", "--model", str(model_dir), "--draft", str(draft), "--subtasks", "qa", "translation",
            "--questions-per-subtask", "4", "--max-new-tokens", "24", "--temperature", "0", "1", "--tree-nodes", "4",
            "--depth", "3", "--top-k", "2", "--no-hf-generate", "--warmup", "0", "--out", str(out)]


def _answers(path: Path) -> list[tuple]:
    return [(a["question_id"], a["temperature"], a["method"], a["tree_nodes"], a["new_tokens"], a["steps"],
             a["accepted"]) for a in json.loads(path.read_text())["answers"]]


def test_bench_killed_part_way_resumes_at_its_question(model_dir, tmp_path, monkeypatch):
    """A live benchmark killed after some questions keeps them (``<out>.progress``) and answers only the rest:
    the same answers as an uninterrupted run, at temperature 1 too (each question has its own generator)."""
    draft = _saved_draft(model_dir, tmp_path / "draft")
    _reference(bench_argv(model_dir, draft, tmp_path / "ref.json"), tmp_path, monkeypatch)
    out = tmp_path / "cut.json"
    progress = out.with_name("cut.json.progress")
    _run_interrupted(bench_argv(model_dir, draft, out), tmp_path, "kill", signal.SIGKILL, lambda err: "[3/16]" in err,
                     random.Random(5).uniform(0.0, 0.2))
    assert not out.exists()
    kept = json.loads(progress.read_text())["done"]
    assert 3 <= len(kept) < 16, sorted(kept)
    _, err = _finish(_start(bench_argv(model_dir, draft, out), tmp_path, "final"))
    assert f"going on from {progress}" in err
    assert _answers(out) == _answers(tmp_path / "ref.json") and not progress.exists()
    times = {(a["temperature"], a["question_id"], a["method"], a["tree_nodes"]): a["time_s"]
             for a in json.loads(out.read_text())["answers"]}
    for key, answers in kept.items():  # the kept questions were not answered again: their timings are the first run's
        assert [times[(a["temperature"], a["question_id"], a["method"], a["tree_nodes"])] for a in answers] == \
            [a["time_s"] for a in answers], key


def test_bench_progress_of_another_draft_or_settings_is_not_taken_up(tiny_target, tmp_path, monkeypatch):
    """A progress file is taken up only for the same settings, draft weights and kind of machine; otherwise the
    benchmark starts over and says why."""
    import elsi.specbench.runner
    from elsi.decode import EagleDrafter
    from elsi.draft.model import random_draft
    from elsi.specbench.runner import BenchConfig, run_bench

    draft = tmp_path / "draft"
    random_draft(tiny_target, [2, 4, 6], draft_vocab=40, seed=0).save_pretrained(draft)
    cfg = lambda **kw: BenchConfig(**{"model": "tiny", "draft": str(draft), "subtasks": ["qa"],  # noqa: E731
                                      "questions_per_subtask": 3, "max_new_tokens": 6, "tree_nodes": [4], "depth": 3,
                                      "top_k": 2, "hf_generate": False, "warmup": 0, **kw})
    drafter = EagleDrafter(random_draft(tiny_target, [2, 4, 6], draft_vocab=40, seed=0).eval())
    progress = tmp_path / "out.json.progress"
    seen = []

    def stop_after_two(a, done, total, kept):
        assert not kept
        seen.append(a.question_id)
        if done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_bench(tiny_target, drafter, cfg(), on_answer=stop_after_two, progress=progress)
    assert len(json.loads(progress.read_text())["done"]) == 2
    ref = run_bench(tiny_target, drafter, cfg())
    answered = []
    real = elsi.specbench.runner.answer
    monkeypatch.setattr(elsi.specbench.runner, "answer",
                        lambda m, name, q, *a: answered.append(q.question_id) or real(m, name, q, *a))
    told = []
    res = run_bench(tiny_target, drafter, cfg(), progress=progress,  # the same draft: two questions kept
                    on_answer=lambda a, done, total, kept: told.append((a.question_id, done, kept)))
    assert [d for _, d, _ in told] == [1, 2, 3]
    assert [k for _, _, k in told] == [q in seen for q, _, _ in told] and sum(k for _, _, k in told) == 2
    assert len(set(seen)) == 2 and set(answered) == {a["question_id"] for a in ref["answers"]} - set(seen)
    key = lambda r: [(a["question_id"], a["method"], a["new_tokens"], a["steps"], a["accepted"])  # noqa: E731
                     for a in r["answers"]]
    assert key(res) == key(ref)
    for why in ("draft weights", "settings"):
        answered.clear()
        if why == "draft weights":  # the same directory, retrained
            random_draft(tiny_target, [2, 4, 6], draft_vocab=40, seed=1).save_pretrained(draft)
        with pytest.warns(UserWarning, match=f"holds the progress of other {why}: starting over"):
            run_bench(tiny_target, drafter, cfg(max_new_tokens=7) if why == "settings" else cfg(), progress=progress)
        assert len(set(answered)) == 3  # every question answered again
    progress.write_text('{"done": [')
    answered.clear()
    with pytest.warns(UserWarning, match="is damaged: starting over"):
        run_bench(tiny_target, drafter, cfg(), progress=progress)
    assert len(set(answered)) == 3


# ---------------------------------------------------------------------------------------------
# Two processes, one directory: one writer at a time (``elsi.io.lock``), in real processes.
# A first process is stopped (SIGSTOP) as soon as it holds its lock, so that the second one meets a live
# holder whatever the machine's speed; it is let go (SIGCONT) once the second has shown what it does.


def _wait_for(cond: Callable[[], bool], proc: subprocess.Popen, what: str, timeout: float = 120.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert proc.poll() is None, f"process {proc.pid} ended (rc {proc.returncode}) before {what}"
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.005)


def lock_argv(model_dir: Path, data: Path, out: Path) -> list[str]:
    return ["analyze", "--model", str(model_dir), "--data", str(data), "--samples", "6", "--max-tokens", "128",
            "--block", "8", "--out", str(out)]


@pytest.fixture(scope="module")
def single_run(model_dir, data, tmp_path_factory) -> Path:
    """`analyze` alone, with the subprocesses' settings (one CPU thread)."""
    out = tmp_path_factory.mktemp("single") / "run"
    threads = torch.get_num_threads()
    try:
        assert main([*lock_argv(model_dir, data, out), "--device", "cpu", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    return out


def assert_same_run(got: Path, want: Path) -> None:
    """The same Gram tensor bit for bit, the same samples and counts, the same statistics."""
    a, b = grams_of(want), grams_of(got)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ma, mb = (json.loads((d / MANIFEST).read_text()) for d in (want, got))
    assert mb["samples"] == ma["samples"] and mb["counts"] == ma["counts"]
    assert mb["counts"]["samples_used"] == 6
    figures = lambda d: {k: v for k, v in json.loads((d / ANALYSIS).read_text()).items()  # noqa: E731
                         if k not in ("integrity", "elapsed_s")}
    assert figures(got) == figures(want)


def test_lock_rules(tmp_path):
    import socket

    d = tmp_path / "out"
    with lock(d, "the run directory") as lf:
        rec = json.loads(lf.read_text())
        assert lf == lock_path(d) == tmp_path / "out.lock" and not d.exists()  # beside it, not in it
        assert rec["pid"] == os.getpid() and rec["host"] == socket.gethostname() and rec["started"] and rec["command"]
        with lock(tmp_path / "." / "out"):  # this process again: nested, released by the outer block
            pass
        assert lf.exists()
    assert not lf.exists()
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C (and SIGTERM, which the CLI turns into it) releases it
        with lock(d):
            raise KeyboardInterrupt
    assert not lf.exists()
    # Another host's lock is never taken over: its process may run.
    lf.write_text(json.dumps({"pid": 1, "host": "elsewhere", "started": "2025-01-01T00:00:00+00:00",
                              "command": "elsi analyze --out out", "token": "x"}))
    with pytest.raises(BusyError, match=rf"the run directory {re.escape(str(d))} is in use: another elsi process is "
                                        r"writing it \(pid 1 on host elsewhere.*if it does not, delete "):
        with lock(d, "the run directory"):
            pass
    # A lock file left half-written (its process killed while writing it) is taken over with a notice.
    lf.write_text('{"pid": 12')
    os.utime(lf, (time.time() - 60, time.time() - 60))
    with pytest.warns(UserWarning, match="left it unreadable.*taking its lock over"):
        with lock(d):
            assert json.loads(lf.read_text())["pid"] == os.getpid()
    assert not lf.exists()


def test_a_second_analyze_on_a_busy_directory_is_refused_before_any_model_loads(model_dir, data, single_run,
                                                                               tmp_path):
    run_dir = tmp_path / "run"
    first = _start(lock_argv(model_dir, data, run_dir), tmp_path, "first")
    _wait_for(lock_path(run_dir).exists, first[0], "the first process's lock")
    first[0].send_signal(signal.SIGSTOP)
    try:
        second, out, err = _start(lock_argv(model_dir, data, run_dir), tmp_path, "second")
        second.wait(timeout=120)
    finally:
        first[0].send_signal(signal.SIGCONT)
    err = err.read_text()
    assert second.returncode == 2 and out.read_text() == "", err
    assert err.startswith(f"elsi analyze: error: the run directory {run_dir} is in use: another elsi process is "
                          f"writing it (pid {first[0].pid} on host ") and "analyze" in err.split("`")[1], err
    assert len(err.strip().splitlines()) == 1  # no progress bar: nothing loaded, nothing collected
    stdout, _ = _finish(first)
    assert f"{run_dir}: 6 samples" in stdout
    assert_same_run(run_dir, single_run)  # a single run's result, counts included
    assert not lock_path(run_dir).exists()


def test_a_lock_left_by_a_killed_analyze_is_taken_over_with_a_notice(model_dir, data, single_run, tmp_path):
    run_dir = tmp_path / "run"
    killed, _, _ = _start(lock_argv(model_dir, data, run_dir), tmp_path, "killed")
    _wait_for(lock_path(run_dir).exists, killed, "the process's lock")
    killed.kill()
    killed.wait(timeout=60)
    assert json.loads(lock_path(run_dir).read_text())["pid"] == killed.pid  # left behind by SIGKILL
    _, err = _finish(_start(lock_argv(model_dir, data, run_dir), tmp_path, "next"))
    assert (f"elsi: warning: {lock_path(run_dir)}: the elsi process that held it (pid {killed.pid} on host " in err
            and "is no longer running; taking its lock over" in err), err
    assert_same_run(run_dir, single_run)
    assert not lock_path(run_dir).exists()


def test_two_train_drafts_that_need_one_feature_cache_build_it_once(model_dir, data, tmp_path, monkeypatch):
    argv = lambda out, feat, layers: ["train-draft", "--model", str(model_dir), "--data", str(data),  # noqa: E731
                                      "--samples", "12", "--max-tokens", "64", "--layers", layers,
                                      "--cache-layers", "2,3,5,6,8", "--out", str(out), "--features-dir", str(feat),
                                      "--draft-vocab", "100", "--ttt", "2", "--max-steps", "20", "--time-budget", "0",
                                      "--batch-size", "2", "--eval-every", "0"]
    sets = {"a": "2,5,8", "b": "3,6,8"}
    for name, layers in sets.items():  # each draft trained alone, on a cache of its own
        _reference(argv(tmp_path / f"ref-{name}", tmp_path / f"ref-feat-{name}", layers), tmp_path, monkeypatch)
    feat = tmp_path / "feat"  # does not exist yet: both processes need it built
    first = _start(argv(tmp_path / "a", feat, sets["a"]), tmp_path, "a")
    _wait_for(lock_path(feat).exists, first[0], "the feature cache's lock")
    first[0].send_signal(signal.SIGSTOP)
    try:
        second = _start(argv(tmp_path / "b", feat, sets["b"]), tmp_path, "b")
        _wait_for(lambda: "waiting for it to finish" in second[2].read_text(), second[0], "the second to wait")
    finally:
        first[0].send_signal(signal.SIGCONT)
    _, err_a = _finish(first)
    _, err_b = _finish(second)
    assert (f"elsi: warning: the feature cache {feat} is being written by another elsi process "
            f"(pid {first[0].pid} on host ") in err_b
    assert "forward, " in err_a and "forward, " not in err_b  # built by the first only; the second read it
    assert len(FeatureStore(feat)) == 12 and not lock_path(feat).exists()
    for name in sets:
        a = load_file(str(tmp_path / f"ref-{name}" / "model.safetensors"))
        b = load_file(str(tmp_path / name / "model.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
        ra, rb = (json.loads((d / "training.json").read_text())["heldout"] for d in (tmp_path / f"ref-{name}",
                                                                                      tmp_path / name))
        assert ra == rb, name


def write_tiny_gguf(path: Path) -> Path:
    """A 2-layer Llama of the tests' tokenizer as a float32 GGUF file (the ``gguf`` package's writer)."""
    import gguf

    t = make_tiny_target(num_layers=2)
    cfg, tok = t.model.config, t.tokenizer
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([k for k, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])])
    w.add_token_types([1] * len(tok))
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    names = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for key, value in t.model.state_dict().items():
        stem = key.removesuffix(".weight")
        if stem.startswith("model.layers."):
            _, _, i, rest = stem.split(".", 3)
            stem = f"blk.{i}.{names[rest]}"
        else:
            stem = names[stem]
        w.add_tensor(f"{stem}.weight", value.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# `resolve_model` in a process of its own, counting the conversions it makes (the calls that read a GGUF file).
CONVERT = """
import sys
import transformers
from elsi.models.load import resolve_model
real = transformers.AutoModelForCausalLM.from_pretrained
def counted(*args, **kwargs):
    if kwargs.get("gguf_file"):
        with open(sys.argv[2], "a") as f:
            f.write("converted\\n")
    return real(*args, **kwargs)
transformers.AutoModelForCausalLM.from_pretrained = counted
print(resolve_model(sys.argv[1]))
"""


def test_two_first_time_conversions_of_one_gguf_convert_it_once(tmp_path):
    gguf_file = write_tiny_gguf(tmp_path / "tiny.gguf")
    count = tmp_path / "conversions.txt"

    def start(name: str) -> tuple[subprocess.Popen, Path, Path]:
        out, err = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
        return (subprocess.Popen([sys.executable, "-c", CONVERT, str(gguf_file), str(count)], stdout=out.open("w"),
                                 stderr=err.open("w"), env=_env(tmp_path), cwd=tmp_path), out, err)

    models = tmp_path / "elsi-cache" / "models"
    first = start("first")
    _wait_for(lambda: any(models.glob("*.lock")), first[0], "the conversion's lock")
    first[0].send_signal(signal.SIGSTOP)
    try:
        second = start("second")
        _wait_for(lambda: "waiting for it to finish" in second[2].read_text(), second[0], "the second to wait")
    finally:
        first[0].send_signal(signal.SIGCONT)
    (out_a, _), (out_b, err_b) = _finish(first), _finish(second)
    assert f"the converted model {out_a.strip()} is being written by another elsi process (pid {first[0].pid}" in err_b
    assert out_a == out_b and count.read_text() == "converted\n"  # one conversion, both processes use it
    converted = Path(out_a.strip())
    assert (converted / "elsi_source.json").is_file() and sorted(p.name for p in models.iterdir()) == [converted.name]
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(converted).num_hidden_layers == 2
