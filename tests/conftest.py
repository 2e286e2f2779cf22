"""Shared fixtures: a tiny random Llama target with a real (small) tokenizer, and runs of it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

WORDS = (
    "the cat sat on a mat while dogs ran far away and birds sang over green hills near old towns "
    "people write code to test models that predict next tokens from long text with many words"
).split()


def make_tokenizer():
    """A byte-level BPE tokenizer trained in memory, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(WORDS)] * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = (
        "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return fast


def make_tiny_target(num_layers: int = 8, hidden: int = 32, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    from elsi.models import Target, adapter_for

    tok = make_tokenizer()
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    return Target("tiny", "memory", model, tok, adapter_for(model), num_layers, hidden)


def write_text_jsonl(path: Path, n: int = 8, words: int = 120, seed: int = 0) -> Path:
    g = torch.Generator().manual_seed(seed)
    with path.open("w") as f:
        for i in range(n):
            idx = torch.randint(len(WORDS), (words + 7 * i,), generator=g).tolist()
            f.write(json.dumps({"id": f"s{i}", "text": " ".join(WORDS[j] for j in idx)}) + "\n")
    return path


@pytest.fixture(scope="session")
def tiny_target():
    return make_tiny_target()


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    return write_text_jsonl(tmp_path_factory.mktemp("data") / "text.jsonl")


@pytest.fixture(scope="session")
def tiny_run(tiny_target, tiny_data, tmp_path_factory) -> Path:
    """A finished run of the tiny 8-layer target (blocks of 8 tokens)."""
    from elsi.collect.collector import CollectConfig, collect
    from elsi.data import load_dataset
    from elsi.stats.analysis import AnalysisConfig, analyze_run

    run_dir = tmp_path_factory.mktemp("run") / "tiny"
    cfg = CollectConfig(model="tiny", data=str(tiny_data), samples=6, max_tokens=128, block=8, rho=0.3)
    collect(tiny_target, load_dataset(str(tiny_data)), cfg, run_dir)
    analyze_run(run_dir, AnalysisConfig())
    return run_dir


def make_tiny_gemma3(num_layers: int = 4, hidden: int = 32, seed: int = 0):
    """A tiny random Gemma-3 text model (sliding and full attention layers)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from elsi.models import Target, adapter_for

    tok = make_tokenizer()
    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                           num_hidden_layers=num_layers, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=16, sliding_window=16, max_position_embeddings=1024,
                           layer_types=["sliding_attention"] * (num_layers - 1) + ["full_attention"],
                           bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = Gemma3ForCausalLM(cfg).eval()
    return Target("tiny-gemma3", "memory", model, tok, adapter_for(model), num_layers, hidden)
