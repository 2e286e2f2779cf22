"""Draft training pipeline on a tiny random target: feature cache, loss, determinism, resume, evaluation."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_target, write_text_jsonl
from safetensors.torch import load_file

from elsi.data import load_dataset
from elsi.draft import Eagle3Draft
from elsi.draft.evaluate import evaluate_draft
from elsi.draft.cache import FeatureStore
from elsi.draft.features import FeatureConfig, build_features
from elsi.draft.train import TrainConfig, parse_duration, train_draft

LAYERS = "1,3,6"


@pytest.fixture(scope="module")
def target():
    t = make_tiny_target(num_layers=6, hidden=32, seed=1)
    with torch.no_grad():  # a peaked (learnable) next-token distribution instead of a near-uniform one
        t.model.lm_head.weight.mul_(60.0)
    return t


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_text_jsonl(tmp_path_factory.mktemp("draftdata") / "text.jsonl", n=16, words=100)


@pytest.fixture(scope="module")
def store(target, data, tmp_path_factory):
    cfg = FeatureConfig(model="tiny", data=str(data), samples=16, max_tokens=64, cache_layers="1,3,5,6",
                        features_dir=str(tmp_path_factory.mktemp("feat")))
    return build_features(target, load_dataset(str(data)), cfg, (1, 3, 6))


def train_cfg(out, **kw) -> TrainConfig:
    base = dict(layers=LAYERS, out=str(out), draft_vocab=150, ttt=3, lr=3e-3, warmup_steps=3, epochs=100.0,
                max_steps=30, time_budget="0", batch_size=2, heldout=0.2, eval_every="0", checkpoint_every="0.000001s")
    base.update(kw)
    return TrainConfig(**base)


def test_feature_cache_matches_target_and_is_reused(target, data, store, monkeypatch):
    assert store.layers == (1, 3, 5, 6) and len(store) == 16
    s = store.sample(0, store.layer_index([3, 6]))
    ids = s["ids"][None]
    with torch.no_grad():
        out = target.model(ids, output_hidden_states=True)
    ref = torch.cat([out.hidden_states[3], out.hidden_states[6]], dim=-1)[0]  # (T, 2d)
    assert s["aux"].dtype == torch.float16
    torch.testing.assert_close(s["aux"].float(), ref, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(s["final"].float(), out.hidden_states[-1][0], atol=2e-3, rtol=2e-3)
    assert torch.equal(s["argmax"], out.logits[0].argmax(-1))
    # A second build with the same settings does not run the target again.
    calls = []
    monkeypatch.setattr(target.model, "forward", lambda *a, **k: calls.append(1))
    cfg = FeatureConfig(model="tiny", data=str(data), samples=16, max_tokens=64, features_dir=str(store.path))
    again = build_features(target, load_dataset(str(data)), cfg, (1, 5))
    assert calls == [] and len(again) == 16


def _no_compiler() -> bool:
    from elsi.models.compiled import compile_support

    return not compile_support(torch.device("cpu"))[0]


needs_compiler = pytest.mark.skipif(_no_compiler(), reason="torch.compile needs a C++ compiler on this machine")


@needs_compiler
def test_compiled_feature_pass_stores_the_eager_features(target, data, store, tmp_path):
    """--compile: the same cache as the eager pass (float32 target: equal up to float16 storage and the
    fused kernels' rounding), the same hard labels."""
    cfg = FeatureConfig(model="tiny", data=str(data), samples=16, max_tokens=64, cache_layers="1,3,5,6",
                        features_dir=str(tmp_path / "feat"), compile=True)
    stages = []
    compiled = build_features(target, load_dataset(str(data)), cfg, (1, 3, 6), on_progress=lambda p: stages.append(p.stage))
    assert stages[0] == "compiling the forward" and stages[-1] == "forward"
    pos = store.layer_index([1, 3, 5, 6])
    for i in range(len(store)):
        a, b = store.sample(i, pos), compiled.sample(i, pos)
        assert torch.equal(a["ids"], b["ids"]) and torch.equal(a["argmax"], b["argmax"])
        torch.testing.assert_close(b["aux"].float(), a["aux"].float(), atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(b["final"].float(), a["final"].float(), atol=2e-3, rtol=2e-3)


def test_states_beyond_float16_are_stored_scaled_and_read_back(data, tmp_path):
    # Gemma-3's residual stream reaches ~1e5, past float16's 65504: stored plainly it became inf (and the
    # draft's loss NaN). Here the embeddings are scaled up until the states reach ~2e5.
    big = make_tiny_target(num_layers=6, hidden=32, seed=1)
    with torch.no_grad():
        big.model.model.embed_tokens.weight.mul_(3e6)
    cfg = FeatureConfig(model="tiny-big", data=str(data), samples=4, max_tokens=64, cache_layers="1,3,6",
                        features_dir=str(tmp_path / "feat"))
    store = build_features(big, load_dataset(str(data)), cfg, (1, 3, 6))
    e = store.scales["0"]["states"]  # one shard; layers 1 and 3 needed a scale, h_6 (after the final norm) not
    assert set(store.scales) == {"0"} and e[0] > 0 and e[1] > 0 and e[2] == 0
    s = store.sample(1, store.layer_index([3, 6]))
    with torch.no_grad():
        out = big.model(s["ids"][None], output_hidden_states=True)
    ref = torch.cat([out.hidden_states[3], out.hidden_states[6]], dim=-1)[0]  # (T, 2d)
    assert ref.abs().max() > 1e5 and s["aux"].dtype == torch.float32 and torch.isfinite(s["aux"]).all()
    torch.testing.assert_close(s["aux"], ref, rtol=1e-3, atol=1e-3)  # float16's precision, at any magnitude
    torch.testing.assert_close(s["final"].float(), out.hidden_states[-1][0], atol=2e-3, rtol=2e-3)


def test_a_non_finite_loss_stops_training_before_the_step(target, store, tmp_path, monkeypatch):
    import elsi.draft.train as train

    real = train.ttt_loss
    calls = []

    def nan_at_fourth(*a, **k):
        loss, stats, extra = real(*a, **k)
        calls.append(1)
        return (loss * float("nan") if len(calls) == 4 else loss), stats, extra

    monkeypatch.setattr(train, "ttt_loss", nan_at_fourth)
    with pytest.raises(ValueError, match=r"the training loss is nan at step 4: a non-finite target feature"):
        train_draft(target, store, train_cfg(tmp_path / "d"), 0, torch.device("cpu"), samples=16)
    assert not (tmp_path / "d" / "model.safetensors").exists()


def test_layers_not_in_cache_is_a_clear_error(target, data, store):
    cfg = FeatureConfig(model="tiny", data=str(data), samples=16, max_tokens=64, features_dir=str(store.path))
    with pytest.raises(ValueError, match=r"holds layers \[1, 3, 5, 6\]; layer\(s\) \[2\] are not in it.*--cache-layers 1,2,3,5,6"):
        build_features(target, load_dataset(str(data)), cfg, (2, 3))
    with pytest.raises(ValueError, match=r"layer\(s\) \[4\] are not in it"):
        FeatureStore(store.path).layer_index([4])


def test_feature_cache_extends_and_resumes(target, data, tmp_path):
    ds = load_dataset(str(data))
    small = FeatureConfig(model="tiny", data=str(data), samples=5, max_tokens=64, features_dir=str(tmp_path))
    a = build_features(target, ds, small, (2,), shard_samples=2)
    assert len(a) == 5
    more = FeatureConfig(model="tiny", data=str(data), samples=9, max_tokens=64, features_dir=str(tmp_path))
    b = build_features(target, ds, more, (2,), shard_samples=2)
    fresh = build_features(target, ds, FeatureConfig(model="tiny", data=str(data), samples=9, max_tokens=64,
                                                     features_dir=str(tmp_path / "fresh")), (2,), shard_samples=4)
    assert [s["id"] for s in b.samples] == [s["id"] for s in fresh.samples]
    for i in range(9):
        assert torch.equal(b.sample(i, [0])["aux"], fresh.sample(i, [0])["aux"])


def test_loss_falls_and_outputs_are_written(target, store, tmp_path):
    rec = train_draft(target, store, train_cfg(tmp_path, max_steps=25, lr=1e-2), seed=0, device=torch.device("cpu"))
    curve = rec["curve"]
    assert curve[-1]["loss"] < 0.9 * curve[0]["loss"]
    assert curve[-1]["acc"] > curve[0]["acc"]
    for name in ("model.safetensors", "config.json", "training.json"):
        assert (tmp_path / name).is_file()
    # vLLM and SGLang load every *.safetensors at the top of a draft directory: only the draft's weights are there
    assert [p.name for p in tmp_path.glob("*.safetensors")] == ["model.safetensors"]
    rec2 = json.loads((tmp_path / "training.json").read_text())
    assert rec2["heldout"]["depth"] == [1, 2, 3] and 0 <= rec2["heldout"]["match"][0] <= 1
    assert rec2["train_tokens_per_s"] > 0 and rec2["data"]["heldout_samples"] == 4
    from elsi.runtime import machine_info, timing_key  # where it trained: the study's pace counts it on such machines

    assert timing_key(rec2["machine"]) == timing_key(machine_info()) and rec2["machine"]["cpu"]
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6] and cfg["draft_vocab_size"] == 150
    # The saved draft reproduces the held-out figures.
    draft = Eagle3Draft.from_pretrained(tmp_path, target.adapter.embed_tokens(target.model))
    from elsi.draft.evaluate import evaluate_store
    from elsi.draft.train import split_samples

    _, held = split_samples(16, 0.2, 0)
    again = evaluate_store(draft, target, store, held, torch.nonzero(draft.t2d).flatten(), 3, 2, torch.device("cpu"))
    assert again["match"] == rec2["heldout"]["match"]


def test_deterministic_and_resumable(target, store, tmp_path):
    cpu = torch.device("cpu")
    train_draft(target, store, train_cfg(tmp_path / "a", max_steps=8), seed=5, device=cpu)
    train_draft(target, store, train_cfg(tmp_path / "b", max_steps=8), seed=5, device=cpu)
    a = load_file(str(tmp_path / "a" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)

    class Stop(Exception):
        pass

    def interrupt(p):
        if p.step == 3 and not p.note:
            raise Stop

    with pytest.raises(Stop):
        train_draft(target, store, train_cfg(tmp_path / "c", max_steps=8), seed=5, device=cpu, on_progress=interrupt)
    notes = []
    train_draft(target, store, train_cfg(tmp_path / "c", max_steps=8), seed=5, device=cpu,
                on_progress=lambda p: notes.append(p.note) if p.note else None)
    assert any("resumed" in n and "step 3" in n for n in notes)
    c = load_file(str(tmp_path / "c" / "model.safetensors"))
    assert all(torch.equal(a[k], c[k]) for k in a)
    with pytest.raises(ValueError, match="other settings"):
        train_draft(target, store, train_cfg(tmp_path / "c", max_steps=9), seed=5, device=cpu)


def test_train_rejects_layers_missing_from_cache(target, store, tmp_path):
    with pytest.raises(ValueError, match=r"layer\(s\) \[2\] are not in it"):
        train_draft(target, store, train_cfg(tmp_path, layers="2,6"), seed=0, device=torch.device("cpu"))
    with pytest.raises(ValueError, match=r"\[9\] out of range"):
        train_draft(target, store, train_cfg(tmp_path, layers="1,9"), seed=0, device=torch.device("cpu"))


def test_eval_match_rate_equals_naive_reference(target, tmp_path):
    """evaluate_draft's depth-1 match == a plain draft forward compared token by token."""
    from elsi.draft import random_draft

    draft = random_draft(target, [1, 3, 6], draft_vocab=list(range(0, 300, 2)), seed=2)
    with torch.no_grad():
        draft.lm_head.weight.mul_(50.0)
    gen = torch.Generator().manual_seed(0)
    answers = [{"subtask": s, "prompt": torch.randint(3, 300, (n,), generator=gen).tolist(),
                "answer": torch.randint(3, 300, (a,), generator=gen).tolist()}
               for s, n, a in [("qa", 7, 9), ("qa", 5, 12), ("rag", 10, 6)]]
    res = evaluate_draft(target, draft, answers, depth=2, batch_size=2)
    hits = total = 0
    for a in answers:
        seq = torch.tensor(a["prompt"] + a["answer"])[None]
        with torch.no_grad():
            out = target.model(seq, output_hidden_states=True)
            aux = torch.cat([out.hidden_states[l] for l in (1, 3, 6)], -1).half().float()
            t = seq.shape[1]
            logits, _ = draft(seq[:, 1:], draft.fuse(aux[:, :-1]), torch.arange(t - 1)[None])
        pred = draft.to_target_ids(logits.argmax(-1))[0]  # row i predicts the target's token at position i+1
        want = out.logits[0].argmax(-1)[1:]
        rows = range(len(a["prompt"]) - 2, t - 2)  # rows whose position i+1 predicts an answer token
        hits += sum(int(pred[i] == want[i]) for i in rows)
        total += len(rows)
    assert res["all"]["scored"][0] == total
    assert res["all"]["match"][0] == pytest.approx(hits / total)
    assert res["all"]["accept_length_chain"] >= 1.0
    assert set(res["subtasks"]) == {"qa", "rag"}


def test_parse_duration():
    assert parse_duration("20m") == 1200 and parse_duration("90s") == 90 and parse_duration("1.5h") == 5400
    assert parse_duration("0") == float("inf")
    with pytest.raises(ValueError, match="bad duration"):
        parse_duration("twenty")


def test_regenerate_writes_the_targets_own_answers(target, tmp_path):
    from conftest import WORDS

    from elsi.data import Sample, render, tokenize

    recs = [{"id": f"c{i}", "conversations": [{"from": "human", "value": " ".join(WORDS[i: i + 6])},
                                             {"from": "gpt", "value": "a reply that the target did not write"}]}
            for i in range(3)]
    path = tmp_path / "conv.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in recs))
    cfg = FeatureConfig(model="tiny", data=str(path), samples=3, max_tokens=64, regenerate=True, regen_max_new=8,
                        regen_batch=1, features_dir=str(tmp_path / "f"))
    store = build_features(target, load_dataset(str(path)), cfg, (2,))
    tok = target.tokenizer
    for s in store.samples:
        user = next(r for r in recs if r["id"] == s["id"])["conversations"][0]["value"]
        prompt = tok(render(Sample(s["id"], (("user", user),)), tok, add_generation_prompt=True),
                     add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            gen = target.model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                                        pad_token_id=2)[0, len(prompt):].tolist()
        gen = gen[: gen.index(2)] if 2 in gen else gen
        answer = tok.decode(gen, skip_special_tokens=True).strip() or "..."
        want = tokenize(Sample(s["id"], (("user", user), ("assistant", answer))), tok, 64)
        got = store.sample(store.samples.index(s), [0])["ids"].tolist()
        assert got == want


def test_regenerate_skips_a_prompt_that_leaves_no_room_for_an_answer(target, tmp_path):
    from conftest import WORDS

    words = [" ".join(WORDS[i: i + 6]) for i in range(4)]
    words[1] = " ".join(WORDS * 3)  # its rendered prompt alone is longer than --max-tokens
    recs = [{"id": f"c{i}", "conversations": [{"from": "human", "value": w}, {"from": "gpt", "value": "not the target"}]}
            for i, w in enumerate(words)]
    path = tmp_path / "conv.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in recs))
    cfg = FeatureConfig(model="tiny", data=str(path), samples=4, max_tokens=64, regenerate=True, regen_max_new=8,
                        regen_batch=2, features_dir=str(tmp_path / "f"))
    store = build_features(target, load_dataset(str(path)), cfg, (2,))
    assert sorted(s["id"] for s in store.samples) == ["c0", "c2", "c3"]
    assert store.manifest["skipped"] == {"prompt_too_long": 1}
    assert all(store.sample(i, [0])["reply"].any() for i in range(len(store.samples)))  # each has a reply to score


def test_regeneration_batches_prompts_of_similar_length_and_keeps_their_order(target, monkeypatch):
    from conftest import WORDS

    from elsi.data import Sample
    from elsi.draft import regenerate as features

    samples = [Sample(f"c{k}", (("user", " ".join(WORDS[k: k + n])), ("assistant", "not the target")))
               for k, n in enumerate((9, 2, 7, 3))]
    batches, answered = [], []
    alone = {s.id: features.regenerate_batch(target, [s], max_tokens=64, max_new=5, turns=1)[0] for s in samples}
    real = features.regenerate_batch

    def spy(target, part, *args):
        batches.append([s.id for s in part])
        return real(target, part, *args)

    monkeypatch.setattr(features, "regenerate_batch", spy)
    out = features.regenerate_sorted(target, samples, 2, 64, 5, 1, on_batch=answered.append)
    assert batches == [["c1", "c3"], ["c2", "c0"]]  # shortest prompts first, two per batch
    assert answered == [2, 4]
    assert [s.id for s in out] == ["c0", "c1", "c2", "c3"]
    # each answer is the one the target gives that prompt alone (left padding changes nothing)
    assert [s.messages for s in out] == [alone[s.id].messages for s in samples]
    assert all(s.messages[1][1] != "not the target" for s in out)


def test_regen_turns_keeps_the_first_turns_and_the_reply_mask_follows(target, tmp_path):
    from conftest import WORDS

    from elsi.data import Sample, tokenize
    from elsi.data.conversations import assistant_mask
    from elsi.draft.regenerate import regenerate_batch

    turns = [("user", " ".join(WORDS[:5])), ("assistant", "not the target"), ("user", " ".join(WORDS[5:9])),
             ("assistant", "nor this")]
    sample = Sample("c0", tuple(turns))
    one = regenerate_batch(target, [sample], max_tokens=200, max_new=6, turns=1)[0]
    both = regenerate_batch(target, [sample], max_tokens=200, max_new=6, turns=0)[0]
    assert [r for r, _ in one.messages] == ["user", "assistant"]
    assert [r for r, _ in both.messages] == ["user", "assistant", "user", "assistant"]
    assert one.messages[1] == both.messages[1] and one.messages[1][1] != "not the target"
    # The cached reply flags: position t is scored when token t+1 belongs to an assistant reply.
    recs = [{"id": "c0", "conversations": [{"from": "human" if r == "user" else "gpt", "value": c}
                                           for r, c in turns]}]
    path = tmp_path / "conv.jsonl"
    path.write_text("\n".join(json.dumps({**recs[0], "id": f"c{i}"}) for i in range(2)))
    cfg = FeatureConfig(model="tiny", data=str(path), samples=2, max_tokens=200, regenerate=True, regen_max_new=6,
                        regen_turns=1, features_dir=str(tmp_path / "f"))
    store = build_features(target, load_dataset(str(path)), cfg, (2,))
    got = store.sample(0, [0])
    ids = tokenize(one, target.tokenizer, 200)
    mask = assistant_mask(one, target.tokenizer, ids)
    assert got["ids"].tolist() == ids
    assert got["reply"].tolist() == mask[1:] + mask[-1:]
    assert 0 < int(got["reply"].sum()) < len(ids)


def test_soft_labels_are_the_full_softmax_restricted_and_renormalised(target):
    from elsi.draft.loss import LabelHead

    vocab = target.model.get_output_embeddings().weight.shape[0]
    ids = torch.tensor([0, 3, 4, 17, 40, vocab - 1])
    final = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = torch.softmax(target.model.lm_head(final), dim=-1)  # (2, 5, V_target)
    want = full[..., ids] / full[..., ids].sum(-1, keepdim=True)
    got = LabelHead.build(target, ids, torch.device("cpu")).probs(final)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_head_from_target_equals_target_logits_on_draft_vocab(target):
    from elsi.draft import random_draft
    from elsi.draft.init import target_head_rows

    ids = torch.arange(5, 205, 2)
    draft = random_draft(target, [1, 6], draft_vocab=ids.tolist(), seed=0)
    norm = target.model.model.norm
    before = norm.weight.detach().clone()
    try:
        with torch.no_grad():  # a non-trivial final-norm scale, to check that it is folded in
            norm.weight.copy_(torch.rand(32, generator=torch.Generator().manual_seed(1)) + 0.5)
            draft.lm_head.weight.copy_(target_head_rows(target, ids))
            h = torch.randn(3, 32, generator=torch.Generator().manual_seed(2)) * 4
            want = target.model.lm_head(norm(h))[:, ids]  # (3, V_draft)
            torch.testing.assert_close(draft.head(h), want, atol=1e-4, rtol=1e-4)
    finally:
        with torch.no_grad():
            norm.weight.copy_(before)


def test_ttt_loss_equals_naive_per_row_reference(target, store):
    """Per step j, row i: soft CE against the target's distribution at position i+1+j (weights 0.8^j)."""
    from elsi.draft import random_draft
    from elsi.draft.loss import make_batch, ttt_loss

    ids = torch.arange(0, 300, 3)
    draft = random_draft(target, [1, 3, 6], draft_vocab=ids.tolist(), seed=4)
    samples = [store.sample(i, store.layer_index([1, 3, 6])) for i in (0, 5)]
    batch = make_batch(target, samples, ids, draft.t2d, torch.device("cpu"))
    with torch.no_grad():
        loss, stats, outs = ttt_loss(draft, batch, 3)
    total = 0.0
    for j, (logits, _) in enumerate(outs):
        ce_sum, n, hits, scored = 0.0, 0, 0, 0
        for b, s in enumerate(samples):
            t = s["ids"].shape[0]
            for i in range(t - 1 - j):  # row i scores position p = i + 1 + j <= t - 1
                p = i + 1 + j
                am = int(s["argmax"][p])
                scored += 1
                hits += int(draft.to_target_ids(logits[b, i].argmax()) == am)
                if draft.t2d[am]:
                    with torch.no_grad():
                        full = torch.softmax(target.model.lm_head(s["final"][p].float()), -1)[ids]
                    ce_sum += float(-(full / full.sum() * torch.log_softmax(logits[b, i], -1)).sum())
                    n += 1
        assert stats[j]["scored"] == scored and stats[j]["correct"] == hits and stats[j]["in_vocab"] == n
        assert stats[j]["loss"] == pytest.approx(ce_sum / n, rel=1e-4)
        total += 0.8**j * ce_sum / n
    assert float(loss) == pytest.approx(total, rel=1e-4)


def test_soft_cross_entropy_value_and_gradient_equal_log_softmax_reference():
    """The fused loss against -(p * log_softmax(z)).sum(-1): value and gradient, float32 and bf16 logits."""
    from elsi.draft.loss import SoftCrossEntropy

    gen = torch.Generator().manual_seed(0)
    z = torch.randn(3, 7, 50, generator=gen) * 4
    p = torch.softmax(torch.randn(3, 7, 50, generator=gen) * 3, -1)
    w = torch.rand(3, 7, generator=gen)  # per-row weights, as the masked mean applies
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-5)):
        a = z.to(dtype).clone().requires_grad_()
        b = z.to(dtype).float().clone().requires_grad_()  # the same (rounded) logits, reference in float32
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):  # as in training
            ce = SoftCrossEntropy.apply(a, p)[0]
        ref = -(p * torch.log_softmax(b, -1)).sum(-1)
        assert ce.dtype == torch.float32
        torch.testing.assert_close(ce, ref, rtol=tol, atol=tol)
        (ce * w).sum().backward()
        (ref * w).sum().backward()
        assert a.grad.dtype == dtype
        torch.testing.assert_close(a.grad.float(), b.grad.to(dtype).float(), rtol=1e-2 if dtype != torch.float32
                                   else 1e-5, atol=1e-6)
    x = torch.randn(4, 9, dtype=torch.float64, requires_grad=True)
    q = torch.softmax(torch.randn(4, 9, dtype=torch.float64), -1)
    assert torch.autograd.gradcheck(lambda t: SoftCrossEntropy.apply(t, q)[0], (x,))


