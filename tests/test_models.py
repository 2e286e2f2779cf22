"""Resolving --model and the family registry."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from elsi.models import adapter_for, load_target, plain_template, resolve_model


def test_bad_model_specs_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown model 'nonsense'"):
        resolve_model("nonsense")
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        resolve_model(str(tmp_path / "missing.gguf"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(tmp_path / "empty"))


def test_unknown_family_lists_known_ones():
    class MyNewForCausalLM(nn.Module):
        pass

    with pytest.raises(ValueError, match="unsupported model class 'MyNewForCausalLM'.*LlamaForCausalLM"):
        adapter_for(MyNewForCausalLM())


def test_load_target_from_a_hf_directory(tiny_target, tmp_path):
    tiny_target.model.save_pretrained(tmp_path / "m")
    tiny_target.tokenizer.save_pretrained(tmp_path / "m")
    t = load_target(str(tmp_path / "m"))
    assert (t.num_layers, t.hidden_size, t.adapter.name) == (8, 32, "llama")
    x = torch.tensor([[1, 5, 9, 12]])
    with torch.no_grad():
        assert torch.allclose(t.model(x).logits, tiny_target.model(x).logits, atol=1e-6)


def test_plain_template_for_tokenizers_without_one():
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert plain_template(msgs, False) == "User: hi\n\nAssistant: yo\n\n"
    assert plain_template(msgs[:1], True) == "User: hi\n\nAssistant:"


def test_compile_where_inductor_cannot_build_is_a_clear_error(monkeypatch):
    from elsi.models.compiled import compiled

    cpu = torch.device("cpu")
    model = nn.Linear(3, 2)
    assert compiled(model, False, cpu, "--compile") is model
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr("shutil.which", lambda name: None)
    assert compiled(model, False, cpu, "--compile") is model  # off: nothing is checked
    with pytest.raises(ValueError, match="--train-compile: .*no C\\+\\+ compiler .*leave --train-compile out"):
        compiled(model, True, cpu, "--train-compile")
