"""``gbmpo compare`` end to end with the embedded tiny model on a minimal grid (2 regularizers x
2 seeds x 2 RL steps, 4-problem evaluation): runs, report, reuse, resume, bad input."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from gbmpo.models import TINY_MODEL_PATH

pytestmark = pytest.mark.skipif(
    not (TINY_MODEL_PATH / "config.json").is_file(), reason="embedded tiny model not built"
)

SMALL = [
    "--steps", "2",
    "--time-budget", "null",
    "--rollout.prompts_per_step", "2",
    "--num-generations", "2",
    "--optim.mini_batch_size", "null",
    "--max-new-tokens", "8",
    "--eval.limit", "4",
    "--eval.max_new_tokens", "8",
    "--eval-every", "0",
    "--run.checkpoint_every", "0",
]
GRID = ["compare", "--regularizers", "kl_k3,none", "--seeds", "0,1"]


def _call(cli, argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli(argv)
    return code, out.getvalue(), err.getvalue()


def _stamps(out: Path) -> dict[str, tuple[float, float]]:
    return {
        str(p.relative_to(out)): (
            p.stat().st_mtime_ns,
            (p.parent / "metrics.jsonl").stat().st_mtime_ns,
        )
        for p in (out / "runs").rglob("summary.json")
    }


@pytest.fixture(scope="module")
def grid(tmp_path_factory, gbmpo_cli):
    out = tmp_path_factory.mktemp("compare") / "grid"
    code, stdout, stderr = _call(gbmpo_cli, [*GRID, "--output-dir", str(out), *SMALL])
    assert code == 0, stderr
    return out, stdout


def test_grid_runs_every_cell_and_reports(grid):
    out, stdout = grid
    assert "0 finished (reused), 0 to resume, 4 to train" in stdout
    for label in ("kl_k3", "none"):
        for seed in (0, 1):
            run = out / "runs" / "arithmetic" / label / f"seed{seed}"
            summary = json.loads((run / "summary.json").read_text())
            assert summary["steps"] == 2 and summary["seed"] == seed
            assert summary["regularizer"] == label
            assert summary["eval_after"]["n"] == 4
            metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
            assert [m["step"] for m in metrics if "reward_mean" in m] == [1, 2]
    results = json.loads((out / "results.json").read_text())
    (task,) = results["tasks"]
    assert task["task"] == "arithmetic" and task["metric"] == "accuracy"
    assert [g["label"] for g in task["groups"]] == ["kl_k3", "none"]
    for g in task["groups"]:
        assert g["seeds"] == [0, 1]
        finals = [r["final"] for r in g["runs"]]
        assert g["final"]["mean"] == pytest.approx(sum(finals) / 2)
        assert g["final"]["std"] == pytest.approx(abs(finals[0] - finals[1]) / 2**0.5)
    assert task["groups"][0]["coef"] == 0.04 and task["groups"][1]["coef"] == 0.0
    assert task["groups"][1]["paired_vs_baseline"]["baseline"] == "kl_k3"
    grid_spec = results["grid"]
    assert grid_spec["seeds"] == [0, 1]
    assert [r["coef_source"] for r in grid_spec["regularizers"]] == ["default", "default"]
    assert results["failures"] == {}
    assert (out / "report.html").is_file()
    assert (out / "curves_arithmetic.png").read_bytes()[:4] == b"\x89PNG"
    assert "| kl_k3 | 0.04 | 0,1 |" in (out / "report.md").read_text()


def test_reinvoking_reuses_finished_runs_and_resumes_unfinished(grid, gbmpo_cli):
    out, _ = grid
    before = _stamps(out)
    results_before = json.loads((out / "results.json").read_text())
    code, stdout, stderr = _call(gbmpo_cli, [*GRID, "--output-dir", str(out), *SMALL])
    assert code == 0, stderr
    assert "4 finished (reused), 0 to resume, 0 to train" in stdout
    assert _stamps(out) == before  # nothing was retrained or rewritten
    results = json.loads((out / "results.json").read_text())
    assert results["tasks"] == results_before["tasks"]

    # an interrupted run (no summary.json) is resumed; the others stay untouched
    victim = out / "runs" / "arithmetic" / "none" / "seed1"
    (victim / "summary.json").unlink()
    code, stdout, stderr = _call(gbmpo_cli, [*GRID, "--output-dir", str(out), *SMALL])
    assert code == 0, stderr
    assert "3 finished (reused), 1 to resume, 0 to train" in stdout
    assert (victim / "summary.json").is_file()
    after = _stamps(out)
    key = str((victim / "summary.json").relative_to(out))
    assert {k: v for k, v in after.items() if k != key} == {
        k: v for k, v in before.items() if k != key
    }


def test_changed_settings_do_not_silently_reuse(grid, gbmpo_cli):
    out, _ = grid
    argv = [*GRID, "--output-dir", str(out), *SMALL, "--optim.lr", "1e-3"]
    code, _, stderr = _call(gbmpo_cli, argv)
    assert code == 2
    assert "different configuration (optim.lr)" in stderr


def test_dry_run_plans_without_training(grid, gbmpo_cli, tmp_path):
    out, _ = grid
    code, stdout, _ = _call(
        gbmpo_cli, ["compare", "--regularizers", "kl_k3,prob_l2", "--seeds", "0",
                    "--output-dir", str(out), "--dry-run", *SMALL]
    )
    assert code == 0
    assert "arithmetic/kl_k3/seed0: reuse" in stdout
    assert "arithmetic/prob_l2/seed0: fresh" in stdout
    assert "prob_l2: regularizer prob_l2, coef 0.05 (from config)" in stdout
    assert not (out / "runs" / "arithmetic" / "prob_l2").exists()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--regularizer", "kl_k3"], "use --regularizers"),
        (["--seed", "3"], "use --seeds"),
        (["--backend", "gpu"], "unknown backend 'gpu'"),
        (["--optim.learning_rate", "1"], "unknown key 'optim.learning_rate'"),
        (["--coefs", "kl=1"], "unknown label"),
        (["--regularizer-params", "[1]"], "must map labels"),
    ],
)
def test_bad_input_exit_2(gbmpo_cli, tmp_path, args, needle):
    code, _, stderr = _call(
        gbmpo_cli, ["compare", "--regularizers", "kl_k3", "--output-dir", str(tmp_path / "o"),
                    *args]
    )
    assert code == 2
    assert needle in stderr and stderr.startswith("gbmpo compare: error:")
    assert not (tmp_path / "o").exists()


def test_local_backend_and_evaluation_of_runs_without_eval_after(gbmpo_cli, tmp_path):
    """A run trained with eval.after false is evaluated by compare (compare_eval.json), on a
    one-worker process pool of gbmpo.meta.backends."""
    out = tmp_path / "o"
    argv = ["compare", "--regularizers", "prob_l2", "--seeds", "0", "--backend", "local",
            "--workers", "1", "--output-dir", str(out), *SMALL,
            "--eval.before", "false", "--eval.after", "false", "--no-plots"]
    code, stdout, stderr = _call(gbmpo_cli, argv)
    assert code == 0, stderr
    run = out / "runs" / "arithmetic" / "prob_l2" / "seed0"
    assert json.loads((run / "summary.json").read_text())["eval_after"] is None
    cached = json.loads((run / "compare_eval.json").read_text())
    assert cached["metrics"]["n"] == 4 and 0.0 <= cached["metrics"]["accuracy"] <= 1.0
    results = json.loads((out / "results.json").read_text())
    group = results["tasks"][0]["groups"][0]
    assert group["final"]["mean"] == cached["metrics"]["accuracy"]
    assert group["before"] is None


def test_main_gbmpo_cli_has_compare_and_report(tmp_path, capsys):
    """Once the lead wires the subcommands into ``gbmpo.cli``, they reach this module."""
    import gbmpo.cli

    if "add_compare_parser" not in Path(gbmpo.cli.__file__).read_text():
        pytest.skip("compare/report are not wired into gbmpo.cli yet")
    code = gbmpo.cli.main(["compare", "--regularizers", "kl_k3", "--seeds", "0", "--dry-run",
                           "--output-dir", str(tmp_path / "o"), "--steps", "3"])
    assert code == 0
    assert "arithmetic/kl_k3/seed0: fresh" in capsys.readouterr().out


def test_match_drift_controls_every_regularizer_but_none(gbmpo_cli, tmp_path):
    """``--match-drift``: each arm's regularizer gets the control (its coefficient the first
    step's), the arm without one stays so; a sweep of the coefficient is refused."""
    from gbmpo.experiments.grid import match_drift, parse_regularizers, plan_grid
    from gbmpo.objectives.drift_control import DriftControl
    from gbmpo.train import load_config

    out = tmp_path / "grid"
    argv = ["compare", "--regularizers", "kl_k3,prob_l2,none", "--seeds", "0",
            "--match-drift", "0.02", "--match-horizon", "5", "--output-dir", str(out),
            "--dry-run", *SMALL]  # fmt: skip
    code, stdout, _ = _call(gbmpo_cli, argv)
    assert code == 0
    assert "kl_k3: regularizer kl_k3, coef 0.04 (controlled: kl -> 0.02)" in stdout
    assert "none: regularizer none, coef 0 (from default)" in stdout
    want = DriftControl(target=0.02, horizon=5.0)
    runs = plan_grid(load_config(None), parse_regularizers("kl_k3,prob_l2,none"), [0], out)
    controls = {r.label: r.config.objective.regularizer.control
                for r in match_drift(runs, want)}  # fmt: skip
    assert all(r.config.objective.regularizer.control is None for r in runs)  # copies
    assert controls == {"kl_k3": want, "prob_l2": want, "none": None}
    code, _, stderr = _call(gbmpo_cli, [*argv, "--sweep", "coef=0.1,0.2"])
    assert code == 2 and "--match-drift sets every coefficient" in stderr
