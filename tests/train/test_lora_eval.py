"""A LoRA run's ``RUN/model`` is a peft adapter directory: it loads as the base model with the
adapter merged in (same outputs as the trained adapter model), also when it was trained on top of
another LoRA run, and ``gbmpo eval --model RUN/model`` works on it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_trainer import micro_config, varied_reward

from gbmpo.models import (
    ADAPTER_CONFIG,
    TINY_MODEL_PATH,
    adapter_base,
    load_model_and_tokenizer,
    resolve_model_path,
)
from gbmpo.train import Trainer

pytest.importorskip("peft")

REPO = Path(__file__).resolve().parents[2]
LORA = {"lora.enabled": "true", "lora.target_modules": "q_proj,v_proj,up_proj", "optim.lr": "3e-2"}


def _logits(model, tokenizer) -> torch.Tensor:
    ids = tokenizer(["Q: Anna has 3 eggs and 4 more.\nA:"], return_tensors="pt").input_ids
    with torch.no_grad():
        return model(input_ids=ids).logits.double()


def _train_lora(base: Path | str, out: Path) -> Trainer:
    trainer = Trainer(micro_config(Path(base), out, **LORA), reward_fn=varied_reward)
    trainer.train()
    trainer.model.eval()
    return trainer


def test_lora_run_model_loads_as_merged_weights(micro_model_dir, tmp_path):
    trainer = _train_lora(micro_model_dir, tmp_path / "run")
    exported = tmp_path / "run" / "model"
    assert (exported / ADAPTER_CONFIG).is_file() and not (exported / "config.json").exists()
    assert resolve_model_path(exported) == str(micro_model_dir)
    model, tokenizer = load_model_and_tokenizer(str(exported))
    assert not any("lora_" in name for name, _ in model.named_parameters())
    trained = _logits(trainer.model, trainer.tokenizer)
    base, _ = load_model_and_tokenizer(str(micro_model_dir))
    assert not torch.allclose(_logits(base, tokenizer), trained), "the adapter must matter"
    torch.testing.assert_close(_logits(model, tokenizer), trained, atol=1e-5, rtol=1e-5)


def test_lora_run_on_a_lora_run_stacks_both_adapters(micro_model_dir, tmp_path):
    _train_lora(micro_model_dir, tmp_path / "first")
    first = tmp_path / "first" / "model"
    second = _train_lora(first, tmp_path / "second")
    exported = tmp_path / "second" / "model"
    assert adapter_base(exported) == str(first)
    assert resolve_model_path(exported) == str(micro_model_dir)
    model, tokenizer = load_model_and_tokenizer(exported)
    torch.testing.assert_close(
        _logits(model, tokenizer), _logits(second.model, second.tokenizer), atol=1e-5, rtol=1e-5
    )


def _adapter_dir(tmp_path: Path, base: object, name: str = "adapter") -> Path:
    directory = tmp_path / name
    directory.mkdir()
    config = {"peft_type": "LORA"} if base is None else {"base_model_name_or_path": base}
    (directory / ADAPTER_CONFIG).write_text(json.dumps(config))
    return directory


def test_adapter_base_of_a_moved_embedded_model_is_this_installs(tmp_path):
    gone = "/no/such/env/lib/python3.11/site-packages/gbmpo/assets/tiny-qwen3"
    assert adapter_base(_adapter_dir(tmp_path, gone)) == str(TINY_MODEL_PATH)
    # other bases are kept as recorded (an existing directory, a hub id, a missing path)
    kept = [str(TINY_MODEL_PATH), "Qwen/Qwen3-0.6B", "/no/such/model"]
    for i, base in enumerate(kept):
        assert adapter_base(_adapter_dir(tmp_path, base, f"a{i}")) == base


@pytest.mark.parametrize(
    ("base", "needle"),
    [(None, "names no base model"), ("", "names no base model"), ("/no/such/model", "/no/such")],
)
def test_bad_adapter_dirs_raise_file_not_found(tmp_path, base, needle):
    directory = _adapter_dir(tmp_path, base)
    with pytest.raises(FileNotFoundError, match=needle):
        load_model_and_tokenizer(directory)


def test_an_adapter_naming_itself_is_refused(tmp_path):
    directory = tmp_path / "loop"
    directory.mkdir()
    (directory / ADAPTER_CONFIG).write_text(json.dumps({"base_model_name_or_path": str(directory)}))
    with pytest.raises(FileNotFoundError, match="stacked"):
        resolve_model_path(directory)


@pytest.mark.slow
def test_cli_eval_of_a_tiny_lora_run(tmp_path, capsys):
    from gbmpo.cli import main

    run = tmp_path / "run"
    code = main(
        [
            "train", "--config", str(REPO / "configs" / "tiny-lora.yaml"), "--steps", "2",
            "--output-dir", str(run), "--eval.before", "false", "--eval.after", "false",
            "--eval-every", "0", "--run.progress", "false",
        ]
    )
    assert code == 0
    assert (run / "model" / ADAPTER_CONFIG).is_file()
    capsys.readouterr()
    out = tmp_path / "eval.jsonl"
    code = main(
        ["eval", "--model", str(run / "model"), "--task", "arithmetic", "--limit", "5",
         "--output", str(out)]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "accuracy" in captured.out
    assert len(out.read_text().splitlines()) == 5
    # a LoRA run's model is also a valid starting point for a new run
    assert main(["train", "--dry-run", "--model", str(run / "model")]) == 0
