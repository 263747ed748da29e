"""The TRL column of the support matrix: every honoured key with a probe changes what the config
becomes on TRL, every refused value stops before anything is written (exit 2, naming the key,
the value and the engine), and the engine's own parts (schedule, weight decay, metric names)
follow the own engine."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl")

from gbmpo.cli import main  # noqa: E402
from gbmpo.config import ConfigError, load_config  # noqa: E402
from gbmpo.config.support import HONOURED, NO_EFFECT, REFUSED, TRL, check_support  # noqa: E402
from gbmpo.engines.trl import args as trl_args
from gbmpo.engines.trl import callbacks as trl_callbacks  # noqa: E402

#: settings a probe needs beside it (the same for the default and the probe)
_COMPANIONS: dict[str, list[tuple[str, Any]]] = {
    "objective.regularizer.params": [("objective.regularizer.name", "kl_k3")],
    **{f"lora.{k}": [("lora.enabled", True)] for k in ("r", "alpha", "dropout", "target_modules")},
    **{f"objective.rollout_correction.{k}": [("rollout.generator", "vllm"),
                                             ("objective.rollout_correction.mode", "tis")]
       for k in ("level", "low", "high")},
}


def _cfg(*overrides: tuple[str, Any]) -> Any:
    return load_config(None, [("engine", "trl"), *overrides])


@pytest.mark.parametrize(
    "key", [k for k, s in TRL.items() if s.status == HONOURED and s.probe is not None]
)
def test_every_honoured_probe_changes_what_trl_runs(key: str) -> None:
    if key == "run.report_to" and importlib.util.find_spec("tensorboard") is None:
        pytest.skip("tensorboard is not installed")
    base = _COMPANIONS.get(key, [])
    default = trl_args.host_settings(_cfg(*base))
    probed_cfg = _cfg(*base, (key, TRL[key].probe))
    assert check_support(probed_cfg, "trl") == []
    assert trl_args.host_settings(probed_cfg) != default, f"{key} changes nothing on TRL"


#: one row per key of TRL's table that sets GRPOConfig fields: key -> (a value, the fields it
#: gives). The defaults: 8 prompts x 8 generations = 64 sequences, mini-batch 16, one process,
#: so micro-batch 16 and 64 / 16 = 4 optimizer steps (and micro-steps) per RL step.
GRPO_FIELD_ROWS: dict[str, tuple[Any, dict[str, Any]]] = {
    "model.dtype": ("bfloat16", {"bf16": True}),
    "model.device": ("cpu", {"use_cpu": True}),
    "model.trust_remote_code": (True, {"trust_remote_code": True}),
    "rollout.prompts_per_step": (4, {"steps_per_generation": 2}),  # 32 sequences / 16
    "rollout.num_generations": (4, {"num_generations": 4}),
    "rollout.max_new_tokens": (16, {"max_completion_length": 16}),
    "rollout.temperature": (0.7, {"temperature": 0.7}),
    "rollout.top_p": (0.9, {"top_p": 0.9}),
    "rollout.top_k": (5, {"top_k": 5}),
    "rollout.generator": ("vllm", {"use_vllm": True}),
    "rollout.decode_step": ("static", {"cache_implementation": "static",
                                       "compile_generation": True}),
    "rollout.vllm_mode": ("server", {"vllm_mode": "server"}),
    "rollout.vllm_gpu_memory_utilization": (0.5, {"vllm_gpu_memory_utilization": 0.5}),
    "rollout.vllm_tensor_parallel_size": (2, {"vllm_tensor_parallel_size": 2}),
    "rollout.vllm_server_host": ("10.0.0.2", {"vllm_server_host": "10.0.0.2"}),
    "rollout.vllm_server_port": (8001, {"vllm_server_port": 8001}),
    "optim.lr": (1e-4, {"learning_rate": 1e-4}),
    "optim.weight_decay": (0.01, {"weight_decay": 0.01}),
    "optim.betas": ([0.8, 0.95], {"adam_beta1": 0.8, "adam_beta2": 0.95}),
    "optim.eps": (1e-6, {"adam_epsilon": 1e-6}),
    "optim.grad_clip": (None, {"max_grad_norm": 0.0}),  # no clipping
    "optim.mu": (2, {"num_iterations": 2}),
    "optim.mini_batch_size": (32, {"per_device_train_batch_size": 32,
                                   "gradient_accumulation_steps": 1}),
    "run.steps": (3, {"max_steps": 12}),  # 3 RL steps x 4 optimizer steps
    "run.seed": (1, {"seed": 1}),
    "run.checkpoint_every": (0, {"save_steps": 4000}),  # 0: the last of 1000 RL steps x 4
    "run.keep_checkpoints": (2, {"save_total_limit": 2}),
    "run.report_to": ([], {"report_to": []}),  # TRL's "none"
}


def test_every_key_that_sets_grpo_fields_has_a_test_row() -> None:
    assert set(GRPO_FIELD_ROWS) == {k for k, s in TRL.items() if s.sets}
    for key, (_, fields) in GRPO_FIELD_ROWS.items():
        assert set(fields) == set(TRL[key].sets), key


@pytest.mark.parametrize("key", list(GRPO_FIELD_ROWS))
def test_the_mapped_grpo_config_fields(key: str) -> None:
    """Each key of TRL's table lands in the GRPOConfig fields its row names."""
    value, fields = GRPO_FIELD_ROWS[key]
    args = trl_args.grpo_args(_cfg((key, value)), "unused")
    assert {f: getattr(args, f) for f in fields} == fields


