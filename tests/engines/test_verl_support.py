"""The verl column of the support matrix: every honoured key reaches verl's overrides, every
refused value stops ``check_support`` (and ``gbmpo train --engine verl``) before anything is
written, and the keys with a verl-specific translation (evaluation schedule, precision, seeds,
optimizer eps) become the verl settings the docs name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gbmpo.config import ConfigError, load_config
from gbmpo.config.support import (
    HONOURED,
    NO_EFFECT,
    REFUSED,
    VERL,
    VERL_REQUIRED,
    check_support,
    probe_settings,
)
from gbmpo.engines.verl.args import overrides, precision_overrides, validation_freq

#: a config verl accepts as it is (the keys verl refuses at the own engine's defaults set), on
#: GPUs (the probes include LoRA and several processes, which a CPU run refuses); eval.every 0,
#: so that eval.after changes test_freq
VERL_OK: list[tuple[str, Any]] = [("engine", "verl"), *VERL_REQUIRED.items(),
                                  ("model.device", "cuda"), ("eval.every", 0)]  # fmt: skip


def _cfg(*settings: tuple[str, Any]) -> Any:
    return load_config(None, [*VERL_OK, *settings])


#: settings a probe needs beside it (in the base config and the probed one)
_COMPANIONS: dict[str, list[tuple[str, Any]]] = {
    "objective.rollout_correction.level": [("objective.rollout_correction.mode", "tis")],
    "objective.rollout_correction.high": [("objective.rollout_correction.mode", "tis")],
    "objective.rollout_correction.low": [("objective.rollout_correction.mode", "mis"),
                                         ("objective.rollout_correction.low", 0.5)],
}


def test_the_base_config_passes_on_verl() -> None:
    assert check_support(_cfg(), "verl") == []


def test_the_default_config_passes_on_verl() -> None:
    """The own engine's defaults (a time budget, every regularizer monitored, the drift at the
    end, the CPU) need no other value on verl."""
    assert VERL_REQUIRED == {}
    for key in ("run.time_budget_seconds", "objective.monitor_regularizers", "eval.drift"):
        assert VERL[key].status == HONOURED, key
    assert check_support(load_config(None, [("engine", "verl")]), "verl") == []


@pytest.mark.parametrize(
    "key", [k for k, s in VERL.items() if s.status == HONOURED and s.probe is not None]
)
def test_every_honoured_probe_changes_the_overrides(key: str, tmp_path: Path) -> None:
    entry = VERL[key]
    base = overrides(_cfg(*_COMPANIONS.get(key, [])), tmp_path / "run")
    probed = _cfg(*_COMPANIONS.get(key, []), (key, entry.probe))
    changed = overrides(probed, tmp_path / "run")
    assert changed != base, f"{key}={entry.probe!r} does not change verl's overrides"


_A = "actor_rollout_ref.actor"

#: one row per key of verl's table that sets overrides: key -> (a value, the overrides it gives,
#: name -> Hydra text). The defaults: 8 prompts x 8 generations, mini-batch 16, 1000 steps.
OVERRIDE_ROWS: dict[str, tuple[Any, dict[str, str]]] = {
    "model.trust_remote_code": (True, {"data.trust_remote_code": "true",
                                       "actor_rollout_ref.model.trust_remote_code": "true"}),
    "rollout.prompts_per_step": (4, {"data.train_batch_size": "4"}),
    "rollout.num_generations": (4, {"actor_rollout_ref.rollout.n": "4"}),
    "rollout.max_new_tokens": (64, {"data.max_response_length": "64",
                                    "actor_rollout_ref.rollout.response_length": "64"}),
    "rollout.temperature": (0.7, {"actor_rollout_ref.rollout.temperature": "0.7"}),
    "rollout.top_p": (0.9, {"actor_rollout_ref.rollout.top_p": "0.9"}),
    "rollout.top_k": (0, {"actor_rollout_ref.rollout.top_k": "-1"}),  # verl's "no top-k"
    "optim.lr": (1e-4, {f"{_A}.optim.lr": "0.0001"}),
    "optim.weight_decay": (0.1, {f"{_A}.optim.weight_decay": "0.1"}),
    "optim.betas": ([0.9, 0.999], {f"{_A}.optim.betas": "[0.9,0.999]"}),
    "optim.eps": (1e-6, {f"{_A}.optim.override_optimizer_config": "{eps:1e-06}"}),
    "optim.grad_clip": (None, {f"{_A}.optim.clip_grad": "1000000000.0"}),  # no clipping
    "optim.mu": (2, {f"{_A}.ppo_epochs": "2"}),
    "optim.mini_batch_size": (32, {f"{_A}.ppo_mini_batch_size": "4"}),  # 32 / 8 generations
    "eval.before": (False, {"trainer.val_before_train": "false"}),
    "run.steps": (7, {"trainer.total_training_steps": "7"}),
    "run.seed": (17, {"data.seed": "17", f"{_A}.data_loader_seed": "17",
                      "actor_rollout_ref.rollout.seed": "17", f"{_A}.fsdp_config.seed": "17",
                      "actor_rollout_ref.ref.fsdp_config.seed": "17"}),
    "run.checkpoint_every": (0, {"trainer.save_freq": "1000"}),  # 0: the last step only
    "run.keep_checkpoints": (3, {"trainer.max_actor_ckpt_to_keep": "3"}),
    "run.report_to": (["tensorboard"], {"trainer.logger": "['console','file','tensorboard']"}),
    "run.num_processes": (2, {"trainer.n_gpus_per_node": "2"}),
    "run.num_nodes": (2, {"trainer.nnodes": "2"}),
}


def test_every_key_that_sets_overrides_has_a_test_row() -> None:
    assert set(OVERRIDE_ROWS) == {k for k, s in VERL.items() if s.sets}
    for key, (_, named) in OVERRIDE_ROWS.items():
        assert set(named) == set(VERL[key].sets), key


@pytest.mark.parametrize("key", list(OVERRIDE_ROWS))
def test_the_mapped_overrides(key: str, tmp_path: Path) -> None:
    """Each key of verl's table gives the overrides its row names, once each."""
    value, named = OVERRIDE_ROWS[key]
    ov = overrides(_cfg((key, value)), tmp_path)
    for name, text in named.items():
        assert [o for o in ov if o.split("=", 1)[0] == name] == [f"{name}={text}"], key


