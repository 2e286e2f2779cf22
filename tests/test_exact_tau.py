"""The exact τ evaluator (elsi.decode.replay, elsi.specbench.exact) against the live engine.

At temperature 0 the accepted length of every live decoding step must equal the replay's at the
same root position, step for step, for a chain, a 30- and a 60-node tree.
"""

from __future__ import annotations

import os

import pytest
import torch

from elsi.decode import DecodeConfig, EagleDrafter, TargetRunner, TreeConfig, generate, stop_tokens
from elsi.decode.replay import replay_answer
from elsi.draft import random_draft

TREES = [TreeConfig(6, 6, 1), TreeConfig(30, 6, 10), TreeConfig(60, 6, 10)]
# Where the equality tests run: cpu here and in CI; ELSI_TEST_DEVICE=cuda on a GPU (bench/gpu_check.sh), where
# the live engine and the replay both run on the GPU's kernels.
DEVICE = os.environ.get("ELSI_TEST_DEVICE", "cpu")


def live_and_replayed(target, draft, prompts: list[list[int]], trees, max_new: int):
    """Per prompt and tree: (live per-step accepted lengths, replayed walk), the answer by plain decoding."""
    runner = TargetRunner.from_target(target)
    eos = stop_tokens(target.model, target.tokenizer)
    cfg = DecodeConfig(max_new_tokens=max_new)
    drafter = EagleDrafter(draft)
    out = []
    for ids in prompts:
        answer = generate(runner, ids, cfg, eos_ids=eos).tokens
        seq = ids + answer
        with torch.inference_mode():
            hs = runner.decoder(input_ids=torch.tensor([seq], device=target.device),
                                output_hidden_states=True).hidden_states
        feats = torch.cat([hs[l][0] for l in draft.layer_ids], dim=-1)  # (L, m·d)
        reps = replay_answer(draft, feats, seq, len(ids), trees, max_new)
        for t, rep in zip(trees, reps):
            g = generate(runner, ids, cfg, drafter, t, eos)
            assert g.tokens == answer, "speculative decoding is lossless"
            out.append((t, g.accepted, rep.walk(), rep))
    return out


def accepting_draft(target, layers, seed: int = 3):
    """A draft that accepts often on a random target: fc passes the target's final state h_N through,
    the head is the target's, and the midlayer adds a small random term (so its attention over the
    prefix and the tree still shapes every score)."""
    n, d = target.num_layers, target.hidden_size
    draft = random_draft(target, layers, seed=seed).eval()
    with torch.no_grad():
        draft.fc.weight.zero_()
        slot = list(layers).index(n)
        draft.fc.weight[:, slot * d:(slot + 1) * d] = torch.eye(d)
        draft.lm_head.weight.copy_(target.model.get_output_embeddings().weight)
        draft.midlayer.self_attn.o_proj.weight.mul_(5.0)
    return draft


def test_replay_equals_live_on_a_tiny_target(tiny_target):
    """Random tiny Llama and a draft that accepts: every live step equals the replay's."""
    if DEVICE != "cpu":  # the same tiny target (same seed), on the device; the session's fixture stays on the CPU
        from conftest import make_tiny_target

        tiny_target = make_tiny_target()
        tiny_target.model.to(DEVICE)
    n = tiny_target.num_layers
    draft = accepting_draft(tiny_target, [1, 4, n]).to(DEVICE)
    gen = torch.Generator().manual_seed(0)
    vocab = int(tiny_target.model.config.vocab_size)
    prompts = [torch.randint(3, vocab, (k,), generator=gen).tolist() for k in (5, 17, 40)]
    # (2, 5, 4) and (1, 4, 10) are alone in their (depth, top_k) groups: expanded only as deep as they keep
    trees = TREES + [TreeConfig(4, 3, 2), TreeConfig(1, 6, 10), TreeConfig(2, 5, 4), TreeConfig(1, 4, 10)]
    accepted = steps = 0
    for t, live, walk, _ in live_and_replayed(tiny_target, draft, prompts, trees, max_new=24):
        assert live == walk, t
        accepted += sum(live) - len(live)
        steps += len(live)
    assert accepted > steps / 2, "the draft accepts: the walk's deeper paths are exercised"


