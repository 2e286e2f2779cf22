"""The decoding engine: stub paths, exact greedy equality, exact sampling distribution."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from conftest import make_tiny_gemma3, make_tiny_target
from scipy.stats import chisquare
from torch import nn

from elsi.decode import (
    DecodeConfig,
    EagleDrafter,
    LMDrafter,
    TableDrafter,
    TargetRunner,
    TreeConfig,
    generate,
    keep_rows,
)
from elsi.models.adapters import LLAMA

V = 16


# ---------- stubs with fixed logits ----------
class BigramDecoder(nn.Module):
    """Hidden state = one-hot of the token; writes the one-hots into the cache as keys/values."""

    def __init__(self, v: int) -> None:
        super().__init__()
        self.v = v
        self.embed_tokens = nn.Embedding(v, v)

    def forward(self, input_ids, position_ids=None, attention_mask=None, cache=None, use_cache=True,
                output_hidden_states=False, **kw):
        h = torch.nn.functional.one_hot(input_ids, self.v).float()  # (1, n, V)
        if cache is not None:
            cache.update(h[:, None], h[:, None], 0)  # (1, 1, n, V)
        return SimpleNamespace(last_hidden_state=h, hidden_states=(h, h) if output_hidden_states else None)


class BigramLM(nn.Module):
    """A stub target whose next-token logits depend only on the current token: table (V, V)."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        from transformers import LlamaConfig

        v = table.shape[0]
        self.config = LlamaConfig(vocab_size=v, hidden_size=v, num_hidden_layers=1, num_attention_heads=1)
        self.model = BigramDecoder(v)
        self.lm_head = nn.Linear(v, v, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(table.T)  # logits = one_hot(x) @ table

    def get_output_embeddings(self):
        return self.lm_head


def shift_table(shift: int, v: int = V, exceptions: dict[int, int] | None = None) -> torch.Tensor:
    """Logits (V, V) whose argmax after token i is (i + shift) % V, or exceptions[i]."""
    nxt = {i: (i + shift) % v for i in range(v)} | (exceptions or {})
    t = torch.zeros(v, v)
    for i, j in nxt.items():
        t[i, j] = 8.0
    return t


def stub_runner():
    return TargetRunner(BigramLM(shift_table(1)), LLAMA)


def run(runner, drafter, max_new=12, tree=TreeConfig(8, 6, 1), eos=(), prompt=(0, 1, 2)):
    return generate(runner, list(prompt), DecodeConfig(max_new_tokens=max_new), drafter, tree, eos)


def test_stub_accept_all():
    r = stub_runner()
    g = run(r, TableDrafter(shift_table(1)))  # the draft equals the target
    assert g.tokens == [(3 + i) % V for i in range(12)]
    assert g.accepted == [7, 4]  # depth 6 + the bonus, then capped by max_new_tokens
    g = run(r, TableDrafter(shift_table(1)), tree=TreeConfig(20, 4, 3))  # a bushy tree accepts the same chain
    assert g.accepted == [5, 5, 1] and g.tokens == [(3 + i) % V for i in range(12)]


def test_stub_reject_all():
    r = stub_runner()
    g = run(r, TableDrafter(-shift_table(1)), tree=TreeConfig(30, 4, 5))  # the right token ranks last
    assert g.tokens == [(3 + i) % V for i in range(12)]
    assert g.accepted == [1] * 11


def test_stub_partial_acceptance():
    r = stub_runner()
    wrong = {i: (i + 2) % V for i in range(V) if i % 4 == 3}  # the draft errs after tokens 3, 7, 11, 15
    g = run(r, TableDrafter(shift_table(1, exceptions=wrong)), max_new=20)
    assert g.tokens == [(3 + i) % V for i in range(20)]
    # Expected: from root x, drafts follow x+1, ... until the first token t with t % 4 == 3 has a wrong child.
    expect, x, n = [], 3, 1
    while n < 20:
        acc, y = 0, x
        while acc < min(6, 20 - n - 1) and y % 4 != 3:
            acc, y = acc + 1, (y + 1) % V
        step = min(acc + 1, 20 - n)
        expect.append(step)
        n, x = n + step, (x + step) % V
    assert g.accepted == expect


def test_stub_eos_inside_accepted_path():
    r = stub_runner()
    g = run(r, TableDrafter(shift_table(1)), eos={7})
    assert g.tokens == [3, 4, 5, 6, 7] and g.stop == "eos"
    assert g.accepted == [4]  # the path went on past 7, the output stops at it
    g = run(r, TableDrafter(shift_table(1)), eos={3})  # EOS as the very first token: no step
    assert g.tokens == [3] and g.steps == 0 and g.stop == "eos"


@pytest.mark.parametrize("max_new,expect", [(1, []), (2, [1]), (4, [3]), (7, [6]), (8, [7]), (9, [7, 1])])
def test_stub_max_length_edge(max_new, expect):
    g = run(stub_runner(), TableDrafter(shift_table(1)), max_new=max_new)
    assert len(g.tokens) == max_new and g.stop == "length"
    assert g.accepted == expect and all(s <= 7 for s in g.tree_sizes)


def test_keep_rows_moves_the_accepted_path():
    from transformers import DynamicCache

    cache = DynamicCache()
    x = torch.arange(10.0).view(1, 1, 10, 1).expand(1, 2, 10, 3).contiguous()  # (1, 2, 10, 3)
    cache.update(x, x + 100, 0)
    cache.update(x, x, 1)
    keep_rows(cache, 4, [0, 2, 5])
    for layer, off in zip(cache.layers, (100, 0)):
        assert layer.keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 6, 9]
        assert layer.values[0, 1, :, 0].tolist() == [v + off for v in [0, 1, 2, 3, 4, 6, 9]]
    keep_rows(cache, 5, [0, 1])  # a contiguous path is a crop
    assert cache.layers[0].keys.shape[2] == 7


