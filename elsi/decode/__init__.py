"""Lossless tree speculative decoding (EAGLE-2 dynamic trees) and plain decoding, one engine."""

from elsi.decode.drafters import EagleDrafter, LMDrafter, TableDrafter, load_drafter
from elsi.decode.engine import (
    DecodeConfig,
    Drafter,
    DraftSession,
    Generation,
    TargetRunner,
    crop_cache,
    generate,
    keep_rows,
    stop_tokens,
)
from elsi.decode.tree import Tree, TreeConfig, additive_mask, attention_masks, build_tree, make_tree
from elsi.decode.verify import choose, greedy_walk, rejection_step, sampling_probs, sampling_walk

__all__ = [
    "DecodeConfig",
    "DraftSession",
    "Drafter",
    "EagleDrafter",
    "Generation",
    "LMDrafter",
    "TableDrafter",
    "TargetRunner",
    "Tree",
    "TreeConfig",
    "additive_mask",
    "attention_masks",
    "build_tree",
    "choose",
    "crop_cache",
    "generate",
    "greedy_walk",
    "keep_rows",
    "load_drafter",
    "make_tree",
    "rejection_step",
    "sampling_probs",
    "sampling_walk",
    "stop_tokens",
]
