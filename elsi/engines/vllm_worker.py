"""Runs inside vLLM's own virtual environment (``make vllm``), started by ``elsi.engines.vllm``.

It imports nothing from elsi (vLLM pins its own torch/transformers) but ``vllm_models`` beside it
(the target classes elsi adds to vLLM: EAGLE-3 for Gemma-3), by path: one process holds one
``vllm.LLM`` (plain, or EAGLE3 with ``num_speculative_tokens`` k) and answers requests, one JSON
object per line on stdin, with one JSON line each on the protocol stream (the original stdout;
everything vLLM prints goes to stderr).

Requests:
- ``{"op": "generate", "prompt_token_ids": [...], "max_tokens": n}`` -> ``{"token_ids", "time_s",
  "spec": {"drafts", "draft_tokens", "accepted_tokens", "accepted_per_pos"}}`` (the request's share
  of vLLM's own speculative-decoding counters; zeros without a draft); greedy (temperature 0).
- ``{"op": "capture", "prompt_token_ids": [...]}`` -> ``{"layer_ids", "states"}``: the target's
  auxiliary hidden states vLLM hands the draft during the prefill of that prompt, (T, d) per id
  as nested lists, and the ids vLLM's target model was told to capture.
- ``{"op": "draft_embed", "prompt_token_ids": [...]}`` -> ``{"states"}``: the token embeddings the draft
  reads for those ids, (T, d) as nested lists (the target's module, shared, for an elsi draft).
- ``{"op": "draft_params"}`` -> ``{name: [shape, sum, sum of squares]}`` of the draft vLLM loaded
  (tensors the CPU backend repacked report shape [0] and are left out).
- ``{"op": "quit"}``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path


def register_models() -> None:
    """``vllm_models.register()``: elsi's target classes, in this process's vLLM registry."""
    spec = importlib.util.spec_from_file_location("elsi_vllm_models", Path(__file__).with_name("vllm_models.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    module.register()


def _counters(llm) -> dict:
    """vLLM's cumulative speculative-decoding counters (``LLM.get_metrics``)."""
    out = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "accepted_per_pos": []}
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}
    for m in llm.get_metrics():
        if m.name in names:
            out[names[m.name]] = int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["accepted_per_pos"] = [int(v) for v in m.values]
    return out


def _delta(after: dict, before: dict) -> dict:
    per = [a - (before["accepted_per_pos"][i] if i < len(before["accepted_per_pos"]) else 0)
           for i, a in enumerate(after["accepted_per_pos"])]
    return {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted_tokens")} | {"accepted_per_pos": per}


def _target_model(llm):
    """The target's ``nn.Module`` inside this process (V1 engine core in-process)."""
    found = []
    llm.apply_model(lambda model: found.append(model))
    return found[0]


def _capture(llm, ids: list[int]) -> dict:
    from vllm import SamplingParams

    model = _target_model(llm)
    inner = model.model  # e.g. LlamaModel: forward returns (hidden, aux list) when aux layers are set
    layer_ids = sorted(int(i) for i in getattr(inner, "aux_hidden_state_layers", ()))
    grabbed = []

    original = inner.forward

    def forward(*args, **kwargs):  # wraps the instance's forward: vLLM's compile wrapper bypasses module hooks
        output = original(*args, **kwargs)
        if isinstance(output, tuple) and len(output) == 2 and isinstance(output[1], list) and not grabbed:
            grabbed.append([t.detach().float().cpu() for t in output[1]])
        return output

    inner.forward = forward
    try:
        llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    finally:
        del inner.forward
    states = [t[: len(ids)].tolist() for t in grabbed[0]] if grabbed else []
    return {"layer_ids": layer_ids, "states": states}


def _draft_model(worker):
    """The draft's ``nn.Module`` on one of vLLM's workers (as ``collective_rpc`` hands it)."""
    return getattr(worker, "worker", worker).model_runner.drafter.model


def _draft_embed(llm, ids: list[int]) -> dict:
    import torch

    def embed(worker) -> list:
        model = _draft_model(worker)
        with torch.no_grad():
            return model.embed_input_ids(torch.tensor(ids)).float().cpu().tolist()

    return {"states": llm.collective_rpc(embed)[0]}


def _draft_params(llm) -> dict:
    def stats(worker) -> dict:
        model = _draft_model(worker)
        return {n: [list(p.shape), float(p.double().sum()), float(p.double().pow(2).sum())]
                for n, p in model.named_parameters() if p.numel() > 0 and "embed_tokens" not in n}

    return llm.collective_rpc(stats)[0]


def main() -> int:
    job = json.loads(sys.argv[1])
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM's own output goes to stderr
    sys.stdout = sys.stderr
    from vllm import LLM, SamplingParams

    register_models()  # the engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): it sees them
    kwargs = dict(model=job["model"], tokenizer=job["model"], dtype=job.get("dtype", "float32"),
                  enforce_eager=True, max_model_len=int(job.get("max_model_len", 4096)), seed=0,
                  disable_log_stats=False, max_num_seqs=1, enable_prefix_caching=False)
    if job.get("draft"):
        kwargs["speculative_config"] = {"method": "eagle3", "model": job["draft"],
                                        "num_speculative_tokens": int(job["k"])}
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    proto.write(json.dumps({"ready": True, "load_s": time.perf_counter() - t0}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "quit":
            break
        if req["op"] == "draft_params":
            proto.write(json.dumps(_draft_params(llm)) + "\n")
            continue
        if req["op"] == "draft_embed":
            proto.write(json.dumps(_draft_embed(llm, req["prompt_token_ids"])) + "\n")
            continue
        if req["op"] == "capture":
            proto.write(json.dumps(_capture(llm, req["prompt_token_ids"])) + "\n")
            continue
        params = SamplingParams(max_tokens=int(req["max_tokens"]), temperature=0.0,
                                stop_token_ids=req.get("stop_token_ids") or None, ignore_eos=False)
        before = _counters(llm)
        t = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": req["prompt_token_ids"]}], params, use_tqdm=False)
        dt = time.perf_counter() - t
        proto.write(json.dumps({"token_ids": list(out[0].outputs[0].token_ids), "time_s": dt,
                                "spec": _delta(_counters(llm), before)}) + "\n")
    return 0


if __name__ == "__main__":  # vLLM spawns processes: the guard is required
    sys.exit(main())
