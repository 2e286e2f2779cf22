"""The decoding loop: plain autoregressive decoding and lossless tree speculative decoding.

One engine serves both, so their speeds compare fairly. Per speculative step (EAGLE-2,
Li et al. 2024):

1. the drafter grows a dynamic tree below the root (the last token the target chose);
2. the target runs once over the root and the tree, with a tree attention mask and
   position ids ``cache length + depth``, appending every tree row to its KV cache;
3. the tree is walked from the root with the target's logits (``verify``): the accepted
   path plus the target's own next token (the bonus token) are the step's output;
4. only the accepted path's rows stay in the target's KV cache (moved in place);
5. the drafter is given the accepted tokens with the target's features at them.

Caches are full length for every layer, also for sliding-window layers (Gemma-3), whose
mask is banded instead: a sliding cache would evict context when rejected tree rows are
appended.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from elsi.config import at_least, opt
from elsi.decode.tree import Tree, TreeConfig, attention_masks, build_tree
from elsi.decode.verify import choose, greedy_walk, sampling_walk
from elsi.models.adapters import Adapter, soft_cap


@dataclass(frozen=True)
class DecodeConfig:
    """How many tokens and how they are chosen."""

    max_new_tokens: int = opt(256, "most new tokens per answer")
    temperature: float = opt(0.0, "sampling temperature; 0 = greedy")
    top_p: float = opt(1.0, "nucleus sampling mass (1 = off); used when temperature > 0")

    def __post_init__(self) -> None:
        at_least(self, max_new_tokens=1, temperature=0)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


class DraftSession(Protocol):
    """A drafter's state for one sequence (its own KV cache).

    Logits are over the drafter's vocabulary; ``token_ids`` (V_d,) gives the target token of
    each column (None: the columns are target ids).
    """

    token_ids: torch.Tensor | None

    def commit(self, tokens: torch.Tensor, features: torch.Tensor | None) -> torch.Tensor:
        """Drop the rows fed by ``expand`` since the last commit, then append accepted context.

        tokens (n,): tokens appended to the sequence since the last commit (the first commit:
        the prompt and the first generated token); the last one is the next tree's root.
        features (m, F) or None: the target's states (at ``Drafter.feature_layers``) at the
        positions whose next token is ``tokens[-m:]`` (an EAGLE draft pairs them).
        Returns the draft's logits (V_d,) for the token after the root.
        """
        ...

    def expand(self, tokens: torch.Tensor, parents: torch.Tensor, tree_mask: torch.Tensor,
               depth: int) -> torch.Tensor:
        """Feed ``k`` tree tokens (target ids) at ``depth``; see ``elsi.decode.tree.ExpandFn``. Returns (k, V_d)."""
        ...


class Drafter(Protocol):
    """Anything that proposes tokens: an EAGLE3 draft, a small LM, the target itself, a stub."""

    feature_layers: tuple[int, ...]  # target hidden-state ids passed to ``commit`` (empty: none)

    def start(self) -> DraftSession:
        """A fresh session for a new sequence."""
        ...


class TargetRunner:
    """The target as the engine calls it: the decoder over a KV cache, and the LM head apart
    (so a tree step computes logits only for the rows the walk visits)."""

    def __init__(self, model: nn.Module, adapter: Adapter) -> None:
        self.model = model
        self.decoder = adapter.decoder(model)
        self.head = model.get_output_embeddings()
        self.layer_types = tuple(adapter.layer_types(model))
        self.window = adapter.sliding_window(model)
        self.softcap = adapter.logit_softcap(model)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.vocab_size = int(self.head.weight.shape[0])

    @classmethod
    def from_target(cls, target) -> TargetRunner:
        """From an ``elsi.models.Target``."""
        return cls(target.model, target.adapter)

    def new_cache(self):
        """An empty cache, full length for every layer (no sliding-window eviction)."""
        from transformers import DynamicCache

        return DynamicCache()

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache, mask=None,
                feature_layers: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens, positions (n,) -> (final hidden states (n, d), features (n, m·d) or None).

        ``mask``: None (causal over the cache) or what ``tree.attention_masks`` returns.
        Features are ``hidden_states[l]`` for l in ``feature_layers``, concatenated.
        """
        out = self.decoder(
            input_ids=tokens[None], position_ids=positions[None], attention_mask=mask, cache=cache,
            use_cache=True, output_hidden_states=list(feature_layers) if feature_layers else False,
        )
        hidden = out.last_hidden_state[0]  # (n, d)
        if not feature_layers:
            return hidden, None
        feats = torch.cat([out.hidden_states[l][0] for l in feature_layers], dim=-1)  # (n, m·d)
        return hidden, feats

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (r, d) -> float32 logits (r, V)."""
        return soft_cap(self.head(hidden).float(), self.softcap)  # (r, V)


def crop_cache(cache, length: int) -> None:
    """Keep the first ``length`` positions of every layer of a ``DynamicCache``."""
    for layer in cache.layers:
        if layer.keys is not None and layer.keys.dim() == 4 and layer.keys.shape[-2] > length:
            layer.keys = layer.keys[:, :, :length]  # (B, KVH, length, hd)
            layer.values = layer.values[:, :, :length]


def keep_rows(cache, start: int, rows: Sequence[int]) -> None:
    """Keep cache positions ``start + rows`` (increasing) right after the first ``start``
    ones and drop the rest: the accepted tree path stays, rejected rows go."""
    m = len(rows)
    if list(rows) != list(range(m)):
        idx = None
        for layer in cache.layers:
            if layer.keys is None or layer.keys.dim() != 4:
                continue
            if idx is None:
                idx = torch.tensor(rows, dtype=torch.long, device=layer.keys.device) + start  # (m,)
            layer.keys[:, :, start:start + m] = layer.keys[:, :, idx]  # (B, KVH, m, hd)
            layer.values[:, :, start:start + m] = layer.values[:, :, idx]
    crop_cache(cache, start + m)


@dataclass
class Generation:
    """One answer and how it was made."""

    tokens: list[int]  # new tokens (prompt excluded); ends with an EOS token when stop == "eos"
    accepted: list[int]  # per decoding step: tokens it added (accepted drafts + the target's own)
    stop: str  # "eos" or "length"
    prompt_tokens: int
    prefill_s: float  # prompt forward and first token
    total_s: float  # prefill included
    tree_sizes: list[int] = field(default_factory=list)  # per step: tree rows the target verified
    profile: dict[str, float] = field(default_factory=dict)  # seconds per phase, summed over steps

    @property
    def steps(self) -> int:
        return len(self.accepted)

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.total_s if self.total_s > 0 else 0.0

    @property
    def tau(self) -> float:
        """Mean accepted length per step (1 for plain decoding)."""
        return sum(self.accepted) / len(self.accepted) if self.accepted else 0.0

    def to_json(self) -> dict:
        return {
            "tokens": self.tokens, "steps": self.steps, "accepted": self.accepted, "tau": self.tau,
            "stop": self.stop, "prompt_tokens": self.prompt_tokens, "new_tokens": len(self.tokens),
            "prefill_s": self.prefill_s, "total_s": self.total_s, "tokens_per_s": self.tokens_per_s,
            "tree_sizes": self.tree_sizes, "profile": self.profile,
        }


class _Clock:
    """Sums wall time per phase: ``lap(name)`` charges the time since the previous lap."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.sums[name] = self.sums.get(name, 0.0) + now - self.last
        self.last = now


