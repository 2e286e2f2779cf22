"""``elsi generate`` / ``elsi bench`` end to end on a tiny saved model, and the EAGLE3 adapter."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_target

from elsi.cli import main
from elsi.decode import DecodeConfig, EagleDrafter, TargetRunner, TreeConfig, generate


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    t = make_tiny_target(num_layers=4)
    d = tmp_path_factory.mktemp("tiny_model")
    t.model.save_pretrained(d)
    t.tokenizer.save_pretrained(d)
    return d


def _run_json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_plain_and_speculative_agree(tiny_dir, capsys):
    base = ["generate", "--model", str(tiny_dir), "--prompt", "the cat sat on", "--max-new-tokens", "12",
            "--device", "cpu", "--json"]
    plain = _run_json(capsys, base)
    assert plain["steps"] == len(plain["tokens"]) - 1 and plain["draft"]["kind"] == "none"
    for draft in ("target", "random"):
        spec = _run_json(capsys, base + ["--draft", draft, "--tree-nodes", "8", "--depth", "4", "--top-k", "3"])
        assert spec["tokens"] == plain["tokens"] and spec["text"] == plain["text"]
        assert len(spec["accepted"]) == spec["steps"] and spec["tokens_per_s"] > 0
    raw = _run_json(capsys, base + ["--raw"])
    assert raw["prompt_tokens"] < plain["prompt_tokens"]  # no chat template around the prompt


def test_generate_errors_name_the_bad_value(tiny_dir, capsys):
    assert main(["generate", "--model", str(tiny_dir), "--device", "cpu"]) == 2
    assert "exactly one of --prompt and --prompt-file" in capsys.readouterr().err
    assert main(["generate", "--model", str(tiny_dir), "--prompt", "x", "--tree-nodes", "0", "--device", "cpu"]) == 2
    assert "tree_nodes must be >= 1, got 0" in capsys.readouterr().err
    argv = ["generate", "--model", str(tiny_dir), "--prompt", "x", "--draft", "/nonexistent", "--device", "cpu"]
    assert main(argv) == 2
    assert "/nonexistent" in capsys.readouterr().err


def test_bench_writes_results(tiny_dir, tmp_path, capsys, monkeypatch):
    from elsi.specbench import runner

    real_answer, tokens = runner.answer, {}

    def recorded(method, name, q, tokenizer, temperature, tree_nodes, gen):
        """``runner.answer`` keeping each turn's new token ids, by (question, temperature, method, tree)."""
        def m(ids, g):
            res = method(ids, g)
            tokens.setdefault((q.question_id, temperature, name, tree_nodes), []).append(res[0])
            return res
        return real_answer(m, name, q, tokenizer, temperature, tree_nodes, gen)

    monkeypatch.setattr(runner, "answer", recorded)
    out = tmp_path / "res.json"
    argv = ["bench", "--model", str(tiny_dir), "--draft", "target", "--subtasks", "mt_bench", "qa",
            "--questions-per-subtask", "1", "--max-new-tokens", "6", "--tree-nodes", "4", "8", "--depth", "3",
            "--top-k", "2", "--temperature", "0", "1", "--warmup", "0", "--out", str(out), "--device", "cpu"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "| T " in text and "vs HF" in text
    res = json.loads(out.read_text())
    assert {"settings", "versions", "machine", "runs", "answers", "draft", "command"} <= set(res)
    kinds = {(r["temperature"], r["method"], r["tree_nodes"]) for r in res["runs"]}
    assert kinds == {(t, m, n) for t in (0.0, 1.0) for m, n in
                     [("hf_generate", None), ("plain", None), ("spec", 4), ("spec", 8)]}
    for r in res["runs"]:
        assert set(r["subtasks"]) == {"mt_bench", "qa"}
        o = r["overall"]
        assert o["questions"] == 2 and o["tokens_per_s"] > 0
        if r["method"] == "spec":
            assert 1.0 <= o["tau"] <= 4.0 and o["speedup_vs_plain"] > 0 and o["speedup_vs_hf"] > 0
            assert "target" in o["ms_per_step"] and "draft" in o["ms_per_step"]
    # Greedy answers of every method agree token for token (same lengths at least).
    greedy = [a for a in res["answers"] if a["temperature"] == 0.0]
    by_q = {}
    for a in greedy:
        by_q.setdefault(a["question_id"], set()).add(a["new_tokens"])
    assert all(len(v) == 1 for v in by_q.values())
    assert len(greedy) == 2 * 4  # 2 questions x (hf_generate, plain, spec 4, spec 8)
    for a in greedy:
        turns = tokens[(a["question_id"], 0.0, a["method"], a["tree_nodes"])]
        assert sum(map(len, turns)) == a["new_tokens"]  # the recorded tokens are the answer's
        plain = tokens[(a["question_id"], 0.0, "plain", None)]
        assert turns == plain, (a["method"], a["tree_nodes"])  # every turn's tokens equal plain decoding's


def test_eagle_session_matches_an_uncached_draft_pass():
    """The adapter's cache, positions, masks and hidden hand-over equal one plain draft pass."""
    from elsi.draft import random_draft

    t = make_tiny_target(num_layers=4)
    draft = random_draft(t, [1, 2, 4], draft_vocab=list(range(0, 300, 2)), seed=1).eval()  # a non-trivial d2t
    r = TargetRunner.from_target(t)
    d = EagleDrafter(draft)
    prompt = torch.tensor([1, 40, 41, 42, 43, 44])  # x_0..x_5; x_5 plays the first generated token
    with torch.inference_mode():
        _, feats = r.forward(prompt[:-1], torch.arange(5), r.new_cache(), None, d.feature_layers)  # (5, F)
        s = d.start()
        root = s.commit(prompt, feats)  # rows (g_i, x_{i+1}), i = 0..4
        a, b = d.target_ids[root.topk(2).indices].tolist()  # draft ids -> target ids
        assert a % 2 == 0 and b % 2 == 0
        lg = s.expand(torch.tensor([a, b]), torch.tensor([-1, -1]), torch.eye(2, dtype=torch.bool), 1)
        c = int(d.target_ids[lg[0].argmax()])
        lg2 = s.expand(torch.tensor([c]), torch.tensor([0]), torch.tensor([[True, False, True]]), 2)
        # Reference: no cache, the chain root -> a -> c as extra rows fed with the draft's own outputs.
        g = draft.fuse(feats[None])  # (1, 5, d)
        lo0, h0 = draft(prompt[1:][None], g, torch.arange(5)[None])
        lo1, h1 = draft(torch.tensor([[*prompt[1:].tolist(), a]]), torch.cat([g, h0[:, -1:]], 1), torch.arange(6)[None])
        lo2, _ = draft(torch.tensor([[*prompt[1:].tolist(), a, c]]), torch.cat([g, h0[:, -1:], h1[:, -1:]], 1),
                       torch.arange(7)[None])
        torch.testing.assert_close(root, lo0[0, -1], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(lg[0], lo1[0, -1], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(lg2[0], lo2[0, -1], rtol=1e-4, atol=1e-5)
    # And decoding with it is lossless.
    plain = generate(r, prompt.tolist(), DecodeConfig(max_new_tokens=10))
    spec = generate(r, prompt.tolist(), DecodeConfig(max_new_tokens=10), d, TreeConfig(10, 4, 3))
    assert spec.tokens == plain.tokens