def test_node_logits_computes_the_spine_at_once_and_other_nodes_on_demand():
    """The walk's logits: the spine (root, best child, its best child) in one head product, any other
    visited node one row on demand, each node's logits those of a one-row product."""
    from elsi.decode.engine import _node_logits
    from elsi.decode.tree import make_tree

    r = stub_runner()
    calls = []
    one_row = r.logits
    r.logits = lambda h: calls.append(h.shape[0]) or one_row(h)
    # root 0 -> children 1 (best), 2; 1 -> 3 (best), 4; 3 -> 5
    tree = make_tree(torch.tensor([0, 1, 5, 2, 9, 3]), torch.tensor([-1, 0, 0, 1, 1, 3]),
                     torch.tensor([0, 1, 1, 2, 2, 3]))
    hidden = torch.nn.functional.one_hot(tree.tokens, V).float()  # (6, V)
    logits_of = _node_logits(r, hidden, tree)
    assert calls == [3]  # nodes 0, 1, 3
    for node in (0, 1, 3, 0):
        assert torch.equal(logits_of(node), one_row(hidden[node:node + 1])[0])
    assert calls == [3]
    assert torch.equal(logits_of(4), one_row(hidden[4:5])[0]) and calls == [3, 1]
    logits_of(4)
    assert calls == [3, 1]  # kept once computed
    assert _node_logits(r, hidden[:1], make_tree(torch.tensor([0]), torch.tensor([-1]), torch.tensor([0]))) \
        and calls == [3, 1, 1]  # a root-only tree: one row


def test_stub_cache_holds_exactly_the_accepted_sequence():
    """After decoding, the target cache's keys are the one-hots of prompt + output[:-1]."""
    r = stub_runner()
    seen = {}
    new_cache = r.new_cache

    def spy():
        seen["cache"] = new_cache()
        return seen["cache"]

    r.new_cache = spy
    wrong = {i: (i + 2) % V for i in range(V) if i % 3 == 0}
    g = run(r, TableDrafter(shift_table(1, exceptions=wrong)), tree=TreeConfig(12, 4, 3), max_new=15)
    keys = seen["cache"].layers[0].keys[0, 0]  # (L, V)
    assert keys.argmax(-1).tolist() == [0, 1, 2] + g.tokens[:-1]


