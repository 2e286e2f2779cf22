"""EAGLE3-style draft model conditioned on any set of target layers.

Architecture (Li et al., "EAGLE-3", 2025; tensor names of the checkpoints vLLM and SGLang load):

    aux  = [h_{l_1} ; ... ; h_{l_m}]          (B, T, m·d_t)  target states at ``layer_ids``
    g    = fc(aux)                              (B, T, d)      (optionally RMS-normalised per layer first)
    x    = [input_layernorm(emb(x_{i+1})) ; hidden_norm(g_i)]   (B, T, 2d)
    a    = o_proj(attention(q_proj(x), k_proj(x), v_proj(x)))   RoPE, causal
    r    = g + a;  out = r + mlp(post_attention_layernorm(r))   (B, T, d)  "hidden_out"
    logits = lm_head(norm(out))                 (B, T, V_draft)

Row i of a call pairs the feature g_i (the target's state after x_0..x_i, or the draft's own
previous ``hidden_out``) with the embedding of x_{i+1}, and predicts x_{i+2}.

Positions: a row built from target features at sequence position i has ``position_id`` i; a
token drafted at depth j on top of root position i (j = 1 for the first drafted token's row)
has ``position_id`` i + j. Training-time test (``unroll``) uses exactly this numbering.

Layer ids follow docs/design.md: ``h_l`` is Hugging Face ``hidden_states[l]`` (vLLM's numbering
of ``eagle_aux_hidden_state_layer_ids``).
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from elsi.draft.checkpoint import CONFIG, WEIGHTS, engine_keys, foreign_draft_config, foreign_weight_name
from elsi.draft.compat import stale_eagle_config


@dataclass
class DraftConfig:
    """Shapes of the draft and the target it serves (written to ``config.json``)."""

    layer_ids: tuple[int, ...]  # target hidden-state ids the draft reads (docs/design.md numbering)
    target_num_layers: int  # N of the target; ids must lie in 0..N
    target_hidden_size: int  # d_t, width of each target state
    hidden_size: int  # d, width of the draft (= the target's embedding width)
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # V_target
    draft_vocab_size: int  # V_draft <= V_target
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    max_position_embeddings: int = 8192
    fc_norm: bool = False  # RMS-normalise each target state (learned weight) before fc (EAGLE-3.1 "fc_norm")

    def __post_init__(self) -> None:
        self.layer_ids = tuple(int(l) for l in self.layer_ids)
        if not self.layer_ids:
            raise ValueError("layer_ids must name at least one target layer, got an empty set")
        bad = [l for l in self.layer_ids if not 0 <= l <= self.target_num_layers]
        if bad:
            raise ValueError(f"layer id(s) {bad} out of range: the target has hidden-state ids 0..{self.target_num_layers}")
        if len(set(self.layer_ids)) != len(self.layer_ids):
            raise ValueError(f"layer_ids {list(self.layer_ids)} repeat a layer")
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in 1..{self.vocab_size}, got {self.draft_vocab_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")

    @property
    def num_aux(self) -> int:
        """m, the number of target layers."""
        return len(self.layer_ids)

    def llama_config(self) -> LlamaConfig:
        """The HF config of the draft's one decoder layer (for the reused HF building blocks)."""
        return LlamaConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            num_hidden_layers=1,
            hidden_act=self.hidden_act,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=dict(self.rope_parameters),
            max_position_embeddings=self.max_position_embeddings,
            vocab_size=self.vocab_size,
            mlp_bias=False,
        )

    def to_json(self) -> dict:
        """``config.json``: a Llama EAGLE3 config as vLLM/SGLang read it, plus elsi's own fields."""
        own = asdict(self)
        return {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": 1,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": float(self.rope_parameters.get("rope_theta", 10000.0)),
            "rope_scaling": None if self.rope_parameters.get("rope_type", "default") == "default"
            else dict(self.rope_parameters),
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
            **engine_keys(self.layer_ids, self.fc_norm),
            "elsi": {
                "layer_id_convention": "top-level eagle_aux_hidden_state_layer_ids: HF hidden_states index, h_0 = "
                                       "embeddings, h_l = input of decoder layer l (vLLM); eagle_config's list: "
                                       "id - 1, the output of layer i (SGLang, SpecForge)",
                "sglang_layer_ids": [l - 1 for l in self.layer_ids],
                "draft_config": own,
            },
        }

    @classmethod
    def from_json(cls, obj: dict, target_num_layers: int | None = None,
                  target_hidden_size: int | None = None) -> DraftConfig:
        """From elsi's ``config.json``, or from the standard keys of another tool's EAGLE3 config
        (SpecForge, EAGLE, speculators), which needs the target's N and hidden size."""
        if "elsi" in obj:
            own = dict(obj["elsi"]["draft_config"])
        elif target_num_layers is None or target_hidden_size is None:
            raise ValueError("a draft config without an 'elsi' block (from another tool) is read against its "
                             "target: pass the target's number of layers and hidden size")
        else:
            own = foreign_draft_config(obj, target_num_layers, target_hidden_size)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in own.items() if k in known})


