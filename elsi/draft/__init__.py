"""Draft model: EAGLE3-style draft on any target layer set, its training and evaluation.

One job per module, in the order the stage runs:
- ``model``: the draft itself; ``vocab``: its reduced vocabulary; ``checkpoint``: a draft directory's
  format as engines read it (``config.json``'s engine keys, other tools' drafts);
- ``regenerate``: the target writes the training conversations' answers (``--regenerate``);
- ``forward``: the target's forward that gives the features; ``cache``: the feature cache on disk
  (fp16 shards, ``features.json``); ``features``: building and extending it;
- ``loss``: soft labels, the training-time-test loss and the figures, for training and evaluation;
- ``init``: initial weights from the target; ``resume``: training checkpoints; ``train``: the loop;
- ``evaluate``: held-out and Spec-Bench figures;
- ``compat``: the files older elsi versions wrote that are still read.
"""

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
