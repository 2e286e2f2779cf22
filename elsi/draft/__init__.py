"""Draft model: EAGLE3-style draft on any target layer set, its training and evaluation."""

from elsi.draft.model import (
    DraftCache,
    DraftConfig,
    Eagle3Draft,
    config_for_target,
    random_draft,
    ttt_attention,
)
from elsi.draft.vocab import build_vocab, draft_to_target, target_to_draft, vocab_maps

__all__ = [
    "DraftCache",
    "DraftConfig",
    "Eagle3Draft",
    "build_vocab",
    "config_for_target",
    "draft_to_target",
    "random_draft",
    "target_to_draft",
    "ttt_attention",
    "vocab_maps",
]