def test_soft_cross_entropy_top1_is_argmax_including_ties():
    from elsi.draft.loss import SoftCrossEntropy

    gen = torch.Generator().manual_seed(1)
    logits = torch.randint(0, 6, (5, 40, 30), generator=gen).float()  # small integers: many tied maxima
    assert bool(((logits == logits.amax(-1, keepdim=True)).sum(-1) > 1).any())  # ties really occur
    p = torch.full_like(logits, 1 / 30)
    for z in (logits, logits.bfloat16()):
        assert torch.equal(SoftCrossEntropy.apply(z, p)[1], logits.argmax(-1))


def test_greedy_tokens_is_argmax_including_ties_across_chunks():
    from elsi.draft.forward import greedy_tokens

    gen = torch.Generator().manual_seed(2)
    head = torch.nn.Linear(4, 60, bias=False)
    with torch.no_grad():  # small integers: many tied maxima, within and across vocabulary chunks
        head.weight.copy_(torch.randint(0, 3, (60, 4), generator=gen).float())
    hidden = torch.randint(0, 3, (5, 30, 4), generator=gen).float()
    logits = (hidden @ head.weight.T).detach()  # (5, 30, 60)
    assert ((logits == logits.amax(-1, keepdim=True)).sum(-1) > 1).float().mean() > 0.5  # ties in most rows
    for chunk in (7, 16, 60, 4096):
        assert torch.equal(greedy_tokens(hidden, head, chunk), logits.argmax(-1))
        assert torch.equal(greedy_tokens(hidden.bfloat16(), head.bfloat16(), chunk), logits.argmax(-1))
        head.float()
    biased = torch.nn.Linear(4, 60)
    assert torch.equal(greedy_tokens(hidden, biased, 7), biased(hidden).argmax(-1))


