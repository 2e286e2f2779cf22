"""Regeneration: the target writes the assistant turns of the training conversations itself (greedy), as
EAGLE3 does (``--regenerate``), so that a draft learns the text it will meet when decoding.

EAGLE and SpecForge run it as a stage of its own; here the feature cache calls it one shard at a time
(``elsi.draft.features``), so that a crash loses at most one shard's answers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from elsi.data.conversations import Sample, render, tokenize
from elsi.models.load import Target


def _prompt_ids(sample: Sample, tok) -> list[int]:
    """Token ids of ``sample``'s conversation so far, rendered to be answered next (the generation prompt)."""
    text = render(sample, tok, add_generation_prompt=True)
    return tok(text, add_special_tokens=not getattr(tok, "chat_template", None))["input_ids"]


def first_prompt_tokens(sample: Sample, tok) -> int:
    """Length of the prompt that ``regenerate_batch`` answers first (system turns and the first user turn)."""
    if sample.text is not None:
        return 0
    head = [m for m in sample.messages if m[0] == "system"]
    first = next((m for m in sample.messages if m[0] == "user"), None)
    return len(_prompt_ids(Sample(sample.id, tuple(head + [first] if first else head)), tok))


def leaves_room(prompt_tokens: int, max_tokens: int) -> bool:
    """Whether a prompt of ``prompt_tokens`` tokens leaves room for at least one answer token in a conversation of
    ``max_tokens``; ``regenerate_batch`` answers only such prompts (the others end their conversation)."""
    return prompt_tokens < max_tokens - 1


def regenerate_sorted(target: Target, samples: Sequence[Sample], batch: int, max_tokens: int, max_new: int,
                      turns: int = 0, on_batch: Callable[[int], None] | None = None) -> list[Sample]:
    """``regenerate_batch`` over ``samples`` in batches of ``batch`` prompts of similar length (shortest
    first), returned in the given order. A batch is left-padded to its longest prompt and every decoding
    step attends over that width, so one long prompt among short ones would make the whole batch pay for
    it (bench/regen_speed.py measures the difference). ``on_batch(n)``: after each batch, n prompts answered."""
    order = sorted(range(len(samples)), key=lambda k: first_prompt_tokens(samples[k], target.tokenizer))
    out: list[Sample | None] = [None] * len(samples)
    for a in range(0, len(order), batch):
        ks = order[a: a + batch]
        for k, s in zip(ks, regenerate_batch(target, [samples[k] for k in ks], max_tokens, max_new, turns)):
            out[k] = s
        if on_batch:
            on_batch(a + len(ks))
    return out


@torch.no_grad()
def regenerate_batch(target: Target, samples: Sequence[Sample], max_tokens: int, max_new: int,
                     turns: int = 0) -> list[Sample]:
    """The samples with every assistant turn rewritten by the target (greedy), turn by turn.

    A conversation stops growing once its prompt reaches ``max_tokens`` or after ``turns``
    user turns (0 = no limit); later turns are dropped.
    """
    tok, model, device = target.tokenizer, target.model, target.device
    convs: list[list[tuple[str, str]]] = [[m for m in s.messages if m[0] == "system"] for s in samples]
    users = [[c for r, c in s.messages if r == "user"] for s in samples]
    alive = [s.text is None for s in samples]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    n_turns = max(len(u) for u in users)
    for turn in range(min(n_turns, turns) if turns else n_turns):
        rows, prompts = [], []
        for k, s in enumerate(samples):
            if not alive[k] or turn >= len(users[k]):
                continue
            convs[k].append(("user", users[k][turn]))
            ids = _prompt_ids(Sample(s.id, tuple(convs[k])), tok)
            if not leaves_room(len(ids), max_tokens):
                alive[k] = False
                continue
            rows.append(k)
            prompts.append(ids)
        if not rows:
            break
        width = max(map(len, prompts))
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)  # (R, W) left-padded
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)  # (R, W)
        new = min(max_new, max_tokens - min(map(len, prompts)))
        out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                             pad_token_id=pad)
        for k, p, seq in zip(rows, prompts, out[:, width:].tolist()):
            seq = seq[: max(1, max_tokens - len(p))]
            if tok.eos_token_id in seq:
                seq = seq[: seq.index(tok.eos_token_id)]
            convs[k].append(("assistant", tok.decode(seq, skip_special_tokens=True).strip() or "..."))
    return [Sample(s.id, tuple(c)) if s.text is None else s for s, c in zip(samples, convs)]


def regenerate_tokenized(target: Target, items: Sequence[tuple[int, Sample, list[int]]], batch: int, max_tokens: int,
                         max_new: int, turns: int = 0, on_batch: Callable[[int], None] | None = None
                         ) -> tuple[list[tuple[int, Sample, list[int]]], int]:
    """``regenerate_sorted`` on (data index, sample, token ids) items -> the answered items, tokenized again, in
    their order, and how many were dropped: a conversation whose first prompt left no room for an answer has
    nothing to score and would cost a whole forward."""
    answered = regenerate_sorted(target, [s for _, s, _ in items], batch, max_tokens, max_new, turns, on_batch)
    kept, dropped = [], 0
    for (i, _, _), s in zip(items, answered):
        if s.text is None and not any(role == "assistant" for role, _ in s.messages):
            dropped += 1
            continue
        kept.append((i, s, tokenize(s, target.tokenizer, max_tokens)))
    return kept, dropped


__all__ = ["first_prompt_tokens", "leaves_room", "regenerate_batch", "regenerate_sorted", "regenerate_tokenized"]
