"""Drafters for the engine (``elsi.decode.engine.Drafter``).

- ``EagleDrafter``: an ``elsi.draft.Eagle3Draft`` (trained or random) with its own KV cache.
- ``LMDrafter``: any causal LM sharing the target's vocabulary, behind a ``TargetRunner``;
  given the target itself it is the *perfect* (oracle) drafter: it proposes the target's own
  predictions, so every greedy step accepts a full path.
- ``TableDrafter``: fixed next-token logits per previous token (V, V): stubs and random drafts.
"""

from __future__ import annotations

import torch

from elsi.decode.engine import TargetRunner, crop_cache
from elsi.decode.tree import additive_mask, attention_masks


class EagleDrafter:
    """Adapter from ``Eagle3Draft`` (docs/INTERFACES.md) to the engine's ``Drafter``."""

    def __init__(self, draft) -> None:
        self.draft = draft
        self.feature_layers = tuple(draft.layer_ids)
        d2t = draft.d2t  # (V_draft,)
        self.target_ids = torch.arange(d2t.shape[0], device=d2t.device) + d2t  # (V_draft,) target id of each

    def start(self) -> EagleSession:
        return EagleSession(self)


class EagleSession:
    """An EAGLE3 draft's cache for one sequence.

    Draft row i pairs the target feature g_i (or the draft's own output) with token x_{i+1}
    at position i; after a commit of length L the root (x_L) is the last committed token and
    a tree row at depth j has position L - 1 + j.
    """

    def __init__(self, owner: EagleDrafter) -> None:
        from elsi.draft import DraftCache

        self.o = owner
        self.token_ids = owner.target_ids  # (V_draft,)
        self.cache = DraftCache()
        self.committed = 0  # rows of target features in the cache
        self.root_hidden: torch.Tensor | None = None  # (1, d) draft output of the last committed row
        self.tree_hidden: torch.Tensor | None = None  # (F, d) draft outputs of the tree rows fed so far
        self.tree_pos: torch.Tensor | None = None  # (F,) their position ids

    def commit(self, tokens: torch.Tensor, features: torch.Tensor | None) -> torch.Tensor:
        if features is None:
            raise ValueError("an EAGLE draft needs the target's features at every committed position")
        draft = self.o.draft
        self.cache.crop(self.committed)
        m = features.shape[0]
        g = draft.fuse(features[None])  # (1, m, d)
        pos = torch.arange(self.committed, self.committed + m, device=g.device)[None]  # (1, m)
        logits, out = draft(tokens[-m:][None], g, pos, cache=self.cache, logits_to_keep=1)  # (1, 1, V_draft), (1, m, d)
        self.committed += m
        self.root_hidden = out[0, -1:]  # (1, d)
        self.tree_hidden = out.new_zeros(0, out.shape[-1])
        self.tree_pos = pos.new_zeros(0)
        return logits[0, -1]  # (V_draft,)

    def expand(self, tokens: torch.Tensor, parents: torch.Tensor, tree_mask: torch.Tensor, depth: int) -> torch.Tensor:
        draft = self.o.draft
        src = torch.cat([self.root_hidden, self.tree_hidden])  # (1 + F, d): row 0 = root
        hidden = src[parents + 1]  # (k, d)
        pos = torch.full_like(tokens, self.committed - 1 + depth)  # (k,)
        k_pos = torch.cat([self.tree_pos, pos])  # (F + k,)
        mask = additive_mask(tree_mask, self.committed, pos, k_pos, hidden.dtype)  # (1, 1, k, L + F + k)
        logits, out = draft(tokens[None], hidden[None], pos[None], cache=self.cache, attention_mask=mask)
        self.tree_hidden = torch.cat([self.tree_hidden, out[0]])  # (F + k, d)
        self.tree_pos = k_pos
        return logits[0]  # (k, V_draft)


class LMDrafter:
    """A causal LM as drafter (the target itself = perfect drafter). ``runner`` wraps it."""

    feature_layers: tuple[int, ...] = ()

    def __init__(self, runner: TargetRunner) -> None:
        self.runner = runner

    def start(self) -> LMSession:
        return LMSession(self.runner)