def test_most_honoured_keys_have_a_probe() -> None:
    # the honoured keys without a probe act through the data files, the reward function or the
    # run directory, not through the overrides (tested below and in tests_verl)
    without = {k for k, s in VERL.items() if s.status == HONOURED and s.probe is None}
    assert without <= {
        "engine", "task.name", "task.params", "task.train_split", "task.template",
        "objective.regularizer.params", "lora.r", "lora.alpha", "lora.target_modules",
        "eval.split", "eval.limit", "eval.auto_limit", "run.output_dir", "run.plugins",
        "run.allow_unsandboxed_code",
        # after verl's run (the merged model's drift) and through the driver hooks' environment
        # (tests/engines/test_verl_driver.py)
        "eval.drift", "run.time_budget_seconds",
    }, without  # fmt: skip


@pytest.mark.parametrize("key", [k for k, s in VERL.items() if s.status == REFUSED])
def test_every_refused_entry_refuses_its_probe_on_verl(key: str) -> None:
    entry = VERL[key]
    cfg = _cfg(*probe_settings(key, entry.probe))
    with pytest.raises(ConfigError, match=rf"'{key}'=.*engine 'verl'"):
        check_support(cfg, "verl")


@pytest.mark.parametrize(
    ("key", "value"),
    [("model.device", "mps"), ("model.device", "cuda:1"), ("model.dtype", "float16"),
     ("lora.dropout", 0.1), ("eval.max_new_tokens", 64), ("objective.advantage", "batch"),
     ("objective.regularizer.anchor", "old")],
)  # fmt: skip
def test_refused_values(key: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=rf"'{key}'=.*engine 'verl'"):
        check_support(_cfg((key, value)), "verl")


@pytest.mark.parametrize(
    "settings",
    [[("model.dtype", "bfloat16")], [("model.dtype", "float32")],
     [("rollout.max_new_tokens", 64), ("eval.max_new_tokens", 64)],
     [("objective.regularizer.name", "rpg_ufkl"), ("objective.regularizer.anchor", "old")],
     [("objective.regularizer.name", "none"), ("objective.regularizer.anchor", "old")],
     [("lora.enabled", True), ("lora.dropout", 0.0)]],
)  # fmt: skip
def test_accepted_values(settings: list[tuple[str, Any]]) -> None:
    assert check_support(_cfg(*settings), "verl") == []


def test_no_effect_keys_give_one_notice_each() -> None:
    cfg = _cfg(("rollout.batch_size", 4), ("eval.batch_size", 7))
    notices = check_support(cfg, "verl")
    assert len(notices) == 2
    assert "rollout.batch_size" in notices[0] and "eval.batch_size" in notices[1]
    for key in ("rollout.batch_size", "eval.batch_size", "rollout.generator", "run.num_threads"):
        assert VERL[key].status == NO_EFFECT


