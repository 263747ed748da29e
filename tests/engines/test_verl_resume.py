"""``gbmpo train --resume DIR`` for ``--engine verl`` runs, without GPUs: the run directory
records where verl keeps its checkpoints (``verl_launch.json``), the resume's overrides are the
launch's (same run directory, data, checkpoint directory) plus verl's resume settings, a real
resume without GPUs exits 2 writing nothing, and metrics.jsonl joins the parts."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from gbmpo.cli import main
from gbmpo.config import dump_yaml, load_config
from gbmpo.config.support import VERL_REQUIRED
from gbmpo.engines.verl import args as verl_args
from gbmpo.engines.verl import metrics as verl_metrics
from gbmpo.engines.verl import runner as verl_runner
from gbmpo.engines.verl.objective import hydra_value

RESUME_KEYS = ("trainer.resume_mode=", "trainer.resume_from_path=", "trainer.val_before_train=")


def _cfg(*settings: tuple[str, Any]) -> Any:
    # on GPUs: a real resume here must stop for want of them (a CPU resume trains:
    # tests/engines/test_verl_cpu_train.py); no drift (it merges a real checkpoint)
    return load_config(None, [("engine", "verl"), *VERL_REQUIRED.items(),
                              ("model.device", "cuda"), ("eval.drift", False),
                              *settings])  # fmt: skip


def _verl_run(tmp_path: Path, step: int | None) -> Path:
    """A verl run directory as the launch leaves it, killed after verl's checkpoint of
    ``step`` (``None``: before any)."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    cfg = _cfg()
    cfg.run.output_dir = str(run)
    (run / "config.yaml").write_text(dump_yaml(cfg))
    (run / verl_runner.LAUNCH_FILE).write_text(json.dumps({
        "verl_checkpoints": str(run.resolve() / "checkpoints"), "model_path": "/models/tiny",
        "max_prompt_length": 40, "n_eval": 8, "kind": "math"}))  # fmt: skip
    if step is not None:
        (run / "checkpoints" / f"global_step_{step}" / "actor").mkdir(parents=True)
        (run / "checkpoints" / "latest_checkpointed_iteration.txt").write_text(str(step))
    return run


def test_resume_overrides_are_the_launch_plus_verl_resume_settings(tmp_path: Path) -> None:
    run = _verl_run(tmp_path, 4)
    cfg = _cfg()
    ov, step = verl_runner.resume_overrides(cfg, run)
    assert step == 4
    launch = verl_args.overrides(verl_args.with_mirror_file(cfg, run / "mirror_init.json"), run,
                            model_path="/models/tiny", max_prompt_length=40)  # fmt: skip
    assert [o for o in ov if not o.startswith(RESUME_KEYS)] == [
        o for o in launch if not o.startswith(RESUME_KEYS)]  # fmt: skip
    ckpts = run.resolve() / "checkpoints"
    assert f"trainer.default_local_dir={hydra_value(str(ckpts))}" in ov
    train = run.resolve() / "data" / "train.parquet"
    assert f"data.train_files={hydra_value(str(train))}" in ov
    assert "trainer.resume_mode=resume_path" in ov
    assert f"trainer.resume_from_path={hydra_value(str(ckpts / 'global_step_4'))}" in ov
    assert "trainer.val_before_train=false" in ov  # the first part's evaluation is kept
    assert sum(o.startswith("trainer.val_before_train=") for o in ov) == 1


def test_without_a_checkpoint_the_run_starts_over(tmp_path: Path) -> None:
    run = _verl_run(tmp_path, None)
    ov, step = verl_runner.resume_overrides(_cfg(), run)
    assert step == 0 and "trainer.resume_mode=disable" in ov
    assert "trainer.val_before_train=true" in ov


def test_resume_dry_run_prints_the_overrides(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = _verl_run(tmp_path, 6)
    before = sorted(p.name for p in run.rglob("*"))
    assert main(["train", "--resume", str(run), "--dry-run", "--steps", "20"]) == 0
    report = json.loads(capsys.readouterr().out.split("dry run OK: ", 1)[1])
    assert report["engine"] == "verl" and report["resume_step"] == 6
    assert "trainer.total_training_steps=20" in report["overrides"]  # a resumable override
    assert "trainer.resume_mode=resume_path" in report["overrides"]
    assert sorted(p.name for p in run.rglob("*")) == before


def test_refusals(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = _verl_run(tmp_path, 2)
    assert main(["train", "--resume", str(run), "--dry-run", "--lr", "1"]) == 2
    assert "cannot change 'optim.lr' when resuming" in capsys.readouterr().err
    (run / verl_runner.LAUNCH_FILE).unlink()
    assert main(["train", "--resume", str(run), "--dry-run"]) == 2
    assert "no readable verl_launch.json" in capsys.readouterr().err
    (run / "summary.json").write_text("{}")
    assert main(["train", "--resume", str(run)]) == 2
    assert "the run already finished" in capsys.readouterr().err


def test_real_resume_without_gpus_exits_2_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the resume would start")
    run = _verl_run(tmp_path, 4)
    (run / verl_metrics.VERL_METRICS_FILE).write_text(json.dumps({"step": 5, "data": {}}) + "\n")
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in run.rglob("*") if p.is_file()}
    assert main(["train", "--resume", str(run)]) == 2
    err = capsys.readouterr().err
    assert "engine verl needs" in err and len(err.strip().splitlines()) == 1
    after = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in run.rglob("*") if p.is_file()}
    assert after == before


