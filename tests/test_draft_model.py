"""The EAGLE3 draft: names and shapes, TTT attention = cached drafting, persistence, vocab maps."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_target

from elsi.draft import DraftCache, Eagle3Draft, random_draft
from elsi.draft.features import parse_layers
from elsi.draft.model import config_for_target
from elsi.draft.vocab import build_vocab, draft_to_target, target_to_draft, top_tokens, vocab_maps


@pytest.fixture(scope="module")
def target():
    return make_tiny_target(num_layers=6, hidden=32)


def vocab_of(target) -> int:
    return target.model.get_input_embeddings().weight.shape[0]


@pytest.mark.parametrize("layers", [[6], [2, 5], [1, 3, 5]])
def test_names_and_shapes(target, tmp_path, layers):
    d, v, m, vd = 32, vocab_of(target), len(layers), 100
    draft = random_draft(target, layers, draft_vocab=vd)
    kvh, hd, inter = 2, 8, 64
    want = {
        "fc.weight": (d, m * d),
        "midlayer.input_layernorm.weight": (d,),
        "midlayer.hidden_norm.weight": (d,),
        "midlayer.self_attn.q_proj.weight": (4 * hd, 2 * d),
        "midlayer.self_attn.k_proj.weight": (kvh * hd, 2 * d),
        "midlayer.self_attn.v_proj.weight": (kvh * hd, 2 * d),
        "midlayer.self_attn.o_proj.weight": (d, 4 * hd),
        "midlayer.post_attention_layernorm.weight": (d,),
        "midlayer.mlp.gate_proj.weight": (inter, d),
        "midlayer.mlp.up_proj.weight": (inter, d),
        "midlayer.mlp.down_proj.weight": (d, inter),
        "norm.weight": (d,),
        "lm_head.weight": (vd, d),
        "d2t": (vd,),
        "t2d": (v,),
    }
    draft.save_pretrained(tmp_path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        got = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        assert f.get_tensor("d2t").dtype == torch.int64 and f.get_tensor("t2d").dtype == torch.bool
    assert got == want
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == layers
    # SGLang and SpecForge read only eagle_config, in their numbering (the output of layer i = our id - 1)
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in layers]
    assert cfg["fc_norm"] is False
    assert cfg["draft_vocab_size"] == vd and cfg["vocab_size"] == v
    assert cfg["target_hidden_size"] == d and cfg["hidden_size"] == d
    assert cfg["num_hidden_layers"] == 1 and cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    # forward shapes
    ids = torch.randint(0, v, (2, 5))
    logits, hid = draft(ids, draft.fuse(torch.randn(2, 5, m * d)), torch.arange(5).expand(2, 5))
    assert logits.shape == (2, 5, vd) and hid.shape == (2, 5, d)


def test_ttt_unroll_equals_cached_chain_drafting(target):
    """Step j of the TTT unroll at row i == drafting depth j on top of root i with a KV cache."""
    draft = random_draft(target, [1, 3, 6], seed=3)
    v, t, steps = vocab_of(target), 12, 4
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, v, (1, t), generator=gen)
    g = draft.fuse(torch.randn(1, t, 96, generator=gen))
    pos = torch.arange(t)[None]
    with torch.no_grad():
        outs = draft.unroll(g, ids, pos, steps)
        for root in (0, 4, 7):
            cache = DraftCache()
            logits, hid = draft(ids[:, : root + 1], g[:, : root + 1], pos[:, : root + 1], cache=cache)
            torch.testing.assert_close(logits, outs[0][0][:, : root + 1], atol=1e-5, rtol=1e-5)
            h = hid[:, root:]
            for j in range(1, steps):
                logits, h = draft(ids[:, root + j: root + j + 1], h, pos[:, root: root + 1] + j, cache=cache)
                torch.testing.assert_close(logits[:, 0], outs[j][0][:, root], atol=1e-5, rtol=1e-5)
            assert cache.length == root + steps


def test_explicit_mask_and_cache_ops(target):
    draft = random_draft(target, [2], seed=1)
    v = vocab_of(target)
    ids = torch.randint(0, v, (1, 6))
    g = draft.fuse(torch.randn(1, 6, 32))
    pos = torch.arange(6)[None]
    with torch.no_grad():
        ref, _ = draft(ids, g, pos)
        mask = torch.full((6, 6), float("-inf")).triu(1)[None, None]  # (1, 1, T, T) additive causal
        got, _ = draft(ids, g, pos, attention_mask=mask)
        torch.testing.assert_close(got, ref)
        # Prefix in the cache, then the rest: same logits as one pass.
        cache = DraftCache()
        draft(ids[:, :4], g[:, :4], pos[:, :4], cache=cache)
        tail, _ = draft(ids[:, 4:], g[:, 4:], pos[:, 4:], cache=cache)
        torch.testing.assert_close(tail, ref[:, 4:], atol=1e-5, rtol=1e-5)
        cache.crop(4)
        assert cache.length == 4
        cache.select([0, 1, 3])
        assert cache.length == 3
        with pytest.raises(ValueError, match="crop"):
            cache.crop(9)
        with pytest.raises(ValueError, match="attention_mask"):
            draft(ids[:, :2], g[:, :2], pos[:, :2], cache=DraftCache(), attention_mask=torch.zeros(1, 1, 2, 5))


def test_save_load_round_trip_identical_logits(target, tmp_path):
    draft = random_draft(target, [1, 4, 6], draft_vocab=list(range(10, 150, 2)), seed=7)
    draft.save_pretrained(tmp_path)
    back = Eagle3Draft.from_pretrained(tmp_path, target.adapter.embed_tokens(target.model))
    assert back.layer_ids == (1, 4, 6)
    ids = torch.randint(0, vocab_of(target), (2, 9))
    aux = torch.randn(2, 9, 96)
    pos = torch.arange(9).expand(2, 9)
    with torch.no_grad():
        a = draft.unroll(draft.fuse(aux), ids, pos, 3)
        b = back.unroll(back.fuse(aux), ids, pos, 3)
    for (la, ha), (lb, hb) in zip(a, b):
        assert torch.equal(la, lb) and torch.equal(ha, hb)
    assert torch.equal(draft.d2t, back.d2t) and torch.equal(draft.t2d, back.t2d)


def test_vocab_maps_round_trip():
    v = 50
    counts = torch.tensor([(7 * i) % 13 for i in range(v)])
    ids = top_tokens(counts, 10)
    # reference: the 10 largest counts, ties to the lower id
    ref = sorted(sorted(range(v), key=lambda i: (-int(counts[i]), i))[:10])
    assert ids.tolist() == ref
    d2t, t2d = vocab_maps(ids, v)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and int(t2d.sum()) == 10
    draft_ids = torch.arange(10)
    assert draft_to_target(draft_ids, d2t).tolist() == ref
    assert target_to_draft(torch.tensor(ref), t2d).tolist() == list(range(10))
    outside = [i for i in range(v) if i not in ref]
    assert (target_to_draft(torch.tensor(outside), t2d) == -1).all()
    _, d2t2, t2d2, cnt = build_vocab([torch.tensor([3, 3, 3, 1, 1, 0]), [4]], 6, 2)
    assert draft_to_target(torch.arange(2), d2t2).tolist() == [1, 3] and cnt.tolist() == [1, 2, 0, 3, 1, 0]
    with pytest.raises(ValueError, match="out of range"):
        build_vocab([[7]], 6, 2)
    with pytest.raises(ValueError, match="repeat"):
        vocab_maps(torch.tensor([1, 1]), 6)


def test_layer_ids_out_of_range_are_clear_errors(target):
    with pytest.raises(ValueError, match=r"layer id\(s\) \[7\] out of range.*0\.\.6"):
        config_for_target(target, [2, 7])
    with pytest.raises(ValueError, match=r"\[-1\] out of range"):
        parse_layers("-1,2", 6)
    with pytest.raises(ValueError, match=r"\[31\] out of range"):
        parse_layers("2,15,31", 30)
    with pytest.raises(ValueError, match="bad layer id"):
        parse_layers("2,x", 30)
    assert parse_layers("27,2,15", 30) == (2, 15, 27)
    assert parse_layers("3-5", 30) == (3, 4, 5)
    draft = random_draft(target, [1, 2])
    with pytest.raises(ValueError, match="aux has width 32"):
        draft.fuse(torch.randn(1, 3, 32))


def test_aux_scale_folds_into_fc(target, tmp_path):
    """Training fc on rescaled inputs and folding the scale into fc's columns computes the same function."""
    draft = random_draft(target, [1, 3, 6], seed=2)
    gen = torch.Generator().manual_seed(0)
    aux = torch.randn(2, 7, 96, generator=gen) * torch.linspace(0.1, 300.0, 96)  # (B, T, m·d), a few huge features
    scale = 1.0 / torch.linspace(0.1, 300.0, 96)
    ids = torch.randint(0, vocab_of(target), (2, 7), generator=gen)
    pos = torch.arange(7).expand(2, 7)
    draft.set_aux_scale(scale)
    with torch.no_grad():
        before, _ = draft(ids, draft.fuse(aux), pos)
    with pytest.raises(ValueError, match="fold_aux_scale"):
        draft.save_pretrained(tmp_path)
    draft.fold_aux_scale()
    assert draft.aux_scale is None
    with torch.no_grad():
        after, _ = draft(ids, draft.fuse(aux), pos)
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)
    draft.save_pretrained(tmp_path)
    assert set(load_names(tmp_path)) == set(draft.state_dict())
    with pytest.raises(ValueError, match=r"aux scale of shape \(5,\)"):
        draft.set_aux_scale(torch.ones(5))


def load_names(path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return list(f.keys())


def test_logits_to_keep_gives_the_last_rows(target):
    draft = random_draft(target, [2, 5], draft_vocab=64, seed=4).eval()
    d = target.hidden_size
    g = torch.randn(1, 7, d, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, 100, (1, 7), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(7)[None]
    with torch.no_grad():
        full, out = draft(ids, g, pos)
        last, out1 = draft(ids, g, pos, logits_to_keep=2)
    assert last.shape == (1, 2, 64)
    torch.testing.assert_close(last, full[:, -2:])
    torch.testing.assert_close(out1, out)
