"""Drafts as the real engines read them: layer numbering, fc_norm layout, other tools' drafts, export.

Each engine's capture rule (``elsi.engines.rules``, cited from vLLM 0.32, SGLang 0.5 and SpecForge
0.2) is applied to the ``config.json`` elsi writes: every engine must feed the draft exactly the HF
``hidden_states`` it was trained on, or elsi must say it cannot. ``tests/test_vllm.py`` checks
vLLM's rule against vLLM itself.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from elsi.cli import main
from elsi.draft.compat import stale_eagle_config, upgrade_draft
from elsi.draft.model import DraftConfig, Eagle3Draft, random_draft
from elsi.engines import ENGINES, count_problems, engine_feed, engine_problems, export_fragment
from elsi.engines.rules import CHECKED, EngineLoadError, engine_reading
from elsi.select.search import dflash_default_ids


def _config(layers, n, fc_norm=False) -> dict:
    return DraftConfig(layer_ids=tuple(layers), target_num_layers=n, target_hidden_size=64, hidden_size=64,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                       vocab_size=100, draft_vocab_size=50, fc_norm=fc_norm).to_json()


# (N, layer set) -> engines that cannot serve it as trained ("count": only its layer count; "state": wrong states);
# "vllm" stands for both of vLLM's runners
CASES = [
    (30, (2, 15, 27), {}),
    (30, (5, 18, 27), {}),
    (30, (1, 2, 29), {}),
    (18, (2, 9, 15), {}),
    (30, (18,), {"specforge": "count", "vllm": "count"}),
    (30, (5, 27), {"specforge": "count", "vllm": "count"}),
    (30, (5, 10, 18, 27), {"specforge": "count", "vllm": "count"}),
    (30, (30,), {"specforge": "count", "vllm": "state", "sglang": "state"}),  # EAGLE-2's [N]: the normed final state
    (30, (28, 29, 30), {"vllm": "state", "sglang": "state", "specforge": "state"}),
    (30, (27, 2, 15), {"vllm": "state", "sglang": "state", "specforge": "state"}),  # engines concatenate in layer order
]


@pytest.mark.parametrize("n,layers,expected", CASES)
def test_every_engine_feeds_the_states_the_draft_was_trained_on(n, layers, expected):
    cfg = _config(layers, n)
    problems = engine_problems(layers, n)
    counts = count_problems(len(layers))
    for engine in ENGINES:
        try:
            fed = engine_feed(engine, cfg, n)
        except EngineLoadError:
            fed = None
        kind = expected.get("vllm" if engine == "vllm-v1" else engine)
        if kind is None:
            assert fed == tuple(layers), engine
            assert engine not in problems and engine not in counts
        elif kind == "state":
            assert fed != tuple(layers), engine
            assert engine in problems, engine
        else:  # "count": the states are right where the engine loads the count at all
            assert engine in counts, engine
            assert fed is None or fed == tuple(layers), engine


def test_engine_rules_match_the_engines_defaults_and_shifts():
    n = 30
    # no ids anywhere: vLLM and SGLang capture EAGLE-3's default (2, N//2, N-3); SpecForge's [1, N//2-1, N-4] + 1
    assert {engine_feed(e, {}, n) for e in CHECKED} == {(2, 15, 27)}
    # SGLang/SpecForge read only eagle_config, and add one
    cfg = {"eagle_aux_hidden_state_layer_ids": [9, 9, 9], "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]}}
    assert engine_feed("sglang", cfg, n) == engine_feed("specforge", cfg, n) == (2, 15, 27)
    assert engine_feed("vllm", {"eagle_aux_hidden_state_layer_ids": [2, 15, 27]}, n) == (2, 15, 27)
    # a config with only eagle_config's list (SpecForge's): vLLM's V1 runner reads it *unshifted*, one layer shallow;
    # its runner V2 (the GPU default) does not read it at all and captures its default layers
    only = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [4, 17, 25]}}
    assert engine_feed("vllm-v1", only, n) == (4, 17, 25)
    assert engine_reading("vllm", only, n).default and engine_feed("vllm", only, n) == (2, 15, 27)
    with pytest.raises(EngineLoadError, match="exactly three"):
        engine_feed("specforge", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14]}}, n)
    # SGLang on DeepSeek-V2/V3 and GLM-4.7-Flash targets adds one only when the first id is 1 (sglang#25454)
    assert engine_feed("sglang", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]}}, n,
                       "deepseek_v3") == (2, 15, 27)
    assert engine_feed("sglang", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 15, 27]}}, n,
                       "glm4_moe_lite") == (2, 15, 27)
    assert engine_problems((4, 12, 14), n, family="deepseek_v3").keys() == {"sglang"}
    # a speculators checkpoint: vLLM reads the top-level ids and builds fc for 3 states, whatever the list holds
    spec = {"speculators_model_type": "eagle3", "eagle_aux_hidden_state_layer_ids": [3, 9, 15, 27],
            "transformer_layer_config": {"num_hidden_layers": 1}}
    assert engine_reading("speculators", spec, n).slots == 3
    with pytest.raises(EngineLoadError, match="4 state"):
        engine_feed("speculators", spec, n)
    assert engine_reading("speculators", {**spec, "eagle_aux_hidden_state_layer_ids": None}, n).default


# DFlash-style readers, from their code (elsi.engines.rules): vLLM's runners add 1 to dflash_config.target_layer_ids
# and size fc from the list; SGLang adds 1 (set_dflash_layers_to_capture); SpecForge reads hidden_states[j + 1]
# in the listed order; the default is DFlash's build_target_layer_ids(N, draft layers) + 1
DFLASH_CASES = [
    (36, {"dflash_config": {"target_layer_ids": [1, 9, 17, 25, 33]}}, (2, 10, 18, 26, 34), {}),
    (30, {"target_layer_ids": [4, 11, 17, 21, 28]}, (5, 12, 18, 22, 29), {"vllm-v1": "default"}),
    (30, {"dflash_config": {"target_layer_ids": [20, 4, 11]}}, (5, 12, 21), {"specforge": (21, 5, 12)}),
    (30, {"dflash_config": {"mask_token_id": 0}, "num_hidden_layers": 5}, (2, 9, 15, 21, 28),
     {"vllm": "default", "vllm-v1": "default"}),
]


@pytest.mark.parametrize("n,cfg,expected,other", DFLASH_CASES)
def test_dflash_readers(n, cfg, expected, other):
    for engine in ENGINES:
        r = engine_reading(engine, cfg, n)
        want = other.get(engine, expected)
        if want == "default":  # the reader finds no id: vLLM captures EAGLE-3's default layers
            assert r.default and r.fed == (2, n // 2, n - 3), engine
        else:
            assert r.fed == want, engine
            assert r.default == ("mask_token_id" in str(cfg)), engine  # case 4 has no ids: DFlash's own default


@pytest.mark.parametrize("layers", [(2, 10, 18, 26, 34), (5, 12, 18, 22, 29), (3, 15)])
def test_export_dflash_fragment_is_read_as_the_layers_by_every_reader(layers):
    n = 36
    frag = export_fragment(layers, n, "dflash")
    assert frag["dflash_config"]["target_layer_ids"] == [i - 1 for i in layers] and "id - 1" in frag["_elsi_note"]
    for engine in ENGINES:
        assert engine_feed(engine, frag, n) == tuple(layers), engine


def test_dflash_default_rule_is_dflash_s():
    assert dflash_default_ids(36, 5) == (1, 9, 17, 25, 33)  # Qwen3-4B
    assert dflash_default_ids(30, 5) == (1, 8, 14, 20, 27)
    assert dflash_default_ids(30, 1) == (15,)


def test_config_carries_both_numberings_and_old_configs_are_detected_and_upgraded(tmp_path, tiny_target):
    cfg = _config((2, 15, 27), 30)
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    assert cfg["fc_norm"] is False and not stale_eagle_config(cfg)
    # a draft written before the fix: eagle_config repeated the vLLM ids, SGLang captured every layer one deeper
    draft = random_draft(tiny_target, [2, 4, 6], draft_vocab=40)
    draft.save_pretrained(tmp_path)
    old = json.loads((tmp_path / "config.json").read_text())
    old["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 4, 6]
    del old["fc_norm"]
    (tmp_path / "config.json").write_text(json.dumps(old))
    assert stale_eagle_config(old)
    assert engine_feed("sglang", old, 8) == (3, 5, 7)
    with pytest.warns(UserWarning, match="elsi upgrade-draft"):
        Eagle3Draft.from_pretrained(tmp_path, tiny_target.adapter.embed_tokens(tiny_target.model), 8)
    assert main(["upgrade-draft", "--draft", str(tmp_path)]) == 0
    new = json.loads((tmp_path / "config.json").read_text())
    assert not stale_eagle_config(new)
    assert all(engine_feed(e, new, 8) == (2, 4, 6) for e in ENGINES)
    assert upgrade_draft(tmp_path) == []  # idempotent


def _rmsnorm(x, w, eps):
    """RMSNorm as vLLM/SGLang/SpecForge apply it to each aux chunk (x * rsqrt(mean(x^2) + eps) * w)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def test_fc_norm_is_stored_per_layer_as_eagle31_and_computes_the_engines_formula(tmp_path, tiny_target):
    from elsi.draft.model import config_for_target, init_weights

    cfg = config_for_target(tiny_target, (2, 4, 6), draft_vocab_size=tiny_target.model.config.vocab_size, fc_norm=True)
    draft = Eagle3Draft(cfg, tiny_target.adapter.embed_tokens(tiny_target.model))
    init_weights(draft, torch.Generator().manual_seed(0))
    with torch.no_grad():
        draft.fc_norm.copy_(torch.rand(draft.fc_norm.shape, generator=torch.Generator().manual_seed(1)) + 0.5)
    draft.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert "fc_norm" not in tensors
    assert [tuple(tensors[f"fc_norm.{i}.weight"].shape) for i in range(3)] == [(32,)] * 3
    assert json.loads((tmp_path / "config.json").read_text())["fc_norm"] is True
    aux = torch.randn(1, 5, 3 * 32, generator=torch.Generator().manual_seed(2)) * 7
    chunks = aux.chunk(3, dim=-1)
    ref = torch.cat([_rmsnorm(c, tensors[f"fc_norm.{i}.weight"], cfg.rms_norm_eps) for i, c in enumerate(chunks)], -1)
    ref = ref @ tensors["fc.weight"].T  # (1, 5, d): the engines' fc(cat(norm_i(chunk_i)))
    back = Eagle3Draft.from_pretrained(tmp_path, tiny_target.adapter.embed_tokens(tiny_target.model), 8)
    torch.testing.assert_close(back.fuse(aux), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(back.fuse(aux), draft.fuse(aux))


def _foreign_copy(src, dst, mode: str) -> None:
    """Rewrite an elsi draft as another tool would: SpecForge (eagle_config in SGLang numbering, midlayer.*,
    its own embed_tokens) or speculators (layers.0.*, transformer_layer_config, top-level ids)."""
    cfg = json.loads((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    ids = cfg.pop("eagle_aux_hidden_state_layer_ids")
    del cfg["elsi"]
    if mode == "specforge":
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids]}
        out = cfg
    else:
        layer = {k: cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                      "intermediate_size", "vocab_size", "rms_norm_eps", "max_position_embeddings",
                                      "hidden_act", "rope_theta")}
        out = {"speculators_model_type": "eagle3", "eagle_aux_hidden_state_layer_ids": ids,
               "draft_vocab_size": cfg["draft_vocab_size"], "target_hidden_size": cfg["target_hidden_size"],
               "transformer_layer_config": layer}
        tensors = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v for k, v in tensors.items()}
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(out))
    return tensors