@dataclass(frozen=True)
class _Loop:
    """What every decoding step of one ``generate`` call reads."""

    runner: TargetRunner  # the target
    cfg: DecodeConfig  # temperature, top-p, the length limit
    eos: frozenset[int]  # the tokens that stop decoding
    generator: torch.Generator | None  # the sampler's randomness (temperature > 0)
    clock: _Clock  # the profile of the phases
    layers: tuple[int, ...] = ()  # the drafter's feature layers (none: plain decoding)
    tree: TreeConfig = field(default_factory=TreeConfig)  # the draft tree's shape


def _take(new: list[int], proposed: Sequence[int], eos: Collection[int], limit: int) -> tuple[list[int], bool]:
    """Append ``proposed`` to ``new`` up to the first EOS or ``limit`` tokens; (added, stopped)."""
    added = []
    for t in proposed:
        added.append(t)
        if t in eos or len(new) + len(added) >= limit:
            new.extend(added)
            return added, True
    new.extend(added)
    return added, False


@torch.inference_mode()
def generate(runner: TargetRunner, prompt: Sequence[int], cfg: DecodeConfig, drafter: Drafter | None = None,
             tree: TreeConfig | None = None, eos_ids: Collection[int] = (),
             generator: torch.Generator | None = None) -> Generation:
    """Decode after ``prompt`` (token ids): plainly without ``drafter``, else with a draft tree.

    Temperature 0 gives exactly the target's greedy tokens; temperature > 0 draws exactly from
    the target's distribution (``sampling_probs``) using ``generator``.
    """
    if len(prompt) == 0:
        raise ValueError("the prompt is empty: decoding needs at least one token")
    tree = tree or TreeConfig()
    eos = frozenset(int(e) for e in eos_ids)
    dev = runner.device
    layers = tuple(drafter.feature_layers) if drafter is not None else ()
    clock = _Clock()
    t0 = clock.last
    prompt_t = torch.as_tensor(list(prompt), dtype=torch.long, device=dev)  # (P,)
    cache = runner.new_cache()
    # Prefill: the prompt in one forward; the target picks the first new token.
    hidden, feats = runner.forward(prompt_t, torch.arange(len(prompt), device=dev), cache, None, layers)
    first = choose(runner.logits(hidden[-1:])[0], cfg.temperature, cfg.top_p, generator)
    new: list[int] = []
    _, stopped = _take(new, [first], eos, cfg.max_new_tokens)
    clock.lap("prefill")
    prefill_s = clock.sums["prefill"]
    cache_len = len(prompt)  # positions in the target's cache; new[-1] is not in it yet
    loop = _Loop(runner, cfg, eos, generator, clock, layers, tree)
    if drafter is None:
        accepted, sizes = _plain_steps(loop, cache, cache_len, new, stopped)
    else:
        session = drafter.start()
        accepted, sizes = [], []
        if not stopped:
            root_logits = session.commit(torch.cat([prompt_t, prompt_t.new_tensor([first])]), feats)  # (V_d,)
            clock.lap("commit")
            accepted, sizes = _tree_steps(loop, cache, cache_len, new, session, root_logits)
    total = time.perf_counter() - t0
    return Generation(tokens=new, accepted=accepted, stop="eos" if new[-1] in eos else "length",
                      prompt_tokens=len(prompt), prefill_s=prefill_s, total_s=total, tree_sizes=sizes,
                      profile=clock.sums)