def test_frozen_head_stays_at_the_targets_rows(target, store, tmp_path):
    from elsi.draft.init import target_head_rows

    rec = train_draft(target, store, train_cfg(tmp_path, max_steps=3, freeze_head=True, head_init="target"), seed=0,
                      device=torch.device("cpu"))
    w = load_file(str(tmp_path / "model.safetensors"))["lm_head.weight"]
    d2t = load_file(str(tmp_path / "model.safetensors"))["d2t"]
    ids = torch.arange(d2t.numel()) + d2t
    assert torch.equal(w, target_head_rows(target, ids))
    assert rec["settings"]["train"]["freeze_head"] is True
    with pytest.raises(ValueError, match="freeze_head"):
        train_cfg(tmp_path, freeze_head=True, head_init="random")


def test_feature_scale_is_inverse_rms(store):
    from elsi.draft.init import feature_scale

    pos = store.layer_index([1, 3, 6])
    got = feature_scale(store, [2, 7], pos)
    aux = torch.cat([store.sample(i, pos)["aux"].float() for i in (2, 7)])  # (T, m·d)
    torch.testing.assert_close(got, 1.0 / aux.pow(2).mean(0).sqrt(), atol=1e-6, rtol=1e-5)


def test_bf16_autocast_training_tracks_float32_and_falls_back_where_bf16_is_emulated(target, store, tmp_path,
                                                                                    monkeypatch):
    import elsi.runtime as runtime
    from elsi.draft.train import matmul_dtype

    rec = {}
    for dt in ("float32", "bfloat16"):
        monkeypatch.setattr(runtime, "fast_bf16", lambda device: (True, "test: native"))
        rec[dt] = train_draft(target, store, train_cfg(tmp_path / dt, train_dtype=dt, max_steps=30), 0,
                              torch.device("cpu"))
    assert rec["float32"]["train_matmul_dtype"] == "float32" and rec["bfloat16"]["train_matmul_dtype"] == "bfloat16"
    l32 = [c["loss"] for c in rec["float32"]["curve"]]
    l16 = [c["loss"] for c in rec["bfloat16"]["curve"]]
    assert l16 != l32  # bf16 products really ran: the losses differ in the low bits ...
    assert l16[-1] < 0.95 * l16[0] and l32[-1] < 0.95 * l32[0]  # ... the loss falls in both ...
    assert all(abs(a - b) <= 0.01 * a for a, b in zip(l32, l16))  # ... and bf16 tracks float32 step by step
    h32, h16 = rec["float32"]["heldout"]["match"][0], rec["bfloat16"]["heldout"]["match"][0]
    assert abs(h32 - h16) <= 0.05
    # where bf16 would be emulated: auto is float32, and an explicit bfloat16 warns and trains in float32
    monkeypatch.setattr(runtime, "fast_bf16", lambda device: (False, "CPU: AMX tiles False, AVX512-BF16 False"))
    assert matmul_dtype("auto", torch.device("cpu")) == (torch.float32, None)
    dt, warning = matmul_dtype("bfloat16", torch.device("cpu"))
    assert dt == torch.float32 and "emulated" in warning and "AVX512-BF16 False" in warning