@pytest.mark.parametrize("mode", ["specforge", "speculators"])
def test_a_draft_from_another_tool_loads_from_the_standard_keys(tmp_path, tiny_target, mode):
    embed = tiny_target.adapter.embed_tokens(tiny_target.model)
    draft = random_draft(tiny_target, [2, 4, 6], draft_vocab=40, seed=3)
    draft.save_pretrained(tmp_path / "elsi")
    tensors = _foreign_copy(tmp_path / "elsi", tmp_path / mode, mode)
    if mode == "specforge":
        tensors["embed_tokens.weight"] = embed.weight.detach().clone()  # SpecForge saves the target's embeddings
    save_file(tensors, str(tmp_path / mode / "model.safetensors"))
    back = Eagle3Draft.from_pretrained(tmp_path / mode, embed, 8)
    assert back.layer_ids == (2, 4, 6)
    ids = torch.tensor([[5, 9, 11, 3]])
    hidden = torch.randn(1, 4, 32, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(4)[None]
    torch.testing.assert_close(back(ids, hidden, pos)[0], draft(ids, hidden, pos)[0])
    with pytest.raises(ValueError, match="pass the target's number of layers"):
        Eagle3Draft.from_pretrained(tmp_path / mode, embed)


def test_a_config_that_is_no_eagle3_config_is_a_clear_error(tmp_path, tiny_target):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="neither an elsi draft nor an EAGLE3"):
        Eagle3Draft.from_pretrained(tmp_path, tiny_target.adapter.embed_tokens(tiny_target.model), 8)