def test_paper_verl_configs_pass() -> None:
    root = Path(__file__).resolve().parents[2] / "configs" / "paper"
    checked = 0
    for path in sorted(root.glob("*.yaml")):
        cfg = load_config(path)
        if cfg.engine != "verl":
            continue
        check_support(cfg, "verl")  # notices allowed, no refusal
        checked += 1
    assert checked >= 4


# ----------------------------------------------------------------- the evaluation schedule


@pytest.mark.parametrize(
    ("every", "after", "steps", "freq"),
    [(0, True, 30, 30), (0, False, 30, -1), (10, True, 30, 10), (10, False, 30, 10),
     (7, True, 30, 7)],
)  # fmt: skip
def test_test_freq_validates_at_the_last_step(every: int, after: bool, steps: int, freq: int
                                              ) -> None:  # fmt: skip
    cfg = _cfg(("eval.every", every), ("eval.after", after), ("run.steps", steps))
    assert validation_freq(cfg) == freq
    # verl validates at step s when test_freq > 0 and (s % test_freq == 0 or s is the last)
    validated = [s for s in range(1, steps + 1)
                 if freq > 0 and (s == steps or s % freq == 0)]  # fmt: skip
    own = [s for s in range(1, steps + 1) if every and s % every == 0]
    if after and steps not in own:
        own.append(steps)
    assert validated == own


def test_after_false_with_an_every_that_misses_the_last_step_is_refused(tmp_path: Path) -> None:
    cfg = _cfg(("eval.every", 7), ("eval.after", False), ("run.steps", 30))
    with pytest.raises(ConfigError, match=r"'eval.after'=False.*engine 'verl'"):
        overrides(cfg, tmp_path)
    with pytest.raises(ConfigError, match=r"'eval.after'=False.*engine 'verl'"):
        check_support(cfg, "verl")  # the matrix says so, before anything is written
    assert check_support(_cfg(("eval.every", 10), ("eval.after", False), ("run.steps", 30)),
                         "verl") == []  # fmt: skip


@pytest.mark.parametrize(("generations", "mini", "refused"),
                         [(8, 12, True), (8, 16, False), (4, None, False), (3, 8, True)])
def test_mini_batch_not_a_multiple_of_the_group_is_refused(
    generations: int, mini: int | None, refused: bool
) -> None:
    cfg = _cfg(("rollout.num_generations", generations), ("rollout.prompts_per_step", 4),
               ("optim.mini_batch_size", mini))  # fmt: skip
    if refused:
        with pytest.raises(ConfigError, match=r"'optim.mini_batch_size'=.*engine 'verl'"):
            check_support(cfg, "verl")
    else:
        assert check_support(cfg, "verl") == []


def test_cpu_refuses_lora_and_several_processes() -> None:
    base = [("model.device", "cpu")]
    assert check_support(_cfg(*base), "verl") == []
    for extra in (("lora.enabled", True), ("run.num_processes", 2), ("run.num_nodes", 2)):
        with pytest.raises(ConfigError, match=r"'model.device'='cpu'.*engine 'verl'"):
            check_support(_cfg(*base, extra), "verl")


def test_cpu_overrides_only_on_a_cpu_run(tmp_path: Path) -> None:
    from gbmpo.engines.verl.args import cpu_overrides

    gpu, cpu = overrides(_cfg(), tmp_path), overrides(_cfg(("model.device", "cpu")), tmp_path)
    assert "actor_rollout_ref.rollout.name=vllm" in gpu and cpu_overrides(_cfg()) == []
    assert "actor_rollout_ref.rollout.name=hf" in cpu
    for o in ("trainer.device=cpu", "+ray_kwargs.ray_init.num_gpus=1"):
        assert o in cpu and o not in gpu
    assert "trainer.use_v1=false" in gpu and "trainer.use_v1=false" in cpu


def test_eval_switches_reach_verl(tmp_path: Path) -> None:
    ov = overrides(_cfg(("eval.before", False), ("run.steps", 12)), tmp_path)
    assert "trainer.val_before_train=false" in ov
    assert "trainer.test_freq=12" in ov  # eval.every 0: only the final step validates
    assert "actor_rollout_ref.rollout.val_kwargs.do_sample=false" in ov
    assert "actor_rollout_ref.rollout.val_kwargs.n=1" in ov


def test_checkpoint_every_zero_keeps_the_final_checkpoint(tmp_path: Path) -> None:
    ov = overrides(_cfg(("run.checkpoint_every", 0), ("run.steps", 12)), tmp_path)
    assert "trainer.save_freq=12" in ov  # verl saves at the last step when save_freq > 0


