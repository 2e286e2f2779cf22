"""Layer-set selection from the Gram tensor (docs/design.md, "Selection").

- ELSI: beam search over set entropy (Goel et al., "Surfing the Activation Wave").
- ELSI-C: ELSI whose extensions are limited to the q layers most dissimilar (1 - CKA)
  to the current set, plus the transition-boundary layers.
- exhaustive: every set of size m (on a per-sample block subsample, the best sets then
  rescored on all blocks).
- low-entropy: ELSI minimising entropy (a negative control).
- baselines: eagle2 = {N}; eagle3 = {2, N//2, N-3}; uniform = m evenly spaced ending at the last pool id;
  dflash = DFlash's evenly spaced rule (``build_target_layer_ids``: m ids from 1 to N-3 in its numbering,
  + 1 in elsi's), the usual choice of multi-layer drafts (DFlash, DSpark, Domino).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch

from elsi.stats.analysis import GramRun, parse_layers

SEARCH_METHODS = ("elsi", "elsi-c", "exhaustive", "low-entropy")
BASELINES = ("eagle2", "eagle3", "uniform", "dflash")
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
    rank_interval: tuple[int, int] | None = None  # sampled search: 95 % interval of the estimated rank

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
            **({"rank_interval": list(self.rank_interval)} if self.rank_interval else {}),
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


def swap_search(scorer: SetScorer, pool: Set, start: Set, require_late: bool = True) -> tuple[Set, float]:
    """Hill climbing from ``start``: replace one layer by one pool layer outside the set while that raises the
    entropy (the best swap each round). A local optimum: the sampled exhaustive search polishes its best with it."""
    n = scorer.run.num_layers
    best = tuple(sorted(start))
    value = scorer.score([best])[0]
    while True:
        out = [l for l in pool if l not in best]
        cands = [tuple(sorted((*[x for x in best if x != a], b))) for a in best for b in out]
        cands = [c for c in dict.fromkeys(cands) if not require_late or any(is_late(l, n) for l in c)]
        if not cands:
            return best, value
        vals = scorer.score(cands)
        i = max(range(len(cands)), key=lambda k: (vals[k], [-x for x in cands[k]]))
        if vals[i] <= value:
            return best, value
        best, value = cands[i], vals[i]


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


def wilson(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion hits/n (95 % for z = 1.96)."""
    p = hits / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * ((p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5) / den
    return max(0.0, mid - half), min(1.0, mid + half)


@dataclass
class Exhaustive:
    """Every set of size m (or, above ``max_sets``, a uniform sample of them), ranked by entropy."""

    best: Set
    best_entropy: float  # exact (all blocks)
    worst: Set
    worst_entropy: float
    exact: dict[Set, float]  # sets scored on all blocks (all of them without a subsample)
    approx: dict[Set, float]  # every scored set on the subsample (the same dict without one)
    top: list[Set]  # rescored best sets, best first
    bottom: list[Set]  # rescored worst sets, worst first
    num_sets: int  # sets of size m in the pool (all of them, sampled or not)
    sampled: int = 0  # > 0: only this many sets, drawn uniformly, were scored; ranks are estimates
    scorer: SetScorer | None = None  # the subsample's scorer (sampled mode: scores the sets to rank)

    def rank(self, s: Set, value: float) -> tuple[int, bool]:
        """(1 + number of sets with higher entropy, whether that rank is exact).

        Exact without a subsample, and for sets among the rescored best/worst (whose
        neighbours in the ranking were rescored too); otherwise from the subsample. Sampled:
        ``rank_interval``'s estimate, never exact.
        """
        if self.sampled:
            return self.rank_interval(s)[0], False
        if self.approx is self.exact:
            return 1 + sum(v > value for v in self.exact.values()), True
        if s in self.top:
            return 1 + sum(self.exact[t] > value for t in self.top), True
        if s in self.bottom:
            return self.num_sets - sum(self.exact[b] < value for b in self.bottom), True
        key = self.approx[s]
        return 1 + sum(v > key for v in self.approx.values()), False

    def rank_interval(self, s: Set) -> tuple[int, int, int]:
        """Sampled mode: (estimate, low, high) of the rank of ``s`` among all ``num_sets`` sets, from the share of
        the sampled sets above it on the subsample (Wilson 95 % interval of that share)."""
        if not self.sampled:
            raise ValueError("rank_interval is for a sampled search")
        key = self.approx[s] if s in self.approx else self.scorer.score([s])[0]
        above = sum(v > key for v in list(self.approx.values())[: self.sampled])
        lo, hi = wilson(above, self.sampled)
        return (1 + round(above / self.sampled * self.num_sets), 1 + math.floor(lo * self.num_sets),
                1 + math.ceil(hi * self.num_sets))

    def offer(self, s: Set, value: float) -> None:
        """Sampled mode: a set found by a search (exact ``value``) becomes the best found when it beats it."""
        if self.sampled and value > self.best_entropy:
            self.best, self.best_entropy = tuple(s), value


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
    max_sets: int = 0,
) -> Exhaustive:
    """All sets of size m. With ``per_sample`` > 0 they are ranked on a block subsample,
    then the ``rescore`` best and worst are recomputed on all blocks and ranked exactly.

    ``max_sets`` > 0 and more sets than that: only ``max_sets`` sets drawn uniformly (seeded) are scored, so
    the best is the best found (``Exhaustive.offer`` adds the searches' sets) and ranks are estimates with an
    interval (``Exhaustive.rank_interval``): m = 5 of N = 30 has 139,503 sets with a late layer."""
    check_m(m, pool)
    n = run.num_layers
    sets = [s for s in itertools.combinations(pool, m) if not require_late or any(is_late(l, n) for l in s)]
    if not sets:
        raise ValueError(f"no set of size {m} in pool {list(pool)} has a layer in the second half")
    total = len(sets)
    sampled = max_sets if 0 < max_sets < total else 0
    if sampled:
        pick = torch.randperm(total, generator=torch.Generator().manual_seed(seed + 7))[:sampled]
        sets = [sets[i] for i in pick.tolist()]
    exact_scorer = exact_scorer or SetScorer(run, aggregate)
    blocks = block_subsample(run, per_sample, seed) if aggregate == "block-entropy" else None
    sub = None
    if blocks is None or all(s in exact_scorer.cache for s in sets):  # exact values at hand: no subsample
        exact = approx = dict(zip(sets, exact_scorer.score(sets)))
        ranked = sorted(sets, key=lambda s: (-exact[s], s))
        top, bottom = ranked, ranked[::-1]
        sub = exact_scorer
    else:
        sub = SetScorer(run, aggregate, blocks)
        approx = dict(zip(sets, sub.score(sets)))
        ranked = sorted(sets, key=lambda s: (-approx[s], s))
        pick = list(dict.fromkeys(ranked[:rescore] + ranked[-rescore:]))
        exact = dict(zip(pick, exact_scorer.score(pick)))
        top = sorted(ranked[:rescore], key=lambda s: (-exact[s], s))
        bottom = sorted(ranked[-rescore:], key=lambda s: (exact[s], s))
    return Exhaustive(top[0], exact[top[0]], bottom[0], exact[bottom[0]], exact, approx, top, bottom, total,
                      sampled, sub)