@pytest.mark.parametrize(("step", "device", "generator", "static"), [
    ("auto", "cpu", "gbmpo", False), ("auto", "cuda", "gbmpo", True),
    ("auto", "cuda", "hf", True), ("static", "cpu", "gbmpo", True),
    ("static", "cuda", "gbmpo", True), ("lean", "cpu", "gbmpo", False),
    ("lean", "cuda", "gbmpo", False), ("static", "cuda", "vllm", False),
    ("auto", "cuda", "vllm", False),
])  # fmt: skip
def test_decode_step_picks_trls_cache(step: str, device: str, generator: str,
                                      static: bool) -> None:
    """rollout.decode_step on TRL: static (and auto on CUDA) -> transformers' static cache with
    its compiled decode step; lean (and auto on the CPU) -> TRL's default dynamic cache,
    uncompiled; vLLM generation takes neither. (The fields themselves, not GRPOConfig: a
    cuda config would not build on a machine without CUDA.)"""
    from gbmpo.config.hosts.trl import grpo_kwargs

    kw = grpo_kwargs(_cfg(("rollout.decode_step", step), ("model.device", device),
                          ("rollout.generator", generator)), 1)  # fmt: skip
    assert (kw["cache_implementation"], kw["compile_generation"]) == (
        ("static", True) if static else (None, False))


def test_the_objective_section_is_grpo_config_s() -> None:
    """The objective section's setting is GBMPOConfig's, under the same name."""
    for value in (False, True):
        args = trl_args.grpo_args(_cfg(("objective.monitor_regularizers", value)), "unused")
        assert args.monitor_regularizers is value


@pytest.mark.parametrize("key", [k for k, s in TRL.items() if s.status == REFUSED])
def test_every_refused_trl_value_is_a_config_error(key: str) -> None:
    value = TRL[key].probe
    with pytest.raises(ConfigError, match=rf"'{key}'={value!r}.*engine 'trl'"):
        trl_args.check_engine(_cfg((key, value)))


