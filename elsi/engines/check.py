"""``elsi check-draft``: which target states each engine would feed a draft, and whether it was trained on them.

Static part (no model loads; ``read_draft``, ``static_check``): the draft directory's ``config.json`` (elsi's,
SpecForge's, EAGLE's, speculators' ``Eagle3Speculator``, DFlash-style ``dflash_config.target_layer_ids``) and
the shape of its ``fc`` (from the safetensors header) are read; every engine's rule (``elsi.engines.rules``)
gives the HF ``hidden_states`` ids it would feed; flags name, in plain words, what would go wrong.

Empirical part (``feeding_acceptance``, ``empirical_verdict``; needs the target): the draft's teacher-forced
depth-1 acceptance on the target's cached greedy Spec-Bench answers when its ``fc`` is fed a layer set L:
the fraction of answer positions where its top-1 token, with the target's states at L concatenated in L's
order, equals the target's greedy next token (``feeding_acceptance`` documents the alignment). Candidate
feedings: each engine's, the draft's recorded set and the engines' shifted by -1 and +1, EAGLE-3's default
(2, N//2, N-3), optionally every set (``scan``), and, as the floor, no state at all (zeros). The feeding
the draft was evidently trained for is the best one when the zero feed is significantly below it; an engine
whose feeding is significantly below it (paired McNemar z >= 2, and at least ``margin`` lower) fails.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from elsi.draft.checkpoint import CONFIG, TRAINING, WEIGHTS, eagle3_default_ids, eagle_config_ids
from elsi.engines.rules import (
    CHECKED,
    ENGINE_NAMES,
    FIRST_ID_FAMILIES,
    EngineLoadError,
    Reading,
    dflash_ids,
    engine_reading,
    is_dflash,
    is_speculators,
)

_DRAFT_KEYS = ("eagle_aux_hidden_state_layer_ids", "eagle_config", "dflash_config", "target_layer_ids",
               "speculators_model_type", "draft_vocab_size", "elsi")


@dataclass
class DraftFacts:
    """What a draft directory says about itself, read without loading any weights."""

    path: Path
    config: dict  # the parsed config.json
    kind: str  # "elsi", "speculators", "dflash", "eagle3" (SpecForge, EAGLE and other EAGLE-3 configs)
    claimed: tuple[int, ...] | None  # HF ids its own tool recorded training on, in the draft's order (None: none)
    claimed_source: str  # where ``claimed`` comes from
    fc_in: int | None  # in-features of fc.weight (None: no weights file or no fc tensor)
    target_hidden: int | None  # the target hidden size the draft records
    target_layers: int | None  # the target's N the draft records (elsi drafts)
    target_model: str  # the target the draft records ("" = none)

    def m(self, hidden: int) -> int | None:
        """Number of target states the draft's fc takes (from its weights; else from its config)."""
        if self.fc_in is not None and hidden and self.fc_in % hidden == 0:
            return self.fc_in // hidden
        return len(self.claimed) if self.claimed else None


def _fc_in(path: Path) -> int | None:
    w = path / WEIGHTS
    if not w.is_file():
        return None
    from safetensors import safe_open

    with safe_open(str(w), "pt") as f:
        if "fc.weight" not in f.keys():
            return None
        return int(f.get_slice("fc.weight").get_shape()[1])  # (d, m·d_t)


def _claimed(obj: dict, kind: str) -> tuple[tuple[int, ...] | None, str]:
    """The HF ids the config's own tool trained on, read in that tool's numbering."""
    if kind == "elsi":
        return tuple(int(i) for i in obj["elsi"]["draft_config"]["layer_ids"]), "elsi.draft_config.layer_ids"
    if kind == "dflash":
        if obj.get("speculators_model_type") == "dflash":
            ids = obj.get("aux_hidden_state_layer_ids")
            return (tuple(int(i) for i in ids), "aux_hidden_state_layer_ids") if ids else (None, "")
        lst, key = dflash_ids(obj)
        return (tuple(int(j) + 1 for j in lst), f"{key} + 1") if lst else (None, "")
    if obj.get("eagle_aux_hidden_state_layer_ids"):
        return tuple(int(i) for i in obj["eagle_aux_hidden_state_layer_ids"]), "eagle_aux_hidden_state_layer_ids"
    lst = eagle_config_ids(obj)
    if lst:
        return tuple(int(j) + 1 for j in lst), "eagle_config.eagle_aux_hidden_state_layer_ids + 1"
    return None, ""