@needs_compiler
def test_compiled_training_tracks_eager_training(target, store, tmp_path):
    """--train-compile: the same run (init, data order, steps) as eager, loss step by step within the fused
    kernels' rounding; the record says it was compiled."""
    rec = {on: train_draft(target, store, train_cfg(tmp_path / str(on), train_compile=on, train_dtype="float32",
                                                    max_steps=30), 0, torch.device("cpu"))
           for on in (False, True)}
    assert rec[True]["train_compiled"] and not rec[False]["train_compiled"]
    eager = [c["loss"] for c in rec[False]["curve"]]
    compiled = [c["loss"] for c in rec[True]["curve"]]
    assert len(compiled) == len(eager) and compiled[-1] < 0.95 * compiled[0]
    assert all(abs(a - b) <= 1e-3 * a for a, b in zip(eager, compiled))
    assert abs(rec[True]["heldout"]["match"][0] - rec[False]["heldout"]["match"][0]) <= 0.02


def test_layer_init_copies_the_last_layer_as_auto_does_and_refuses_other_types(target, store, tmp_path):
    from conftest import make_tiny_gemma3

    from elsi.draft.model import config_for_target
    from elsi.draft.init import init_layer_from_target, resolve_layer_init

    rec = train_draft(target, store, train_cfg(tmp_path, max_steps=0, epochs=0.0, layer_init="target"), seed=0,
                      device=torch.device("cpu"))  # no step: the saved weights are the initial ones
    w = load_file(str(tmp_path / "model.safetensors"))
    last = target.model.model.layers[-1]
    d = target.hidden_size
    for p in ("q", "k", "v"):
        assert torch.equal(w[f"midlayer.self_attn.{p}_proj.weight"][:, d:], getattr(last.self_attn, f"{p}_proj").weight)
        assert not torch.equal(w[f"midlayer.self_attn.{p}_proj.weight"][:, :d], torch.zeros(1))  # random, not zeros
    assert torch.equal(w["midlayer.self_attn.o_proj.weight"], last.self_attn.o_proj.weight)
    for p in ("gate", "up", "down"):
        assert torch.equal(w[f"midlayer.mlp.{p}_proj.weight"], getattr(last.mlp, f"{p}_proj").weight)
    assert torch.equal(w["midlayer.hidden_norm.weight"], last.input_layernorm.weight)
    assert torch.equal(w["midlayer.post_attention_layernorm.weight"], last.post_attention_layernorm.weight)
    assert rec["settings"]["train"]["layer_init"] == "target" and rec["layer_init"] == "target"
    # auto (the default) copies the layer where it is of the draft's type, as 'target' does: the same weights
    auto = train_draft(target, store, train_cfg(tmp_path / "auto", max_steps=0, epochs=0.0), seed=0,
                       device=torch.device("cpu"))
    assert auto["settings"]["train"]["layer_init"] == "auto" and auto["layer_init"] == "target"
    assert load_file(str(tmp_path / "auto" / "model.safetensors")).keys() == w.keys()
    for k, v in load_file(str(tmp_path / "auto" / "model.safetensors")).items():
        assert torch.equal(v, w[k]), k
    rand = train_draft(target, store, train_cfg(tmp_path / "random", max_steps=0, epochs=0.0, layer_init="random"),
                       seed=0, device=torch.device("cpu"))
    assert rand["layer_init"] == "random"
    assert not torch.equal(load_file(str(tmp_path / "random" / "model.safetensors"))["midlayer.mlp.up_proj.weight"],
                           last.mlp.up_proj.weight)
    gemma = make_tiny_gemma3()
    draft = Eagle3Draft(config_for_target(gemma, [1, 2, 4]), gemma.adapter.embed_tokens(gemma.model))
    with pytest.raises(ValueError, match="needs a Llama-type decoder layer .*Gemma3DecoderLayer.*q_norm"):
        init_layer_from_target(draft, gemma)
    assert resolve_layer_init("auto", gemma) == "random" and resolve_layer_init("auto", target) == "target"
    assert resolve_layer_init("random", target) == "random"
    with pytest.raises(ValueError, match="layer_init must be auto, 'target' or 'random', got 'last'"):
        train_cfg(tmp_path, layer_init="last")