# ----------------------------------------------------------------- precision, seeds, eps


def test_precision() -> None:
    bf16, fp32 = precision_overrides("bfloat16"), precision_overrides("float32")
    a = "actor_rollout_ref.actor.fsdp_config"
    assert f"{a}.model_dtype=fp32" in bf16 and f"{a}.model_dtype=fp32" in fp32  # fp32 masters
    assert any("param_dtype:bf16" in o for o in bf16)
    assert all("param_dtype:bf16" not in o for o in fp32)
    assert "actor_rollout_ref.rollout.dtype=bfloat16" in bf16
    assert "actor_rollout_ref.rollout.dtype=float32" in fp32


def test_seed_reaches_data_actor_and_rollout(tmp_path: Path) -> None:
    ov = overrides(_cfg(("run.seed", 17)), tmp_path)
    for key in ("data.seed", "actor_rollout_ref.actor.data_loader_seed",
                "actor_rollout_ref.rollout.seed", "actor_rollout_ref.actor.fsdp_config.seed",
                "actor_rollout_ref.ref.fsdp_config.seed"):  # fmt: skip
        assert f"{key}=17" in ov, key


def test_optimizer_eps(tmp_path: Path) -> None:
    ov = overrides(_cfg(("optim.eps", 1e-6)), tmp_path)
    assert "actor_rollout_ref.actor.optim.override_optimizer_config={eps:1e-06}" in ov


def test_rollout_correction_overrides(tmp_path: Path) -> None:
    rc = "objective.rollout_correction."
    c = "algorithm.rollout_correction."
    base = overrides(_cfg(), tmp_path / "run")
    assert f"{c}rollout_is=null" in base  # off by default, said explicitly
    icepop = overrides(_cfg((rc + "mode", "icepop"), (rc + "low", 0.5), (rc + "high", 5.0)),
                       tmp_path / "run")  # fmt: skip
    assert f"{c}rollout_is=token" in icepop and f"{c}rollout_is_threshold='0.5_5.0'" in icepop
    tis = overrides(_cfg((rc + "mode", "tis"), (rc + "level", "sequence")), tmp_path / "run")
    assert f"{c}rollout_is=sequence" in tis and f"{c}rollout_is_threshold=2.0" in tis
    assert f"{c}bypass_mode=false" in tis and f"{c}rollout_is_batch_normalize=false" in tis
    for bad in ([(rc + "mode", "tis"), (rc + "low", 0.5)], [(rc + "mode", "mis")],
                [(rc + "off_policy_mask_threshold", 0.5)]):  # fmt: skip
        with pytest.raises(ConfigError, match="rollout_correction.*engine 'verl'"):
            check_support(_cfg(*bad), "verl")


def test_cpu_modules_are_loaded_only_for_a_cpu_run(monkeypatch: pytest.MonkeyPatch) -> None:
    from gbmpo.engines.verl.runner import _verl_env

    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    gpu, cpu = _verl_env(["json"]), _verl_env(["json"], cpu=True)
    # the plugin and the driver hooks on both (gbmpo.engines.verl.driver)
    assert gpu["VERL_USE_EXTERNAL_MODULES"] == (
        "json,gbmpo.integrations.verl,gbmpo.engines.verl.driver")
    assert gpu["GBMPO_VERL_DRIVER"] == cpu["GBMPO_VERL_DRIVER"] == "1"
    assert "VERL_PLATFORM" not in gpu and "VERL_ENGINE_DEVICE" not in gpu
    assert cpu["VERL_USE_EXTERNAL_MODULES"] == ("gbmpo.engines.verl.cpu.plugin,json,"
                                                "gbmpo.integrations.verl,"
                                                "gbmpo.engines.verl.driver")
    assert cpu["VERL_PLATFORM"] == "cpu" and cpu["VERL_ENGINE_DEVICE"] == "cuda"


def test_untested_verl_stops_a_cpu_run_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:  # fmt: skip
    """The version guard, from gbmpo's own environment (verl's version read in verl's)."""
    import subprocess

    from gbmpo.engines.checks import EngineUnavailable
    from gbmpo.engines.verl import runner as verl_runner

    monkeypatch.setattr(verl_runner, "verl_python", lambda: "/x/python")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a, 0, stdout="0.10.0\n", stderr=""))  # fmt: skip
    with pytest.raises(EngineUnavailable, match=r"tested with verl 0\.9\.1 only, found verl 0\.10"):
        verl_runner._gpu_python(_cfg(("model.device", "cpu")))
