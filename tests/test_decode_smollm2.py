"""Speculative decoding on the real SmolLM2-135M equals transformers' greedy ``generate``."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.mark.slow
def test_smollm2_speculative_equals_generate():
    from elsi.decode import (DecodeConfig, EagleDrafter, LMDrafter, TargetRunner, TreeConfig, generate,
                             load_drafter, stop_tokens)
    from elsi.models import load_target
    from elsi.specbench import encode_chat

    t = load_target("smollm2-135m")
    r = TargetRunner.from_target(t)
    eos = stop_tokens(t.model, t.tokenizer)
    ids = encode_chat(t.tokenizer, [("user", "Name three primary colors and explain what makes them primary.")])
    x = torch.tensor([ids])
    with torch.inference_mode():
        hf = t.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=16, do_sample=False,
                              eos_token_id=sorted(eos), pad_token_id=min(eos))[0, len(ids):].tolist()
    cfg = DecodeConfig(max_new_tokens=16)
    assert generate(r, ids, cfg, eos_ids=eos).tokens == hf
    drafters = {"perfect": LMDrafter(r), "random": load_drafter("random", t)[0]}
    trained = os.environ.get("ELSI_TEST_DRAFT")  # a trained draft directory, when there is one
    if trained:
        drafters["trained"] = load_drafter(trained, t)[0]
    for name, d in drafters.items():
        g = generate(r, ids, cfg, d, TreeConfig(30, 6, 8), eos)
        assert g.tokens == hf, name
        if name == "perfect":
            assert g.tau > 4
        assert isinstance(d, (LMDrafter, EagleDrafter))
