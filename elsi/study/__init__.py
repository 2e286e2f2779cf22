"""The study (``elsi study``): does the selected layer set beat the defaults once drafts are trained?

``make_plan`` selects every compared set on a finished analysis, ``prepare_study`` starts or
continues STUDY_DIR, ``run_study`` trains one draft per set and seed on the same features and
benchmarks each on Spec-Bench, and ``summarize_study`` gives τ per subtask, condition and set,
the seed-to-seed spread and Spearman's ρ between set entropy and τ with a bootstrap interval.
"""

from elsi.study.plan import DEFAULT_SETS, PLAN, LayerSet, StudyConfig, StudyPlan, make_plan, parse_set, resolve_sets
from elsi.study.run import Hooks, StudyRun, prepare_study, run_study, write_summary
from elsi.report.study import load_study, study_markdown
from elsi.stats.sampling import rankdata, spearman
from elsi.study.summary import summarize_study

__all__ = ["DEFAULT_SETS", "PLAN", "Hooks", "LayerSet", "StudyConfig", "StudyPlan", "StudyRun", "load_study",
           "make_plan", "parse_set", "prepare_study", "rankdata", "resolve_sets", "run_study", "spearman",
           "study_markdown", "summarize_study", "write_summary"]
