"""``elsi study --so-far``: the summary of a study's drafts finished so far, while it runs or after it stopped.

A powered study takes days of CPU; its verdict should not wait for the last draft to be readable. This
reads what a running study has already written whole (plan.json, each finished draft's training.json and
its exact τ or live benchmark: the records ``bench/study_results.sh`` keeps) and writes ``so-far.json``
and ``so-far.md`` beside them: the same summary ``study.json`` will be, over the finished drafts only,
each set with the seeds it has (Δ% intervals pair the seeds both sets have), and how long the drafts' work left
takes at the pace of the machine it last ran on (``elsi.study.pace``). Nothing is trained,
benchmarked or loaded, and the running study never writes these two files, so it can run beside it.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from elsi.io import RunError, read_json, write_json, write_text
from elsi.report.study import study_markdown
from elsi.runtime import machine_label
from elsi.study.plan import PLAN, StudyPlan, load_plan
from elsi.study.run import baseline_paths, draft_work, study_time_left, with_exact
from elsi.study.summary import summarize_study

SO_FAR_JSON = "so-far.json"
SO_FAR_MD = "so-far.md"


def _record(path: Path) -> dict | None:
    """A result file, or None when it is missing or unreadable (not finished, as far as a summary can tell)."""
    try:
        return read_json(path) if path.is_file() else None
    except RunError:
        return None


def finished_drafts(study_dir: str | Path, plan: StudyPlan) -> tuple[dict, dict]:
    """The drafts of ``plan`` finished in ``study_dir``: trained, with every result the plan asks of them (a live
    benchmark where it decodes a temperature live for that seed, the exact τ of the plan's settings where it has
    one) -> (their results as the summary reads them, their training.json), each keyed (set name, seed), in plan
    order."""
    benches: dict[tuple[str, int], dict] = {}
    trained: dict[tuple[str, int], dict] = {}
    for s, seed in plan.drafts:
        work = draft_work(study_dir, plan, s, seed, read=_record)
        if any(r is None for r in work.values()):
            continue
        rec = work.get("live benchmark", {"answers": []})
        if "exact τ" in work:
            rec = with_exact(rec, work["exact τ"])
        benches[(s.name, seed)], trained[(s.name, seed)] = rec, work["training"]
    return benches, trained


def drafts_left(plan: StudyPlan, benches: dict) -> list[str]:
    """The planned drafts not finished (not in ``benches``, as ``finished_drafts`` gives it), as "<set> s<seed>",
    in the order the study trains them."""
    return [f"{s.name} s{seed}" for s, seed in plan.seed_major() if (s.name, seed) not in benches]


def summary_so_far(study_dir: str | Path, bootstrap: int = 1000, command: str = "") -> dict:
    """``so-far.json`` and ``so-far.md`` in ``study_dir`` from its finished drafts -> the summary, with
    ``so_far`` = {"finished", "planned", "left" (the drafts not finished, as "<set> s<seed>")}. Raises
    ValueError when the study has no plan.json or no finished draft."""
    study_dir = Path(study_dir)
    if not (study_dir / PLAN).is_file():
        raise ValueError(f"{study_dir}: no {PLAN}, so no study to summarize (run elsi study --out {study_dir})")
    plan = load_plan(study_dir)
    benches, trained = finished_drafts(study_dir, plan)
    if not benches:
        raise ValueError(f"{study_dir}: no draft of its {len(plan.drafts)} is finished yet (trained, with its τ)")
    seeds = {s.name: [sd for name, sd in benches if name == s.name] for s in plan.sets}
    part = replace(plan, sets=[s for s in plan.sets if seeds[s.name]],
                   draft_seeds={name: v for name, v in seeds.items() if v})
    left = drafts_left(plan, benches)
    works = [draft_work(study_dir, plan, s, seed, read=_record) for s, seed in plan.seed_major()]
    pace, machine = study_time_left(works, where="there")  # at the pace of the machine the study last ran on
    study = {"command": command, **summarize_study(part, benches, [read_json(p) for p in baseline_paths(study_dir)],
                                                   bootstrap, trained=trained),
             "so_far": {"finished": len(benches), "planned": len(plan.drafts), "left": left, "time_left": pace}}
    write_json(study_dir / SO_FAR_JSON, study)
    title, _, rest = study_markdown(study).partition("\n")
    head = (f"**So far: {len(benches)} of the {len(plan.drafts)} planned drafts are finished**; every figure below is "
            f"of those alone, each set over the seeds it has (Δ% intervals pair the seeds both sets have)."
            + (f" Not finished yet: {', '.join(left)}." if left else " The study's own summary is study.md.")
            + (f" At the pace of the machine it last ran on ({machine_label(machine)}): {pace}." if pace else ""))
    write_text(study_dir / SO_FAR_MD, f"{title} (so far)\n\n{head}\n{rest}")
    return study


__all__ = ["SO_FAR_JSON", "SO_FAR_MD", "drafts_left", "finished_drafts", "summary_so_far"]