# ---------- tiny random HF models: exact greedy equality ----------
def _hf_greedy(model, prompt, n, eos):
    x = torch.tensor([prompt])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                         eos_token_id=eos, pad_token_id=eos[0] if eos else 0)
    return out[0, len(prompt):].tolist()


PROMPTS = [[1, 40, 41, 42, 43], [1, 7, 99, 130, 5, 61, 17, 8, 250, 33, 12, 90, 4]]


@pytest.fixture(scope="module")
def tiny():
    t = make_tiny_target(num_layers=4)
    with torch.no_grad():  # sharper logits than the default init: fewer near-ties
        for p in t.model.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
    return t


def _drafters(target, runner):
    from elsi.draft import random_draft

    v = runner.vocab_size
    n = target.num_layers
    return {
        "perfect": LMDrafter(runner),
        "random-table": TableDrafter.random(v, torch.Generator().manual_seed(0)),
        "random-eagle3": EagleDrafter(random_draft(target, sorted({1, max(2, n // 2), n}),
                                                   draft_vocab=200, seed=0)),
    }


def test_tiny_llama_greedy_equals_generate(tiny):
    r = TargetRunner.from_target(tiny)
    for prompt in PROMPTS:
        hf = _hf_greedy(tiny.model, prompt, 20, None)
        plain = generate(r, prompt, DecodeConfig(max_new_tokens=20))
        assert plain.tokens == hf and plain.accepted == [1] * 19
        for name, d in _drafters(tiny, r).items():
            trees = [TreeConfig(20, 5, 4), TreeConfig(6, 6, 1)]
            if name == "random-table":
                trees.append(TreeConfig(60, 6, 10))
            for tree in trees:
                g = generate(r, prompt, DecodeConfig(max_new_tokens=20), d, tree)
                assert g.tokens == hf, (name, tree)
                assert sum(g.accepted) == 19
                if name == "perfect" and tree.top_k == 1:
                    assert g.accepted[:2] == [7, 7]  # a chain of the target's own tokens is always accepted


def test_tiny_llama_eos_matches_generate(tiny):
    r = TargetRunner.from_target(tiny)
    prompt = PROMPTS[1]
    ref = _hf_greedy(tiny.model, prompt, 12, None)
    eos = [ref[5]]  # stop at the 6th token (or earlier if it repeats)
    hf = _hf_greedy(tiny.model, prompt, 12, eos)
    g = generate(r, prompt, DecodeConfig(max_new_tokens=12), LMDrafter(r), TreeConfig(10, 4, 2), eos)
    assert g.tokens == hf and g.stop == "eos"


def test_eagle_session_commits_equal_the_teacher_forced_draft(tiny):
    """Root logits after every commit (with tree rows fed and dropped in between) equal the
    draft run once over the whole sequence with the target's features (row i predicts x_{i+2})."""
    from elsi.draft import random_draft

    r = TargetRunner.from_target(tiny)
    draft = random_draft(tiny, [1, 2, 4], draft_vocab=200, seed=0).eval()
    seq = torch.randint(3, r.vocab_size, (20,), generator=torch.Generator().manual_seed(1))  # (20,)
    with torch.inference_mode():
        _, feats = r.forward(seq, torch.arange(20), r.new_cache(), None, draft.layer_ids)  # (20, m·d)
        n = 19
        full, _ = draft(seq[1:][None], draft.fuse(feats[:n][None]), torch.arange(n)[None])  # (1, 19, V_d)
        session = EagleDrafter(draft).start()
        length = 7  # the prompt and the first token
        got = session.commit(seq[:length], feats[: length - 1])
        torch.testing.assert_close(got, full[0, length - 2], rtol=1e-4, atol=1e-4)
        for accepted in (2, 1, 4, 1, 3):
            # Draft a small tree below the root (two children, one grandchild), then drop it.
            kids = session.expand(seq[:2], torch.tensor([-1, -1]), torch.eye(2, dtype=torch.bool), 1)  # (2, V_d)
            assert kids.shape == (2, full.shape[-1])
            session.expand(seq[2:3], torch.tensor([0]), torch.tensor([[True, False, True]]), 2)
            # The step added `accepted` tokens (accepted drafts + bonus); features at the root and accepted rows.
            got = session.commit(seq[length: length + accepted], feats[length - 1: length - 1 + accepted])
            length += accepted
            torch.testing.assert_close(got, full[0, length - 2], rtol=1e-4, atol=1e-4)


def test_tiny_gemma3_greedy_equals_generate():
    """Sliding-window and full layers: dict masks over full-length caches; prompt > window."""
    t = make_tiny_gemma3(num_layers=3)
    with torch.no_grad():
        for p in t.model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    r = TargetRunner.from_target(t)
    assert "sliding_attention" in r.layer_types and r.window == 16
    prompt = [1] + [(7 * i) % 250 + 3 for i in range(20)]  # 21 tokens > window 16
    hf = _hf_greedy(t.model, prompt, 20, None)
    assert generate(r, prompt, DecodeConfig(max_new_tokens=20)).tokens == hf
    for name, d in _drafters(t, r).items():
        g = generate(r, prompt, DecodeConfig(max_new_tokens=20), d, TreeConfig(12, 4, 3))
        assert g.tokens == hf, name


# ---------- exact sampling distribution (chi-square) ----------
@pytest.fixture(scope="module")
def micro():
    """A 1-layer Llama over 5 tokens, peaked enough to make every path informative."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=5, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(40.0)
    return TargetRunner(model, LLAMA)


def _exact_joint(runner, prompt, n, temperature, top_p):
    """P(first n tokens) by enumeration: {tuple: prob}."""
    from elsi.decode import sampling_probs

    out = {}
    with torch.inference_mode():
        for seq in itertools.product(range(runner.vocab_size), repeat=n - 1):
            x = torch.tensor(prompt + list(seq))
            cache = runner.new_cache()
            hidden, _ = runner.forward(x, torch.arange(len(x)), cache)
            probs = sampling_probs(runner.logits(hidden[len(prompt) - 1:]), temperature, top_p)  # (n, V)
            base = 1.0
            for i, tok in enumerate(seq):
                base *= float(probs[i, tok])
            for last in range(runner.vocab_size):
                out[seq + (last,)] = base * float(probs[n - 1, last])
    return out


@pytest.mark.parametrize("temperature,top_p,draft", [(1.0, 1.0, "good"), (1.0, 1.0, "bad"), (0.8, 0.9, "bad")])
def test_sampling_is_distributed_as_the_target(micro, temperature, top_p, draft):
    """Joint distribution of the first 3 tokens over many seeds against the exact one.

    The first token comes from the prompt's forward, the next two from one tree step
    (depth 2): accepted drafts, residual draws and bonus tokens all enter the joint.
    """
    prompt = [0, 3, 1]
    n_tok, runs = 3, 800
    exact = _exact_joint(micro, prompt, n_tok, temperature, top_p)
    drafter = LMDrafter(micro) if draft == "good" else TableDrafter(torch.eye(5) * -6.0)  # bad: arbitrary
    cfg = DecodeConfig(max_new_tokens=n_tok, temperature=temperature, top_p=top_p)
    gen = torch.Generator().manual_seed(11)
    counts = dict.fromkeys(exact, 0)
    drafted = 0
    for _ in range(runs):
        g = generate(micro, prompt, cfg, drafter, TreeConfig(6, 2, 2), (), gen)
        counts[tuple(g.tokens)] += 1
        drafted += sum(g.accepted) - g.steps
    # Pool the cells expected fewer than 5 times into one.
    obs, exp, rest_o, rest_e = [], [], 0, 0.0
    for c, p in exact.items():
        if p * runs < 5:
            rest_o, rest_e = rest_o + counts[c], rest_e + p * runs
        else:
            obs.append(counts[c])
            exp.append(p * runs)
    if rest_e > 1e-9:
        obs.append(rest_o)
        exp.append(rest_e)
    else:
        assert rest_o == 0  # tokens outside the nucleus never appear
    exp = [e * runs / sum(exp) for e in exp]  # float rounding of the exact joint
    assert chisquare(obs, exp).pvalue > 1e-3
    if draft == "good":
        assert drafted > 0.5 * runs  # the tree really is used
