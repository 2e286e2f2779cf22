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


def test_compile_modes_resolve_and_name_what_is_missing(monkeypatch):
    from elsi.models.compiled import AUTO_MIN_SAMPLES, want_compile

    cpu = torch.device("cpu")
    monkeypatch.setenv("CXX", "g++")
    assert want_compile("on", cpu, 1) and not want_compile("off", cpu, 10**6)
    assert want_compile("auto", cpu, AUTO_MIN_SAMPLES) and not want_compile("auto", cpu, AUTO_MIN_SAMPLES - 1)
    monkeypatch.delenv("CXX")
    monkeypatch.setattr("shutil.which", lambda name: None)
    assert not want_compile("auto", cpu, 10**6)  # no compiler: auto stays eager
    with pytest.raises(ValueError, match="--compile on: .*no C\\+\\+ compiler"):
        want_compile("on", cpu, 10**6)
    with pytest.raises(ValueError, match="got 'fast'"):
        want_compile("fast", cpu, 1)


def test_a_failed_compilation_warns_and_runs_eager(monkeypatch):
    from elsi.models.compiled import Forward

    def broken(model, **kw):
        def fn(**inputs):
            raise RuntimeError("inductor: no kernel\nstack")
        return fn

    monkeypatch.setattr(torch, "compile", broken)
    model = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    fwd = Forward(model, True)
    with pytest.warns(UserWarning, match="torch.compile failed \\(RuntimeError: inductor: no kernel\\)"):
        y = fwd(input=x)
    assert torch.equal(y, model(x)) and not fwd.compiled
    strict = Forward(model, True, strict=True)
    with pytest.raises(RuntimeError, match="no kernel"):
        strict(input=x)
