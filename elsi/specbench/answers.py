"""The target's own greedy answers to Spec-Bench, cached once per model and settings.

Every question is answered greedily, turn by turn (turn k's prompt holds the earlier turns and
the target's own decoded answers, as ``elsi.specbench.runner.answer`` builds it), stopping at
the engine's stop tokens (``stop_tokens``) or ``max_new_tokens``. Live decoding at temperature 0
produces exactly these tokens, so they are the reference every offline measure reads: the
exact τ (``elsi.specbench.exact``) and the teacher-forced match rates (``elsi eval-draft``).

Cache: ``$ELSI_CACHE/spec_bench_answers/<key>.json``, one file per (model source, dtype,
subtasks, questions per subtask, max_new_tokens); a file records what it was made with and is
refused, naming the difference, when read for anything else.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from elsi.data.spec_bench import SUBTASKS, load_questions
from elsi.decode.engine import stop_tokens
from elsi.io import RunError, lock, read_json, write_json
from elsi.models.load import Target, cache_dir
from elsi.specbench.runner import encode_chat

FORMAT = 2  # bumped when the answers' rules change (1: eval-draft's, stopping at the tokenizer's EOS only)


def answers_settings(target: Target, subtasks: Sequence[str], per_subtask: int, max_new_tokens: int) -> dict:
    """What a set of answers depends on (recorded in, and checked against, the cache file)."""
    subs = list(SUBTASKS) if list(subtasks) in (["all"], []) else list(subtasks)
    load_questions(subs, per_subtask)  # validates the subtasks
    if per_subtask < 1:
        raise ValueError(f"questions per subtask must be >= 1, got {per_subtask}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    return {"format": FORMAT, "model": target.source, "dtype": target.dtype_name, "subtasks": subs,
            "questions_per_subtask": per_subtask, "max_new_tokens": max_new_tokens}


def answers_path(settings: dict) -> Path:
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    return cache_dir() / "spec_bench_answers" / f"{key}.json"


def answers_digest(answers: Sequence[dict]) -> str:
    """A fingerprint of a set of answers (each turn's question, turn and answer tokens; not their order): two exact
    τ measure the same thing only where they were computed on answers of one digest. The target's greedy answers
    can differ between machines where float rounding flips a near tie, which is why the digest is recorded."""
    h = hashlib.sha256()
    for a in sorted(answers, key=lambda r: (int(r["question_id"]), int(r.get("turn", 0)))):
        h.update(json.dumps([int(a["question_id"]), int(a.get("turn", 0)), list(map(int, a["answer"]))]).encode())
    return h.hexdigest()[:16]


def check_answers(rec: dict, settings: dict, path: Path | str) -> list[dict]:
    """The answers of an answers file made with ``settings``, else a ValueError naming each difference."""
    have = rec.get("settings", {}) if isinstance(rec, dict) else {}
    diff = [f"{k}: {have.get(k)!r} in the file, {v!r} asked" for k, v in settings.items() if have.get(k) != v]
    if diff:
        raise ValueError(f"{path} holds answers made with other settings ({'; '.join(diff)}): pass the matching "
                         "settings, or leave the file out to have the answers made again")
    answers = rec.get("answers")
    if not isinstance(answers, list) or not all(isinstance(a, dict) and {"prompt", "answer"} <= a.keys()
                                                for a in answers):
        raise ValueError(f"{path} is no answers file (no list of prompt/answer records under 'answers')")
    return answers


@torch.inference_mode()
def greedy_answers(target: Target, subtasks: Sequence[str] = ("all",), per_subtask: int = 80,
                   max_new_tokens: int = 128, batch: int = 16, path: str | Path | None = None,
                   on_progress: Callable[[int, int], None] | None = None) -> list[dict]:
    """Per question turn: ``{"question_id", "subtask", "turn", "prompt", "answer"}`` (token ids; the answer
    ends with its stop token when it has one). Read from ``path`` (default: the cache file of these settings)
    when it holds them, else generated (``batch`` questions per ``generate`` call) and written there."""
    settings = answers_settings(target, subtasks, per_subtask, max_new_tokens)
    explicit = path is not None
    path = Path(path) if explicit else answers_path(settings)
    if path.is_file():
        try:
            return check_answers(read_json(path), settings, path)
        except RunError:
            if explicit:
                raise
            # a damaged cache entry: the answers are made again
    elif explicit:
        raise FileNotFoundError(f"--answers {path}: no such file")
    path.parent.mkdir(parents=True, exist_ok=True)
    with lock(path, "the cached Spec-Bench answers", wait=True):  # one process makes them, another waits and reads
        if path.is_file():
            try:
                return check_answers(read_json(path), settings, path)
            except RunError:
                pass  # damaged: made again
        out = _from_superset(settings)
        if out is None:
            out = _answer_all(target, settings, per_subtask, max_new_tokens, batch, on_progress)
        write_json(path, {"settings": settings, "answers": out})
    return out


def _from_superset(settings: dict) -> list[dict] | None:
    """The answers of ``settings`` taken from a cached file of more questions per subtask, all else equal (a
    question's answer does not depend on which others were asked), or None when there is none."""
    want = {q.question_id for q in load_questions(settings["subtasks"], settings["questions_per_subtask"])}
    for n in range(80, settings["questions_per_subtask"], -1):
        path = answers_path({**settings, "questions_per_subtask": n})
        if not path.is_file():
            continue
        try:
            rec = read_json(path)
        except RunError:
            continue
        if rec.get("settings") == {**settings, "questions_per_subtask": n}:
            return [a for a in rec["answers"] if a["question_id"] in want]
    return None


def _answer_all(target: Target, settings: dict, per_subtask: int, max_new_tokens: int, batch: int,
                on_progress: Callable[[int, int], None] | None) -> list[dict]:
    """Every question's turns answered greedily, ``batch`` questions per ``generate`` call."""
    qs = load_questions(settings["subtasks"], per_subtask)
    tok, model = target.tokenizer, target.model
    eos = stop_tokens(model, tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else min(eos)
    convs: dict[int, list[tuple[str, str]]] = {q.question_id: [] for q in qs}
    out: list[dict] = []
    total = sum(len(q.turns) for q in qs)
    for turn in range(max(len(q.turns) for q in qs)):
        live = [q for q in qs if turn < len(q.turns)]
        prompt_of = {}
        for q in live:
            convs[q.question_id].append(("user", q.turns[turn]))
            prompt_of[q.question_id] = encode_chat(tok, convs[q.question_id])
        live.sort(key=lambda q: len(prompt_of[q.question_id]))  # batches of like lengths: little padding
        for a in range(0, len(live), batch):
            part = live[a: a + batch]
            prompts = [prompt_of[q.question_id] for q in part]
            for q, p, ans in zip(part, prompts, _generate(model, prompts, eos, pad, max_new_tokens)):
                out.append({"question_id": q.question_id, "subtask": q.subtask, "turn": turn, "prompt": p,
                            "answer": ans})
                convs[q.question_id].append(("assistant", tok.decode(ans, skip_special_tokens=True)))
            if on_progress:
                on_progress(len(out), total)
    out.sort(key=lambda r: (r["question_id"], r["turn"]))
    return out


def _generate(model, prompts: list[list[int]], eos: set[int], pad: int, max_new: int) -> list[list[int]]:
    """Greedy continuations of left-padded ``prompts``, each cut after its first stop token."""
    device = model.get_input_embeddings().weight.device
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)  # (B, W)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)  # (B, W)
    gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                         eos_token_id=sorted(eos), pad_token_id=pad)[:, width:].tolist()  # (B, new)
    out = []
    for ans in gen:
        stop = next((i for i, t in enumerate(ans) if t in eos), None)
        out.append(ans if stop is None else ans[: stop + 1])
    return out
