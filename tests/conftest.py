"""Fixtures shared by the whole suite.

``micro_model_dir`` / ``micro_model``: a micro Qwen3 (random weights, ~0.1M parameters) with a
small byte-level BPE tokenizer trained on arithmetic problems, saved like a real checkpoint
(trainer, rollout and CLI tests). ``sandbox``: one fully protected code sandbox per test session
(sandbox and code-reward tests).

``data_mode`` runs a test twice: with the data sets as this checkout has them (``packed``:
GSM8K/MBPP packed into the package at install, where the install found them) and as a user's
own clone has them (``hidden``: no package data, no ``GBMPO_DATA_DIR``, no hub), so CI, which
has the data, still proves what a user without it gets.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from gbmpo.sandbox import Sandbox


@pytest.fixture(params=["packed", "hidden"])
def data_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
              tmp_path: Path) -> str:  # fmt: skip
    """``packed``: this checkout's data; ``hidden``: a user's clone (no data anywhere)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    if request.param == "hidden":
        from gbmpo.tasks import _common

        monkeypatch.delenv(_common.DATA_DIR_ENV, raising=False)
        monkeypatch.setenv(_common.HUB_ENV, "0")
        monkeypatch.setattr(_common, "package_data_dir", lambda: tmp_path / "no-package-data")
    return str(request.param)


def build_micro_model(directory: Path, *, seed: int = 0, hidden: int = 32, layers: int = 1) -> Path:
    """Save a randomly initialised micro Qwen3 and its tokenizer into ``directory``."""
    import torch
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


@pytest.fixture(scope="session")
def sandbox() -> Iterator[Sandbox]:
    """A strict 2-worker sandbox; skips when this machine lacks a protection layer."""
    from gbmpo.sandbox import Sandbox, SandboxError, SandboxUnavailableError

    try:
        box = Sandbox(workers=2, strict=True, timeout_s=5.0)
    except SandboxUnavailableError as exc:
        pytest.skip(f"full sandbox unavailable here: {exc}")
    except SandboxError as exc:  # e.g. no /usr/bin/python3
        pytest.skip(f"sandbox cannot start here: {exc}")
    yield box
    box.close()
