"""Dry run of examples/verl/run_qwen3_1.7b_gsm8k.sh: the overrides the script passes (read from
the script itself with ``--print-overrides``) compose with verl's shipped ``ppo_trainer.yaml`` and
pass everything ``verl.trainer.main_ppo.main`` does before it starts Ray (``validate_config``,
which builds the actor config through Hydra, i.e. ``GBMPOPolicyLossConfig``), and they select
gbmpo's objectives with the intended hyperparameters."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("verl")

import verl  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from verl.trainer.ppo.utils import need_critic, need_reference_policy  # noqa: E402
from verl.utils.config import omega_conf_to_dataclass, validate_config  # noqa: E402

import gbmpo.integrations.verl as gv  # noqa: E402
from gbmpo.objectives import NeuralMirrorMap  # noqa: E402
from gbmpo.objectives.surrogates import atr_bounds  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "verl" / "run_qwen3_1.7b_gsm8k.sh"
PREPARE = ROOT / "examples" / "verl" / "prepare_gsm8k.py"
CONFIG_DIR = Path(verl.__file__).parent / "trainer" / "config"


def _overrides(variant: str, tmp_path: Path) -> list[str]:
    env = {**os.environ, "DATA_DIR": str(tmp_path / "gsm8k"), "MIRROR": str(tmp_path / "m.json")}
    out = subprocess.run(
        ["bash", str(SCRIPT), variant, "--print-overrides"],
        env=env, capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    lines = [ln for ln in out.stdout.splitlines() if ln.strip()]
    assert lines, out.stderr
    return lines


def _compose(overrides: list[str]) -> Any:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


@pytest.fixture(autouse=True)
def _reset_kl_params() -> Any:
    yield
    gv.configure_kl({})


def test_script_launches_verl_main_ppo_with_its_overrides() -> None:
    text = SCRIPT.read_text()
    assert re.search(r'"\$PYTHON" -m verl\.trainer\.main_ppo "\$\{OVERRIDES\[@\]\}" "\$@"', text)
    assert "printf '%s\\n' \"${OVERRIDES[@]}\"" in text  # --print-overrides prints the same list
    bad = subprocess.run(["bash", str(SCRIPT), "nope", "--print-overrides"], capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "nm_grpo, atr_grpo" in bad.stderr


def _dry_run(cfg: Any) -> Any:
    """What verl.trainer.main_ppo.main does before Ray, then the actor config it builds."""
    validate_config(
        config=cfg,
        use_reference_policy=need_reference_policy(cfg),
        use_critic=need_critic(cfg),
    )
    return omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


def test_nm_grpo_dry_run(tmp_path: Path) -> None:
    ov = _overrides("nm_grpo", tmp_path)
    cfg = _compose(ov)
    actor = cfg.actor_rollout_ref.actor
    assert actor.policy_loss.loss_mode == "gbmpo_clip"
    assert actor.use_kl_loss is True
    assert actor.kl_loss_type == "gbmpo_neural_mirror"
    assert actor.kl_loss_coef == pytest.approx(1e-4)
    assert actor.loss_agg_mode == "seq-mean-token-sum-norm"
    assert actor.loss_scale_factor == 1024 == cfg.data.max_response_length
    assert cfg.algorithm.adv_estimator == "grpo"
    assert cfg.algorithm.norm_adv_by_std_in_grpo is False
    assert actor.policy_loss.gbmpo_kl.mirror == str(tmp_path / "m.json")
    assert cfg.actor_rollout_ref.model.path == "Qwen/Qwen3-1.7B"
    assert need_reference_policy(cfg)  # the mirror divergence is to the reference model

    mirror = NeuralMirrorMap.random(0.01, 42)
    mirror.save(tmp_path / "m.json")
    built = _dry_run(cfg)
    assert type(built.policy_loss) is gv.GBMPOPolicyLossConfig
    chosen = gv.describe(built)
    assert chosen["surrogate"].name == "clip"
    assert chosen["surrogate"].dual_clip_c == built.clip_ratio_c
    reg = chosen["regularizer"]
    assert reg.name == "neural_mirror"
    assert reg.params["mirror"].to_vector().tolist() == mirror.to_vector().tolist()


def test_atr_grpo_dry_run(tmp_path: Path) -> None:
    cfg = _compose(_overrides("atr_grpo", tmp_path))
    actor = cfg.actor_rollout_ref.actor
    assert actor.policy_loss.loss_mode == "gbmpo_atr"
    assert actor.policy_loss.gbmpo_surrogate.delta == pytest.approx(0.02)
    assert actor.kl_loss_type == "low_var_kl" and actor.use_kl_loss is True
    assert actor.loss_agg_mode == "token-mean"
    built = _dry_run(cfg)
    chosen = gv.describe(built)
    assert chosen["regularizer"] is None  # verl's own k3
    assert chosen["surrogate"].name == "atr"
    assert chosen["surrogate"].bounds == pytest.approx(atr_bounds(0.02))


def test_extra_keys_need_the_gbmpo_config_class(tmp_path: Path) -> None:
    """Without the _target_ override verl's PolicyLossConfig rejects gbmpo's keys (why the
    script sets it)."""
    ov = [o for o in _overrides("atr_grpo", tmp_path) if "._target_=" not in o]
    cfg = _compose(ov)
    with pytest.raises(Exception, match="gbmpo_surrogate"):
        omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


def test_bad_hyperparameter_fails_the_dry_run(tmp_path: Path) -> None:
    ov = [o.replace("loss_mode=gbmpo_atr", "loss_mode=gbmpo_atrr") for o in
          _overrides("atr_grpo", tmp_path)]  # fmt: skip
    with pytest.raises(Exception, match="'gbmpo_atrr' is not a gbmpo policy loss.*gbmpo_atr"):
        _dry_run(_compose(ov))


def test_prepare_gsm8k_rows_score_with_verl(tmp_path: Path) -> None:
    from importlib.resources import files

    if not (files("gbmpo") / "data" / "gsm8k" / "test.jsonl.gz").is_file():
        pytest.skip("gbmpo installed without packed GSM8K (scripts/pack_data.py found no data)")
    import pandas as pd
    from verl.utils.reward_score import default_compute_score

    subprocess.run([sys.executable, str(PREPARE), "--out", str(tmp_path)], check=True,
                   capture_output=True, timeout=120)  # fmt: skip
    test = pd.read_parquet(tmp_path / "test.parquet")
    train = pd.read_parquet(tmp_path / "train.parquet")
    assert (len(train), len(test)) == (7473, 1319)
    row = test.iloc[0]
    gold = row["reward_model"]["ground_truth"]
    assert gold == "18" and row["data_source"] == "openai/gsm8k"
    assert row["prompt"][0]["role"] == "user" and "####" in row["prompt"][0]["content"]
    score = default_compute_score(row["data_source"], f"so the answer is #### {gold}", gold)
    assert score == 1.0
    assert default_compute_score(row["data_source"], "#### 17", gold) == 0.0
