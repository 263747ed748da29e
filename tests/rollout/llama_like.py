"""Tiny random Qwen3 / Qwen2 / Llama models for the lean decoder and lean forward tests."""

from __future__ import annotations

import torch
import transformers

SMALL = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             intermediate_size=48, max_position_embeddings=128)
KINDS = ("qwen3", "qwen2", "llama")


def tiny_llama_like(kind: str, dtype: torch.dtype) -> torch.nn.Module:
    """A seeded model of ``kind`` in ``dtype`` (mode left to the caller)."""
    torch.manual_seed(0)
    if kind == "qwen3":  # per-head q/k norms, explicit head_dim, GQA 4:2, tied head
        cfg = transformers.Qwen3Config(**SMALL, num_key_value_heads=2, head_dim=16,
                                       tie_word_embeddings=True)
        model = transformers.Qwen3ForCausalLM(cfg)
    elif kind == "qwen2":  # q/k/v biases, no q/k norm, no GQA
        cfg = transformers.Qwen2Config(**SMALL, num_key_value_heads=4)
        model = transformers.Qwen2ForCausalLM(cfg)
    elif kind == "llama":  # GQA 4:1, llama3 rope scaling, untied head
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16}
        cfg = transformers.LlamaConfig(**SMALL, num_key_value_heads=1, rope_parameters=rope,
                                       tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        raise AssertionError(kind)
    # random norm weights and biases, so that a norm or bias applied wrongly shows
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return model.to(dtype)


def padded_prompts(rows: int = 3, width: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded prompt ids and their attention mask, rows 0 and 2 left-padded by 3 and 1."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, SMALL["vocab_size"], (rows, width), generator=g)
    mask = torch.ones(rows, width, dtype=torch.long)
    mask[0, :3] = 0  # left padding of different lengths
    mask[2, :1] = 0
    return ids, mask
