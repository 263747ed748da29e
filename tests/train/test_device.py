"""The trainer on one device: every tensor of a step where the policy is (checked on a simulated
second device), bf16 trained through fp32 master weights, fp16 refused, absent devices and
multi-process launches refused before anything is loaded, the dry run's device check and memory
estimate, ``gbmpo eval --device``."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from simulated_device import DEVICE, SimulatedDevice
from test_trainer import micro_config, varied_reward

from gbmpo.cli import main
from gbmpo.train import ConfigError, Trainer, dry_run, load_config
from gbmpo.train.policy import PolicyModels
from gbmpo.train.precision import MasterWeightOptimizer

# ----------------------------------------------------------------------------- device mixing


def test_simulated_device_catches_mixing():
    with SimulatedDevice():
        x = torch.ones(3).to(DEVICE)
        assert x.device == DEVICE and float((x * 2).sum()) == 6.0
        assert float((x * torch.tensor(2.0)).sum()) == 6.0  # 0-dim CPU tensors may mix
        with pytest.raises(RuntimeError, match="same device"):
            x + torch.ones(3)


@pytest.mark.parametrize(
    "extra",
    [
        {},  # on-policy: one mini-batch, rollout log-probs filled in by the update
        {"optim.mu": "2", "optim.mini_batch_size": "4", "optim.micro_batch_size": "2"},
    ],
    ids=["one-minibatch", "mu2-shuffled-micro"],
)
def test_step_keeps_every_tensor_on_the_policy_device(micro_model_dir, monkeypatch, extra):
    """A whole RL step with the policy's log-probs on another device than the CPU: the rollout,
    rewards, advantages, masks, row order and buffers must all follow them there."""
    cfg = micro_config(
        micro_model_dir, None, **{"objective.monitor_regularizers": "true", **extra}
    )
    trainer = Trainer(cfg, reward_fn=varied_reward)
    trainer.device = DEVICE  # where the policy lives, as the trainer sees it
    forward = PolicyModels.logprobs  # every log-prob forward of the step

    def logprobs_on_device(models, model, batch, *, with_entropy=False):
        logp, entropy = forward(models, model, batch, with_entropy=with_entropy)
        return logp.to(DEVICE), None if entropy is None else entropy.to(DEVICE)

    monkeypatch.setattr(PolicyModels, "logprobs", logprobs_on_device)
    before = [p.detach().clone() for p in trainer.params]
    with SimulatedDevice():
        record = trainer.train_step()
    assert math.isfinite(record["loss"]) and record["grad_norm"] > 0
    assert any(not torch.equal(a, p.detach()) for a, p in zip(before, trainer.params, strict=True))
    assert all(math.isfinite(v) for k, v in record.items() if k.startswith("reg/"))


# ----------------------------------------------------------------------------- precision


def test_master_weights_accumulate_updates_below_bf16_resolution():
    """w = 1 in bf16 (spacing 2^-7): an AdamW step of 1e-3 rounds back to 1 every time when
    applied to the bf16 weight, and accumulates through the fp32 master copy."""
    plain = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    mixed = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt_plain = torch.optim.AdamW([plain], lr=1e-3, weight_decay=0.0)
    opt_mixed = MasterWeightOptimizer(
        [mixed], lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.0)
    )
    for _ in range(50):
        for p, opt in ((plain, opt_plain), (mixed, opt_mixed)):
            opt.zero_grad()
            p.sum().backward()
            if opt is opt_mixed:
                opt.grads_to_masters()
            opt.step()
    assert torch.equal(plain, torch.ones(4, dtype=torch.bfloat16))  # the silent no-op
    assert opt_mixed.masters[0].dtype == torch.float32
    assert torch.allclose(opt_mixed.masters[0], torch.full((4,), 1 - 50e-3), atol=1e-4)
    assert torch.equal(mixed, opt_mixed.masters[0].to(torch.bfloat16))
    assert float(mixed.detach()[0]) < 0.96


def test_bf16_run_at_small_lr_changes_the_weights(micro_model_dir, tmp_path):
    cfg = micro_config(
        micro_model_dir, tmp_path / "run",
        **{"model.dtype": "bfloat16", "optim.lr": "1e-6", "run.steps": "2"},
    )
    trainer = Trainer(cfg, reward_fn=varied_reward)
    assert all(p.dtype == torch.bfloat16 for p in trainer.params)
    initial = [p.detach().float().clone() for p in trainer.params]
    summary = trainer.train()
    assert summary["dtype"] == "bfloat16" and summary["fp32_master_weights"] is True
    masters = trainer.optimizer.masters
    changed = sum(int((m.detach() != w).sum()) for m, w in zip(masters, initial, strict=True))
    total = sum(w.numel() for w in initial)
    assert changed / total > 0.9  # ~1e-6 steps, far below bf16's resolution, are all kept
    # a resumed run continues from the fp32 weights, not from their bf16 rounding
    state = torch.load(
        next((tmp_path / "run" / "checkpoints").iterdir()) / "optimizer.pt", weights_only=False
    )
    assert all(torch.equal(a, b) for a, b in zip(state["masters"], masters, strict=True))


def test_fp16_training_is_refused(micro_model_dir, tmp_path):
    cfg = micro_config(micro_model_dir, tmp_path / "run", **{"model.dtype": "float16"})
    with pytest.raises(ConfigError, match="float16"):
        Trainer(cfg)
    assert main(["train", "--model.dtype", "float16", "--output-dir", str(tmp_path / "r")]) == 2
    assert not (tmp_path / "r").exists()


# ----------------------------------------------------------------------------- devices


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_absent_device_stops_at_once(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--model.device", "cuda", "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert "'cuda'" in err and "no cuda device" in err and err.count("\n") == 1
    assert not out.exists()


@pytest.mark.parametrize("var", ["WORLD_SIZE", "LOCAL_WORLD_SIZE"])
def test_multi_process_launch_is_refused(tmp_path, capsys, monkeypatch, var):
    monkeypatch.setenv(var, "2")
    out = tmp_path / "run"
    assert main(["train", "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert "torchrun" in err and "TRL" in err and "verl" in err
    assert not out.exists()


def test_one_process_launch_is_accepted(micro_model_dir, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    Trainer(micro_config(micro_model_dir, None), reward_fn=varied_reward)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_dry_run_of_a_cuda_config_warns_and_estimates_memory(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--dry-run", "--model.device", "cuda", "--output-dir", str(out)]) == 0
    captured = capsys.readouterr()
    assert "warning: model.device 'cuda': no cuda device" in captured.err
    assert "memory estimate" in captured.out
    info = json.loads(captured.out.split("dry run OK: ", 1)[1])
    assert info["device_available"] is False
    memory = info["memory"]
    # the embedded model: 1.86M float32 parameters, trained in full with a frozen reference
    assert memory["weights"] == memory["reference"] == memory["gradients"] == 4 * memory[
        "parameters"
    ]
    assert memory["optimizer"] == 8 * memory["parameters"] and memory["kv_cache"] > 0
    assert memory["fits_one_device"] is True
    assert not out.exists()


def test_dry_run_names_the_engines_when_a_run_does_not_fit(tmp_path, capsys):
    """A Qwen3-4B-shaped config.json (the tiny tokenizer beside it) with a rollout of 64 x 128
    sequences: the KV cache alone is far beyond one device."""
    from gbmpo.models import resolve_model_path

    model = tmp_path / "qwen3-4b-shape"
    shutil.copytree(resolve_model_path("tiny"), model)
    config = json.loads((model / "config.json").read_text())
    config.pop("layer_types", None)
    config.update(
        hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        tie_word_embeddings=True,
    )
    (model / "config.json").write_text(json.dumps(config))
    cfg = load_config(None, [
        ("model.path", str(model)), ("model.dtype", "bfloat16"), ("model.device", "cuda"),
        ("rollout.prompts_per_step", "64"), ("rollout.num_generations", "128"),
        ("rollout.max_new_tokens", "1024"),
    ])
    info = dry_run(cfg)
    memory = info["memory"]
    assert 4.0e9 < memory["parameters"] < 4.1e9  # Qwen3-4B: 4.02B with tied embeddings
    assert memory["optimizer"] == 12 * memory["parameters"]  # AdamW moments + fp32 masters
    # 2 (K, V) x 36 layers x 8 heads x 128 dims x 2 bytes per token
    tokens = 64 * 128 * (memory["kv_cache"] // (64 * 128 * 2 * 36 * 8 * 128 * 2))
    assert memory["kv_cache"] == 2 * 36 * 8 * 128 * 2 * tokens and tokens > 1024
    assert memory["fits_one_device"] is False
    assert any("--engine trl" in w and "verl" in w for w in info["warnings"])


def test_paper_config_dry_runs_without_its_model(capsys, monkeypatch):
    """A hub model that is not here: the data and objectives are still checked, memory is
    reported as unknown, and the device warning is given."""
    paper = Path(__file__).resolve().parents[2] / "configs" / "paper"
    cfg = load_config(str(paper / "gbmpo-qwen3-1.7b-gsm8k-probl2.yaml"), [
        ("model.path", "no-such-org/no-such-model"), ("task.name", "arithmetic"),
    ])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    info = dry_run(cfg)
    assert info["memory"] is None and info["train_examples"] > 0
    assert any("no-such-org/no-such-model" in w for w in info["warnings"])
    if not torch.cuda.is_available():
        assert any("no cuda device" in w for w in info["warnings"])


# ----------------------------------------------------------------------------- eval --device


def test_eval_takes_a_device(capsys):
    assert main(["eval", "--task", "arithmetic", "--limit", "2", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    summary = json.loads(out[: out.rindex("}") + 1])
    assert summary["config"]["device"] == "cpu" and summary["metrics"]["n"] == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_eval_on_an_absent_device_is_refused(capsys):
    assert main(["eval", "--task", "arithmetic", "--device", "cuda"]) == 2
    assert "no cuda device" in capsys.readouterr().err
