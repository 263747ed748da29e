"""One monitoring setting and one metric name: the own engine logs each monitored divergence
D(pi_old || pi_ref) once, under ``gbmpo.io.metrics.MONITOR_PREFIX`` (the name GBMPOTrainer's log
and every run directory use); the former names of the setting are refused, naming the one."""

from __future__ import annotations

import pytest
from test_trainer import micro_config, varied_reward

from gbmpo.cli import main
from gbmpo.config import ConfigError
from gbmpo.io.metrics import MONITOR_PREFIX, is_shared
from gbmpo.objectives.regularizers import REGULARIZERS
from gbmpo.objectives.spec import ObjectiveSpec, SpecError
from gbmpo.train import Trainer, load_config

FORMER = ["monitor_reference", "log_all_regularizers"]


@pytest.mark.parametrize("monitor", [True, False])
def test_own_engine_logs_each_monitored_divergence_once_under_the_prefix(
    micro_model_dir: object, monitor: bool
) -> None:
    cfg = micro_config(micro_model_dir, None, **{  # type: ignore[arg-type]
        "objective.regularizer.name": "prob_l2",
        "objective.monitor_regularizers": str(monitor).lower()})  # fmt: skip
    record = Trainer(cfg, reward_fn=varied_reward).train_step()
    names = set(REGULARIZERS.names()) - {"none"} if monitor else {"prob_l2"}
    assert {k for k in record if k.startswith(MONITOR_PREFIX)} == {MONITOR_PREFIX + n
                                                                   for n in names}  # fmt: skip
    for n in names:  # once: no other key names the same divergence
        assert [k for k in record if k.rsplit("/", 1)[-1] == n] == [MONITOR_PREFIX + n], n
        assert is_shared(MONITOR_PREFIX + n)
    assert not [k for k in record if k.startswith(("regularizer/", "reference/"))]


@pytest.mark.parametrize("old", FORMER)
def test_former_objective_keys_are_refused_naming_the_one_setting(old: str, tmp_path) -> None:
    message = f"'objective.{old}' was renamed: use 'objective.monitor_regularizers'"
    with pytest.raises(SpecError, match=message):
        ObjectiveSpec.from_dict({old: False})
    with pytest.raises(ConfigError, match=message):  # a CLI override
        load_config(None, [(f"objective.{old}", "false")])
    path = tmp_path / "old.yaml"
    path.write_text(f"objective:\n  {old}: false\n")
    with pytest.raises(ConfigError, match=message):  # a config file
        load_config(path)


@pytest.mark.parametrize("old", FORMER)
def test_cli_refuses_a_former_key_with_one_line(old: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["train", f"--objective.{old}", "false", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "use 'objective.monitor_regularizers'" in err, err