def test_a_draft_for_another_target_is_refused(tmp_path, tiny_target):
    from elsi.draft.model import check_fits_target

    draft = random_draft(tiny_target, [2, 4, 6], draft_vocab=40)
    draft.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["elsi"]["draft_config"]["target_num_layers"] = 40
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"records 40 layers \(the model has 8\)"):
        Eagle3Draft.from_pretrained(tmp_path, tiny_target.adapter.embed_tokens(tiny_target.model), 8)
    with pytest.raises(ValueError, match=r"hidden size 32 \(the model's is 64\)"):
        check_fits_target(DraftConfig.from_json(cfg), 40, 64)


def test_export_numbering_per_runtime():
    v = export_fragment((27, 2, 15), 30, "vllm")
    assert v["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    for fmt in ("sglang", "specforge"):
        f = export_fragment((2, 15, 27), 30, fmt)
        assert f["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 14, 26], "use_aux_hidden_state": True}
        assert "id - 1" in f["_elsi_note"]
    with pytest.raises(ValueError, match=r"\[30\] cannot be exported"):
        export_fragment((2, 30), 30, "vllm")
    with pytest.raises(ValueError, match=r"\[0\] cannot be exported"):
        export_fragment((0, 5), 30, "sglang")
    with pytest.raises(ValueError, match="SpecForge trains and exports exactly 3"):
        export_fragment((2, 15), 30, "specforge")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        export_fragment((2, 15), 30, "vllm")
        export_fragment((2, 15), 30, "sglang")
    assert len(w) == 2 and all("vLLM" in str(x.message) and "hard-code" in str(x.message) for x in w)


def test_export_cli_checks_before_writing(tmp_path, capsys):
    assert main(["export", "--format", "speculators", "--layers", "2,15,27"]) == 2
    assert "--draft DIR and --out" in capsys.readouterr().err
    assert main(["export"]) == 2
    assert "nothing to export" in capsys.readouterr().err
    assert main(["export", "--layers", "2,15,27", "--format", "vllm"]) == 2  # no default model to check the ids on
    assert "--layers IDS alone names no target: pass --model" in capsys.readouterr().err


def _run_with_choice(tiny_run, dst, chosen, extra=()):
    """A copy of the 8-layer tiny run whose selections.json chose ``chosen`` (ELSI), with ``extra`` results."""
    import shutil

    shutil.copytree(tiny_run, dst)
    res = [{"method": "elsi", "m": len(ids), "layers": list(ids)} for ids in (chosen, *extra)]
    (dst / "selections.json").write_text(json.dumps({"results": res, "chosen": res[0]}))
    return dst


def _model_dir(path, num_layers):
    from conftest import make_tiny_target

    t = make_tiny_target(num_layers=num_layers)
    t.model.save_pretrained(path)
    t.tokenizer.save_pretrained(path)
    return path


def test_export_takes_the_model_the_run_records(tiny_run, tmp_path, capsys):
    """The issue's case: a run of a shallow model exported without --model was checked against the default
    SmolLM2 (N = 30), accepted the run's final layer h_N and named the wrong model in its note."""
    run = _run_with_choice(tiny_run, tmp_path / "run", (3, 5, 8))  # h_8 = h_N of the run's 8-layer model
    assert main(["export", "--layers", "chosen", "--run", str(run), "--format", "sglang"]) == 2
    assert "[8] cannot be exported for N = 8" in capsys.readouterr().err
    run2 = _run_with_choice(tiny_run, tmp_path / "run2", (2, 4, 6))
    assert main(["export", "--layers", "chosen", "--run", str(run2), "--format", "sglang"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    assert "of tiny with N = 8" in out.err and f"the run ({run2})" in out.err
    # a --model that contradicts the run is an error naming both
    other = _model_dir(tmp_path / "four", 4)
    assert main(["export", "--layers", "chosen", "--run", str(run2), "--format", "vllm", "--model", str(other)]) == 2
    err = capsys.readouterr().err
    assert f"--model {other} (N = 4, hidden 32) contradicts the run {run2}, which records tiny (N = 8" in err


def test_export_takes_the_target_the_draft_records(tmp_path, tiny_target, capsys):
    draft = random_draft(tiny_target, [2, 4, 6], draft_vocab=40)
    draft.save_pretrained(tmp_path / "d")
    assert main(["export", "--draft", str(tmp_path / "d"), "--format", "sglang"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    assert "with N = 8" in out.err and "the draft (" in out.err
    other = _model_dir(tmp_path / "four", 4)
    assert main(["export", "--draft", str(tmp_path / "d"), "--format", "vllm", "--model", str(other)]) == 2
    assert "contradicts the draft" in capsys.readouterr().err
    # a speculators checkpoint names its verifier: a draft without a recorded model needs --model (or a default that
    # matches its recorded N, hidden size and vocabulary, which the tiny target's is not)
    assert main(["export", "--draft", str(tmp_path / "d"), "--format", "speculators", "--out", str(tmp_path / "s")]) == 2
    assert "records no target model" in capsys.readouterr().err


def test_export_dflash_takes_the_runs_five_layer_selection(tiny_run, tmp_path, capsys):
    run = _run_with_choice(tiny_run, tmp_path / "run", (2, 4, 6), extra=[(1, 2, 4, 6, 7)])
    assert main(["export", "--layers", "chosen", "--run", str(run), "--format", "dflash"]) == 0
    out = capsys.readouterr()
    frag = json.loads(out.out)
    assert frag["dflash_config"] == {"target_layer_ids": [0, 1, 3, 5, 6]} and "DFlash numbering" in out.err
    assert all(engine_feed(e, frag, 8) == (1, 2, 4, 6, 7) for e in ENGINES)
    run2 = _run_with_choice(tiny_run, tmp_path / "run2", (2, 4, 6))
    assert main(["export", "--layers", "chosen", "--run", str(run2), "--format", "dflash"]) == 2
    assert "--method elsi --m 5` first" in capsys.readouterr().err
    assert main(["export", "--layers", "chosen", "--run", str(run2), "--format", "dflash", "--m", "3"]) == 0
    assert json.loads(capsys.readouterr().out)["dflash_config"]["target_layer_ids"] == [1, 3, 5]


def test_bench_engine_vllm_without_its_environment_fails_before_any_model_loads(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ELSI_VLLM_PYTHON", str(tmp_path / "no-venv" / "python"))
    monkeypatch.setattr("elsi.cli.decode.load_target", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main(["bench", "--engine", "vllm", "--model", str(tmp_path), "--questions-per-subtask", "1"]) == 2
    err = capsys.readouterr().err
    assert "no vLLM environment" in err and "make vllm" in err


def test_bench_engine_vllm_no_plain_without_a_draft_fails_before_any_model_loads(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ELSI_VLLM_PYTHON", sys.executable)  # an environment that exists: the check is ours
    monkeypatch.setattr("elsi.cli.decode.load_target", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main(["bench", "--engine", "vllm", "--no-plain", "--model", str(tmp_path)]) == 2
    assert "--no-plain times nothing without a --draft" in capsys.readouterr().err


def test_bench_engine_vllm_refuses_a_draft_directory_vllm_would_misload(tmp_path, tiny_target, monkeypatch, capsys):
    """vLLM loads every *.safetensors of a draft directory: a stray one (e.g. a checkpoint) is refused up front."""
    model_dir = tmp_path / "model"
    tiny_target.model.save_pretrained(model_dir)
    tiny_target.tokenizer.save_pretrained(model_dir)
    random_draft(tiny_target, [2, 4, 6], draft_vocab=40).save_pretrained(tmp_path / "draft")
    save_file({"x": torch.zeros(1)}, str(tmp_path / "draft" / "checkpoint.safetensors"))
    python = tmp_path / "python"
    python.write_text("")
    monkeypatch.setenv("ELSI_VLLM_PYTHON", str(python))
    monkeypatch.setattr("elsi.cli.decode.load_target", lambda *a, **k: pytest.fail("the model was loaded"))
    argv = ["bench", "--engine", "vllm", "--model", str(model_dir), "--draft", str(tmp_path / "draft")]
    assert main(argv) == 2
    assert "['checkpoint.safetensors'] besides model.safetensors" in capsys.readouterr().err
    (tmp_path / "draft" / "checkpoint.safetensors").unlink()
    cfg = json.loads((tmp_path / "draft" / "config.json").read_text())  # a draft on the final, normed state h_N
    cfg["elsi"]["draft_config"]["layer_ids"] = [2, 4, 8]
    (tmp_path / "draft" / "config.json").write_text(json.dumps(cfg))
    assert main(argv) == 2
    assert "vllm cannot serve a draft over layers [2, 4, 8]" in capsys.readouterr().err


def test_engine_summary_counts_emitted_tokens_and_keeps_vllms_counter():
    """Both engines' τ = emitted tokens per verification step; vLLM's counter also counts drafts accepted past
    the stop (here 2 extra on one question), which the agreement must not mistake for a drafting difference."""
    from elsi.data.spec_bench import load_questions
    from elsi.engines.vllm import VllmBenchConfig, summarize_engines, tau_agreement
    from elsi.specbench.runner import Answer, BenchConfig

    qs = load_questions(["qa", "rag"], 3)
    answers, tokens = [], {}
    for i, q in enumerate(qs):
        new = 40 + i
        steps = 20 + i
        for method, k, acc in (("plain", None, new - 1), ("vllm_plain", None, new - 1), ("spec", 2, new - 1),
                               ("vllm_spec", 2, new - 1 + (2 if i == 0 else 0))):
            answers.append(Answer(q.question_id, q.subtask, method, 0.0, k, new, 1.0, steps if k else new - 1, acc,
                                  {"vllm_accepted_pos0": 5.0, "vllm_accepted_pos1": 2.0} if method == "vllm_spec" else {}))
            tokens[(method, k, q.question_id)] = list(range(new))
    bench = BenchConfig(subtasks=["qa", "rag"], questions_per_subtask=3)
    res = summarize_engines(answers, tokens, qs, VllmBenchConfig(spec_tokens=[2], bootstrap=200), bench)
    row = res["tau_agreement"][0]
    assert row["steps_equal"] == row["emitted_equal"] == 6
    assert row["overall"]["diff"] == 0 and row["overall"]["agree"]
    assert row["vllm_counter"]["diff"] > 0
    spec = next(r for r in res["runs"] if r["method"] == "vllm_spec")
    assert spec["overall"]["tau"] == pytest.approx(sum(39 + i for i in range(6)) / sum(20 + i for i in range(6)))
    assert spec["overall"]["tau_vllm_counter"] > spec["overall"]["tau"]
    assert spec["greedy_equal_vllm_plain"] == 6
    # the bootstrap interval of a real difference excludes 0
    far = tau_agreement([10] * 6, [10] * 6, [15] * 6, [10] * 6, 200)
    assert far["diff"] == pytest.approx(0.5) and not far["agree"]


def test_engine_agreement_rows_say_what_was_compared():
    """An agreement where neither engine accepted a draft token (τ = 1 on both) says nothing was compared, not
    "yes"; vLLM's own counter row is shown and labelled as counting drafts past the stop, not judged."""
    from elsi.data.spec_bench import load_questions
    from elsi.engines.vllm import VllmBenchConfig, agreement_rows, summarize_engines, tau_agreement
    from elsi.specbench.runner import Answer, BenchConfig

    none = tau_agreement([10] * 4, [10] * 4, [10] * 4, [10] * 4, 100)
    assert none["agree"] and none["nothing_accepted"]
    assert not tau_agreement([10] * 4, [10] * 4, [12] * 4, [10] * 4, 100)["nothing_accepted"]
    qs = load_questions(["qa"], 2)
    answers, tokens = [], {}
    for q in qs:
        for method, k, acc in (("spec", 1, 20), ("vllm_spec", 1, 21)):
            # 21 tokens in 20 steps: one prefill token and one per step, no draft accepted (vLLM's counter: +1 past the stop)
            answers.append(Answer(q.question_id, q.subtask, method, 0.0, k, 21, 1.0, 20, acc, {"vllm_accepted_pos0": 0.0}))
            tokens[(method, k, q.question_id)] = list(range(21))
    res = summarize_engines(answers, tokens, qs, VllmBenchConfig(spec_tokens=[1], bootstrap=100),
                            BenchConfig(subtasks=["qa"], questions_per_subtask=2))
    header, rows = agreement_rows(res)
    verdict = {r[1]: r[header.index("agree")] for r in rows}
    assert verdict["all"] == verdict["qa"] == "nothing compared: no draft accepted"
    assert verdict["all, vLLM's own counter"] == "not judged: counts drafts past the stop"


def test_vllm_worker_preloads_intel_openmp_where_asked(tmp_path, monkeypatch):
    """--vllm-preload iomp puts the vLLM environment's libiomp5.so first in the worker's LD_PRELOAD (x86, no
    CUDA); none, an LD_PRELOAD that has it already, or an environment without it leave LD_PRELOAD alone."""
    import platform

    import elsi.engines.vllm as ev

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    monkeypatch.setenv(ev.VENV_ENV, str(venv / "bin" / "python"))
    assert ev.iomp_library() is None and ev.preload_env("iomp") == {}
    (venv / "lib").mkdir()
    (venv / "lib" / "libiomp5.so").write_text("")
    assert ev.iomp_library() == venv / "lib" / "libiomp5.so"
    if platform.machine() in ("x86_64", "AMD64") and not torch.cuda.is_available():
        assert ev.preload_env("iomp") == {"LD_PRELOAD": str(venv / "lib" / "libiomp5.so")}
        assert ev.preload_env("iomp", "/x/libfoo.so") == {"LD_PRELOAD": f"{venv / 'lib' / 'libiomp5.so'}:/x/libfoo.so"}
    assert ev.preload_env("iomp", "/opt/libiomp5.so") == {} and ev.preload_env("none") == {}
    with pytest.raises(ValueError, match="--vllm-preload must be one of iomp, none, got 'gnu'"):
        ev.preload_env("gnu")

def test_vllm_bench_keeps_finished_configurations_across_an_interrupt(tmp_path, tiny_target, monkeypatch):
    """`elsi bench --engine vllm` and the study's vLLM step: a configuration (method, k) that finished is kept in
    the progress file and not run again after an interruption; the results equal an uninterrupted run's. vLLM
    itself is a stand-in here (greedy decoding by the target; tests/test_vllm.py runs the real one)."""
    import elsi.engines.vllm as ev
    from elsi.engines.vllm import VllmBenchConfig, run_vllm_bench
    from elsi.specbench.runner import BenchConfig, progress_path

    draft = tmp_path / "draft"
    random_draft(tiny_target, [2, 4, 6], draft_vocab=40).save_pretrained(draft)
    started = []

    class FakeWorker:
        def __init__(self, model, draft=None, k=3, **kw):
            self.k = k if draft else 0
            started.append((bool(draft), self.k))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def capture(self, ids):  # the draft's layers, as the real vLLM captures them (tests/test_vllm.py)
            with torch.no_grad():
                hs = tiny_target.model(torch.tensor([ids]), output_hidden_states=True).hidden_states
            return {"layer_ids": [2, 4, 6], "states": [hs[l][0].tolist() for l in (2, 4, 6)]}

        def generate(self, ids, max_tokens, stop):
            if os.environ.get("FAKE_VLLM_FAIL") == str(self.k):
                raise KeyboardInterrupt
            with torch.no_grad():
                out = tiny_target.model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False)
            new = out[0, len(ids):].tolist()
            return {"token_ids": new, "time_s": 0.01, "spec": {"drafts": len(new), "accepted_tokens": 0,
                                                               "draft_tokens": len(new) * self.k,
                                                               "accepted_per_pos": [0] * self.k}}

    monkeypatch.setattr(ev, "VllmWorker", FakeWorker)
    bench = BenchConfig(subtasks=["qa"], questions_per_subtask=2, max_new_tokens=4, hf_generate=False)
    vcfg = VllmBenchConfig(engine="vllm", spec_tokens=[1, 2], bootstrap=20)
    ref = run_vllm_bench(tiny_target, str(draft), bench, vcfg, plain=False)
    assert [(c["k"], c["ok"]) for c in ref["states_check"]] == [(1, True), (2, True)]  # first question of every run
    out = tmp_path / "res.json"
    monkeypatch.setenv("FAKE_VLLM_FAIL", "2")  # interrupted in vLLM's k = 2
    started.clear()
    with pytest.raises(KeyboardInterrupt):
        run_vllm_bench(tiny_target, str(draft), bench, vcfg, plain=False, progress=progress_path(out))
    kept = json.loads(progress_path(out).read_text())["done"]
    assert set(kept) == {"spec:1", "spec:2", "vllm_spec:1"} and started == [(True, 1), (True, 2)]
    monkeypatch.delenv("FAKE_VLLM_FAIL")
    started.clear()
    res = run_vllm_bench(tiny_target, str(draft), bench, vcfg, plain=False, progress=progress_path(out))
    assert started == [(True, 2)]  # only the unfinished configuration ran again
    strip = lambda r: [{k: v for k, v in a.items() if k not in ("time_s", "profile")} for a in r["answers"]]  # noqa: E731
    assert strip(res) == strip(ref) and res["tokens"] == ref["tokens"]
    # other settings: the progress file is not used (a warning says so)
    with pytest.warns(UserWarning, match="progress of other settings"):
        run_vllm_bench(tiny_target, str(draft), bench, VllmBenchConfig(engine="vllm", spec_tokens=[1], bootstrap=20),
                       plain=False, progress=progress_path(out))
