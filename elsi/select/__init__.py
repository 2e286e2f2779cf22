"""Layer-set selection (ELSI, ELSI-C, exhaustive, baselines) and export to runtimes."""

from elsi.select.export import FORMATS, export_fragment
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
    "FORMATS",
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
    "export_fragment",
    "save_selections",
    "select_all",
]
