"""Spec-Bench: tau per subtask and speed-ups of speculative decoding (``elsi bench``)."""

from elsi.specbench.runner import (
    Answer,
    BenchConfig,
    encode_chat,
    run_bench,
    summarize,
    summary_rows,
)

__all__ = ["Answer", "BenchConfig", "encode_chat", "run_bench", "summarize", "summary_rows"]
