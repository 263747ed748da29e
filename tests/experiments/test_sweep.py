"""``gbmpo compare --sweep``: the option's syntax, the planned runs and their labels, refusals
before anything runs, and an end-to-end sweep on the embedded tiny model (2 arms x 2 values x
1 seed x 2 steps) that is reused on a second call and reported as a frontier."""

from __future__ import annotations

import contextlib
import io
import json
import shutil

import pytest
from test_arms import SMALL

from gbmpo.experiments.grid import GridError, parse_arms, plan_arms
from gbmpo.experiments.sweep import (
    Sweep,
    SweepPoint,
    parse_sweep,
    sweep_label,
    sweep_point,
    sweep_runs,
)
from gbmpo.models import TINY_MODEL_PATH
from gbmpo.train import load_config


def _call(cli, argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli(argv)
    return code, out.getvalue(), err.getvalue()


# ------------------------------------------------------------------------------- syntax


def test_parse_sweep():
    assert parse_sweep(["coef=0.01, 0.05,0.2"]) == Sweep(
        "objective.regularizer.coef", ("0.01", "0.05", "0.2")
    )
    s = parse_sweep(["kl:coef=0.01,0.04", "objective.regularizer.coef=1,2", "none:coef=0"])
    assert s.key == "objective.regularizer.coef" and s.short == "coef"
    assert s.values_for("kl") == ("0.01", "0.04") and s.values_for("other") == ("1", "2")
    assert s.values_for("none") == ("0",)
    only = parse_sweep(["a:objective.surrogate.params.delta=0.1,0.2"])
    assert only.short == "delta" and only.values_for("b") is None  # b runs unswept


@pytest.mark.parametrize(
    ("items", "match"),
    [
        (["coef"], "must look like KEY=V1,V2"),
        ([":coef=1"], "must look like KEY=V1,V2"),
        (["coef=1,,2"], "empty value"),
        (["coef=1", "lr=1"], "one key per grid .* objective.regularizer.coef and optim.lr"),
        (["coef=1", "coef=2"], "values for every arm given twice"),
        (["a:coef=1", "a:coef=2"], "arm 'a' is given values twice"),
        (["seed=1,2"], "run.seed is set by the grid per run; use --seeds"),
        (["task=a,b"], "use --task"),
        (["optim.nope=1"], "--sweep optim.nope: unknown key 'optim.nope'"),
        (["x.params.m=a/b,a_b"], "unknown key 'x'"),
        (["mirror=a/b,a_b"], "the values 'a/b' and 'a_b' give the same run label"),
        ([], "--sweep is empty"),
    ],
)
def test_bad_sweeps(items, match):
    with pytest.raises(GridError, match=match):
        parse_sweep(items)


def test_labels():
    assert sweep_label("kl_k3", "coef", "0.04") == "kl_k3@coef=0.04"
    assert sweep_label("nm", "mirror", "es/best mirror.json") == "nm@mirror=es_best_mirror.json"
    assert sweep_point("kl_k3@coef=0.04") == SweepPoint("kl_k3", "coef", "0.04")
    assert sweep_point("kl_k3@0.04") == SweepPoint("kl_k3", None, "0.04")  # gbmpo report's
    assert sweep_point("kl_k3") is None


# ------------------------------------------------------------------------------- planning


def test_sweep_runs_inside_arms(tmp_path):
    base = load_config(None, [("steps", "3")])
    arms = parse_arms(["kl:regularizer=kl_k3", "atr:surrogate=atr,objective.surrogate.params."
                       "delta=0.02", "none:regularizer=none,coef=0"])  # fmt: skip
    runs = plan_arms(base, arms, [0, 1], tmp_path / "o")
    swept = sweep_runs(runs, parse_sweep(["coef=0.01,0.1", "none:coef=0"]), tmp_path / "o")
    assert [r.name for r in swept] == [
        f"arithmetic/{lab}/seed{s}"
        for lab in ("kl@coef=0.01", "kl@coef=0.1", "atr@coef=0.01", "atr@coef=0.1",
                    "none@coef=0")
        for s in (0, 1)
    ]  # fmt: skip
    by = {(r.label, r.seed): r for r in swept}
    r = by[("atr@coef=0.1", 1)]
    assert r.arm == "atr" and r.coef_source == "--sweep"
    assert r.config.objective.regularizer.coef == 0.1
    assert r.config.objective.surrogate.params == {"delta": 0.02}  # the arm's own settings
    assert r.config.run.seed == 1 and r.config.run.steps == 3
    assert r.run_dir == tmp_path / "o" / "runs" / "arithmetic" / "atr@coef=0.1" / "seed1"
    assert r.config.run.output_dir == str(r.run_dir)
    # an arm without values runs once, unswept
    partial = sweep_runs(runs, parse_sweep(["kl:coef=0.01,0.1"]), tmp_path / "o")
    assert sorted({x.label for x in partial}) == ["atr", "kl@coef=0.01", "kl@coef=0.1", "none"]
    with pytest.raises(GridError, match="unknown arm.* zz; the grid has kl, atr, none"):
        sweep_runs(runs, parse_sweep(["zz:coef=1"]), tmp_path / "o")
    with pytest.raises(GridError, match=r"--sweep objective.regularizer.coef=big \(arm kl\): "
                                        "'objective.regularizer.coef' must be float"):
        sweep_runs(runs, parse_sweep(["coef=0.1,big"]), tmp_path / "o")
    with pytest.raises(GridError, match="the values '0.1' and '1e-1' are the same setting"):
        sweep_runs(runs, parse_sweep(["kl:coef=0.1,1e-1"]), tmp_path / "o")


def test_sweep_value_invalid_for_the_key_fails_before_anything_runs(gbmpo_cli, tmp_path):
    for args, needle in (
        (["--sweep", "rollout.temperature=1.0,-2"],
         "--sweep rollout.temperature=-2 (arm base): "),
        (["--arms", "a:", "--sweep", "surrogate=clip,nope"],
         "--sweep objective.surrogate.name=nope (arm a): "),
        (["--regularizers", "kl_k3", "--sweep", "regularizer=kl_k3,none"], "use --regularizers"),
        (["--regularizers", "kl_k3", "--coefs", "kl_k3=1", "--sweep", "coef=1,2"],
         "--coefs and --sweep objective.regularizer.coef both set"),
        (["--sweep", "coef=1", "--sweep", "lr=1"], "one key per grid"),
    ):  # fmt: skip
        code, _, stderr = _call(gbmpo_cli, ["compare", "--seeds", "0", "--output-dir",
                                            str(tmp_path / "o"), *args, *SMALL])  # fmt: skip
        assert code == 2, stderr
        assert stderr.startswith("gbmpo compare: error:") and needle in stderr
        assert not (tmp_path / "o").exists()


needs_tiny = pytest.mark.skipif(
    not (TINY_MODEL_PATH / "config.json").is_file(), reason="embedded tiny model not built"
)


@needs_tiny
def test_dry_run_lists_the_runs(gbmpo_cli, tmp_path):
    code, stdout, stderr = _call(
        gbmpo_cli, ["compare", "--regularizers", "kl_k3,none", "--sweep", "kl_k3:coef=0.01,0.1",
                    "--seeds", "0,1", "--dry-run", "--output-dir", str(tmp_path / "o"), *SMALL]
    )  # fmt: skip
    assert code == 0, stderr
    assert "[compare] kl_k3@coef=0.1: regularizer kl_k3, coef 0.1 (from --sweep)" in stdout
    for name in ("kl_k3@coef=0.01/seed0", "kl_k3@coef=0.1/seed1", "none/seed1"):
        assert f"arithmetic/{name}: fresh" in stdout
    assert "dry run OK: 6 runs" in stdout and not (tmp_path / "o").exists()


@needs_tiny
@pytest.mark.parametrize("sweep", ["coef=0.04,0.16", "fkl:coef=0.04,0.16"])
def test_sweep_sets_the_coefficient_of_a_regularizer_without_a_default(gbmpo_cli, tmp_path,
                                                                        sweep):
    """fkl has no built-in default coefficient: the sweep gives it its values (without the
    sweep, --regularizers asks for --coefs)."""
    argv = ["compare", "--regularizers", "kl_k3,fkl", "--seeds", "0", "--dry-run",
            "--output-dir", str(tmp_path / "o"), *SMALL]  # fmt: skip
    code, _, stderr = _call(gbmpo_cli, argv)
    assert code == 2 and "no coefficient for 'fkl' (fkl): pass --coefs" in stderr
    code, stdout, stderr = _call(gbmpo_cli, [*argv, "--sweep", sweep])
    assert code == 0, stderr
    for coef in ("0.04", "0.16"):
        assert f"[compare] fkl@coef={coef}: regularizer fkl, coef {coef} (from --sweep)" in stdout
    assert "fkl/seed0" not in stdout  # no unswept fkl run with a made-up coefficient


# ------------------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def sweep_grid(tmp_path_factory, gbmpo_cli):
    """2 arms x 2 coefficients x 1 seed x 2 steps on the tiny model."""
    out = tmp_path_factory.mktemp("sweep") / "grid"
    argv = ["compare", "--arms", "kl:regularizer=kl_k3", "pl:regularizer=prob_l2",
            "--sweep", "coef=0.01,0.1", "--seeds", "0", "--output-dir", str(out),
            *SMALL]  # fmt: skip
    code, stdout, stderr = _call(gbmpo_cli, argv)
    assert code == 0, stderr
    return out, argv, stdout


LABELS = ["kl@coef=0.01", "kl@coef=0.1", "pl@coef=0.01", "pl@coef=0.1"]


@needs_tiny
def test_sweep_grid_trains_every_point(sweep_grid):
    out, _, stdout = sweep_grid
    assert "4 runs: 0 finished (reused), 0 to resume, 4 to train" in stdout
    results = json.loads((out / "results.json").read_text())
    (task,) = results["tasks"]
    assert [g["label"] for g in task["groups"]] == LABELS
    assert [g["coef"] for g in task["groups"]] == [0.01, 0.1, 0.01, 0.1]
    assert [g["regularizer"] for g in task["groups"]] == ["kl_k3", "kl_k3", "prob_l2", "prob_l2"]
    assert task["baseline"] is None  # the first arm is no row of a sweep
    spec = results["grid"]["sweep"]
    assert spec["key"] == "objective.regularizer.coef" and spec["label_key"] == "coef"
    assert spec["points"]["pl@coef=0.1"] == {"arm": "pl", "value": 0.1}
    for label in LABELS:
        run = out / "runs" / "arithmetic" / label / "seed0"
        assert json.loads((run / "summary.json").read_text())["status"] == "finished"
    fr = task["frontier"]
    assert fr is not None  # a sweep
    if "reason" in fr:  # the trainer wrote no drift: the report says so, no frontier PNG
        assert "No frontier: no run has drift.kl" in (out / "report.md").read_text()
        assert not (out / "frontier_arithmetic.png").exists()


def _fabricate_drift(out):
    """Give runs whose summary lacks ``drift`` a known one (until the trainer writes it)."""
    fabricated = False
    kls = {"kl@coef=0.01": 0.3, "kl@coef=0.1": 0.1, "pl@coef=0.01": 0.35, "pl@coef=0.1": 0.05}
    for label, kl in kls.items():
        path = out / "runs" / "arithmetic" / label / "seed0" / "summary.json"
        summary = json.loads(path.read_text())
        if "drift" not in summary:
            summary["drift"] = {"kl": kl, "kl_reverse": kl, "prob_l2": kl / 10, "tv": kl / 2,
                                "entropy": 1.0, "response_length": 8.0, "n_prompts": 4,
                                "n_tokens": 32}  # fmt: skip
            path.write_text(json.dumps(summary))
            fabricated = True
    return fabricated


@needs_tiny
def test_second_call_reuses_and_draws_the_frontier(sweep_grid, gbmpo_cli):
    out, argv, _ = sweep_grid
    fabricated = _fabricate_drift(out)
    code, stdout, stderr = _call(gbmpo_cli, argv)
    assert code == 0, stderr
    assert "4 runs: 4 finished (reused), 0 to resume, 0 to train" in stdout
    results = json.loads((out / "results.json").read_text())
    fr = results["tasks"][0]["frontier"]
    assert [a["arm"] for a in fr["arms"]] == ["kl", "pl"]
    assert [p["value"] for p in fr["arms"][0]["points"]] == ["0.01", "0.1"]
    assert (out / "frontier_arithmetic.png").read_bytes()[:4] == b"\x89PNG"
    md = (out / "report.md").read_text()
    assert "### Accuracy versus drift" in md and "frontier_arithmetic.png" in md
    if fabricated:
        assert fr["matched"]["range"] == pytest.approx([0.1, 0.3])
        assert len(fr["matched"]["rows"]) == 5
    # gbmpo report on the grid's runs groups them by the sweep labels too
    rep = out.parent / "report"
    code, _, stderr = _call(gbmpo_cli, ["report", str(out / "runs"), "--output-dir", str(rep),
                                        "--drift-measure", "tv"])  # fmt: skip
    assert code == 0, stderr
    again = json.loads((rep / "results.json").read_text())["tasks"][0]
    assert [g["label"] for g in again["groups"]] == LABELS
    assert again["frontier"]["measure"] == "tv" and (rep / "frontier_arithmetic.png").is_file()


@needs_tiny
def test_unfinished_sweep_run_is_resumed(sweep_grid, gbmpo_cli):
    out, argv, _ = sweep_grid
    copy = out.parent / "copy"
    shutil.copytree(out, copy)
    (copy / "runs" / "arithmetic" / "pl@coef=0.1" / "seed0" / "summary.json").unlink()
    i = argv.index("--output-dir")
    moved = [*argv[:i], "--output-dir", str(copy), *argv[i + 2:]]
    code, stdout, stderr = _call(gbmpo_cli, [*moved, "--dry-run"])
    assert code == 0, stderr
    assert "arithmetic/pl@coef=0.1/seed0: resume" in stdout
    assert "arithmetic/kl@coef=0.01/seed0: reuse" in stdout
    # the run resumes from its final checkpoint and finishes; the others are reused
    code, stdout, stderr = _call(gbmpo_cli, moved)
    assert code == 0, stderr
    assert "4 runs: 3 finished (reused), 1 to resume, 0 to train" in stdout
    assert "pl@coef=0.1/seed0: resume" in stdout
    assert (copy / "runs" / "arithmetic" / "pl@coef=0.1" / "seed0" / "summary.json").is_file()
