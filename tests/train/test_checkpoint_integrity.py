"""Run-directory integrity (reliability): damaged checkpoints are detected and skipped,
a failed checkpoint write (full disk) keeps the previous one, one process per run directory,
a metrics line cut short by a kill is dropped on resume, the ES map export is never
half-written."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch

from gbmpo.lifecycle.logging import read_metrics, without_timing
from gbmpo.train import Trainer, load_config
from gbmpo.train.checkpoint import (
    LOCK_FILE,
    MANIFEST_FILE,
    CheckpointError,
    RunDirInUseError,
    RunLock,
    latest_valid_checkpoint,
    list_checkpoints,
    verify_checkpoint,
)


def varied_reward(prompts, completions, **columns):
    """Deterministic, with spread inside every group (non-zero advantages)."""
    return [float(len(c) % 3) / 2 for c in completions]


def micro_config(model_dir: Path, out: Path, **extra: str):
    overrides = {
        "model.path": str(model_dir), "rollout.prompts_per_step": "2",
        "rollout.num_generations": "4", "rollout.max_new_tokens": "8", "eval.before": "false",
        "eval.after": "false", "eval.every": "0", "run.time_budget_seconds": "null",
        "run.progress": "false", "optim.lr": "1e-3", "optim.mu": "1",
        "optim.mini_batch_size": "null", "optim.schedule": "constant",
        "run.output_dir": str(out), **extra,
    }
    return load_config(None, list(overrides.items()))

EXTRA = {"run.steps": "4", "run.checkpoint_every": "1", "run.keep_checkpoints": "2"}


def _run(model_dir: Path, out: Path, **extra: str) -> None:
    cfg = micro_config(model_dir, out, **{**EXTRA, **extra})
    Trainer(cfg, reward_fn=varied_reward).train()


def _unfinish(run: Path) -> None:
    """Make a finished run look killed after its last checkpoint."""
    (run / "summary.json").unlink()


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_checkpoints_have_a_manifest_that_verifies(micro_model_dir, tmp_path):
    _run(micro_model_dir, tmp_path / "run")
    found = list_checkpoints(tmp_path / "run")
    assert [s for s, _ in found] == [3, 4]
    for _, path in found:
        manifest = json.loads((path / MANIFEST_FILE).read_text())["files"]
        assert set(manifest) == {"trainable.safetensors", "optimizer.pt", "rng.pt", "state.json"}
        assert verify_checkpoint(path) is None
    assert not [p for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("victim", ["trainable.safetensors", "optimizer.pt", "state.json"])
def test_truncated_latest_checkpoint_falls_back_to_the_previous_one(
    micro_model_dir, tmp_path, capsys, victim
):
    full = tmp_path / "full"
    _run(micro_model_dir, full, **{"run.steps": "6", "run.checkpoint_every": "2"})
    part = tmp_path / "part"
    _run(micro_model_dir, part, **{"run.steps": "4", "run.checkpoint_every": "2"})
    _unfinish(part)
    latest = part / "checkpoints" / "step-4"
    _truncate(latest / victim)
    assert verify_checkpoint(latest)
    assert latest_valid_checkpoint(part).name == "step-2"
    err = capsys.readouterr().err
    assert "step-4" in err and victim in err and "damaged" in err

    Trainer.resume(part, [("run.steps", "6")], reward_fn=varied_reward).train()
    # resumed from step 2: the rows of steps 3-4 were recomputed and equal the straight run's
    a = [without_timing(r) for r in read_metrics(full)]
    b = [without_timing(r) for r in read_metrics(part)]
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    assert a == b
    assert json.loads((part / "summary.json").read_text())["steps"] == 6


def test_no_intact_checkpoint_is_a_clear_error(micro_model_dir, tmp_path):
    run = tmp_path / "run"
    _run(micro_model_dir, run, **{"run.keep_checkpoints": "1"})
    _unfinish(run)
    _truncate(run / "checkpoints" / "step-4" / "trainable.safetensors")
    with pytest.raises(CheckpointError, match=r"no intact checkpoint .*step-4: "
                       r"trainable.safetensors has \d+ bytes, the manifest says \d+"):
        Trainer.resume(run, reward_fn=varied_reward).train()
    assert not (run / "summary.json").exists()


def test_disk_full_during_a_checkpoint_keeps_the_previous_one(
    micro_model_dir, tmp_path, monkeypatch
):
    run = tmp_path / "run"
    cfg = micro_config(micro_model_dir, run, **EXTRA)
    trainer = Trainer(cfg, reward_fn=varied_reward)
    real_save = torch.save
    calls = {"n": 0}

    def full_disk(obj, f, *a, **kw):  # the 3rd checkpoint's optimizer.pt hits a full disk
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *a, **kw)

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(CheckpointError, match=r"could not write checkpoint .*step-3: .*No "
                       r"space left on device; the previous checkpoints are untouched "
                       r"\(step-1, step-2\)"):
        trainer.train()
    monkeypatch.setattr(torch, "save", real_save)
    assert [s for s, _ in list_checkpoints(run)] == [1, 2]
    assert all(verify_checkpoint(p) is None for _, p in list_checkpoints(run))
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]
    status = json.loads((run / "status.json").read_text())
    assert status["status"] == "failed" and "No space left" in status["error"]
    assert not (run / "summary.json").exists()

    Trainer.resume(run, reward_fn=varied_reward).train()
    full = tmp_path / "full"
    _run(micro_model_dir, full)
    assert [without_timing(r) for r in read_metrics(run)] == [
        without_timing(r) for r in read_metrics(full)
    ]


def test_a_second_process_on_the_same_run_directory_is_refused(micro_model_dir, tmp_path):
    run = tmp_path / "run"
    with RunLock(run):  # another process owns the directory (flock is per open file)
        cfg = micro_config(micro_model_dir, run, **EXTRA)
        trainer = Trainer(cfg, reward_fn=varied_reward)  # nothing written yet: passes
        with pytest.raises(RunDirInUseError, match=rf"run directory '{run}' is in use by another "
                           r"gbmpo process \(pid \d+\)"):
            trainer.train()
        assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE]
    # the lock file alone does not make the directory "not empty"; the first run can start
    trainer.train()
    assert (run / "summary.json").is_file()


def test_a_fresh_run_that_lost_the_race_does_not_touch_the_winner(micro_model_dir, tmp_path):
    run = tmp_path / "run"
    first = Trainer(micro_config(micro_model_dir, run, **EXTRA), reward_fn=varied_reward)
    second = Trainer(micro_config(micro_model_dir, run, **EXTRA), reward_fn=varied_reward)
    first.train()  # both passed the constructor's check; the second trains after the first
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match="already exists and is not empty"):
        second.train()
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_a_metrics_line_cut_short_is_dropped_on_resume(micro_model_dir, tmp_path):
    run = tmp_path / "run"
    _run(micro_model_dir, run, **{"run.steps": "2"})
    _unfinish(run)
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "reward_me')  # a kill or a full disk in the middle of a line
    with pytest.raises(ValueError, match="line 3 is not valid JSON"):
        read_metrics(run)
    Trainer.resume(run, [("run.steps", "4")], reward_fn=varied_reward).train()
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4]


def test_es_resume_rewrites_a_half_written_map_export(tmp_path):
    import numpy as np

    from gbmpo.meta.analytic import QuadraticFitness
    from gbmpo.meta.backends import SerialBackend
    from gbmpo.meta.es import ESConfig
    from gbmpo.meta.runner import MIRROR_FILE, export_mirror_map, run_es_loop
    from gbmpo.objectives.mirror import VECTOR_SIZE, NeuralMirrorMap

    cfg = ESConfig(population=4, iterations=2, sigma0=0.1, seed=1)
    fit = QuadraticFitness(target=np.zeros(VECTOR_SIZE))
    out = tmp_path / "es"
    run_es_loop(fit, SerialBackend(), cfg, out, theta0=np.full(VECTOR_SIZE, 0.01),
                export=lambda s, d: export_mirror_map(s, d / MIRROR_FILE))
    good = (out / MIRROR_FILE).read_bytes()
    (out / MIRROR_FILE).write_bytes(good[:100])  # killed during the last export
    with RunLock(out, "ES output"), pytest.raises(RunDirInUseError, match="ES output directory"):
        run_es_loop(fit, SerialBackend(), cfg, out, resume=True)
    run_es_loop(fit, SerialBackend(), cfg, out, resume=True,
                export=lambda s, d: export_mirror_map(s, d / MIRROR_FILE))
    assert (out / MIRROR_FILE).read_bytes() == good
    NeuralMirrorMap.load(out / MIRROR_FILE)


def _es_run(out, iterations=2):
    import numpy as np

    from gbmpo.meta.analytic import QuadraticFitness
    from gbmpo.meta.backends import SerialBackend
    from gbmpo.meta.es import ESConfig
    from gbmpo.meta.runner import run_es_loop

    cfg = ESConfig(population=4, iterations=iterations, sigma0=0.1, seed=1)
    return run_es_loop(QuadraticFitness(target=np.zeros(6)), SerialBackend(), cfg, out,
                       theta0=np.zeros(6), resume=(out / "es_state.json").exists())


def test_es_damaged_state_falls_back_to_the_previous_one_with_a_warning(tmp_path):
    from gbmpo.meta.checkpoint import PREV_STATE_FILE, STATE_FILE, load_state

    out = tmp_path / "es"
    _es_run(out)
    theta = out / "theta" / "iter_0002.safetensors"
    theta.write_bytes(theta.read_bytes()[:50])
    with pytest.warns(RuntimeWarning, match=r"iter_0002.safetensors is damaged.*previous state"):
        state, _ = load_state(out)
    assert state.iteration == 1
    theta.unlink()
    with pytest.warns(RuntimeWarning, match=r"iter_0002.safetensors is missing"):
        assert load_state(out)[0].iteration == 1
    (out / STATE_FILE).write_text('{"format": "gbmpo-es-st')
    with pytest.warns(RuntimeWarning, match=r"es_state.json is damaged \(not valid JSON"):
        assert load_state(out)[0].iteration == 1
    # resuming redoes iteration 2 from iteration 1's state: the same result as the first run
    fresh = _es_run(tmp_path / "fresh")
    with pytest.warns(RuntimeWarning):
        again = _es_run(out)
    assert again.iteration == 2 and (again.theta == fresh.theta).all()
    # both damaged: one error naming both files, nothing is resumed
    (out / STATE_FILE).write_text("{")
    (out / PREV_STATE_FILE).write_text("{")
    with pytest.raises(ValueError, match=r"es_state.json is damaged.*previous state is damaged "
                                         r"too.*es_state.prev.json"):
        load_state(out)


def test_es_state_write_failure_names_the_cause_and_keeps_the_previous_state(
    tmp_path, monkeypatch
):
    import errno

    from gbmpo.meta import checkpoint as es_checkpoint
    from gbmpo.meta.checkpoint import STATE_FILE, load_state
    from gbmpo.train.checkpoint import CheckpointError

    out = tmp_path / "es"
    _es_run(out, iterations=1)
    before = (out / STATE_FILE).read_bytes()

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(es_checkpoint, "save_file", full_disk)
    with pytest.raises(CheckpointError, match=r"iteration 2 .*No space left on device.*"
                                              r"previous es_state.json is untouched"):
        _es_run(out, iterations=2)
    assert (out / STATE_FILE).read_bytes() == before
    assert not list(out.rglob("*.tmp"))
    assert load_state(out)[0].iteration == 1


def test_a_really_full_disk_during_a_checkpoint(micro_model_dir, tmp_path):
    """The same on a real full file system (a tmpfs; root only): the error names ENOSPC."""
    import shutil
    import subprocess

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8M", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        run = mnt / "run"

        class FillsTheDisk(Trainer):
            def _checkpoint(self) -> None:
                super()._checkpoint()
                if self.step == 1:  # leave 64 kB: enough for metrics lines, not a checkpoint
                    free = shutil.disk_usage(mnt).free
                    (mnt / "filler").write_bytes(b"\0" * (free - 64 * 1024))

        cfg = micro_config(micro_model_dir, run, **EXTRA)
        with pytest.raises(CheckpointError, match=r"could not write checkpoint \S*step-2: "
                           r".*No space left on device.*; the previous checkpoints "
                           r"are untouched \(step-1\)"):
            FillsTheDisk(cfg, reward_fn=varied_reward).train()
        assert [s for s, _ in list_checkpoints(run)] == [1]
        assert verify_checkpoint(run / "checkpoints" / "step-1") is None
        assert not (run / "summary.json").exists()
        (mnt / "filler").unlink()
        Trainer.resume(run, reward_fn=varied_reward).train()
        full = tmp_path / "full"
        _run(micro_model_dir, full)
        assert [without_timing(r) for r in read_metrics(run)] == [
            without_timing(r) for r in read_metrics(full)
        ]
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


class _Killed(Exception):
    pass


def test_a_kill_after_the_final_evaluation_row_does_not_duplicate_it(micro_model_dir, tmp_path):
    """Killed after the final evaluation was logged but before the final checkpoint: the resume
    starts from the last periodic checkpoint (same step) and evaluates again; the first
    evaluation's row must not stay in metrics.jsonl (it did: two eval rows at the last step)."""
    extra = {**EXTRA, "run.checkpoint_every": "2", "eval.after": "true", "eval.limit": "2",
             "eval.max_new_tokens": "4"}

    class KilledBeforeFinalCheckpoint(Trainer):
        def _checkpoint(self) -> None:
            if self.step == 4 and self.last_eval is not None:  # after the loop's own one
                raise _Killed
            super()._checkpoint()

    run = tmp_path / "run"
    with pytest.raises(_Killed):
        KilledBeforeFinalCheckpoint(micro_config(micro_model_dir, run, **extra),
                                    reward_fn=varied_reward).train()
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4, 4]
    Trainer.resume(run, reward_fn=varied_reward).train()
    full = tmp_path / "full"
    Trainer(micro_config(micro_model_dir, full, **extra), reward_fn=varied_reward).train()
    a = [without_timing(r) for r in read_metrics(full)]
    assert [r["step"] for r in a] == [1, 2, 3, 4, 4]
    assert [without_timing(r) for r in read_metrics(run)] == a
