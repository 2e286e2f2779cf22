"""Bridges to the engines users serve and train drafts with: vLLM, SGLang, SpecForge, speculators.

- ``rules``: each engine's rule for which target hidden states it feeds a draft (from their code);
- ``configs``: the per-engine checks of a layer set and config fragments (``elsi export --layers``); the
  engine-facing keys of a draft's ``config.json`` and drafts written by other tools are the draft stage's
  (``elsi.draft.checkpoint``);
- ``check``: ``elsi check-draft``: what each engine feeds any EAGLE-3 or DFlash-style draft, and the
  teacher-forced acceptance that tells which feeding the draft was trained for;
- ``speculators``: the speculators (vLLM) checkpoint format (``elsi export --format speculators``);
- ``vllm``: Spec-Bench through vLLM's offline API in its own virtual environment (``elsi bench
  --engine vllm``; ``vllm_worker`` is the script that runs there, and ``vllm_models`` the target classes
  it adds to vLLM: EAGLE-3 for Gemma-3).
"""

from elsi.engines.configs import (
    FORMATS,
    check_exportable,
    check_for_engine,
    count_problems,
    engine_problems,
    export_fragment,
    warn_engines,
)
from elsi.engines.rules import CHECKED, ENGINES, EngineLoadError, engine_feed, engine_reading

__all__ = [
    "CHECKED",
    "ENGINES",
    "FORMATS",
    "EngineLoadError",
    "check_exportable",
    "check_for_engine",
    "count_problems",
    "engine_feed",
    "engine_reading",
    "engine_problems",
    "export_fragment",
    "warn_engines",
]