@pytest.mark.parametrize(
    ("key", "value"),
    [("model.dtype", "float16"), ("model.device", "cuda:1"), ("run.num_nodes", "2")],
)
def test_refused_values_exit_2_before_anything_is_written(
    key: str, value: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "run"
    assert main(["train", "--engine", "trl", f"--{key}", value, "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert key in err and value in err  # (cuda:1 on a machine without it: the device check)
    assert not out.exists()
    # the dry run refuses it too, naming the engine
    assert main(["train", "--engine", "trl", f"--{key}", value, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert key in err and value in err and "engine 'trl'" in err


VLLM_KEYS = ("rollout.vllm_mode", "rollout.vllm_gpu_memory_utilization",
             "rollout.vllm_tensor_parallel_size", "rollout.vllm_server_host",
             "rollout.vllm_server_port")  # fmt: skip


@pytest.mark.parametrize("key", VLLM_KEYS)
def test_vllm_settings_without_vllm_generation_are_refused(key: str) -> None:
    """A rollout.vllm_* value would change nothing without vLLM generation: refused, as on the
    own engine; with rollout.generator vllm it reaches GRPOConfig."""
    probe = TRL[key].probe
    with pytest.raises(ConfigError, match=rf"'{key}'=.*engine 'trl'.*rollout.generator vllm"):
        check_support(_cfg((key, probe)), "trl")
    assert check_support(_cfg(("rollout.generator", "vllm"), (key, probe)), "trl") == []
    assert check_support(_cfg(), "trl") == []  # the defaults are not refused


def test_checkpoint_every_zero_keeps_the_final_checkpoint() -> None:
    """checkpoint_every 0 means the final checkpoint only (the own engine keeps its last step):
    TRL saves at max_steps, the end of run.steps."""
    cfg = _cfg(("run.checkpoint_every", 0), ("run.steps", 3))
    args = trl_args.grpo_args(cfg, "unused")
    assert args.save_strategy == "steps" and args.save_steps == args.max_steps


def test_values_the_matrix_accepts() -> None:
    for key, value in (("model.device", "cuda:0"), ("model.device", "cuda"),
                       ("model.dtype", "bfloat16"), ("run.num_nodes", 1)):  # fmt: skip
        assert check_support(_cfg((key, value)), "trl") == []


def test_no_effect_keys_give_notices() -> None:
    notices = check_support(_cfg(("rollout.batch_size", 4), ("run.progress", False)), "trl")
    assert len(notices) == 2 and all("engine 'trl'" in n for n in notices)
    assert TRL["rollout.batch_size"].status == NO_EFFECT


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed")
def test_vllm_without_vllm_is_exit_2_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "run"
    argv = ["train", "--engine", "trl", "--rollout.generator", "vllm", "--output-dir", str(out)]
    assert main(argv) == 2
    assert "needs the vllm package" in capsys.readouterr().err
    assert not out.exists()
    assert main(["train", "--engine", "trl", "--rollout.generator", "vllm", "--dry-run"]) == 0
    report = json.loads(capsys.readouterr().out.split("dry run OK: ", 1)[1])
    assert report["checks"]["vllm"].startswith("skipped")
    assert "a real run here stops with exit 2" in report["checks"]["vllm"]


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [("rollout.vllm_mode", "remote", "colocate or server"),
     ("rollout.vllm_gpu_memory_utilization", 1.5, r"\(0, 1\]"),
     ("rollout.vllm_tensor_parallel_size", 0, ">= 1"),
     ("rollout.vllm_server_port", 70000, "TCP port")],
)  # fmt: skip
def test_bad_vllm_values(key: str, value: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        trl_args.check_engine(_cfg(("rollout.generator", "vllm"), (key, value)))


# ------------------------------------------------------------------ the engine's own parts


def test_learning_rate_is_the_own_schedule_per_rl_step() -> None:
    """The rate of every optimizer step of an RL step is the own engine's rate of that RL
    step, and with a time budget it decays with the RL time used (not over run.steps)."""
    from types import SimpleNamespace

    from gbmpo.train.schedule import lr_at

    cfg = _cfg(("run.steps", 100), ("run.time_budget_seconds", 8.0), ("optim.warmup_steps", 1))
    for step, seconds in ((0, 0.0), (1, 2.0), (3, 6.0), (5, 8.0)):
        own = lr_at(cfg.optim, cfg.run, step, seconds)
        assert trl_args.lr_at(cfg, step, seconds) == own
    assert trl_args.lr_at(cfg, 5, 8.0) == 0.0  # budget used up: the cosine has reached 0
    assert trl_args.lr_at(cfg, 3, 6.0) < 0.2 * cfg.optim.lr  # without the budget: ~0.99 lr

    progress = trl_callbacks.RLProgress(cfg, k=2)
    hooks = trl_callbacks.RunDirCallback(cfg, progress, None, None, None).as_trainer_callback()
    optimizer = SimpleNamespace(param_groups=[{"lr": 1.0}, {"lr": 1.0}])
    control = SimpleNamespace(should_training_stop=False)
    args = SimpleNamespace()
    seen = []
    for global_step in range(6):
        state = SimpleNamespace(global_step=global_step)
        hooks.on_step_begin(args, state, control, optimizer=optimizer)
        seen.append(optimizer.param_groups[0]["lr"])
        assert optimizer.param_groups[1]["lr"] == seen[-1]
        progress.rl_seconds += 3.0 * (global_step % 2)  # 3 s per RL step
    assert seen[0] == seen[1] and seen[2] == seen[3] and seen[4] == seen[5]
    assert seen[0] > seen[2] > seen[4]
    assert seen[2] == trl_args.lr_at(cfg, 1, 3.0) and seen[4] == trl_args.lr_at(cfg, 2, 6.0)


def test_weight_decay_on_every_parameter_as_the_own_engine() -> None:
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    names = trl_callbacks.engine_trainer_class().get_decay_parameter_names(None, model)
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    assert "0.bias" in names and "1.weight" in names  # transformers would exempt these


def test_bf16_is_autocast_over_fp32_weights() -> None:
    args = trl_args.grpo_args(_cfg(("model.dtype", "bfloat16")), "unused")
    assert args.bf16 is True and args.fp16 is False
    args = trl_args.grpo_args(_cfg(), "unused")
    assert args.bf16 is False and args.fp16 is False


def test_schema_record_names() -> None:
    logs = {"loss": 1.0, "pg_loss": 0.5, "reg_loss": 0.1, "reward": 0.3,
            "reward_std": 0.2, "gbmpo/reward_std": 0.19, "gbmpo/accuracy": 0.25,
            "completions/clipped_ratio": 0.5, "completions/mean_length": 7.0,
            "completions/max_length": 9.0, "reg_value": 0.01, "reg/kl_k1": 0.03,
            "ratio/min": 0.9, "clip_ratio/low_mean": 0.1, "kl": 0.04}  # fmt: skip
    rec = trl_callbacks.schema_record(logs)
    assert rec == {
        "loss": 1.0, "pg_loss": 0.5, "reg_loss": 0.1, "reward_mean": 0.3, "trl/reward_std": 0.2,
        "reward_std": 0.19, "accuracy": 0.25, "truncated_frac": 0.5,
        "response_length_mean": 7.0, "response_length_max": 9, "reg_value": 0.01,
        "reg/kl_k1": 0.03, "ratio_min": 0.9, "clip_frac_low": 0.1, "trl/kl": 0.04,
    }  # fmt: skip
    assert isinstance(rec["response_length_max"], int)  # the own engine's type


def test_rollout_correction_is_off_on_trl_unless_asked() -> None:
    """TRL's vLLM importance sampling is on by default; the engine switches it off for the
    default mode 'none', and maps each mode onto TRL's fields."""
    assert trl_args.grpo_args(_cfg(("rollout.generator", "vllm")),
                              "unused").vllm_importance_sampling_correction is False  # fmt: skip
    rc = "objective.rollout_correction."
    for mode, level, low, high, trl_mode in (("tis", "token", None, 2.0, "token_truncate"),
                                             ("tis", "sequence", 0.5, 3.0, "sequence_truncate"),
                                             ("mis", "sequence", None, 3.0, "sequence_mask"),
                                             ("icepop", "token", 0.5, 5.0, "token_mask")):
        cfg = _cfg(("rollout.generator", "vllm"), (rc + "mode", mode), (rc + "level", level),
                   (rc + "low", low), (rc + "high", high), (rc + "off_policy_mask_threshold", 0.4))
        assert check_support(cfg, "trl") == []
        args = trl_args.grpo_args(cfg, "unused")
        assert args.vllm_importance_sampling_correction is True
        assert args.vllm_importance_sampling_mode == trl_mode
        assert args.vllm_importance_sampling_clip_min == low
        assert args.vllm_importance_sampling_clip_max == high
        assert args.off_policy_mask_threshold == 0.4


def test_gbmpo_config_drop_in_takes_the_spec_correction() -> None:
    from gbmpo.integrations.trl import GBMPOConfig

    args = GBMPOConfig("unused", use_cpu=True,
                       objective={"regularizer": {"name": "none", "coef": 0.0}})
    assert args.vllm_importance_sampling_correction is False  # 'none' by default
    with pytest.raises(ValueError, match="objective.rollout_correction"):
        GBMPOConfig("unused", use_cpu=True,
                    objective={"regularizer": {"name": "none", "coef": 0.0}},
                    vllm_importance_sampling_mode="token_truncate")


def test_rollout_correction_metric_names() -> None:
    logs = {f"rollout_correction/{k}": 0.5 for k in ("weight_mean", "weight_min", "weight_max",
                                                      "masked_frac")}  # fmt: skip
    logs["sampling/importance_sampling_ratio/mean"] = 0.9
    rec = trl_callbacks.schema_record(logs)
    assert {k for k in rec if k.startswith("rollout_correction/")} == set(logs) - {
        "sampling/importance_sampling_ratio/mean"}
    assert rec["trl/sampling/importance_sampling_ratio/mean"] == 0.9