def _plain_steps(loop: _Loop, cache, cache_len: int, new: list[int], stopped: bool) -> tuple[list[int], list[int]]:
    """Plain decoding: one target forward per token. Appends to ``new``; (accepted, tree sizes)."""
    runner, cfg, clock = loop.runner, loop.cfg, loop.clock
    dev = runner.device
    accepted: list[int] = []
    while not stopped:
        tok_t = torch.tensor([new[-1]], device=dev)  # (1,)
        hidden, _ = runner.forward(tok_t, torch.tensor([cache_len], device=dev), cache)  # (1, d)
        cache_len += 1
        clock.lap("target")
        tok = choose(runner.logits(hidden)[0], cfg.temperature, cfg.top_p, loop.generator)
        added, stopped = _take(new, [tok], loop.eos, cfg.max_new_tokens)
        accepted.append(len(added))
        clock.lap("head")
    return accepted, [1] * len(accepted)


def _tree_steps(loop: _Loop, cache, cache_len: int, new: list[int], session: DraftSession,
                root_logits: torch.Tensor) -> tuple[list[int], list[int]]:
    """Speculative steps until EOS or the length limit (Steps 1-5 of the module docstring).

    ``new[-1]`` is the root, not yet in ``cache`` (``cache_len`` positions); ``root_logits`` (V_d,): the draft's
    logits after it. Appends to ``new``; returns (accepted length per step, verified tree size per step).
    """
    runner, cfg, clock = loop.runner, loop.cfg, loop.clock
    dev = runner.device
    accepted: list[int] = []
    sizes: list[int] = []
    while True:
        # Step 1: draft a tree below the root (no deeper than the tokens still allowed).
        t = build_tree(new[-1], root_logits, session.expand, loop.tree, max_depth=cfg.max_new_tokens - len(new) - 1,
                       token_ids=session.token_ids)
        clock.lap("draft")
        # Step 2: one target forward over root + tree.
        pos = cache_len + t.depth  # (n,) position ids
        mask = attention_masks(t.ancestors, cache_len, pos, pos, runner.dtype, runner.layer_types, runner.window)
        clock.lap("mask")
        hidden, feats = runner.forward(t.tokens, pos, cache, mask, loop.layers)  # (n, d), (n, F)
        clock.lap("target")
        # Step 3: walk the tree with the target's logits.
        logits_of = _node_logits(runner, hidden, t)
        if cfg.temperature <= 0:
            path, bonus = greedy_walk(t, logits_of)
        else:
            path, bonus = sampling_walk(t, logits_of, cfg.temperature, cfg.top_p, loop.generator)
        clock.lap("verify")
        # Step 4: keep only the accepted path in the target's cache.
        keep_rows(cache, cache_len, path)
        cache_len += len(path)
        clock.lap("cache")
        proposed = t.tokens[path[1:]].tolist() + [bonus]
        added, stopped = _take(new, proposed, loop.eos, cfg.max_new_tokens)
        accepted.append(len(added))
        sizes.append(t.size)
        if stopped:
            return accepted, sizes
        # Step 5: the drafter learns the accepted tokens and the target's features there.
        path_t = torch.tensor(path, device=dev)  # (m,) accepted tree rows
        root_logits = session.commit(torch.tensor(proposed, device=dev), None if feats is None else feats[path_t])
        clock.lap("commit")


