"""Selection against exhaustive references; baselines; export numbering; bad input."""

from __future__ import annotations

import json
import math
from math import comb

import pytest

from elsi.cli import main
from elsi.select import SelectConfig, Selector, baseline, elsi_c_candidates
from elsi.select.search import SetScorer, beam_search, exhaustive_search
from elsi.stats.analysis import GramRun


def _sel(run_dir, **kw):
    return Selector(SelectConfig(run=str(run_dir), **kw))


@pytest.mark.parametrize("m", [1, 2, 3])
def test_elsi_with_full_beam_equals_exhaustive_optimum(tiny_run, m):
    run = GramRun(tiny_run)
    pool = tuple(range(1, 9))
    full_beam = comb(len(pool), max(m - 1, 1))
    scorer = SetScorer(run)
    best, _ = beam_search(scorer, pool, m, beam=full_beam)
    ex = exhaustive_search(run, pool, m, per_sample=0)
    assert best == ex.best
    assert scorer.cache[best] == pytest.approx(ex.best_entropy, abs=1e-12)
    low, _ = beam_search(SetScorer(run), pool, m, beam=full_beam, maximize=False)
    assert low == ex.worst


def test_without_require_late_search_covers_early_sets(tiny_run):
    run = GramRun(tiny_run)
    ex = exhaustive_search(run, (1, 2, 3, 4, 5, 6, 7, 8), 2, require_late=False, per_sample=0)
    assert ex.num_sets == comb(8, 2)
    ex_late = exhaustive_search(run, (1, 2, 3, 4, 5, 6, 7, 8), 2, per_sample=0)
    assert ex_late.num_sets == comb(8, 2) - comb(4, 2)  # sets with no layer > N/2 = 4 excluded


def test_elsi_c_only_extends_by_allowed_candidates(tiny_run):
    sel = _sel(tiny_run, method="elsi-c", m=3, q=2, beam=4)
    res = sel.select("elsi-c", 3)
    allowed = elsi_c_candidates(sel.run, sel.pool, 2, sel.boundaries)
    assert res.beams and len(res.beams) == 3
    for depth in res.beams[1:]:
        for item in depth["sets"]:
            parent = tuple(item["parent"])
            added = set(item["layers"]) - set(parent)
            assert item["candidates"] == allowed(parent)
            assert added <= set(item["candidates"])
            assert len(item["candidates"]) <= 2 + len(sel.boundaries)


def test_exhaustive_subsample_then_rescore_finds_the_same_set(tiny_run):
    run = GramRun(tiny_run)
    full = exhaustive_search(run, tuple(range(1, 9)), 3, per_sample=0)
    sub = exhaustive_search(run, tuple(range(1, 9)), 3, per_sample=1, rescore=20)
    assert sub.best == full.best
    assert sub.best_entropy == pytest.approx(full.best_entropy, abs=1e-12)


def test_baselines():
    pool = tuple(range(1, 31))
    assert baseline("eagle3", 30, 3, pool) == (2, 15, 27)
    assert baseline("eagle2", 30, 1, pool) == (30,)
    assert baseline("uniform", 30, 3, pool) == (10, 20, 30)
    assert baseline("eagle3", 18, 3, tuple(range(1, 19))) == (2, 9, 15)
    for n in (3, 4, 5, 6):
        with pytest.raises(ValueError, match=r"needs N >= 7\); choose a set with --method elsi") as err:
            baseline("eagle3", n, 3, tuple(range(1, n + 1)))
        assert "pick layers with --layers" not in str(err.value)  # select has no --layers option
    # DFlash's evenly spaced rule (1 .. N-3 in its numbering), in elsi's ids
    assert baseline("dflash", 30, 5, pool) == (2, 9, 15, 21, 28)
    assert baseline("dflash", 36, 5, tuple(range(1, 37))) == (2, 10, 18, 26, 34)  # Qwen3-4B's [1, 9, 17, 25, 33] + 1
    assert baseline("dflash", 18, 5, tuple(range(1, 19))) == (2, 5, 9, 13, 16)


