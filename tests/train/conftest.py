"""Fixtures for trainer tests: a micro Qwen3 (random weights, ~0.1M parameters) with a small
byte-level BPE tokenizer trained on arithmetic problems, saved like a real checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def build_micro_model(directory: Path, *, seed: int = 0, hidden: int = 32, layers: int = 1) -> Path:
    """Save a randomly initialised micro Qwen3 and its tokenizer into ``directory``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    from gbmpo.tasks.arithmetic import generate_problems

    texts = [ex["prompt"] + ex["solution"] for ex in generate_problems(300, "micro-tokenizer")]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=160,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.padding_side = "left"
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=len(fast),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=2 * hidden,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
    )
    model = Qwen3ForCausalLM(config)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    fast.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def micro_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_micro_model(tmp_path_factory.mktemp("micro") / "model")


@pytest.fixture(scope="session")
def micro_model(micro_model_dir: Path):  # noqa: ANN201 - (model, tokenizer)
    from gbmpo.models import load_model_and_tokenizer

    return load_model_and_tokenizer(str(micro_model_dir))
