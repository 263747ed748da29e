"""``gbmpo train --engine verl`` pieces in verl's own environment: the Hydra overrides composed from
a gbmpo config pass verl's validation and select exactly the spec's objective; the reward function
verl loads (``reward.custom_reward_function``), called with verl's own signature on the data files
the engine writes, equals the gbmpo task's reward on the same completions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("verl")

import pandas as pd  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

import gbmpo.integrations.verl as gv  # noqa: E402
from gbmpo.engines.verl import overrides, write_data  # noqa: E402
from gbmpo.engines.verl_check import check  # noqa: E402
from gbmpo.objectives import get_regularizer, get_surrogate  # noqa: E402
from gbmpo.train.config import dump_yaml, load_config  # noqa: E402
from gbmpo.train.trainer import build_task, load_tokenizer  # noqa: E402


@pytest.fixture(autouse=True)
def _reset_kl_params() -> Any:
    yield
    gv.configure_kl({})


def _compose(ov: list[str]) -> Any:
    import verl

    config_dir = Path(verl.__file__).parent / "trainer" / "config"
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose(config_name="ppo_trainer", overrides=ov)


@pytest.mark.parametrize(
    ("settings", "surrogate", "regularizer"),
    [
        ([], get_surrogate("clip"), get_regularizer("prob_l2")),
        ([("objective.surrogate.name", "atr"), ("objective.surrogate.params", {"delta": 0.02}),
          ("advantage", "grpo"), ("aggregation", "bnpo"), ("regularizer", "none"),
          ("coef", 0.0)], get_surrogate("atr", delta=0.02), None),
        ([("objective.surrogate.params", {"eps_low": 0.2, "eps_high": 0.28, "dual_clip_c": 3.0}),
          ("regularizer", "rpg_ufkl"), ("anchor", "old"), ("coef", 1e-4),
          ("objective.regularizer.params", {"clamp": 10.0})],
         get_surrogate("clip", eps_low=0.2, eps_high=0.28, dual_clip_c=3.0),
         get_regularizer("rpg_ufkl", clamp=10.0, anchor="old")),
    ],
)  # fmt: skip
def test_overrides_select_the_spec_objective(
    tmp_path: Path, settings: list[tuple[str, Any]], surrogate: Any, regularizer: Any
) -> None:
    cfg = load_config(None, [("engine", "verl"), *settings])
    ov = overrides(cfg, tmp_path / "run")
    result = check(ov)  # verl's validate_config on the composed ppo_trainer.yaml
    assert result["surrogate"] == surrogate.name
    from verl.utils.config import omega_conf_to_dataclass

    actor = omega_conf_to_dataclass(_compose(ov).actor_rollout_ref.actor)
    chosen = gv.describe(actor)
    assert chosen["surrogate"] == surrogate  # every parameter, none taken from verl's defaults
    if regularizer is None:
        assert chosen["regularizer"] is None and actor.use_kl_loss is False
    else:
        assert chosen["regularizer"].name == regularizer.name
        assert chosen["regularizer"].anchor == regularizer.anchor
        assert actor.kl_loss_coef == cfg.objective.regularizer.coef


def test_reward_function_with_verls_signature_equals_the_task_reward(tmp_path: Path) -> None:
    from verl.trainer.ppo.reward import get_custom_reward_fn

    run_dir = tmp_path / "run"
    cfg = load_config(None, [("engine", "verl"), ("output-dir", str(run_dir))])
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(dump_yaml(cfg))
    task = build_task(cfg, load_tokenizer(cfg))
    counts = write_data(cfg, task, run_dir / "data")
    assert counts["train"] == len(task.split(task.train_split))
    fn = get_custom_reward_fn(_compose(overrides(cfg, run_dir)))
    assert fn is not None
    rows = pd.read_parquet(run_dir / "data" / "train.parquet").head(6)
    examples = task.split(task.train_split)[:6]
    n_right = 0
    for (_, row), ex in zip(rows.iterrows(), examples, strict=True):
        assert row["prompt"][0]["content"] == ex["prompt"]  # gbmpo's rendering, unchanged
        for completion in (ex["solution"], " 12 #### 99999", ""):
            got = fn(data_source=row["data_source"], solution_str=completion,
                     ground_truth=row["reward_model"]["ground_truth"],
                     extra_info=row["extra_info"])  # fmt: skip
            cols = {k: [v] for k, v in json.loads(row["extra_info"]["columns"]).items()}
            want = task.reward([ex["prompt"]], [completion], **cols)[0] or 0.0
            assert got == want, (completion, got, want)
            n_right += got == 1.0
    assert n_right == 6  # the gold solutions score 1


def test_plugin_prints_the_overrides_of_an_objective_file(tmp_path: Path) -> None:
    """The verl plugin takes the same spec: ``python -m gbmpo.integrations.verl --objective``."""
    import subprocess
    import sys

    import yaml

    spec = {"advantage": "grpo", "aggregation": "bnpo", "regularizer": {"name": "none", "coef": 0},
            "surrogate": {"name": "atr", "params": {"delta": 0.02}}}  # fmt: skip
    path = tmp_path / "objective.yaml"
    path.write_text(yaml.safe_dump({"objective": spec}))
    cmd = [sys.executable, "-m", "gbmpo.integrations.verl", "--objective", str(path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.split()
    assert lines == gv.objective_overrides(spec, max_response_length=1024)
    assert "+actor_rollout_ref.actor.policy_loss.gbmpo_surrogate.delta=0.02" in lines
    from verl.utils.config import omega_conf_to_dataclass

    composed = _compose([*lines, "actor_rollout_ref.actor.use_dynamic_bsz=true"])
    actor = composed.actor_rollout_ref.actor
    chosen = gv.describe(omega_conf_to_dataclass(actor))
    assert chosen["surrogate"] == get_surrogate("atr", delta=0.02)


def test_data_files_give_the_longest_prompt(tmp_path: Path) -> None:
    cfg = load_config(None, [("engine", "verl")])
    tok = load_tokenizer(cfg)
    task = build_task(cfg, tok)
    counts = write_data(cfg, task, tmp_path, tok)
    longest = max(len(tok(ex["prompt"])["input_ids"]) for name in ("train", "test")
                  for ex in task.split(name))  # fmt: skip
    assert counts["max_prompt_tokens"] == longest
    ov = overrides(cfg, tmp_path, max_prompt_length=longest)
    assert f"data.max_prompt_length={longest}" in ov
