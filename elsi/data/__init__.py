"""Data: calibration conversations (ShareGPT and friends) and the Spec-Bench questions."""

from elsi.data.conversations import (
    Dataset,
    Sample,
    data_fingerprint,
    data_identity,
    data_path,
    iter_tokenized,
    load_dataset,
    recover_json_list,
    render,
    sample_order,
    sharegpt_path,
    tokenize,
)
from elsi.data.spec_bench import SUBTASKS, Question, load_questions

__all__ = [
    "SUBTASKS",
    "Dataset",
    "Question",
    "Sample",
    "data_fingerprint",
    "data_identity",
    "data_path",
    "iter_tokenized",
    "load_dataset",
    "load_questions",
    "recover_json_list",
    "render",
    "sample_order",
    "sharegpt_path",
    "tokenize",
]
