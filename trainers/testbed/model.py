"""The testbed model: a tiny Qwen3-style causal LM built from config (no download).

2 layers, hidden 128, 4 heads, a character vocabulary: ~0.3M parameters, small enough that GRPO on
Voting runs a step in ~0.1–0.2 s on 2 CPU cores, and the same architecture family as the paper's
Qwen3 checkpoints, so peft targets and chat-free templates work the same way.
"""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, Qwen3Config

from gradscope.trainers.testbed.tokenizer import build_tokenizer


def testbed_config(vocab_size: int, hidden: int = 128, layers: int = 2, heads: int = 4,
                   kv_heads: int = 2, intermediate: int = 256, max_positions: int = 256) -> Qwen3Config:
    tok = build_tokenizer()
    return Qwen3Config(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       head_dim=hidden // heads, max_position_embeddings=max_positions,
                       tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)


def build_testbed_model(seed: int = 0, **sizes: int) -> PreTrainedModel:
    """A freshly initialised testbed model (fp32), deterministic for ``seed``."""
    torch.manual_seed(seed)
    config = testbed_config(len(build_tokenizer()), **sizes)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