# Rows of the LM head computed in one product before the walk starts: on CPU a product of 1 to 3 rows
# costs about one row's time (the weight read dominates; bench/head_rows.py), 4 rows twice that.
SPINE_ROWS = 3


def _node_logits(runner: TargetRunner, hidden: torch.Tensor, tree: Tree, spine_rows: int = SPINE_ROWS):
    """``logits_of(node)`` for the walk: the LM head on the visited nodes only.

    hidden (n, d). The tree's spine (the root, its best child, that child's best child, up to
    ``spine_rows`` nodes: the path a walk takes when the draft's first choices are accepted) gets its
    logits in one product; any other node the walk visits gets one row on demand. A head over every
    node would cost several times a walk's tau visited rows on CPU.
    """
    spine = [0]
    while len(spine) < spine_rows and tree.children[spine[-1]]:
        spine.append(tree.children[spine[-1]][0])
    known = dict(zip(spine, runner.logits(hidden[spine])))  # node -> (V,)

    def logits_of(node: int) -> torch.Tensor:
        if node not in known:
            known[node] = runner.logits(hidden[node:node + 1])[0]  # (V,)
        return known[node]

    return logits_of


def stop_tokens(model: nn.Module, tokenizer) -> set[int]:
    """EOS ids: the tokenizer's and those of the model's generation config."""
    ids: set[int] = set()
    gen_cfg = getattr(model, "generation_config", None)
    for src in (getattr(tokenizer, "eos_token_id", None), getattr(gen_cfg, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif src:
            ids.update(int(i) for i in src)
    return ids
