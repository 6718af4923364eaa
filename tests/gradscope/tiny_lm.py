"""A tiny Hugging Face causal LM with LoRA adapters, built from config (no download), for probe tests."""
from __future__ import annotations

import warnings

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, Qwen3Config

VOCAB = 50


def tiny_lora_lm(adapters: list[str], seed: int = 0, dtype: torch.dtype = torch.float32):
    """A 2-layer Qwen3-style LM (hidden 32) with one LoRA adapter per name, B not zero-initialised.

    Random (not zero) LoRA B matters: with B = 0 every lora_A gradient is 0 and a test would only
    check half of the parameters.
    """
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         max_position_embeddings=64, tie_word_embeddings=False)
    base = AutoModelForCausalLM.from_config(config).to(dtype)
    lora = dict(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False, lora_dropout=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(base, LoraConfig(**lora), adapter_name=adapters[0])
        for name in adapters[1:]:
            model.add_adapter(name, LoraConfig(**lora))
    model.eval()  # no dropout: probed and reference passes must see the same function
    return model


def batch(n_seq: int, length: int, seed: int, pad_left: int = 0):
    """Random token ids (n_seq, length) with ``pad_left`` leading pad positions masked out."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n_seq, length), generator=g)
    mask = torch.ones(n_seq, length, dtype=torch.long)
    if pad_left:
        ids[: n_seq // 2, :pad_left] = 0
        mask[: n_seq // 2, :pad_left] = 0
    return ids, mask


def token_logprobs(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T-1) log-probability of each next token; 0 where the target is padding."""
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    lp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    return lp * mask[:, 1:]