def read_draft(path: str | Path) -> DraftFacts:
    """A draft directory's facts, or a FileNotFoundError/ValueError naming the file and what is wrong."""
    path = Path(path)
    cfg_path = path / CONFIG
    if not path.is_dir():
        raise FileNotFoundError(f"--draft {path}: no such directory")
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{path} is not a draft directory: it has no {CONFIG}")
    try:
        obj = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{cfg_path} is not valid JSON ({err})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{cfg_path} holds {type(obj).__name__}, not a config object")
    archs = obj.get("architectures") or []
    if not (any(k in obj for k in _DRAFT_KEYS) or any("eagle" in a.lower() or "dflash" in a.lower() for a in archs)):
        raise ValueError(f"{cfg_path} is no draft config: it has none of {', '.join(_DRAFT_KEYS)} and no EAGLE or "
                         f"DFlash architecture (architectures {archs}, num_hidden_layers "
                         f"{obj.get('num_hidden_layers')}): a target model's directory?")
    kind = ("elsi" if "elsi" in obj else "speculators" if is_speculators(obj) and not is_dflash(obj)
            else "dflash" if is_dflash(obj) else "eagle3")
    claimed, source = _claimed(obj, kind)
    layer = obj.get("transformer_layer_config") or obj
    hidden = obj.get("target_hidden_size") or (obj["elsi"]["draft_config"]["target_hidden_size"] if kind == "elsi"
                                                else None)
    model = ""
    rec = path / TRAINING
    if rec.is_file():
        try:
            model = json.loads(rec.read_text())["settings"]["features"]["model"]
        except (json.JSONDecodeError, KeyError, TypeError):
            model = ""
    if not model and is_speculators(obj):
        model = (((obj.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")) or ""
    return DraftFacts(path, obj, kind, claimed, source, _fc_in(path),
                      int(hidden) if hidden else (int(layer["hidden_size"]) if kind == "dflash" and
                                                  "hidden_size" in layer else None),
                      int(obj["elsi"]["draft_config"]["target_num_layers"]) if kind == "elsi" else None, model)


def model_facts(spec: str, trust_remote_code: bool = False) -> tuple[int, int, str]:
    """(N, hidden size, HF model_type) of a model from its config alone."""
    from transformers import AutoConfig

    from elsi.models import resolve_model

    cfg = AutoConfig.from_pretrained(resolve_model(spec), trust_remote_code=trust_remote_code)
    text = cfg.get_text_config()
    return int(text.num_hidden_layers), int(text.hidden_size), str(getattr(cfg, "model_type", "") or "")


def _lists(obj: dict) -> list[tuple[str, list[int], int]]:
    """(key, ids, shift to HF) of every id list the config carries."""
    out = []
    if obj.get("eagle_aux_hidden_state_layer_ids"):
        out.append(("eagle_aux_hidden_state_layer_ids", list(obj["eagle_aux_hidden_state_layer_ids"]), 0))
    if eagle_config_ids(obj):
        out.append(("eagle_config.eagle_aux_hidden_state_layer_ids", eagle_config_ids(obj), 1))
    lst, key = dflash_ids(obj)
    if lst:
        out.append((key, lst, 1))
    if obj.get("aux_hidden_state_layer_ids"):
        out.append(("aux_hidden_state_layer_ids", list(obj["aux_hidden_state_layer_ids"]), 0))
    return out


def check_fits(facts: DraftFacts, num_layers: int, hidden: int, model: str) -> None:
    """Bad input, before any model loads: ids beyond the model's N, another hidden size or N than the draft's
    target. Raises ValueError naming the file, the value and the model."""
    cfg_path = facts.path / CONFIG
    for key, ids, shift in _lists(facts.config):
        bad = [j for j in ids if not 0 <= int(j) + shift <= num_layers]
        if bad:
            own = f", i.e. {key} 0..{num_layers - 1}" if shift else ""
            raise ValueError(f"{cfg_path}: {key} {list(ids)} holds {bad}, beyond {model}'s N = {num_layers} "
                             f"(hidden-state ids 0..{num_layers}{own}): the draft was made for a deeper target")
    if facts.target_hidden is not None and facts.target_hidden != hidden:
        raise ValueError(f"{cfg_path}: the draft's target hidden size is {facts.target_hidden}, {model}'s is {hidden}: "
                         "the draft was trained for another target")
    if facts.target_layers is not None and facts.target_layers != num_layers:
        raise ValueError(f"{cfg_path}: the draft records a target of {facts.target_layers} layers, {model} has "
                         f"{num_layers}: the draft was trained for another target")
    m = facts.m(hidden)
    if facts.fc_in is not None and facts.fc_in % hidden:
        raise ValueError(f"{facts.path / WEIGHTS}: fc.weight takes {facts.fc_in} inputs, not a multiple of "
                         f"{model}'s hidden size {hidden}: the draft was trained for another target")
    if m is None:
        raise ValueError(f"{facts.path}: neither its weights ({WEIGHTS} with fc.weight) nor its config tell how many "
                         "target states the draft reads")


def _shift_text(fed: Sequence[int], want: Sequence[int]) -> str:
    if len(fed) == len(want) and fed and all(f is not None for f in fed):
        deltas = {f - w for f, w in zip(fed, want)}
        if len(deltas) == 1:
            (d,) = deltas
            if d:
                return f" (every id {'+' if d > 0 else ''}{d})"
    return ""


def _fmt(ids) -> str:
    return "[" + ", ".join("pre-norm h_N" if i is None else str(i) for i in ids) + "]"


@dataclass
class Flag:
    level: str  # "error": the engine would not serve the draft as recorded; "warning"; "note"
    text: str
    engine: str = ""
    feeding: bool = False  # about which layers the engine feeds (the empirical check, when run, decides those)

    def to_json(self) -> dict:
        return {"level": self.level, "engine": self.engine, "text": self.text, "feeding": self.feeding}


def _key_flags(obj: dict, kind: str) -> list[Flag]:
    """Keys whose meaning or default differs between engines (cited in ``elsi.engines.rules``)."""
    out = []
    if obj.get("norm_output"):
        out.append(Flag("warning", "norm_output is true: vLLM and SGLang feed the draft its normed output at depth >= 2 "
                        "(default false); elsi's engine feeds the pre-norm state, so only the depth-1 check below, "
                        "which does not depend on it, applies"))
    if "norm_output" in obj and kind == "eagle3":
        out.append(Flag("warning", f"norm_output is {obj['norm_output']} in a SpecForge-style config: SpecForge gave "
                        "the key another meaning before sgl-project/SpecForge#879 (2026-09; its false normalised "
                        "neither the LM head's input nor the next state), so a draft it trained earlier may expect "
                        "other states than vLLM and SGLang give it"))
    if kind == "speculators" and "norm_before_residual" not in obj:
        out.append(Flag("warning", "norm_before_residual is absent: vLLM reads a speculators config's absence as "
                        "true (algos.py update_eagle3), an EAGLE-3 config's as false (llama_eagle3.py); elsi and "
                        "EAGLE drafts are trained with false", "speculators"))
    if obj.get("norm_before_residual"):
        out.append(Flag("warning", "norm_before_residual is true: elsi's engine runs the draft without it, so the "
                        "empirical check below measures another computation than vLLM's"))
    if (obj.get("eagle_config") or {}).get("use_aux_hidden_state") is False:
        out.append(Flag("error", "eagle_config.use_aux_hidden_state is false: vLLM builds no fc and feeds the draft "
                        "the target's last state alone", "vllm"))
    top, lst = obj.get("eagle_aux_hidden_state_layer_ids"), eagle_config_ids(obj)
    if top and lst and [int(j) + 1 for j in lst] != [int(i) for i in top]:
        same = " (the same ids in both: one of the two numberings is wrong)" if list(lst) == list(top) else ""
        out.append(Flag("error", f"the two id lists disagree: top-level {list(top)} is read by vLLM as HF ids, "
                        f"eagle_config's {list(lst)} by SGLang and SpecForge as layer outputs (HF "
                        f"{[int(j) + 1 for j in lst]}){same}"))
    return out


def static_check(facts: DraftFacts, num_layers: int, hidden: int, family: str = "") -> dict:
    """Per engine (``rules.CHECKED``), what it feeds the draft, and the flags; ``family``: the target's HF
    ``model_type`` ("" = unknown: SGLang's DeepSeek/GLM rule is then shown as a note)."""
    obj, n = facts.config, num_layers
    m = facts.m(hidden)
    claimed = facts.claimed
    flags: list[Flag] = []
    engines = {}
    if facts.kind == "speculators":
        flags.append(Flag("note", "a speculators checkpoint is vLLM's format (layers.0.*, transformer_layer_config): "
                          "SGLang and SpecForge serve or train the EAGLE-3 checkpoint it was converted from"))
    for e in CHECKED:
        if facts.kind == "speculators" and e not in ("vllm", "vllm-v1"):
            continue  # read by vLLM alone (its speculators column is the vllm one)
        if facts.kind == "dflash" and e == "speculators" and not is_speculators(obj):
            continue  # a DFlash draft's speculators form is another algorithm (dflash): not an EAGLE-3 conversion
        try:
            r: Reading | None = engine_reading(e, obj, n, family)
        except EngineLoadError as err:
            engines[e] = {"name": ENGINE_NAMES[e], "fed": None, "source": "", "default": False, "slots": None,
                          "loads": False}
            flags.append(Flag("error", f"{ENGINE_NAMES[e]} refuses the config: {err}", e))
            continue
        loads = len(r.fed) == r.slots and (m is None or m == r.slots)
        engines[e] = {"name": ENGINE_NAMES[e], "fed": list(r.fed), "source": r.source, "default": r.default,
                      "slots": r.slots, "loads": loads}
        name = ENGINE_NAMES[e]
        if r.default:
            what = f"falls back to its default and feeds {_fmt(r.fed)} ({r.source})"
            level = "error" if claimed is None or tuple(r.fed) != tuple(claimed) else "warning"
            if claimed is None:
                what += "; the config records no layers, so whether the draft was trained on them only the " \
                        "empirical check (--model) can tell"
            flags.append(Flag(level, f"{name} {what}", e, feeding=True))
        if len(r.fed) != r.slots:
            flags.append(Flag("error", f"{name} cannot load the draft: it captures {len(r.fed)} state(s) "
                              f"{_fmt(r.fed)} for an fc it builds with {r.slots} input slot(s)", e))
        elif m is not None and r.slots != m:
            flags.append(Flag("error", f"{name} cannot load the draft: it builds fc for {r.slots} states, the "
                              f"weights' fc takes {m} ({facts.fc_in} = {m} x {hidden})", e))
        if None in r.fed:
            flags.append(Flag("error", f"{name} feeds the last layer's pre-norm output for id {n}: the draft "
                              f"recorded HF's h_{n}, which is after the final norm; no engine captures that", e))
        if claimed is not None and not r.default and tuple(r.fed) != tuple(claimed):
            order = " (engines concatenate in layer order)" if sorted(claimed) == sorted(
                i for i in r.fed if i is not None) else ""
            flags.append(Flag("error", f"{name} feeds {_fmt(r.fed)}, the draft records {list(claimed)} "
                              f"({facts.claimed_source}){_shift_text(r.fed, claimed)}{order}", e, feeding=True))
        engines[e]["matches_recorded"] = None if claimed is None else tuple(r.fed) == tuple(claimed)
    if m is not None and claimed is not None and len(claimed) != m:
        flags.append(Flag("error", f"fc takes {facts.fc_in} = {m} x {hidden} inputs, but the config lists "
                          f"{len(claimed)} ids {list(claimed)} ({facts.claimed_source})"))
    if claimed is not None:
        if 0 in claimed or n in claimed:
            which = [i for i in claimed if i in (0, n)]
            flags.append(Flag("error", f"the recorded layers include {which}: h_0 is the embedding output (SGLang "
                              f"and SpecForge cannot name it) and h_{n} the final normed state, which no engine's "
                              "capture hook sees"))
        if list(claimed) != sorted(claimed):
            flags.append(Flag("error", f"the recorded layers {list(claimed)} are not in layer order: the engines "
                              f"concatenate {sorted(claimed)}, so each fc slot gets another layer's state"))
    flags.extend(_key_flags(obj, facts.kind))
    lst = eagle_config_ids(obj)
    if facts.kind != "dflash" and lst and not family:
        alt = engine_reading("sglang", obj, n, FIRST_ID_FAMILIES[1])
        if tuple(alt.fed) != tuple(engines["sglang"]["fed"] or ()):
            flags.append(Flag("note", f"for a DeepSeek-V2/V3, Kimi-K2 or GLM-4.7-Flash target SGLang would feed "
                              f"{_fmt(alt.fed)}: it adds 1 to eagle_config's ids only when the first is 1 "
                              "(sglang/srt/models/deepseek_v2.py, glm4_moe_lite.py; sgl-project/sglang#25454); "
                              "pass --model to apply the target's rule", "sglang"))
    return {"engines": engines, "flags": [f.to_json() for f in flags], "m": m,
            "recorded": None if claimed is None else {"ids": list(claimed), "source": facts.claimed_source}}


# ---- empirical: teacher-forced depth-1 acceptance under candidate feedings ----

def load_for_check(facts: DraftFacts, target, m: int):
    """The draft as an ``Eagle3Draft`` for ``target``, its fc taking m states whatever ids its config lists (the
    check feeds every slot itself)."""
    from dataclasses import replace

    from safetensors.torch import load_file

    from elsi.draft.model import DraftConfig, Eagle3Draft, check_fits_target, elsi_state_dict

    if facts.kind == "dflash":
        raise ValueError(f"{facts.path} is a DFlash-style draft, which elsi cannot run: only the engines' "
                         "readings (above) are checked")
    if not (facts.path / WEIGHTS).is_file():
        raise FileNotFoundError(f"{facts.path} has no {WEIGHTS}: the empirical check needs the draft's weights")
    embed = target.adapter.embed_tokens(target.model)
    cfg = DraftConfig.from_json(facts.config, target.num_layers, target.hidden_size)
    if cfg.num_aux != m:
        cfg = replace(cfg, layer_ids=tuple(range(1, m + 1)))  # placeholder ids: only the fc width matters here
    check_fits_target(cfg, target.num_layers, target.hidden_size, int(embed.weight.shape[0]),
                      where=f"draft {facts.path}")
    draft = Eagle3Draft(cfg, embed)
    draft.load_state_dict(elsi_state_dict(load_file(str(facts.path / WEIGHTS)), cfg, embed, facts.path), strict=True)
    return draft.to(next(embed.parameters()).device).eval()


def candidate_feedings(facts: DraftFacts, static: dict, num_layers: int, m: int, scan: bool = False) -> dict:
    """Layer set (in feeding order) -> labels, for every candidate of size m with ids in 0..N-1."""
    n = num_layers
    out: dict[tuple[int, ...], list[str]] = {}

    def add(ids, label: str) -> None:
        ids = tuple(ids)
        if len(ids) == m and len(set(ids)) == m and all(i is not None and 0 <= i < n for i in ids):
            out.setdefault(ids, []).append(label)

    for e, row in static["engines"].items():
        if row.get("fed") is not None:
            add(row["fed"], e)
    bases = [("recorded", facts.claimed)] if facts.claimed else []
    bases += [(e, tuple(row["fed"])) for e, row in static["engines"].items()
              if row.get("fed") and None not in row["fed"]]
    if bases:
        add(bases[0][1], bases[0][0])
    for label, ids in bases:
        add([i - 1 for i in ids], f"{label} - 1")
        add([i + 1 for i in ids], f"{label} + 1")
    add(eagle3_default_ids(n), "EAGLE-3 default (2, N//2, N-3)")
    if scan:
        for ids in itertools.combinations(range(1, n), m):
            add(ids, "scan")
    return out


@dataclass
class Acceptance:
    hits: int = 0
    scored: int = 0
    per_subtask: dict = field(default_factory=dict)  # subtask -> [hits, scored]
    hit: list = field(default_factory=list)  # per answer: (A,) bool, whether each scored position hit

    @property
    def rate(self) -> float:
        return self.hits / self.scored if self.scored else float("nan")

    def z_over(self, other: Acceptance) -> float:
        """Paired (McNemar) z of this feeding's hits over ``other``'s on the same positions: (b - c) / sqrt(b + c),
        b = positions only this one hits, c = positions only the other hits (0 where they never differ)."""
        import torch

        a, o = torch.cat(self.hit), torch.cat(other.hit)  # (positions,) bool each
        b, c = int((a & ~o).sum()), int((~a & o).sum())
        return 0.0 if b + c == 0 else (b - c) / (b + c) ** 0.5


def feeding_acceptance(target, draft, answers: list[dict], feedings: Sequence[tuple[int, ...]],
                       zero_feed: bool = True) -> dict[tuple[int, ...] | None, Acceptance]:
    """Teacher-forced depth-1 acceptance of ``draft`` fed each layer set in ``feedings`` (key None: zeros).

    Per answer record (``elsi.specbench.answers``) the sequence x = prompt + answer (T tokens) gets one target
    forward (``elsi.draft.forward.target_features``): states h_l (T, d) and the target's greedy token after
    each prefix, argmax (T,). Draft row i pairs g_i = fc([h_{L_1}[i]; ...; h_{L_m}[i]]) with the embedding of
    x_{i+1} and predicts x_{i+2} (``elsi.draft.model``); it is scored where x_{i+2} is an answer token
    (P <= i + 2 < T, P the prompt length) and hits when its top-1 (mapped to a target id) equals argmax[i+1].
    """
    import torch

    from elsi.draft.forward import target_features

    keys: list[tuple[int, ...] | None] = [tuple(f) for f in feedings] + ([None] if zero_feed else [])
    layers = sorted({i for f in feedings for i in f})
    pos_of = {l: k for k, l in enumerate(layers)}
    out = {k: Acceptance() for k in keys}
    device = next(draft.parameters()).device
    with torch.no_grad():
        for rec in answers:
            p, a = len(rec["prompt"]), len(rec["answer"])
            if a == 0 or p < 2:
                continue
            seq = list(rec["prompt"]) + list(rec["answer"])
            t = len(seq)
            (argmax, _, states), = target_features(target, [seq], layers)  # (T,), _, (T, L, d)
            ids = torch.tensor(seq, device=device)[None]  # (1, T)
            pos = torch.arange(t - 1, device=device)[None]  # (1, T-1): row i at position i
            want = argmax[p - 1: t - 1].to(device)  # (A,): the target's greedy token after x_0..x_{i+1}, i = P-2..T-3
            for key in keys:
                if key is None:
                    aux = torch.zeros(1, t, draft.config.num_aux * draft.config.target_hidden_size, device=device)
                else:
                    aux = states[:, [pos_of[l] for l in key]].flatten(1)[None].to(device)  # (1, T, m·d) in L's order
                g = draft.fuse(aux)  # (1, T, d)
                # (1, A+1, V_draft): rows T-A-2..T-2
                logits, _ = draft(ids[:, 1:], g[:, :-1], pos, logits_to_keep=a + 1)
                top = draft.to_target_ids(logits[0, :-1].argmax(-1))  # (A,) rows P-2..T-3
                hits = (top == want).cpu()  # (A,)
                hit = int(hits.sum())
                acc = out[key]
                acc.hit.append(hits)
                acc.hits += hit
                acc.scored += a
                sub = acc.per_subtask.setdefault(rec.get("subtask", "all"), [0, 0])
                sub[0] += hit
                sub[1] += a
    return out


Z = 2.0  # a paired difference counts when its McNemar z reaches this (about 95 %, two-sided)


def empirical_verdict(static: dict, candidates: dict[tuple[int, ...], list[str]],
                      acc: dict[tuple[int, ...] | None, Acceptance], margin: float) -> dict:
    """The feeding the draft was evidently trained for, and per engine whether it feeds something worse.

    A feeding is *below* another when its acceptance is lower by at least ``margin`` and the paired difference on
    the same positions is significant (``Acceptance.z_over`` >= ``Z``). Evident: the best candidate, provided the
    zero feed is below it (else no candidate is what the draft was trained on). An engine fails when its
    feeding is below the best."""
    rows = sorted(((ids, labels, acc[ids].rate) for ids, labels in candidates.items()), key=lambda r: -r[2])
    zero = acc[None].rate if None in acc else float("nan")
    best_ids, best_labels, best = rows[0]

    def below(ids) -> bool:
        other = acc[ids]
        return best - other.rate >= margin and acc[best_ids].z_over(other) >= Z

    trained = below(None) if None in acc else True
    engines = {}
    for e, row in static["engines"].items():
        fed = row.get("fed")
        if fed is None or None in fed or tuple(fed) not in acc:
            engines[e] = {"acceptance": None, "ok": None,
                          "text": "not measured (the engine feeds a state outside HF hidden_states, or none)"}
            continue
        r = acc[tuple(fed)].rate
        ok = trained and not below(tuple(fed))
        text = (f"feeds {_fmt(fed)}: acceptance {r:.3f}" + ("" if tuple(fed) == best_ids else
                f" against {best:.3f} for {list(best_ids)}"))
        engines[e] = {"acceptance": r, "ok": ok, "text": text}
    return {"feedings": [{"ids": list(ids), "labels": labels, "acceptance": rate, "hits": acc[ids].hits,
                          "scored": acc[ids].scored} for ids, labels, rate in rows],
            "zero_feed": zero, "evident": list(best_ids) if trained else None, "best": best, "margin": margin,
            "close": [list(ids) for ids, _, _ in rows[1:] if not below(ids)],  # not told apart from the best
            "engines": engines}


def verdict(static: dict, empirical: dict | None) -> tuple[str, list[str]]:
    """("pass" or "fail", the reasons): fail on any static error flag or an engine failing the empirical check.
    With the empirical check, it alone judges which layers each engine feeds (static flags about feedings
    compare with what the config records, which may itself be wrong)."""
    reasons = [f["text"] for f in static["flags"] if f["level"] == "error" and not (empirical and f["feeding"])]
    if empirical is not None:
        if empirical["evident"] is None:
            reasons.append(f"no candidate feeding helps the draft beyond its token embeddings (best "
                           f"{empirical['best']:.3f}, zero feed {empirical['zero_feed']:.3f}): it was trained on "
                           "other layers than any engine feeds; --scan tries every set")
        else:
            reasons += [f"{ENGINE_NAMES[e]} {r['text']}" for e, r in empirical["engines"].items() if r["ok"] is False]
    return ("fail" if reasons else "pass"), reasons


__all__ = ["Acceptance", "DraftFacts", "Flag", "candidate_feedings", "check_fits", "empirical_verdict",
           "feeding_acceptance", "load_for_check", "model_facts", "read_draft", "static_check", "verdict"]