def test_replay_bad_input(tiny_target):
    draft = random_draft(tiny_target, [1, 4], seed=0).eval()
    feats = torch.zeros(6, 2 * tiny_target.hidden_size)
    with pytest.raises(ValueError, match="prompt length 0"):
        replay_answer(draft, feats, [1, 2, 3, 4, 5, 6], 0, TREES, 8)
    with pytest.raises(ValueError, match="features have 6 rows for 7 tokens"):
        replay_answer(draft, feats, [1, 2, 3, 4, 5, 6, 7], 2, TREES, 8)
    with pytest.raises(ValueError, match="TreeConfig"):
        replay_answer(draft, feats, [1, 2, 3, 4, 5, 6], 2, [(60, 6, 10)], 8)


@pytest.mark.slow
def test_replay_equals_live_on_smollm2_with_a_trained_draft(smollm2_draft):
    """The real SmolLM2 and a trained draft, 12 Spec-Bench questions (2 per subtask), chain, 30 and 60
    nodes: the replayed steps equal the live engine's step for step. Float rounding may flip a near tie
    between two candidates; such steps are counted and bounded (at most 1 in 100)."""
    from elsi.data.spec_bench import load_questions
    from elsi.specbench import encode_chat

    target, draft = smollm2_draft
    qs = load_questions(["all"], 2)
    prompts = [encode_chat(target.tokenizer, [("user", q.turns[0])]) for q in qs]
    res = live_and_replayed(target, draft, prompts, TREES, max_new=48)
    steps = differ = accepted = 0
    for t, live, walk, _ in res:
        steps += len(live)
        accepted += sum(live) - len(live)
        if live != walk:  # count the steps from the first difference on
            first = next((i for i, (a, b) in enumerate(zip(live, walk)) if a != b), min(len(live), len(walk)))
            differ += len(live) - first
    assert len(qs) >= 12
    assert accepted > steps / 4, f"the draft accepts too little for the comparison to mean something: {accepted} " \
        f"drafted tokens accepted in {steps} steps"
    assert differ <= steps / 100, f"{differ} of {steps} live steps differ from the replay"


@pytest.fixture(scope="module")
def smollm2_draft(tmp_path_factory):
    """SmolLM2-135M and a draft trained briefly on ShareGPT (or ELSI_TEST_DRAFT's): 400 steps on 120 conversations
    (3.5 epochs). With 240 this setup took 382 s of the test's 684 s on a 2-core AVX2 CPU, 238 s with 120, whose
    draft accepted 414 drafted tokens in 1,188 steps (the test asks more than a quarter), every step equal to the
    replay's."""
    from elsi.draft import Eagle3Draft
    from elsi.models import load_target

    target = load_target("smollm2-135m", device=DEVICE)
    path = os.environ.get("ELSI_TEST_DRAFT")
    if not path:
        from elsi.cli import main

        path = str(tmp_path_factory.mktemp("draft") / "d")
        rc = main(["train-draft", "--layers", "2,15,27", "--samples", "120", "--max-tokens", "512",
                   "--max-steps", "400", "--time-budget", "0", "--out", path,
                   "--features-dir", str(tmp_path_factory.mktemp("feats")), "--threads", "2"])
        assert rc == 0
    draft = Eagle3Draft.from_pretrained(path, target.adapter.embed_tokens(target.model), target.num_layers).eval()
    return target, draft.to(DEVICE)


