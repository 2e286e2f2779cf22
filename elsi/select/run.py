"""``elsi select``: run one method (or all) on a finished run and save the result."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

from elsi.config import at_least, opt, result_settings
from elsi.io import lock, read_json, write_json
from elsi.select.search import (
    BASELINES,
    METHODS,
    Selection,
    Set,
    SetScorer,
    baseline,
    beam_search,
    check_m,
    eagle3_unavailable,
    elsi_c_candidates,
    exhaustive_search,
    parse_pool,
    swap_search,
)
from elsi.stats.analysis import AGGREGATES, ANALYSIS, GramRun

SELECTIONS = "selections.json"


@dataclass(frozen=True)
class SelectConfig:
    """Which selection to run on which finished run."""

    run: str = opt(help="run directory of a finished `elsi analyze`")
    method: str = opt("elsi", "selection method, or all (a table for m = 1, 2, 3)", choices=(*METHODS, "all"))
    m: int = opt(3, "number of layers to select")
    beam: int = opt(8, "beam width of ELSI / ELSI-C / low-entropy")
    q: int = opt(0, "ELSI-C: candidates per set by set-transition score (0 = ceil(|pool| / 4))")
    pool: str = opt("", "candidate layer ids, e.g. 1-30 or 3,5,9 (default 1..N)")
    require_late: bool = opt(True, "every set keeps at least one layer in the second half (l > N/2)")
    aggregate: str = opt("block-entropy", "entropy summary used for scoring", choices=AGGREGATES)
    search_blocks: int = opt(4, "exhaustive search: blocks per sample in its subsample (0 = all blocks)")
    rescore: int = opt(32, "exhaustive search: best and worst sets rescored on all blocks")
    seed: int = opt(0, "seed of the exhaustive search's block subsample (and of its sample of sets)")
    max_sets: int = opt(30000, "exhaustive search and ranks: above this many sets of size m, score a uniform sample of "
                               "this many (ranks then estimated, with a 95 % interval; the optimum is the best set "
                               "found); 0 = every set (m = 5 of N = 30: 139,503)")
    rank: bool = opt(False, "also rank the selection among all sets of its size, with its gap to the optimum (runs "
                            "the exhaustive search; --method all and exhaustive always do)")
    json: bool = opt(False, "print JSON", affects_result=False)
    out: str = opt("", "also write the JSON to this file", affects_result=False)

    def __post_init__(self):
        at_least(self, m=1, beam=1, q=0, max_sets=0)


def preload(scorer: SetScorer, run_dir: Path, aggregate: str) -> None:
    """Reuse the singleton and pair entropies analysis.json already holds (same aggregate)."""
    path = run_dir / ANALYSIS
    if not path.exists():
        return
    res = read_json(path)
    if res.get("settings", {}).get("aggregate") != aggregate:
        return
    layers = res["layers"]
    for i, a in enumerate(layers):
        for j, b in enumerate(layers):
            if j >= i:
                scorer.cache[(a,) if i == j else (a, b)] = res["pair_entropy"][i][j]


class Selector:
    """Everything one ``elsi select`` invocation needs, loaded once."""

    def __init__(self, cfg: SelectConfig):
        self.cfg = cfg
        self.run = GramRun(cfg.run)
        self.pool = parse_pool(cfg.pool, self.run.num_layers)
        self.scorer = SetScorer(self.run, cfg.aggregate)
        preload(self.scorer, Path(cfg.run), cfg.aggregate)
        self.exhaustive_cache: dict[int, object] = {}
        analysis = Path(cfg.run) / ANALYSIS
        self.boundaries = read_json(analysis)["boundaries"] if analysis.exists() else []

    def settings(self) -> dict:
        """The search settings each selection records (the run, method, m and rank are the selection's own)."""
        return result_settings(self.cfg, drop=("run", "method", "m", "rank"))

    def exhaustive(self, m: int):
        if m not in self.exhaustive_cache:
            c = self.cfg
            self.exhaustive_cache[m] = exhaustive_search(
                self.run, self.pool, m, c.require_late, c.aggregate, c.search_blocks, c.rescore, c.seed, self.scorer,
                c.max_sets)
        return self.exhaustive_cache[m]

    def select(self, method: str, m: int, with_optimum: bool = False) -> Selection:
        """Run ``method`` for size ``m``; with_optimum adds rank, optimum and gap."""
        c = self.cfg
        t0 = time.perf_counter()
        beams: list[dict] = []
        if method in BASELINES:
            layers = tuple(sorted(baseline(method, self.run.num_layers, m, self.pool)))
            self.run.check(layers)
        elif method == "exhaustive":
            ex = self.exhaustive(m)
            layers = ex.best
            if ex.sampled:  # not every set was scored: polish the best sampled set and ELSI's by swaps
                for start in (ex.best, beam_search(self.scorer, self.pool, m, c.beam, c.require_late)[0]):
                    ex.offer(*swap_search(self.scorer, self.pool, start, c.require_late))
                layers = ex.best
        else:
            check_m(m, self.pool)
            cand = None
            if method == "elsi-c":
                q = c.q or math.ceil(len(self.pool) / 4)
                cand = elsi_c_candidates(self.run, self.pool, q, self.boundaries)
            layers, beams = beam_search(
                self.scorer, self.pool, m, c.beam, c.require_late, maximize=method != "low-entropy", candidates_of=cand
            )
        entropy = self.scorer.score([layers])[0] if c.aggregate == "mean-block" else self.run.entropy(layers).mean
        sel = Selection(method, len(layers), layers, entropy, entropy / math.log(self.run.block), beams,
                        settings={**self.settings(), "pool": list(self.pool)})
        if with_optimum or method == "exhaustive":
            ex = self.exhaustive(len(layers))
            ex.offer(layers, entropy)
            sel.rank, sel.rank_exact = ex.rank(layers, entropy)
            sel.optimum = {"layers": list(ex.best), "entropy": ex.best_entropy, "num_sets": ex.num_sets}
            if ex.sampled:
                est, lo, hi = ex.rank_interval(layers)
                sel.rank_interval = (lo, hi)
                sel.optimum["sampled"] = ex.sampled  # the best of the sampled sets and the searches' sets so far
            sel.gap = ex.best_entropy - entropy
        sel.elapsed_s = time.perf_counter() - t0
        return sel


ALL_METHODS = ("exhaustive", "elsi", "elsi-c", "low-entropy", "uniform")


def all_steps(selector: Selector, ms: tuple[int, ...] = (1, 2, 3)) -> list[tuple[str, int]]:
    """(method, m) pairs of ``--method all``: every method for each m, then the fixed baselines."""
    steps = [(method, m) for m in ms if m <= len(selector.pool) for method in ALL_METHODS]
    steps.append(("eagle2", 1))
    if not eagle3_unavailable(selector.run.num_layers):
        steps.append(("eagle3", 3))
    return steps


def skipped_steps(selector: Selector, ms: tuple[int, ...] = (1, 2, 3)) -> list[dict]:
    """What ``--method all`` leaves out, each with why (shown by ``elsi select`` and kept in selections.json)."""
    out = [{"method": method, "m": m, "why": f"m = {m} exceeds the pool's {len(selector.pool)} layers"}
           for m in ms if m > len(selector.pool) for method in ALL_METHODS]
    why = eagle3_unavailable(selector.run.num_layers)
    if why:
        out.append({"method": "eagle3", "m": 3, "why": why})
    return out


def select_all(selector: Selector, ms: tuple[int, ...] = (1, 2, 3), on_step=None) -> list[Selection]:
    """Every method for m = 1, 2, 3 (fixed-size baselines at their own size), with rank and gap."""
    out = []
    for method, m in all_steps(selector, ms):
        out.append(selector.select(method, m, with_optimum=True))
        if on_step:
            on_step(out[-1])
    return out


def save_selections(run_dir: str | Path, results: list[Selection], chosen: Selection | None,
                    skipped: list[dict] | None = None) -> Path:
    """Merge results into RUN_DIR/selections.json (one per method and m; newest wins); ``skipped``: what
    ``--method all`` left out and why (replaces the previous list). Two selections at once merge in turn (the
    second waits for the first: ``lock``), so that neither's results are lost."""
    path = Path(run_dir) / SELECTIONS
    with lock(path, "the selections file", wait=True):
        data = read_json(path) if path.exists() else {"results": [], "chosen": None}
        keep = {(r["method"], r["m"]): r for r in data["results"]}
        for r in results:
            keep[(r.method, r.m)] = r.to_json()
        data["results"] = sorted(keep.values(), key=lambda r: (r["m"], r["method"]))
        if skipped is not None:
            data["skipped"] = skipped
        if chosen is not None:
            data["chosen"] = {"method": chosen.method, "m": chosen.m, "layers": list(chosen.layers)}
        write_json(path, data)
    return path


def chosen_layers(run_dir: str | Path, m: int = 0) -> Set:
    """The layers `elsi select` chose last for this run; with ``m`` (> 0) another size than the chosen one, the
    same method's selection of m layers."""
    path = Path(run_dir) / SELECTIONS
    if not path.exists():
        raise ValueError(f"{run_dir} has no {SELECTIONS}; run `elsi select --run {run_dir}"
                         f"{f' --m {m}' if m else ''}` first")
    data = read_json(path)
    chosen = data.get("chosen")
    if not chosen:
        raise ValueError(f"{path} records no chosen selection")
    if not m or m == chosen["m"]:
        return tuple(chosen["layers"])
    same = next((r for r in data.get("results", []) if r["method"] == chosen["method"] and r["m"] == m), None)
    if same is None:
        raise ValueError(f"{path} has no {chosen['method']} selection of {m} layers (the chosen one has "
                         f"{chosen['m']}): run `elsi select --run {run_dir} --method {chosen['method']} --m {m}` first")
    return tuple(same["layers"])


__all__ = ["SELECTIONS", "SelectConfig", "Selector", "chosen_layers", "save_selections", "select_all", "skipped_steps"]