def test_selection_entropy_equals_score_and_is_saved(tiny_run, capsys):
    assert main(["select", "--run", str(tiny_run), "--method", "elsi", "--m", "2", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    layers = ",".join(map(str, res["layers"]))
    assert main(["score", "--run", str(tiny_run), "--layers", layers, "--json"]) == 0
    sc = json.loads(capsys.readouterr().out)
    assert res["entropy"] == sc["entropy"]
    assert res["entropy_normalized"] == pytest.approx(sc["entropy"] / math.log(8))
    saved = json.loads((tiny_run / "selections.json").read_text())
    assert saved["chosen"]["layers"] == res["layers"]


def test_select_all_table(tiny_run, capsys):
    assert main(["select", "--run", str(tiny_run), "--method", "all", "--search-blocks", "0"]) == 0
    out = capsys.readouterr().out
    for method in ("elsi", "elsi-c", "exhaustive", "low-entropy", "uniform", "eagle2", "eagle3"):
        assert f"| {method} " in out
    saved = json.loads((tiny_run / "selections.json").read_text())
    ex = {r["m"]: r for r in saved["results"] if r["method"] == "exhaustive"}
    for r in saved["results"]:
        assert r["rank"] >= 1 and r["gap"] >= -1e-12
        assert r["optimum"]["entropy"] == ex[r["m"]]["entropy"]


@pytest.mark.parametrize("args,msg", [
    (["--m", "0"], "m must be >= 1"),
    (["--m", "9"], "m must be in 1..8"),
    (["--pool", "2,2"], "repeated"),
    (["--pool", "0-12"], "out of range 0..8"),
    (["--pool", "1,2", "--m", "1"], "no pool layer lies in the second half"),
])
def test_bad_select_input_is_a_clear_error(tiny_run, capsys, args, msg):
    assert main(["select", "--run", str(tiny_run), *args]) == 2
    assert msg in capsys.readouterr().err


def test_score_rejects_bad_layers(tiny_run, capsys):
    assert main(["score", "--run", str(tiny_run), "--layers", "3,99"]) == 2
    assert "[99] out of range" in capsys.readouterr().err
    assert main(["score", "--run", str(tiny_run), "--layers", "2,x"]) == 2
    assert "'x' is not an id" in capsys.readouterr().err


def test_select_all_says_why_eagle3_is_left_out(tiny_target, tiny_data, tmp_path, capsys):
    """N = 6: [2, N//2, N-3] = [2, 3, 3]; the table and selections.json say so instead of dropping it silently."""
    from conftest import make_tiny_target

    from elsi.collect.collector import CollectConfig, collect
    from elsi.data import load_dataset
    from elsi.stats.analysis import AnalysisConfig, analyze_run

    run = tmp_path / "six"
    collect(make_tiny_target(num_layers=6), load_dataset(str(tiny_data)),
            CollectConfig(model="tiny6", data=str(tiny_data), samples=3, max_tokens=96, block=8, rho=0.3), run)
    analyze_run(run, AnalysisConfig())
    assert main(["select", "--run", str(run), "--method", "all", "--search-blocks", "0"]) == 0
    out = capsys.readouterr().out
    assert "| eagle3 " not in out and "left out: eagle3 m=3: eagle3 = [2, N//2, N-3] = [2, 3, 3]" in out
    saved = json.loads((run / "selections.json").read_text())
    assert saved["skipped"] == [{"method": "eagle3", "m": 3, "why": "eagle3 = [2, N//2, N-3] = [2, 3, 3] repeats or "
                                 "leaves the ids 1..N for N = 6 (it needs N >= 7)"}]
    from elsi.report.build import build_report

    paths = build_report([run])  # the report says it too
    why = "Not in the table: eagle3 (m = 3): eagle3 = [2, N//2, N-3] = [2, 3, 3] repeats or leaves the ids 1..N"
    assert why in paths["selection.md"].read_text() and why in paths["index.html"].read_text()
    assert main(["select", "--run", str(run), "--method", "eagle3"]) == 2
    assert "choose a set with --method elsi or exhaustive" in capsys.readouterr().err


def test_sampled_exhaustive_ranks_within_their_interval(tiny_run):
    """Above --max-sets the search scores a uniform sample: each estimated rank's interval holds the exact rank."""
    run = GramRun(tiny_run)
    pool = tuple(range(1, 9))
    full = exhaustive_search(run, pool, 3, per_sample=0)  # 52 sets with a late layer
    part = exhaustive_search(run, pool, 3, per_sample=0, max_sets=30)
    assert part.sampled == 30 and part.num_sets == full.num_sets == 52 and len(part.approx) == 30
    for s in list(full.exact)[::3]:
        true, _ = full.rank(s, full.exact[s])
        est, lo, hi = part.rank_interval(s)
        assert lo <= true <= hi and lo <= est <= hi
        assert part.rank(s, full.exact[s]) == (est, False)
    before = part.best_entropy
    part.offer(full.best, full.best_entropy)  # a search's better set becomes the best found
    assert part.best == full.best and part.best_entropy >= before


def test_swap_search_ends_at_a_local_optimum(tiny_run):
    from elsi.select.search import swap_search

    run = GramRun(tiny_run)
    scorer = SetScorer(run)
    pool = tuple(range(1, 9))
    best, value = swap_search(scorer, pool, (1, 2, 5))
    assert value >= scorer.score([(1, 2, 5)])[0] and value == scorer.score([best])[0]
    for a in best:
        for b in set(pool) - set(best):
            swapped = tuple(sorted((*[x for x in best if x != a], b)))
            assert scorer.score([swapped])[0] <= value


def test_select_m5_with_a_sampled_exhaustive_search(tiny_run, capsys, tmp_path):
    """m = 5 of N = 8 (56 sets, all with a late layer) with --max-sets 20: ranks are estimates with an interval, the
    optimum the best set found (sampled, polished by swaps, or ELSI's); the dflash baseline is ranked alike."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    for method in ("exhaustive", "elsi", "dflash"):
        assert main(["select", "--run", str(run), "--method", method, "--m", "5", "--max-sets", "20",
                     "--search-blocks", "0", "--rank", "--json"]) == 0
        res = json.loads(capsys.readouterr().out)
        assert res["m"] == 5 and res["optimum"]["sampled"] == 20 and res["optimum"]["num_sets"] == 56
        lo, hi = res["rank_interval"]
        assert res["rank_exact"] is False and 1 <= lo <= res["rank"] <= hi <= 57 and res["gap"] >= -1e-12
    assert res["layers"] == [2, 3, 4, 5, 6]  # DFlash's rule for N = 8: [1, 2, 3, 4, 5] + 1
    assert main(["select", "--run", str(run), "--method", "elsi", "--m", "5", "--max-sets", "20",
                 "--search-blocks", "0", "--rank"]) == 0
    assert "~ rank estimated from 20 of the 56 sets" in capsys.readouterr().out