def test_replayed_trees_equal_build_tree(tiny_target):
    """White box: at every root of an answer, the replay keeps the nodes ``build_tree`` keeps on the live
    session committed up to that root (same tokens and depths, scores equal up to rounding), also under the
    engine's depth cap near the length limit."""
    from elsi.decode.replay import _candidates, _rerank, teacher_forced
    from elsi.decode.tree import build_tree

    draft = random_draft(tiny_target, [2, 5, 8], seed=1).eval()
    runner = TargetRunner.from_target(tiny_target)
    gen = torch.Generator().manual_seed(1)
    seq = torch.randint(3, int(tiny_target.model.config.vocab_size), (30,), generator=gen).tolist()
    P = 12
    with torch.inference_mode():
        hs = runner.decoder(input_ids=torch.tensor([seq]), output_hidden_states=True).hidden_states
        feats = torch.cat([hs[l][0] for l in draft.layer_ids], dim=-1)  # (L, m·d)
        ids = torch.tensor(seq)
        cache, roots, root_logits, root_hidden = teacher_forced(draft, feats, ids, P)
        for tree in (TreeConfig(60, 6, 10), TreeConfig(7, 4, 3), TreeConfig(6, 6, 1)):
            cand = _candidates(draft, cache, root_logits, root_hidden, roots, tree.depth, tree.top_k)
            cap = torch.clamp(16 - (roots - P + 1) - 1, max=tree.depth)  # max_new_tokens 16: caps near the end
            kept = _rerank(cand, tree.tree_nodes, cap)
            for b, r in enumerate(roots.tolist()):
                session = EagleDrafter(draft).start()
                logits = session.commit(ids[: r + 1], feats[:r])
                live = build_tree(seq[r], logits, session.expand, tree, max_depth=int(cap[b]),
                                  token_ids=session.token_ids)
                idx = kept[b].nonzero().flatten()
                assert cand.tokens[b, idx[1:]].tolist() == live.tokens[1:].tolist(), (tree, r)
                assert cand.depth[idx].tolist() == live.depth.tolist(), (tree, r)
                node_of = {c: n for n, c in enumerate(idx.tolist())}
                assert [node_of.get(p, -1) for p in cand.parent[b, idx].tolist()] == live.parents.tolist()
                torch.testing.assert_close(cand.scores[b, idx], live.scores, rtol=1e-4, atol=1e-4)


def test_answers_cache_checks_settings_and_serves_subsets(tiny_target, tmp_path, monkeypatch):
    """The answers are made once per settings; a file made with other settings is refused naming the
    difference; fewer questions per subtask are read from a cached superset without generating."""
    import elsi.specbench.answers as answers
    from elsi.io import write_json

    monkeypatch.setenv("ELSI_CACHE", str(tmp_path))
    made = []
    real = answers._answer_all
    monkeypatch.setattr(answers, "_answer_all", lambda *a, **k: made.append(a[2]) or real(*a, **k))
    big = answers.greedy_answers(tiny_target, ["qa", "rag"], 3, 4)
    assert made == [3] and len(big) == 6 and all(1 <= len(a["answer"]) <= 4 for a in big)
    assert answers.greedy_answers(tiny_target, ["qa", "rag"], 3, 4) == big and made == [3]  # cached
    small = answers.greedy_answers(tiny_target, ["qa", "rag"], 2, 4)
    assert made == [3] and small == [a for a in big if a["question_id"] in {r["question_id"] for r in small}]
    assert len(small) == 4
    # the answers' fingerprint: the same answers in any order give one digest, one token more another
    digest = answers.answers_digest(big)
    assert answers.answers_digest(big[::-1]) == digest and len(digest) == 16
    assert answers.answers_digest([{**big[0], "answer": big[0]["answer"] + [1]}, *big[1:]]) != digest
    other = tmp_path / "other.json"
    write_json(other, {"settings": {**answers.answers_settings(tiny_target, ["qa", "rag"], 3, 4), "max_new_tokens": 9},
                       "answers": big})
    with pytest.raises(ValueError, match="max_new_tokens: 9 in the file, 4 asked"):
        answers.greedy_answers(tiny_target, ["qa", "rag"], 3, 4, path=other)
    with pytest.raises(FileNotFoundError, match="no such file"):
        answers.greedy_answers(tiny_target, ["qa", "rag"], 3, 4, path=tmp_path / "missing.json")