class LMSession:
    """The LM's own cache: committed tokens, then the tree rows fed since the last commit."""

    def __init__(self, runner: TargetRunner) -> None:
        self.runner = runner
        self.token_ids = None
        self.cache = runner.new_cache()
        self.committed = 0  # tokens in the cache; the root is the last one
        self.tree_pos: torch.Tensor | None = None  # (F,) position ids of the fed tree rows

    def commit(self, tokens: torch.Tensor, features: torch.Tensor | None) -> torch.Tensor:
        r = self.runner
        crop_cache(self.cache, self.committed)
        n = tokens.shape[0]
        pos = torch.arange(self.committed, self.committed + n, device=tokens.device)  # (n,)
        hidden, _ = r.forward(tokens, pos, self.cache)  # (n, d)
        self.committed += n
        self.tree_pos = pos.new_zeros(0)
        return r.logits(hidden[-1:])[0]  # (V,)

    def expand(self, tokens: torch.Tensor, parents: torch.Tensor, tree_mask: torch.Tensor, depth: int) -> torch.Tensor:
        r = self.runner
        pos = torch.full_like(tokens, self.committed - 1 + depth)  # (k,)
        k_pos = torch.cat([self.tree_pos, pos])  # (F + k,)
        mask = attention_masks(tree_mask, self.committed, pos, k_pos, r.dtype, r.layer_types, r.window)
        hidden, _ = r.forward(tokens, pos, self.cache, mask)  # (k, d)
        self.tree_pos = k_pos
        return r.logits(hidden)  # (k, V)


class TableDrafter:
    """Next-token logits that depend only on the previous token: ``table`` (V, V), row = previous."""

    feature_layers: tuple[int, ...] = ()

    def __init__(self, table: torch.Tensor) -> None:
        if table.dim() != 2 or table.shape[0] != table.shape[1]:
            raise ValueError(f"table must be (V, V), got {tuple(table.shape)}")
        self.table = table

    @classmethod
    def random(cls, vocab_size: int, generator: torch.Generator, scale: float = 3.0,
               device: torch.device | str = "cpu") -> TableDrafter:
        """A random draft: N(0, scale^2) logits drawn from ``generator``."""
        t = torch.randn(vocab_size, vocab_size, generator=generator) * scale  # (V, V)
        return cls(t.to(device))

    def start(self) -> TableSession:
        return TableSession(self.table)


class TableSession:
    def __init__(self, table: torch.Tensor) -> None:
        self.table = table  # (V, V)
        self.token_ids = None

    def commit(self, tokens: torch.Tensor, features: torch.Tensor | None) -> torch.Tensor:
        return self.table[tokens[-1]]  # (V,)

    def expand(self, tokens: torch.Tensor, parents: torch.Tensor, tree_mask: torch.Tensor, depth: int) -> torch.Tensor:
        return self.table[tokens]  # (k, V)


def load_drafter(spec: str, target, seed: int = 0) -> tuple[EagleDrafter | LMDrafter | None, dict]:
    """Resolve ``--draft`` for ``target`` (an ``elsi.models.Target``) -> (drafter, description).

    "" = none (plain decoding); "random" = an untrained EAGLE3 draft on EAGLE-3's default
    layers {2, N//2, N-3} (a baseline, labelled so); "target" = the target itself (perfect
    drafter); anything else = a draft directory: elsi's (``Eagle3Draft.save_pretrained``) or
    another tool's EAGLE3 checkpoint, checked against the target (layers, hidden size, vocabulary).
    """
    from pathlib import Path

    if not spec:
        return None, {"draft": None, "kind": "none"}
    if spec == "target":
        return LMDrafter(TargetRunner.from_target(target)), {"draft": spec, "kind": "perfect (the target itself)"}
    from elsi.draft import Eagle3Draft, random_draft

    embed = target.adapter.embed_tokens(target.model)
    if spec == "random":
        n = target.num_layers
        layers = sorted({2, n // 2, n - 3}) if n >= 4 else [n]
        vocab = int(embed.weight.shape[0])
        draft = random_draft(target, layers, draft_vocab=min(32000, vocab), seed=seed).eval()
        return EagleDrafter(draft), {"draft": spec, "kind": "random (untrained EAGLE3 draft)", "layer_ids": layers}
    path = Path(spec)
    if not path.is_dir():
        raise FileNotFoundError(f"--draft {spec!r}: not a draft directory (nor 'random' or 'target')")
    draft = Eagle3Draft.from_pretrained(path, embed, target.num_layers).eval()
    return EagleDrafter(draft), {"draft": str(path), "kind": "trained EAGLE3 draft", "layer_ids": list(draft.layer_ids)}


def check_draft_spec(spec: str, model: str, trust_remote_code: bool = False):
    """Before any model loads: a draft directory's config must parse and fit ``model``'s config
    (its layer count and hidden size), or a ValueError/FileNotFoundError naming both. Returns the
    draft's ``DraftConfig`` (None for "", "target" and "random")."""
    from pathlib import Path

    if spec in ("", "target", "random"):
        return None
    path = Path(spec)
    if not path.is_dir():
        raise FileNotFoundError(f"--draft {spec!r}: not a draft directory (nor 'random' or 'target')")
    from elsi.draft.model import check_fits_target, read_draft_config
    from elsi.models import model_shape

    n, d = model_shape(model, trust_remote_code)
    cfg = read_draft_config(path, n, d)
    check_fits_target(cfg, n, d, where=f"draft {path}")
    return cfg