def test_metrics_join_the_parts_before_and_after_a_resume(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    cfg = _cfg()

    def rows(*steps: int) -> str:
        return "".join(json.dumps({"step": s, "data": {"actor/pg_loss": s / 10,
                                                       "training/global_step": s}}) + "\n"
                       for s in steps)  # fmt: skip

    (run / verl_metrics.VERL_EARLIER_METRICS_FILE).write_text(rows(1, 2))
    (run / verl_metrics.VERL_METRICS_FILE).write_text(rows(3, 4))
    summary = verl_metrics.summarize_run(cfg, run, kind="math", wall_seconds=1.0)
    got = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in got] == [1, 2, 3, 4] and summary["steps"] == 4


def test_resume_without_a_checkpoint_exits_1_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Killed before verl's first checkpoint: one line, exit 1, the directory unchanged (the
    user starts it over with ``--restart``)."""
    run = _verl_run(tmp_path, None)
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in run.rglob("*") if p.is_file()}
    assert main(["train", "--resume", str(run)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no checkpoint" in err[0] and "--restart" in err[0]
    after = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in run.rglob("*") if p.is_file()}
    assert after == before


def test_resume_at_the_last_checkpointed_step_launches_nothing_and_finishes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stopped after verl's checkpoint of the last step but before the summary: verl's loop
    would train one step more (it advances before it checks for the end), so the resume launches
    nothing (not even on a machine without verl's GPUs) and writes the summary from the rows up
    to that checkpoint, then ``finished``."""
    run = _verl_run(tmp_path, 4)
    cfg = load_config(run / "config.yaml")
    cfg.run.steps = 4
    (run / "config.yaml").write_text(dump_yaml(cfg))
    rows = "".join(json.dumps({"step": s, "data": {"actor/pg_loss": s / 10,
                                                   "training/global_step": s}}) + "\n"
                   for s in (1, 2, 3, 4))  # fmt: skip
    (run / verl_metrics.VERL_METRICS_FILE).write_text(rows)

    def no_launch(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("verl was launched")

    monkeypatch.setattr(verl_runner, "_launch", no_launch)
    summary = verl_runner.resume(run)
    assert summary["steps"] == 4
    status = json.loads((run / "status.json").read_text())
    assert status["status"] == "finished" and status["engine"] == "verl"
    assert json.loads((run / "summary.json").read_text())["steps"] == 4
    got = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert got == [1, 2, 3, 4]


def test_resume_after_the_step_that_spent_the_budget_launches_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed after verl's checkpoint of the step that spent the time budget (the driver hooks'
    RL clock in its row) but before the summary: the run ended there, as the uninterrupted
    run did; nothing is launched and the summary says time_budget. The parts' RL seconds reach
    the next launch when the budget is not spent yet."""
    run = _verl_run(tmp_path, 2)
    cfg = load_config(run / "config.yaml")
    cfg.run.steps, cfg.run.time_budget_seconds = 10, 5.0
    (run / "config.yaml").write_text(dump_yaml(cfg))
    rows = "".join(json.dumps({"step": s, "data": {"actor/pg_loss": s / 10,
                                                   "training/global_step": s,
                                                   "gbmpo/rl_seconds": 3.0 * s}}) + "\n"
                   for s in (1, 2))  # fmt: skip
    (run / verl_metrics.VERL_METRICS_FILE).write_text(rows)

    def no_launch(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("verl was launched")

    monkeypatch.setattr(verl_runner, "_launch", no_launch)
    summary = verl_runner.resume(run)
    assert summary["steps"] == 2 and summary["stop_reason"] == "time_budget"
    assert summary["rl_seconds"] == 6.0
    # with a larger budget the run goes on, its clock starting from the parts before
    assert verl_runner._rl_seconds(run, 1) == 3.0


def test_a_checkpoint_whose_step_was_not_logged_is_not_resumed_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """verl saves a step's checkpoint before it logs the step's row: stopped in between (seen
    under load, verl finishing steps after the signal), the newest checkpoint (4) has no row.
    The resume continues from the newest checkpoint whose step was logged (3), so step 4 is
    trained and logged again; with ``--steps 4`` it is launched, not taken as finished."""
    run = _verl_run(tmp_path, 4)
    (run / "checkpoints" / "global_step_3" / "actor").mkdir(parents=True)
    cfg = load_config(run / "config.yaml")
    cfg.run.steps = 4
    (run / "config.yaml").write_text(dump_yaml(cfg))
    rows = "".join(json.dumps({"step": s, "data": {"actor/pg_loss": s / 10,
                                                   "training/global_step": s}}) + "\n"
                   for s in (1, 2, 3))  # fmt: skip
    (run / verl_metrics.VERL_METRICS_FILE).write_text(rows)
    ov, step = verl_runner.resume_overrides(cfg, run)
    ckpts = run.resolve() / "checkpoints"
    assert step == 3
    assert f"trainer.resume_from_path={hydra_value(str(ckpts / 'global_step_3'))}" in ov
    launched: list[int] = []
    monkeypatch.setattr(verl_runner, "_gpu_python", lambda cfg: sys.executable)
    monkeypatch.setattr(verl_runner, "_launch", lambda *a, **k: launched.append(1) or {})
    verl_runner.resume(run)
    assert launched == [1]
    # without the checkpoint of a logged step, the newest one (the row of 4 stays missing)
    (run / "checkpoints" / "global_step_3" / "actor").rmdir()
    (run / "checkpoints" / "global_step_3").rmdir()
    assert verl_runner.resume_overrides(cfg, run)[1] == 4