def test_exact_tau_refuses_answers_of_another_model(tiny_target):
    from elsi.specbench.exact import exact_tau

    draft = random_draft(tiny_target, [1, 4], seed=0).eval()
    bad = [{"question_id": 1, "subtask": "qa", "turn": 0, "prompt": [1, 2, 3], "answer": [5, 10**6]}]
    with pytest.raises(ValueError, match="beyond the draft's target vocabulary"):
        exact_tau(tiny_target, draft, bad, TREES, 8)


def test_answer_states_are_kept_once_per_model_and_read_bit_for_bit(tiny_target, tmp_path):
    """The target's states over an answer are computed once and kept: a second read (any layers) equals the
    forward bit for bit without running the target; the exact τ is the same from the cache; an entry left
    half-written or damaged is not read but computed again; keep=False writes nothing."""
    from elsi.specbench.answers import answers_digest
    from elsi.specbench.exact import exact_tau
    from elsi.specbench.states import AnswerStates

    n = tiny_target.num_layers
    draft = accepting_draft(tiny_target, [1, 4, n])
    gen = torch.Generator().manual_seed(1)
    vocab = int(tiny_target.model.config.vocab_size)
    answers = [{"question_id": q, "subtask": s, "turn": 0, "prompt": torch.randint(3, vocab, (k,), generator=gen).tolist(),
                "answer": torch.randint(3, vocab, (9,), generator=gen).tolist()}
               for q, s, k in ((1, "qa", 7), (2, "rag", 15))]
    seq, P = answers[0]["prompt"] + answers[0]["answer"], 7
    with torch.inference_mode():
        hs = tiny_target.model.model(input_ids=torch.tensor([seq]), output_hidden_states=True).hidden_states
        logits = tiny_target.model(input_ids=torch.tensor([seq])).logits[0, P - 1:-1]
    flips_ref = int((logits.argmax(-1) != torch.tensor(seq[P:])).sum())
    assert flips_ref > 0, "random answers: the flips count is exercised"

    store = AnswerStates(tiny_target, root=tmp_path / "states")
    flips, feats = store.states(seq, P, [1, 4, n])
    assert (store.computed, store.kept, store.read) == (1, 1, 0) and flips == flips_ref
    assert torch.equal(feats, torch.cat([hs[l][0] for l in (1, 4, n)], dim=-1))
    again = AnswerStates(tiny_target, root=tmp_path / "states")
    flips2, feats2 = again.states(seq, P, [0, 2])
    assert (again.computed, again.read) == (0, 1) and flips2 == flips_ref
    assert torch.equal(feats2, torch.cat([hs[0][0], hs[2][0]], dim=-1))

    fresh = exact_tau(tiny_target, draft, answers, TREES, 9, states=AnswerStates(tiny_target, keep=False,
                                                                                   root=tmp_path / "none"))
    assert not (tmp_path / "none").exists() or not any((tmp_path / "none").iterdir())
    cached = exact_tau(tiny_target, draft, answers, TREES, 9, states=AnswerStates(tiny_target, root=tmp_path / "states"))
    assert fresh["target_forwards"] == 2 and cached["target_forwards"] == 1  # the second answer was not kept yet
    assert [t["overall"] for t in cached["trees"]] == [t["overall"] for t in fresh["trees"]]
    assert cached["greedy_flips"] == fresh["greedy_flips"]
    assert cached["answers_digest"] == answers_digest(answers)  # which answers the τ was computed on

    for meta in (tmp_path / "states").glob("*.json"):  # damaged: the states file cut short
        pt = meta.with_suffix(".safetensors")
        pt.write_bytes(pt.read_bytes()[:100])
    meta.unlink()  # and one entry without its record: half-written
    redo = AnswerStates(tiny_target, root=tmp_path / "states")
    exact_tau(tiny_target, draft, answers, TREES, 9, states=redo)
    assert (redo.read, redo.computed, redo.kept) == (0, 2, 2)
