"""``gbmpo train --engine verl`` from the main environment: the dry run composes verl's config and
has verl validate it (in .venv-verl where it exists); a real run stops with exit 2, naming what is
missing, and writes nothing where verl or its GPUs are absent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gbmpo.cli import main
from gbmpo.config import ConfigError, load_config
from gbmpo.engines.verl.args import overrides

#: on GPUs (a run here must stop for want of them); the rest is the default config, which verl
#: runs as it is (its dry run: tests/engines/test_engine_registry.py)
VERL_OK = ["--model.device", "cuda"]


def test_run_without_gpus_exits_2_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the run would start")
    out = tmp_path / "run"
    assert main(["train", "--engine", "verl", "--output-dir", str(out), *VERL_OK]) == 2
    err = capsys.readouterr().err
    assert "engine verl needs" in err and ("GPU" in err or "verl" in err)
    assert not out.exists()


@pytest.mark.parametrize(
    ("flags", "key"),
    [(["--model.dtype", "float16"], "model.dtype"),
     (["--lora.dropout", "0.1"], "lora.dropout"),
     (["--eval.max_new_tokens", "64"], "eval.max_new_tokens"),
     (["--model.device", "cpu", "--lora.enabled", "true"], "model.device"),
     (["--model.device", "cpu", "--num-processes", "2"], "model.device")],
)  # fmt: skip
@pytest.mark.parametrize("dry", [False, True])
def test_refused_values_exit_2_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture, flags: list[str], key: str, dry: bool
) -> None:
    out = tmp_path / "run"
    argv = ["train", "--engine", "verl", "--output-dir", str(out), *VERL_OK, *flags]
    assert main(argv + (["--dry-run"] if dry else [])) == 2
    err = capsys.readouterr().err
    assert f"'{key}'=" in err and "engine 'verl'" in err
    assert not out.exists()


def test_settings_verl_cannot_express_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'objective.advantage'='batch' has no verl counterpart"):
        overrides(load_config(None, [("advantage", "batch")]), tmp_path)
    with pytest.raises(ConfigError, match="anchor'=old with 'prob_l2'"):
        overrides(load_config(None, [("anchor", "old")]), tmp_path)


def test_default_mirror_map_is_written_for_verl(tmp_path: Path) -> None:
    """verl's workers read the mirror map from a file: without one, the engine writes the map
    gbmpo's neural_mirror uses by default and points the KL loss at it."""
    from gbmpo.engines.verl.args import with_mirror_file
    from gbmpo.objectives import NeuralMirrorMap, get_regularizer

    cfg = load_config(None, [("regularizer", "neural_mirror"), ("coef", 1e-4)])
    path = tmp_path / "mirror_init.json"
    used = with_mirror_file(cfg, path)
    assert cfg.objective.regularizer.params == {}  # the run's config.yaml keeps the spec as is
    default = get_regularizer("neural_mirror").params["mirror"].to_vector()
    assert NeuralMirrorMap.load(path).to_vector().tolist() == default.tolist()
    ov = overrides(used, tmp_path)
    key = "+actor_rollout_ref.actor.policy_loss.gbmpo_objective="
    (line,) = [o for o in ov if o.startswith(key)]
    spec = json.loads(line.split("=", 1)[1][1:-1])  # the objective the plugin builds
    assert spec["regularizer"]["params"] == {"mirror": str(path.resolve())}
    assert with_mirror_file(used, tmp_path / "other.json") is used  # an existing file is kept
