"""Layer-set selection from the Gram tensor (docs/design.md, "Selection").

- ELSI: beam search over set entropy (Goel et al., "Surfing the Activation Wave").
- ELSI-C: ELSI whose extensions are limited to the q layers most dissimilar (1 - CKA)
  to the current set, plus the transition-boundary layers.
- exhaustive: every set of size m (on a per-sample block subsample, the best sets then
  rescored on all blocks).
- low-entropy: ELSI minimising entropy (a negative control).
- baselines: eagle2 = {N}; eagle3 = {2, N//2, N-3}; uniform = m evenly spaced ending at the last pool id.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from elsi.stats.analysis import GramRun, parse_layers

SEARCH_METHODS = ("elsi", "elsi-c", "exhaustive", "low-entropy")
BASELINES = ("eagle2", "eagle3", "uniform")
METHODS = (*SEARCH_METHODS, *BASELINES)

Set = tuple[int, ...]  # sorted layer ids


class SetScorer:
    """Entropy of layer sets with a cache; block-entropy or mean-block aggregate.

    ``blocks`` restricts the block-entropy to a subset of blocks (the exhaustive
    search's subsample); values are then per-sample means over that subset.
    """

    def __init__(self, run: GramRun, aggregate: str = "block-entropy", blocks: torch.Tensor | None = None):
        self.run = run
        self.aggregate = aggregate
        self.blocks = blocks
        self.cache: dict[Set, float] = {}
        self.evaluated = 0  # sets actually computed (not cached)

    def score(self, sets: list[Set]) -> list[float]:
        todo = [s for s in dict.fromkeys(sets) if s not in self.cache]
        if todo:
            self.evaluated += len(todo)
            if self.aggregate == "mean-block":
                vals = self.run.mean_block_entropy(todo)
            else:
                per_block = self.run.block_entropies(todo, self.blocks)  # (sets, nb)
                vals = [self.run.aggregate(v, self.blocks).mean for v in per_block]
            self.cache.update(zip(todo, vals))
        return [self.cache[s] for s in sets]


@dataclass
class Selection:
    """Result of one method for one m (see docs/INTERFACES.md, selections.json)."""

    method: str
    m: int
    layers: Set
    entropy: float
    entropy_normalized: float
    beams: list[dict] = field(default_factory=list)
    rank: int | None = None
    rank_exact: bool | None = None
    optimum: dict | None = None
    gap: float | None = None
    elapsed_s: float = 0.0
    settings: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "method": self.method,
            "m": self.m,
            "layers": list(self.layers),
            "entropy": self.entropy,
            "entropy_normalized": self.entropy_normalized,
            "rank": self.rank,
            "rank_exact": self.rank_exact,
            "optimum": self.optimum,
            "gap": self.gap,
            "beams": self.beams,
            "elapsed_s": round(self.elapsed_s, 3),
            "settings": self.settings,
        }


def default_pool(num_layers: int) -> Set:
    return tuple(range(1, num_layers + 1))


def check_m(m: int, pool: Set) -> None:
    if not pool:
        raise ValueError("the layer pool is empty")
    if not 1 <= m <= len(pool):
        raise ValueError(f"m must be in 1..{len(pool)} (the pool has {len(pool)} layers), got {m}")


def is_late(layer: int, num_layers: int) -> bool:
    """Second half of the network: l > N/2."""
    return layer > num_layers / 2


def beam_search(
    scorer: SetScorer,
    pool: Set,
    m: int,
    beam: int = 8,
    require_late: bool = True,
    maximize: bool = True,
    candidates_of=None,
) -> tuple[Set, list[dict]]:
    """ELSI beam search (ELSI-C when ``candidates_of`` limits the extensions).

    Step 1: seeds = the ``beam`` best singletons (only late ones if ``require_late``).
    Step 2: each depth extends every beam set by every allowed pool layer not in it,
            dedupes, scores by set entropy and keeps the best ``beam``.
    Step 3: the best set of size m, and every depth's beam (the beam-tree data).
    """
    check_m(m, pool)
    if beam < 1:
        raise ValueError(f"beam must be >= 1, got {beam}")
    n = scorer.run.num_layers
    sign = 1.0 if maximize else -1.0
    # Step 1: seeds
    seeds = [(l,) for l in pool if not require_late or is_late(l, n)]
    if not seeds:
        raise ValueError(f"require_late: no pool layer lies in the second half (l > {n / 2}); pool = {list(pool)}")
    vals = scorer.score(seeds)
    order = sorted(range(len(seeds)), key=lambda i: (-sign * vals[i], seeds[i]))[:beam]
    current = [(seeds[i], None, None) for i in order]  # (set, parent, allowed candidates)
    beams = [_beam_json(1, current, scorer)]
    # Step 2: extend depth by depth
    for depth in range(2, m + 1):
        children: dict[Set, tuple[Set, list[int] | None]] = {}
        for s, _, _ in current:
            allowed = candidates_of(s) if candidates_of else [l for l in pool if l not in s]
            for c in allowed:
                child = tuple(sorted((*s, c)))
                children.setdefault(child, (s, allowed if candidates_of else None))
        if not children:
            break
        sets = list(children)
        vals = scorer.score(sets)
        order = sorted(range(len(sets)), key=lambda i: (-sign * vals[i], sets[i]))[:beam]
        current = [(sets[i], *children[sets[i]]) for i in order]
        beams.append(_beam_json(depth, current, scorer))
    # Step 3: the best set of the last depth
    return current[0][0], beams


def _beam_json(depth: int, current: list, scorer: SetScorer) -> dict:
    sets = []
    for s, parent, allowed in current:
        item = {"layers": list(s), "entropy": scorer.cache[s], "parent": list(parent) if parent else None}
        if allowed is not None:
            item["candidates"] = list(allowed)
        sets.append(item)
    return {"depth": depth, "sets": sets}


def elsi_c_candidates(run: GramRun, pool: Set, q: int, boundaries: list[int], estimator: str = "debiased"):
    """ELSI-C's extension rule: the q layers with the highest 1 - CKA(S, c), plus boundaries."""
    if q < 1:
        raise ValueError(f"q must be >= 1, got {q}")
    hsic = run.hsic(estimator)  # (N+1, N+1)

    def allowed(s: Set) -> list[int]:
        rest = [c for c in pool if c not in s]
        a = torch.as_tensor(list(s))
        ss = hsic[a][:, a].sum()
        score = {c: 1.0 - float(hsic[a, c].sum() / torch.sqrt(ss * hsic[c, c])) for c in rest}
        top = sorted(rest, key=lambda c: (-score[c], c))[:q]
        return sorted(set(top) | {b for b in boundaries if b in rest})

    return allowed


def block_subsample(run: GramRun, per_sample: int, seed: int = 0) -> torch.Tensor | None:
    """Up to ``per_sample`` blocks of each sample (random, seeded); None = all blocks."""
    if per_sample <= 0:
        return None
    g = torch.Generator().manual_seed(seed)
    keep = []
    for s in range(run.num_samples):
        idx = torch.nonzero(run.block_sample == s).squeeze(-1)
        if idx.numel() > per_sample:
            idx = idx[torch.randperm(idx.numel(), generator=g)[:per_sample]].sort().values
        keep.append(idx)
    sub = torch.cat(keep)
    return None if sub.numel() == run.num_blocks else sub


@dataclass
class Exhaustive:
    """Every set of size m, ranked by entropy."""

    best: Set
    best_entropy: float  # exact (all blocks)
    worst: Set
    worst_entropy: float
    exact: dict[Set, float]  # sets scored on all blocks (all of them without a subsample)
    approx: dict[Set, float]  # every set on the subsample (the same dict without one)
    top: list[Set]  # rescored best sets, best first
    bottom: list[Set]  # rescored worst sets, worst first
    num_sets: int

    def rank(self, s: Set, value: float) -> tuple[int, bool]:
        """(1 + number of sets with higher entropy, whether that rank is exact).

        Exact without a subsample, and for sets among the rescored best/worst (whose
        neighbours in the ranking were rescored too); otherwise from the subsample.
        """
        if self.approx is self.exact:
            return 1 + sum(v > value for v in self.exact.values()), True
        if s in self.top:
            return 1 + sum(self.exact[t] > value for t in self.top), True
        if s in self.bottom:
            return self.num_sets - sum(self.exact[b] < value for b in self.bottom), True
        key = self.approx[s]
        return 1 + sum(v > key for v in self.approx.values()), False


def exhaustive_search(
    run: GramRun,
    pool: Set,
    m: int,
    require_late: bool = True,
    aggregate: str = "block-entropy",
    per_sample: int = 4,
    rescore: int = 32,
    seed: int = 0,
    exact_scorer: SetScorer | None = None,
) -> Exhaustive:
    """All sets of size m. With ``per_sample`` > 0 they are ranked on a block subsample,
    then the ``rescore`` best and worst are recomputed on all blocks and ranked exactly."""
    check_m(m, pool)
    n = run.num_layers
    sets = [s for s in itertools.combinations(pool, m) if not require_late or any(is_late(l, n) for l in s)]
    if not sets:
        raise ValueError(f"no set of size {m} in pool {list(pool)} has a layer in the second half")
    exact_scorer = exact_scorer or SetScorer(run, aggregate)
    blocks = block_subsample(run, per_sample, seed) if aggregate == "block-entropy" else None
    if blocks is None or all(s in exact_scorer.cache for s in sets):  # exact values at hand: no subsample
        exact = approx = dict(zip(sets, exact_scorer.score(sets)))
        ranked = sorted(sets, key=lambda s: (-exact[s], s))
        top, bottom = ranked, ranked[::-1]
    else:
        approx = dict(zip(sets, SetScorer(run, aggregate, blocks).score(sets)))
        ranked = sorted(sets, key=lambda s: (-approx[s], s))
        pick = list(dict.fromkeys(ranked[:rescore] + ranked[-rescore:]))
        exact = dict(zip(pick, exact_scorer.score(pick)))
        top = sorted(ranked[:rescore], key=lambda s: (-exact[s], s))
        bottom = sorted(ranked[-rescore:], key=lambda s: (exact[s], s))
    return Exhaustive(top[0], exact[top[0]], bottom[0], exact[bottom[0]], exact, approx, top, bottom, len(sets))


def baseline(method: str, num_layers: int, m: int, pool: Set) -> Set:
    """The fixed layer sets the field uses today."""
    n = num_layers
    if method == "eagle2":
        return (n,)
    if method == "eagle3":
        ids = (2, n // 2, n - 3)
        if len(set(ids)) < 3 or min(ids) < 1:
            raise ValueError(f"eagle3 = [2, N//2, N-3] = {list(ids)} collides or leaves 1..N for N = {n}; pick layers with --layers")
        return ids
    if method == "uniform":
        check_m(m, pool)
        p = sorted(pool)
        return tuple(sorted({p[round((i + 1) * len(p) / m) - 1] for i in range(m)}))
    raise ValueError(f"unknown baseline {method!r}; known: {BASELINES}")


def parse_pool(text: str, num_layers: int) -> Set:
    """``--pool`` ("1-30", "1,5,9"; empty = 1..N)."""
    return tuple(sorted(parse_layers(text, num_layers))) if text else default_pool(num_layers)