def baseline(method: str, num_layers: int, m: int, pool: Set) -> Set:
    """The fixed layer sets the field uses today."""
    n = num_layers
    if method == "eagle2":
        return (n,)
    if method == "eagle3":
        why = eagle3_unavailable(n)
        if why:
            raise ValueError(f"{why}; choose a set with --method elsi or exhaustive (or give ids to train-draft "
                             "--layers / export --layers yourself)")
        return (2, n // 2, n - 3)
    if method == "dflash":
        check_m(m, pool)
        if n < 5 and m > 1:
            raise ValueError(f"DFlash's rule spaces ids from 1 to N-3, empty for N = {n}")
        ids = tuple(sorted({j + 1 for j in dflash_default_ids(n, m)}))
        if len(ids) < m:
            raise ValueError(f"DFlash's rule gives {m} ids from 1 to N-3 = {n - 3} that collide for N = {n}: "
                             f"{list(ids)}")
        return ids
    if method == "uniform":
        check_m(m, pool)
        p = sorted(pool)
        return tuple(sorted({p[round((i + 1) * len(p) / m) - 1] for i in range(m)}))
    raise ValueError(f"unknown baseline {method!r}; known: {BASELINES}")


def dflash_default_ids(num_layers: int, m: int) -> tuple[int, ...]:
    """DFlash's evenly spaced rule (``build_target_layer_ids``) in its own numbering (a layer's output):
    m ids from 1 to N-3 (one: N//2). Qwen3-4B (N = 36), m = 5: [1, 9, 17, 25, 33]."""
    if m < 1:
        raise ValueError(f"m must be >= 1, got {m}")
    if m == 1:
        return (num_layers // 2,)
    start, end = 1, num_layers - 3
    return tuple(int(round(start + i * (end - start) / (m - 1))) for i in range(m))


def eagle3_unavailable(num_layers: int) -> str:
    """Why EAGLE-3's fixed set [2, N//2, N-3] does not exist for this N ("" where it does: N >= 7)."""
    n = num_layers
    ids = (2, n // 2, n - 3)
    if len(set(ids)) < 3 or min(ids) < 1:
        return f"eagle3 = [2, N//2, N-3] = {list(ids)} repeats or leaves the ids 1..N for N = {n} (it needs N >= 7)"
    return ""


def parse_pool(text: str, num_layers: int) -> Set:
    """``--pool`` ("1-30", "1,5,9"; empty = 1..N)."""
    return tuple(sorted(parse_layers(text, num_layers))) if text else default_pool(num_layers)

