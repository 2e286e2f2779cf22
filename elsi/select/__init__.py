"""Layer-set selection (ELSI, ELSI-C, exhaustive, baselines); export to runtimes is ``elsi.engines``."""

from elsi.select.run import SELECTIONS, SelectConfig, Selector, chosen_layers, save_selections, select_all
from elsi.select.search import (
    BASELINES,
    METHODS,
    Selection,
    SetScorer,
    baseline,
    beam_search,
    elsi_c_candidates,
    exhaustive_search,
)

__all__ = [
    "BASELINES",
    "METHODS",
    "SELECTIONS",
    "SelectConfig",
    "Selection",
    "Selector",
    "SetScorer",
    "baseline",
    "beam_search",
    "chosen_layers",
    "elsi_c_candidates",
    "exhaustive_search",
    "save_selections",
    "select_all",
]
