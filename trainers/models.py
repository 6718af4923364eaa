"""Loading the base model and attaching one LoRA adapter per policy.

``testbed`` is the built-in tiny model (warm-started, cached); anything else is a local Hugging
Face causal-LM folder, loaded with ``local_files_only`` so nothing is ever downloaded.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from gradscope.errors import ConfigError
from gradscope.peft_support import adapter_parameters

if TYPE_CHECKING:
    from peft import PeftModel

TESTBED = "testbed"


@dataclass(frozen=True)
class LoraSpec:
    """LoRA on all linear layers: the paper's r64/α32 for real models, r8/α16 for the testbed."""

    rank: int
    alpha: float
    dropout: float = 0.0

    @classmethod
    def default_for(cls, model: str) -> "LoraSpec":
        return cls(8, 16.0) if model == TESTBED else cls(64, 32.0)


def check_model_path(model: str) -> None:
    """Fail early (exit 2) on a model path that cannot be a local checkpoint."""
    if model != TESTBED and not (Path(model) / "config.json").is_file():
        raise ConfigError(f"--model {model!r}: not a local Hugging Face model folder (no config.json); "
                          f"use a path or 'testbed'")


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def device_and_dtype(model: str = "", dtype: str = "auto") -> tuple[torch.device, torch.dtype]:
    """The device (CUDA when available) and the weights' dtype: ``auto`` is bf16 for a real model on
    CUDA and fp32 otherwise (the testbed is trained in fp32 unless told ``bf16``)."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda") if cuda else torch.device("cpu")
    if dtype != "auto":
        return device, DTYPES[dtype]
    return device, torch.bfloat16 if cuda and model != TESTBED else torch.float32


def load_base(model: str, seed: int, verbose: bool = False, scale: str = "0.3M", dtype: str = "auto"):
    """(base model, tokenizer, template style) for ``model`` ('testbed' at ``scale``, or a local path)."""
    check_model_path(model)
    device, dtype = device_and_dtype(model, dtype)
    if model == TESTBED:
        from gradscope.trainers.testbed.cache import warm_started_model
        from gradscope.trainers.testbed.tokenizer import build_tokenizer
        from gradscope.trainers.testbed.scales import SCALES

        base = warm_started_model(SCALES[scale], verbose=verbose).to(device=device, dtype=dtype)
        return base, build_tokenizer(), "testbed"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(model, padding_side="left", local_files_only=True)
        base = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, local_files_only=True).to(device)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--model {model!r}: cannot load ({str(exc).splitlines()[0]})") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return base, tok, "chat" if tok.chat_template else "testbed"


def attach_adapters(base, adapters: list[str], spec: LoraSpec, seed: int) -> PeftModel:
    """One LoRA adapter per name on all linear layers, every adapter trainable."""
    from peft import LoraConfig, get_peft_model  # peft pulls in transformers (~3 s): not for a bad flag

    torch.manual_seed(seed)
    config = dict(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules="all-linear")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft warns about the tied embedding, which stays frozen
        model = get_peft_model(base, LoraConfig(**config), adapter_name=adapters[0])
        for name in adapters[1:]:
            model.add_adapter(name, LoraConfig(**config))
    for params in adapter_parameters(model).values():
        for _, p in params:
            p.requires_grad_(True)
    return model