class DraftCache:
    """Key/value cache of the draft's one attention layer.

    ``k``/``v``: (B, KVH, L, hd). ``append`` returns the full keys/values after appending;
    ``crop(length)`` keeps the first ``length`` positions; ``select(index)`` keeps the
    positions listed in ``index`` (L',) in that order (e.g. an accepted tree path).
    """

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k is None:
            self.k, self.v = k, v
        else:
            self.k = torch.cat([self.k, k], dim=2)  # (B, KVH, L + T, hd)
            self.v = torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def crop(self, length: int) -> None:
        if length < 0 or length > self.length:
            raise ValueError(f"cannot crop a draft cache of length {self.length} to {length}")
        if self.k is not None:
            self.k = self.k[:, :, :length]  # (B, KVH, length, hd)
            self.v = self.v[:, :, :length]

    def select(self, index: torch.Tensor | Sequence[int]) -> None:
        if self.k is None:
            raise ValueError("cannot select positions of an empty draft cache")
        index = torch.as_tensor(index, dtype=torch.long, device=self.k.device)  # (L',)
        self.k = self.k.index_select(2, index)  # (B, KVH, L', hd)
        self.v = self.v.index_select(2, index)


class DraftAttention(nn.Module):
    """Projections of the draft's attention: q/k/v read the 2d-wide [embedding ; state] input."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        hd, h, kvh = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.q_proj = nn.Linear(2 * cfg.hidden_size, h * hd, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, kvh * hd, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, kvh * hd, bias=False)
        self.o_proj = nn.Linear(h * hd, cfg.hidden_size, bias=False)
        self.heads, self.kv_heads, self.head_dim = h, kvh, hd

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x (B, T, 2d) -> q (B, H, T, hd), k, v (B, KVH, T, hd), RoPE applied to q and k."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)  # (B, KVH, T, hd)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)  # (B, KVH, T, hd)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def out(self, a: torch.Tensor) -> torch.Tensor:
        """a (B, H, T, hd) -> (B, T, d)."""
        b, _, t, _ = a.shape
        return self.o_proj(a.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))  # (B, T, d)


class DraftDecoderLayer(nn.Module):
    """EAGLE3's ``midlayer``: one Llama decoder layer whose attention reads [emb ; state]."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg.llama_config())

    def qkv(self, emb: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """emb, hidden (B, T, d) -> q, k, v of the attention over x = [norm(emb) ; norm(hidden)] (B, T, 2d)."""
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)  # (B, T, 2d)
        return self.self_attn.project(x, cos, sin)

    def finish(self, attn: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """attn (B, H, T, hd), residual ``hidden`` (B, T, d) -> the layer's output (B, T, d)."""
        r = hidden + self.self_attn.out(attn)  # (B, T, d)
        return r + self.mlp(self.post_attention_layernorm(r))


def _expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, KVH, L, hd) -> (B, H, L, hd) for grouped-query attention."""
    rep = heads // x.shape[1]
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def ttt_attention(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor,
                  ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor]) -> torch.Tensor:
    """EAGLE3 training-time-test attention at unroll step j = len(ks).

    Row i attends to the step-0 keys at positions <= i (the prefix built from target
    features) and to its own keys of steps 1..j (its drafted chain), which is what a
    token drafted at depth j sees at inference. q (B, H, T, hd); k0, v0 and each of
    ks, vs (B, KVH, T, hd). Returns (B, H, T, hd).
    """
    h, t = q.shape[1], q.shape[2]
    if not ks:  # step 0 is plain causal attention: the fused kernel, no (T, T) scores kept for backward
        return F.scaled_dot_product_attention(q, k0, v0, is_causal=True, enable_gqa=h != k0.shape[1])
    scale = 1.0 / math.sqrt(q.shape[-1])
    k0, v0 = _expand_kv(k0, h), _expand_kv(v0, h)  # (B, H, T, hd)
    s0 = (q @ k0.transpose(-1, -2)) * scale  # (B, H, T, T)
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()  # (T, T)
    s0 = s0.masked_fill(~causal, float("-inf"))
    ks = [_expand_kv(k, h) for k in ks]
    vs = [_expand_kv(v, h) for v in vs]
    sd = torch.stack([(q * k).sum(-1) for k in ks], dim=-1) * scale  # (B, H, T, j): the diagonal of each step
    w = torch.softmax(torch.cat([s0, sd], dim=-1), dim=-1)  # (B, H, T, T + j)
    out = w[..., :t] @ v0  # (B, H, T, hd)
    for n, v in enumerate(vs):
        out = out + w[..., t + n, None] * v  # (B, H, T, 1) * (B, H, T, hd)
    return out


class Eagle3Draft(nn.Module):
    """The draft. ``embed_tokens`` is the target's: frozen, shared, neither saved nor moved."""

    def __init__(self, cfg: DraftConfig, embed_tokens: nn.Module) -> None:
        super().__init__()
        self.config = cfg
        object.__setattr__(self, "embed_tokens", embed_tokens)  # not a submodule: not trained, not saved
        m, dt, d = cfg.num_aux, cfg.target_hidden_size, cfg.hidden_size
        self.fc = nn.Linear(m * dt, d, bias=False)  # weight (d, m·d_t)
        if cfg.fc_norm:
            self.fc_norm = nn.Parameter(torch.ones(m, dt))  # per-layer RMSNorm weight (m, d_t)
        self.midlayer = DraftDecoderLayer(cfg)
        self.norm = LlamaRMSNorm(d, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(d, cfg.draft_vocab_size, bias=False)  # weight (V_draft, d)
        self.rotary = LlamaRotaryEmbedding(cfg.llama_config())  # inv_freq is a non-persistent buffer
        # Training-time reparametrisation of fc (see ``set_aux_scale``); not saved: ``fold_aux_scale`` first.
        self.register_buffer("aux_scale", None, persistent=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))  # (V_draft,)
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))  # (V_target,)
        self.t2d[: cfg.draft_vocab_size] = True

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return self.config.layer_ids

    # ---- vocabulary ----
    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install the draft vocabulary maps (see ``elsi.draft.vocab``)."""
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(f"vocab maps of shapes {tuple(d2t.shape)}, {tuple(t2d.shape)} do not fit the draft's "
                             f"{tuple(self.d2t.shape)}, {tuple(self.t2d.shape)}")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids (any shape) -> target ids: id + d2t[id]."""
        return draft_ids + self.d2t[draft_ids]

    # ---- fc reparametrisation ----
    def set_aux_scale(self, scale: torch.Tensor | None) -> None:
        """Train fc on ``aux * scale`` (scale (m·d_t,), e.g. 1/RMS of each input feature).

        The target's states have a few "massive" dimensions (hundreds of times the median);
        with the raw states, Adam's per-weight steps let those dimensions dominate ``fc``.
        Training ``W_s`` on rescaled inputs and saving ``W = W_s * scale`` computes the same
        function and keeps the EAGLE3 format; ``fold_aux_scale`` does that folding.
        """
        m, dt = self.config.num_aux, self.config.target_hidden_size
        if scale is not None and scale.shape != (m * dt,):
            raise ValueError(f"aux scale of shape {tuple(scale.shape)}, the draft expects ({m * dt},)")
        self.aux_scale = None if scale is None else scale.to(self.fc.weight)

    @torch.no_grad()
    def fold_aux_scale(self) -> None:
        """fc.weight <- fc.weight * aux_scale (columns), then no scale: same outputs, savable weights."""
        if self.aux_scale is not None:
            self.fc.weight.mul_(self.aux_scale)  # (d, m·d_t) * (m·d_t,)
            self.aux_scale = None

    # ---- forward ----
    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """aux (B, T, m·d_t): the target's states at ``layer_ids``, concatenated -> g (B, T, d)."""
        m, dt = self.config.num_aux, self.config.target_hidden_size
        if aux.shape[-1] != m * dt:
            raise ValueError(f"aux has width {aux.shape[-1]}, the draft expects {m} layers x {dt} = {m * dt}")
        aux = aux.to(self.fc.weight.dtype)
        if self.config.fc_norm:
            x = aux.unflatten(-1, (m, dt))  # (B, T, m, d_t)
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps) * self.fc_norm
            aux = x.flatten(-2)  # (B, T, m·d_t)
        if self.aux_scale is not None:  # right before fc, so that it folds into fc's columns
            aux = aux * self.aux_scale  # (B, T, m·d_t)
        return self.fc(aux)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids (B, T) -> the target's embeddings (B, T, d), without gradient."""
        with torch.no_grad():
            return self.embed_tokens(input_ids).to(self.fc.weight.dtype)

    def head(self, hidden_out: torch.Tensor) -> torch.Tensor:
        """hidden_out (B, T, d) -> draft-vocabulary logits (B, T, V_draft)."""
        return self.lm_head(self.norm(hidden_out))

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                cache: DraftCache | None = None, attention_mask: torch.Tensor | None = None,
                logits_to_keep: int = 0):
        """One draft pass.

        input_ids (B, T): x_{i+1} of each row; hidden (B, T, d): g_i or the draft's own
        previous ``hidden_out``; position_ids (B, T). With ``cache`` the new keys are appended
        and the rows attend to everything cached. ``attention_mask``: additive float
        (B, 1, T, past + T); None = causal over cache + new rows. ``logits_to_keep`` n > 0:
        logits of the last n rows only (the head is most of a pass's cost on a few rows).
        Returns (logits (B, T or n, V_draft), hidden_out (B, T, d)).
        """
        emb = self.embed(input_ids)  # (B, T, d)
        hidden = hidden.to(emb.dtype)
        cos, sin = self.rotary(emb, position_ids)  # (B, T, hd)
        q, k, v = self.midlayer.qkv(emb, hidden, cos, sin)
        past = 0
        if cache is not None:
            past = cache.length
            k, v = cache.append(k, v)  # (B, KVH, past + T, hd)
        t = q.shape[2]
        if attention_mask is None:
            mask = torch.ones(t, past + t, dtype=torch.bool, device=q.device).tril(past)  # (T, past + T)
        else:
            if attention_mask.shape[-2:] != (t, past + t):
                raise ValueError(f"attention_mask of shape {tuple(attention_mask.shape)} does not fit "
                                 f"{t} new rows over {past} cached positions: expected (B, 1, {t}, {past + t})")
            mask = attention_mask.to(q.dtype)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
        out = self.midlayer.finish(a, hidden)  # (B, T, d)
        return self.head(out[:, -logits_to_keep:] if logits_to_keep else out), out

    def unroll(self, g: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor, steps: int,
               pad_id: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Training-time test: ``steps`` draft passes on a whole sequence.

        g (B, T, d): fused features g_0..g_{T-1}; input_ids (B, T): x_1..x_T; position_ids (B, T).
        Step j (0-based) gives row i the token x_{i+1+j} (``input_ids`` shifted left by j,
        right-padded with ``pad_id``), the hidden output of step j-1 at row i (g_i at j = 0)
        and position i + j; row i then predicts x_{i+2+j}. Attention: ``ttt_attention``.
        Returns per step (logits (B, T, V_draft), hidden_out (B, T, d)); rows i >= T - j
        of step j see padding and must be masked by the caller.
        """
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        hidden = g
        emb_all = self.embed(input_ids)  # (B, T, d)
        pad = self.embed(torch.full_like(input_ids[:, :1], pad_id))  # (B, 1, d)
        k0 = v0 = None
        ks: list[torch.Tensor] = []
        vs: list[torch.Tensor] = []
        outs = []
        for j in range(steps):
            emb = torch.cat([emb_all[:, j:], pad.expand(-1, min(j, emb_all.shape[1]), -1)], dim=1)  # (B, T, d)
            cos, sin = self.rotary(emb, position_ids + j)
            q, k, v = self.midlayer.qkv(emb, hidden, cos, sin)
            if j == 0:
                k0, v0 = k, v
            else:
                ks.append(k)
                vs.append(v)
            a = ttt_attention(q, k0, v0, ks, vs)  # (B, H, T, hd)
            hidden = self.midlayer.finish(a, hidden)  # (B, T, d)
            outs.append((self.head(hidden), hidden))
        return outs

    # ---- persistence ----
    def state_for_save(self) -> dict[str, torch.Tensor]:
        """Tensors of ``model.safetensors``: EAGLE3 names, no embeddings, no rotary buffer; the
        per-layer norm weights as EAGLE-3.1's ``fc_norm.{i}.weight`` (d_t,) each."""
        if self.aux_scale is not None:
            raise ValueError("the draft still trains fc on rescaled inputs: call fold_aux_scale() before saving")
        out = {k: v.detach().contiguous() for k, v in self.state_dict().items() if k != "fc_norm"}
        if self.config.fc_norm:
            out.update({f"fc_norm.{i}.weight": w.detach().contiguous() for i, w in enumerate(self.fc_norm)})
        return out

    def save_pretrained(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_file(self.state_for_save(), str(path / WEIGHTS))
        (path / CONFIG).write_text(json.dumps(self.config.to_json(), indent=1))

    @classmethod
    def from_pretrained(cls, path: str | Path, embed_tokens: nn.Module, target_num_layers: int | None = None) -> Eagle3Draft:
        """Load elsi's draft directory, or another tool's EAGLE3 checkpoint (SpecForge, EAGLE,
        speculators: ``config.json`` + ``model.safetensors``) for a target of ``target_num_layers``
        layers whose token embeddings are ``embed_tokens``. Never unpickles."""
        path = Path(path)
        if not (path / CONFIG).is_file() or not (path / WEIGHTS).is_file():
            pickled = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
            extra = (f"; {pickled} are pickle files, which elsi does not load: convert them to safetensors"
                     if pickled and (path / CONFIG).is_file() else "")
            raise FileNotFoundError(f"{path} is not a draft directory (needs {CONFIG} and {WEIGHTS}){extra}")
        try:
            obj = json.loads((path / CONFIG).read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path / CONFIG} is not valid JSON ({err})") from None
        if stale_eagle_config(obj):
            warnings.warn(f"{path / CONFIG} was written by an older elsi: its eagle_config ids are in vLLM's "
                          "numbering, so SGLang and SpecForge would capture every layer one too deep; rewrite it "
                          f"with `elsi upgrade-draft --draft {path}`", stacklevel=2)
        width, vocab = int(embed_tokens.weight.shape[1]), int(embed_tokens.weight.shape[0])
        cfg = DraftConfig.from_json(obj, target_num_layers, width)
        if target_num_layers is not None:
            check_fits_target(cfg, target_num_layers, width, vocab, where=f"draft {path}")
        draft = cls(cfg, embed_tokens)
        device = next(embed_tokens.parameters()).device
        draft.load_state_dict(elsi_state_dict(load_file(str(path / WEIGHTS)), cfg, embed_tokens, path), strict=True)
        return draft.to(device)


def check_fits_target(cfg: DraftConfig, num_layers: int, hidden_size: int, vocab_size: int | None = None,
                      where: str = "the draft") -> None:
    """ValueError where a draft recorded for another target would be fed states it never saw."""
    bad = []
    if cfg.target_num_layers != num_layers:
        bad.append(f"{cfg.target_num_layers} layers (the model has {num_layers})")
    if cfg.target_hidden_size != hidden_size:
        bad.append(f"hidden size {cfg.target_hidden_size} (the model's is {hidden_size})")
    if vocab_size is not None and cfg.vocab_size != vocab_size:
        bad.append(f"vocabulary {cfg.vocab_size} (the model's is {vocab_size})")
    if bad:
        raise ValueError(f"{where} was trained for another target: it records {', '.join(bad)}; "
                         "train a draft for this model (elsi train-draft --model ...)")


def read_draft_config(path: str | Path, num_layers: int, hidden_size: int) -> DraftConfig:
    """The ``DraftConfig`` of a draft directory (elsi's or another tool's), without its weights."""
    path = Path(path)
    if not (path / CONFIG).is_file():
        raise FileNotFoundError(f"{path} is not a draft directory (no {CONFIG})")
    try:
        obj = json.loads((path / CONFIG).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path / CONFIG} is not valid JSON ({err})") from None
    return DraftConfig.from_json(obj, num_layers, hidden_size)


def elsi_state_dict(tensors: dict[str, torch.Tensor], cfg: DraftConfig, embed_tokens: nn.Module, path: Path) -> dict:
    """A checkpoint's tensors under elsi's names: foreign names mapped, ``fc_norm.{i}.weight`` stacked
    into (m, d_t), the draft's own copy of the token embeddings checked against the target's and dropped."""
    out: dict[str, torch.Tensor] = {}
    norms: dict[int, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.startswith("embed_tokens."):
            ref = embed_tokens.weight
            if t.shape != ref.shape or not torch.equal(t.to(ref.device, ref.dtype), ref.detach()):
                warnings.warn(f"{path / WEIGHTS} holds its own token embeddings, which differ from the target's; "
                              "elsi's engine uses the target's (as vLLM does where the draft has none)", stacklevel=3)
            continue
        new = foreign_weight_name(name)
        if new is None:
            continue
        if new.startswith("fc_norm.") and new.endswith(".weight"):
            norms[int(new.split(".")[1])] = t
        else:
            out[new] = t
    if norms:
        if sorted(norms) != list(range(cfg.num_aux)):
            raise ValueError(f"{path / WEIGHTS}: fc_norm weights for slots {sorted(norms)}, the draft reads "
                             f"{cfg.num_aux} layers")
        out["fc_norm"] = torch.stack([norms[i] for i in range(cfg.num_aux)])  # (m, d_t)
    if "t2d" not in out and "d2t" in out:  # some tools save only d2t: rebuild t2d from it
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[torch.arange(cfg.draft_vocab_size) + out["d2t"]] = True
        out["t2d"] = t2d
    if "d2t" not in out and cfg.draft_vocab_size == cfg.vocab_size:  # full vocabulary: identity maps
        out["d2t"] = torch.zeros(cfg.vocab_size, dtype=torch.long)
        out["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
    return out


def config_for_target(target, layer_ids: Sequence[int], draft_vocab_size: int | None = None,
                      fc_norm: bool = False) -> DraftConfig:
    """A DraftConfig shaped like one decoder layer of ``target`` (an ``elsi.models.Target``)."""
    tc = target.model.config.get_text_config()
    heads = int(tc.num_attention_heads)
    rope = getattr(tc, "rope_parameters", None) or {"rope_type": "default",
                                                    "rope_theta": float(getattr(tc, "rope_theta", 10000.0))}
    rope = dict(rope.get("full_attention", rope)) if isinstance(rope.get("full_attention"), dict) else dict(rope)
    vocab = int(target.adapter.embed_tokens(target.model).weight.shape[0])
    return DraftConfig(
        layer_ids=tuple(layer_ids),
        target_num_layers=target.num_layers,
        target_hidden_size=target.hidden_size,
        hidden_size=target.hidden_size,
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(tc, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(tc, "head_dim", None) or target.hidden_size // heads),
        intermediate_size=int(tc.intermediate_size),
        vocab_size=vocab,
        draft_vocab_size=vocab if draft_vocab_size is None else int(draft_vocab_size),
        rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6)),
        rope_parameters=rope,
        max_position_embeddings=int(getattr(tc, "max_position_embeddings", 8192)),
        fc_norm=fc_norm,
    )


def init_weights(draft: Eagle3Draft, generator: torch.Generator, std: float = 0.02) -> None:
    """Normal(0, std) linear weights, unit norm weights, drawn from ``generator`` (deterministic)."""
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight") or name == "fc_norm":
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * std)


def random_draft(target, layer_ids: Sequence[int], draft_vocab: int | Sequence[int] | None = None,
                 seed: int = 0) -> Eagle3Draft:
    """An untrained draft for ``target`` with random weights (tests, baselines).

    ``draft_vocab``: None = the full target vocabulary; an int k = target ids 0..k-1; a
    sequence = those target ids (sorted).
    """
    from elsi.draft.vocab import vocab_maps

    vocab = int(target.adapter.embed_tokens(target.model).weight.shape[0])
    if draft_vocab is None:
        ids = torch.arange(vocab)
    elif isinstance(draft_vocab, int):
        ids = torch.arange(draft_vocab)
    else:
        ids = torch.as_tensor(list(draft_vocab), dtype=torch.long)
    cfg = config_for_target(target, layer_ids, draft_vocab_size=len(ids))
    draft = Eagle3Draft(cfg, target.adapter.embed_tokens(target.model))
    init_weights(draft, torch.Generator().manual_seed(seed))
    d2t, t2d = vocab_maps(ids, vocab)
    draft.set_vocab(d2t, t2d)
    return draft.to(target.device)