def test_records_from_before_a_setting_existed_still_match(target, store, tmp_path, monkeypatch):
    """A checkpoint (or a study's plan.json) written before layer_init existed was made with its default."""
    import elsi.draft.train as train
    from elsi.study.plan import plan_differences

    class Stop(Exception):
        pass

    def stop(p):
        if p.step == 3 and not p.note:
            raise Stop

    cpu = torch.device("cpu")
    old_cfg = train_cfg(tmp_path, max_steps=6, layer_init="random")  # the default when layer_init was added
    with pytest.raises(Stop):
        train_draft(target, store, old_cfg, seed=1, device=cpu, on_progress=stop)
    real = train.load_checkpoint

    def older(path):
        tensors, saved = real(path)
        del saved["settings"]["train"]["layer_init"]
        return tensors, saved

    monkeypatch.setattr(train, "load_checkpoint", older)
    with pytest.raises(ValueError, match="other settings: train.layer_init: .random. in the checkpoint, .auto. now"):
        train_draft(target, store, train_cfg(tmp_path, max_steps=6), seed=1, device=cpu)
    notes = []
    train_draft(target, store, old_cfg, seed=1, device=cpu,
                on_progress=lambda p: notes.append(p.note) if p.note else None)
    assert any("resumed" in n and "step 3" in n for n in notes)
    settings = {"train": {"ttt": 1, "layer_init": "random"}, "features": {}}
    plan = {"model": "m", "sets": [], "settings": settings}
    old = {"model": "m", "sets": [], "settings": {"train": {"ttt": 1}, "features": {}}}
    assert plan_differences(old, plan) == []
    changed = {**plan, "settings": {**settings, "train": {"ttt": 1, "layer_init": "target"}}}
    assert plan_differences(old, changed) == ["train.layer_init: 'random' in plan.json, 'target' now"]
