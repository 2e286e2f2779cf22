"""The target's states over its cached greedy answers, at every layer, kept on disk once per model.

Every draft of a model is scored on the same answers (``elsi.specbench.answers``), so the target's one
forward over each answer turn (prompt + answer) is the same for all of them; only the layers a draft
reads differ. ``AnswerStates`` makes that forward once per turn and keeps every layer's states, so
each later draft of the model, whatever its layer set (every seed of a study, every set), reads its
layers from disk instead of running the target again.

Cache: ``$ELSI_CACHE/spec_bench_states/<model key>/<turn key>.safetensors``, the states
``(n_layers + 1, L, d)`` in the target's dtype exactly as its forward returned them (a layer is read
alone, memory-mapped; no pickle), and ``<turn key>.json`` written after it
(an entry is complete when both exist; a write goes through a temporary name, so an interrupted one
leaves nothing that is read). ``<model key>``: the weights' source and dtype; ``<turn key>``: the
turn's token ids. About 16 GB for SmolLM2 on all of Spec-Bench in float32; when the disk has not
room for an entry and a margin, the states are computed and not kept (``kept`` says so).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from elsi.draft.forward import greedy_tokens
from elsi.models.load import Target, cache_dir

FORMAT = 2  # 1: torch.save files (.pt)
MARGIN = 2 << 30  # bytes left free on the cache's disk


class AnswerStates:
    """The target's states at any layers over answer turns, from the cache or one forward (then kept).

    ``keep``: write what is computed to the cache (reading it is always on). Counts: ``read`` turns
    read from the cache, ``computed`` turns run through the target, ``kept`` of those written.
    """

    def __init__(self, target: Target, keep: bool = True, root: str | Path | None = None):
        self.target = target
        self.keep = keep
        model_key = _key({"format": FORMAT, "model": target.source, "dtype": target.dtype_name})
        self.dir = Path(root) if root is not None else cache_dir() / "spec_bench_states" / model_key
        self.read = self.computed = self.kept = 0

    def states(self, seq: list[int], prompt_len: int, layers: list[int]) -> tuple[int, torch.Tensor]:
        """(greedy flips, the states at ``layers`` concatenated (L, m·d) in the target's dtype) over ``seq``.

        Flips: answer positions where the one-pass forward's argmax differs from the answer's next token.
        """
        key = _key({"tokens": list(seq), "prompt_len": prompt_len})
        path, meta = self.dir / f"{key}.safetensors", self.dir / f"{key}.json"
        if meta.is_file() and path.is_file():
            try:
                info = json.loads(meta.read_text())
                with safe_open(path, framework="pt") as f:
                    hs = f.get_slice("states")  # (n+1, L, d), only the layers asked for are read
                    if hs.get_shape()[1] == len(seq) and info.get("tokens") == len(seq):
                        feats = torch.cat([hs[l] for l in layers], dim=-1)
                        self.read += 1
                        return int(info["flips"]), feats
            except (OSError, ValueError, RuntimeError, KeyError, json.JSONDecodeError, SafetensorError):
                pass  # a damaged entry: computed again, and rewritten
        flips, hs = self._forward(seq, prompt_len)
        self.computed += 1
        if self.keep and self._room(hs):
            self._write(path, meta, hs, {"format": FORMAT, "tokens": len(seq), "prompt_len": prompt_len,
                                         "flips": flips})
            self.kept += 1
        return flips, _at(hs, layers)

    def _forward(self, seq: list[int], prompt_len: int) -> tuple[int, torch.Tensor]:
        target = self.target
        ids = torch.tensor([seq], device=target.device)  # (1, L)
        out = target.adapter.decoder(target.model)(input_ids=ids, output_hidden_states=True, use_cache=False)
        hs = torch.stack([h[0] for h in out.hidden_states]).cpu()  # (n+1, L, d)
        argmax = greedy_tokens(out.hidden_states[-1][0, prompt_len - 1: len(seq) - 1],
                               target.model.get_output_embeddings())  # (A,)
        return int((argmax.cpu() != torch.tensor(seq[prompt_len:])).sum()), hs

    def _room(self, hs: torch.Tensor) -> bool:
        self.dir.mkdir(parents=True, exist_ok=True)
        return shutil.disk_usage(self.dir).free > hs.numel() * hs.element_size() + MARGIN

    @staticmethod
    def _write(path: Path, meta: Path, hs: torch.Tensor, info: dict) -> None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        save_file({"states": hs.contiguous()}, tmp)
        os.replace(tmp, path)
        tmp = meta.with_name(f".{meta.name}.{os.getpid()}")
        tmp.write_text(json.dumps(info))
        os.replace(tmp, meta)


def _at(hs: torch.Tensor, layers: list[int]) -> torch.Tensor:
    """hs (n+1, L, d) -> the states at ``layers`` side by side (L, m·d)."""
    return torch.cat([hs[l] for l in layers], dim=-1)


def _key(obj: dict) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]
