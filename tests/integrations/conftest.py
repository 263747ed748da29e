"""Fixtures for the TRL integration tests: a ~0.15M-parameter random Qwen3 with a locally trained
byte-level BPE tokenizer, saved to a temporary directory (no hub access), and a tiny dataset."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _build_tiny_model(path: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    texts = [f"What is {a} + {b}? The answer is {a + b}." for a in range(25) for b in range(25)]
    tok.train_from_iterator(texts, trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.padding_side = "left"
    config = Qwen3Config(
        vocab_size=len(hf_tok),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=256,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=hf_tok.eos_token_id,
        pad_token_id=hf_tok.pad_token_id,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    model.save_pretrained(path)
    hf_tok.save_pretrained(path)


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Any:
    """The tiny model runs faster on one thread, and the machine's 2 cores are shared."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tiny-qwen3")
    _build_tiny_model(path)
    return str(path)


@pytest.fixture
def cpu_args() -> dict[str, Any]:
    """The trainer settings every TRL run here shares: fp32 on CPU, no gradient checkpointing,
    nothing saved or reported, one batch of 4 completions (one prompt group of 4), seed 0."""
    return {
        "use_cpu": True,
        "bf16": False,
        "fp16": False,
        "gradient_checkpointing": False,
        "report_to": "none",
        "save_strategy": "no",
        "per_device_train_batch_size": 4,
        "num_generations": 4,
        "disable_tqdm": True,
        "seed": 0,
    }


@pytest.fixture(scope="session")
def tiny_dataset() -> Any:
    from datasets import Dataset

    rows = [
        {"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)}
        for a in range(4)
        for b in range(4)
    ]
    return Dataset.from_list(rows)


def digit_reward(completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
    """A reward with spread on a random model: 1 for the right answer, else digit density."""
    out = []
    for c, a in zip(completions, answer, strict=True):
        text = c[0]["content"] if isinstance(c, list) else c
        digits = sum(ch.isdigit() for ch in text)
        out.append(1.0 if a in text else digits / max(1, len(text)))
    return out


@pytest.fixture(scope="session")
def reward_fn() -> Any:
    return digit_reward
