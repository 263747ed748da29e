"""``gbmpo compare --arms``: arm syntax (inline and YAML), per-arm configurations, the paired
t-test, the training-dynamics table (entropy, clip fractions), and end-to-end runs of a
surrogate grid (dry run) and an RPG-forms grid (trained) on the embedded tiny model."""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import pytest
from scipy import stats as sstats

from gbmpo.experiments.grid import GridArm, GridError, parse_arms, plan_arms
from gbmpo.experiments.stats import paired_t_test
from gbmpo.models import TINY_MODEL_PATH
from gbmpo.train import load_config

ATR = "atr:objective.surrogate.name=atr,objective.surrogate.params.delta=0.02"


def _call(cli, argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli(argv)
    return code, out.getvalue(), err.getvalue()


# ------------------------------------------------------------------------------ arm syntax


def test_parse_inline_arms():
    arms = parse_arms(["ratio:objective.surrogate.name=clip", ATR, "base:"])
    assert arms == [
        GridArm("ratio", (("objective.surrogate.name", "clip"),)),
        GridArm("atr", (("objective.surrogate.name", "atr"),
                        ("objective.surrogate.params.delta", "0.02"))),
        GridArm("base", ()),
    ]  # fmt: skip
    # aliases are canonicalised; a comma not followed by key= stays in the value
    (arm,) = parse_arms(["x:surrogate=clip,lr=1e-4,task.params.ops=[add,sub]"])
    assert arm.overrides == (
        ("objective.surrogate.name", "clip"), ("optim.lr", "1e-4"),
        ("task.params.ops", "[add,sub]"),
    )  # fmt: skip


def test_parse_arms_file(tmp_path):
    f = tmp_path / "arms.yaml"
    f.write_text(
        "arms:\n"
        "  ratio: {objective.surrogate.name: clip}\n"
        "  k1:\n"
        "    objective:\n"
        "      surrogate: {name: divergence_clip, params: {measure: k1, delta: 0.2}}\n"
        "  base:\n"
    )
    arms = parse_arms([str(f)])
    assert [a.label for a in arms] == ["ratio", "k1", "base"]
    assert arms[1].overrides == (
        ("objective.surrogate.name", "divergence_clip"),
        ("objective.surrogate.params.measure", "k1"),
        ("objective.surrogate.params.delta", 0.2),
    )
    assert arms[2].overrides == ()


@pytest.mark.parametrize(
    ("items", "match"),
    [
        (["ratio"], "must look like LABEL:key=value"),
        (["a/b:lr=1"], "bad arm label 'a/b'"),
        (["x:lr"], "'lr' in arm 'x' must look like key=value"),
        (["x:lr=1", "x:lr=2"], "'x' appears twice"),
        (["x:run.seed=3"], "sets run.seed, which the grid sets per run; use --seeds"),
        (["x:task=gsm8k"], "use --task"),
        (["x:output-dir=/tmp/x"], "use --output-dir"),
        (["/nonexistent/arms.yaml"], "the arms file does not exist"),
        ([" "], "--arms is empty"),
    ],
)
def test_bad_arms(items, match):
    with pytest.raises(GridError, match=match):
        parse_arms(items)


def test_bad_arms_files(tmp_path):
    f = tmp_path / "a.yaml"
    for text, match in (("[1, 2]", "expected a mapping of arm labels"),
                        ("a: [1]", "arm 'a' must map setting keys"),
                        ("a: {b: [}", "not valid YAML")):  # fmt: skip
        f.write_text(text)
        with pytest.raises(GridError, match=match):
            parse_arms([str(f)])


def test_plan_arms_configs(tmp_path):
    base = load_config(None, [("objective.surrogate.params.eps_low", "0.1"), ("steps", "7")])
    arms = parse_arms([
        "ratio:",
        "k2:objective.surrogate.name=divergence_clip,objective.surrogate.params.measure=k2,"
        "objective.surrogate.params.delta=0.02",
        "none:objective.regularizer.name=none,objective.regularizer.coef=0",
    ])  # fmt: skip
    runs = plan_arms(base, arms, [0, 1], tmp_path / "o")
    assert [r.name for r in runs] == [f"arithmetic/{a}/seed{s}" for a in ("ratio", "k2", "none")
                                      for s in (0, 1)]  # fmt: skip
    cfg = {r.label: r.config for r in runs if r.seed == 1}
    assert cfg["ratio"].objective.surrogate.params == {"eps_low": 0.1}  # the base's own
    # switching the surrogate drops the base's clip parameters (they belong to 'clip')
    assert cfg["k2"].objective.surrogate.params == {"measure": "k2", "delta": 0.02}
    assert cfg["none"].objective.regularizer.name == "none"
    assert cfg["none"].objective.surrogate.params == {"eps_low": 0.1}
    assert all(c.run.steps == 7 and c.run.seed == 1 for c in cfg.values())
    assert runs[3].run_dir == tmp_path / "o" / "runs" / "arithmetic" / "k2" / "seed1"
    with pytest.raises(GridError, match="arm 'x': unknown key 'optim.learning_rate'"):
        plan_arms(base, parse_arms(["x:optim.learning_rate=1"]), [0], tmp_path / "o")
    with pytest.raises(GridError, match="arithmetic/x: .*unknown measure 'js'"):
        plan_arms(base, parse_arms(["x:surrogate=divergence_clip,"
                                    "objective.surrogate.params.measure=js,"
                                    "objective.surrogate.params.delta=1"]), [0], tmp_path)


# ------------------------------------------------------------------------ paired t-test


def test_paired_t_test_matches_scipy():
    a, b = [0.80, 0.72, 0.85, 0.61], [0.70, 0.75, 0.83, 0.60]
    t, p = paired_t_test([x - y for x, y in zip(a, b, strict=True)])
    ref = sstats.ttest_rel(a, b)
    assert t == pytest.approx(ref.statistic, rel=1e-12)
    assert p == pytest.approx(ref.pvalue, rel=1e-12)
    assert paired_t_test([0.1]) is None and paired_t_test([0.05, 0.05]) is None


# ---------------------------------------------------------------------------- the report


def _with_dynamics(path: Path, entropy0: float, clip_low: float, clip_high: float) -> None:
    """Add entropy (falling by 0.01 a step from ``entropy0``) and clip fractions to a fake run's
    metrics."""
    lines = []
    for line in (path / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "reward_mean" in rec:
            rec.update(entropy=entropy0 - 0.01 * rec["step"], clip_frac_low=clip_low,
                       clip_frac_high=clip_high, clip_frac_dual=0.0)  # fmt: skip
        lines.append(json.dumps(rec))
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_report_dynamics_and_p_values(tmp_path, make_run, gbmpo_cli):
    root = tmp_path / "runs"
    for seed, (a, b) in enumerate([(0.70, 0.80), (0.75, 0.72), (0.83, 0.85)]):
        _with_dynamics(make_run(root / f"kl{seed}", regularizer="kl_k3", coef=0.04, seed=seed,
                                final=a), 1.0 + seed, 0.01, 0.02)  # fmt: skip
        _with_dynamics(make_run(root / f"pl{seed}", regularizer="prob_l2", seed=seed, final=b),
                       2.0, 0.03 * (seed + 1), 0.0)  # fmt: skip
    out = tmp_path / "report"
    assert gbmpo_cli(["report", str(root), "--output-dir", str(out), "--no-plots"]) == 0
    results = json.loads((out / "results.json").read_text())
    kl, pl = results["tasks"][0]["groups"]
    # 20 steps: entropy e0 - 0.01 s; first 10 steps mean e0 - 0.055, last 10 e0 - 0.155
    assert kl["entropy_first"]["mean"] == pytest.approx(2.0 - 0.055)
    assert kl["entropy_first"]["std"] == pytest.approx(1.0)
    assert kl["entropy_last"]["mean"] == pytest.approx(2.0 - 0.155)
    assert pl["clip_frac_low"]["mean"] == pytest.approx(0.06)
    assert pl["clip_frac_high"]["mean"] == 0.0
    assert kl["clip_frac_high"]["mean"] == pytest.approx(0.02)
    ref = sstats.ttest_rel([0.80, 0.72, 0.85], [0.70, 0.75, 0.83])
    assert pl["paired_vs_baseline"]["p_value"] == pytest.approx(ref.pvalue)
    md = (out / "report.md").read_text()
    assert f"| {ref.pvalue:.2f} |" in md and "p (paired t)" in md
    assert "| regularizer | coef | seeds |" in md  # a regularizer grid names its rows so
    assert "| prob_l2 | 1.945 ± 0.000 | 1.845 ± 0.000 | 6.00 ± 3.00 | 0.00 ± 0.00 |" in md
    assert "Training dynamics" in (out / "report.html").read_text()


# --------------------------------------------------------------------------- the CLI

needs_tiny = pytest.mark.skipif(
    not (TINY_MODEL_PATH / "config.json").is_file(), reason="embedded tiny model not built"
)

SMALL = [
    "--steps", "2",
    "--time-budget", "null",
    "--rollout.prompts_per_step", "2",
    "--num-generations", "2",
    "--optim.mini_batch_size", "2",
    "--max-new-tokens", "8",
    "--eval.limit", "4",
    "--eval.max_new_tokens", "8",
    "--eval-every", "0",
    "--run.checkpoint_every", "0",
]  # fmt: skip


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ([], "give exactly one of --arms"),
        (["--arms", "a:", "--regularizers", "kl_k3"], "give exactly one of --arms"),
        (["--arms", "ratio"], "must look like LABEL:key=value"),
        (["--arms", "x:foo.bar=1"], "arm 'x': unknown key 'foo'"),
        (["--arms", "x:seed=1"], "use --seeds"),
        (["--arms", "x:", "--coefs", "x=1"], "--coefs goes with --regularizers"),
        (["--arms", "x:objective.surrogate.name=atr"], "missing 1 required positional"),
        (["--arms", "x:surrogate=nope"], "valid names"),
    ],
)
def test_bad_arms_exit_2(gbmpo_cli, tmp_path, args, needle):
    code, _, stderr = _call(gbmpo_cli, ["compare", "--output-dir", str(tmp_path / "o"), *args])
    assert code == 2
    assert needle in stderr and stderr.startswith("gbmpo compare: error:")
    assert not (tmp_path / "o").exists()


@needs_tiny
def test_surrogate_grid_dry_run(gbmpo_cli, tmp_path):
    """The clip-measure grid plans every arm with its own surrogate and validated parameters."""
    measures = {"k1": 0.2, "k2": 0.02, "prob_l2": 0.02}
    arms = ["ratio:objective.surrogate.name=clip", ATR] + [
        f"{m}:objective.surrogate.name=divergence_clip,objective.surrogate.params.measure={m},"
        f"objective.surrogate.params.delta={d}"
        for m, d in measures.items()
    ]
    code, stdout, stderr = _call(
        gbmpo_cli, ["compare", "--arms", *arms, "--seeds", "0,1", "--dry-run",
                    "--output-dir", str(tmp_path / "o"), *SMALL]
    )  # fmt: skip
    assert code == 0, stderr
    assert "atr: surrogate atr {'delta': 0.02}, regularizer prob_l2, coef 0.05" in stdout
    assert "prob_l2: surrogate divergence_clip {'measure': 'prob_l2', 'delta': 0.02}" in stdout
    assert "arithmetic/k2/seed1: fresh" in stdout and "dry run OK: 10 runs" in stdout
    assert not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def rpg_grid(tmp_path_factory, gbmpo_cli):
    """An RPG-forms grid (REINFORCE vs RPG-style clip, both URKL with the rollout anchor),
    2 arms x 1 seed x 2 steps, from an arms file."""
    root = tmp_path_factory.mktemp("arms")
    arms = root / "rpg.yaml"
    arms.write_text(
        "reinforce_urkl:\n"
        "  objective.surrogate.name: rpg_reinforce\n"
        "  objective.surrogate.params: {variant: urkl, beta: 0.01}\n"
        "clip_urkl:\n"
        "  objective.surrogate.name: rpg_clip\n"
        "  objective.surrogate.params: {variant: urkl, beta: 0.01}\n"
    )
    out = root / "grid"
    argv = ["compare", "--arms", str(arms), "--seeds", "0", "--output-dir", str(out), *SMALL,
            "--objective.advantage", "rpg", "--objective.regularizer.name", "none",
            "--objective.regularizer.coef", "0"]  # fmt: skip
    code, stdout, stderr = _call(gbmpo_cli, argv)
    assert code == 0, stderr
    return out, argv, stdout


@needs_tiny
def test_rpg_forms_grid_runs_and_reports_dynamics(rpg_grid):
    out, _, stdout = rpg_grid
    assert "0 finished (reused), 0 to resume, 2 to train" in stdout
    results = json.loads((out / "results.json").read_text())
    (task,) = results["tasks"]
    assert [g["label"] for g in task["groups"]] == ["reinforce_urkl", "clip_urkl"]
    assert [g["surrogate"] for g in task["groups"]] == ["rpg_reinforce", "rpg_clip"]
    assert task["baseline"] == "reinforce_urkl"  # the first arm
    for g in task["groups"]:
        run = out / "runs" / "arithmetic" / g["label"] / "seed0"
        cfg = (run / "config.yaml").read_text()
        assert f"name: {g['surrogate']}" in cfg and "variant: urkl" in cfg
        assert math.isfinite(g["entropy_last"]["mean"]) and g["entropy_last"]["mean"] > 0
        assert 0.0 <= g["clip_frac_low"]["mean"] <= 1 and 0.0 <= g["clip_frac_high"]["mean"] <= 1
    spec = results["grid"]["arms"]
    assert spec[0]["overrides"][0] == ["objective.surrogate.name", "rpg_reinforce"]
    md = (out / "report.md").read_text()
    assert "Training dynamics" in md and "`clip_urkl`: objective.surrogate.name=rpg_clip" in md
    assert md.count("| arm | coef | seeds |") == 1 and md.count("| arm | seed |") == 1
    assert (out / "curves_arithmetic.png").read_bytes()[:4] == b"\x89PNG"


@needs_tiny
def test_arms_grid_reuses_finished_runs(rpg_grid, gbmpo_cli):
    out, argv, _ = rpg_grid
    code, stdout, stderr = _call(gbmpo_cli, argv)
    assert code == 0, stderr
    assert "2 finished (reused), 0 to resume, 0 to train" in stdout


@needs_tiny
def test_an_arm_may_be_an_engine(tmp_path, gbmpo_cli):
    """``--arms own:engine=gbmpo trl:engine=trl``: each arm runs on its own engine (the grid
    used to train every arm with the own trainer, whatever its engine said)."""
    out = tmp_path / "grid"
    argv = ["compare", "--arms", "own:engine=gbmpo", "trl:engine=trl", "--seeds", "0",
            "--output-dir", str(out), *SMALL]  # fmt: skip
    code, stdout, stderr = _call(gbmpo_cli, argv)
    assert code == 0, stderr
    runs = out / "runs" / "arithmetic"
    for arm, engine in (("own", "gbmpo"), ("trl", "trl")):
        summary = json.loads((runs / arm / "seed0" / "summary.json").read_text())
        assert summary["engine"] == engine
    results = json.loads((out / "results.json").read_text())
    assert [g["label"] for g in results["tasks"][0]["groups"]] == ["own", "trl"]


def test_dry_run_of_an_arm_with_a_sum_of_regularizers(tmp_path, gbmpo_cli):
    arms = tmp_path / "arms.yaml"
    arms.write_text("sum:\n  objective.regularizer:\n    - {name: prob_l2, coef: 0.05}\n"
                    "    - {name: kl_k1, coef: 0.04, placement: reward}\n")  # fmt: skip
    code, stdout, stderr = _call(gbmpo_cli, ["compare", "--arms", str(arms), "--seeds", "0",
                                             "--output-dir", str(tmp_path / "o"), "--dry-run"])
    assert code == 0, stderr
    assert "regularizer prob_l2 (coef 0.05) + kl_k1 (coef 0.04, in the reward)" in stdout


@needs_tiny
def test_an_arm_with_a_sum_of_regularizers_runs_and_reports(tmp_path, gbmpo_cli):
    """A grid whose arm sums two regularizers trains and writes its report (the report's arm
    record once read ``regularizer.name`` of the list and failed after every run finished)."""
    arms = tmp_path / "arms.yaml"
    arms.write_text("sum:\n  objective.regularizer:\n    - {name: prob_l2, coef: 0.05}\n"
                    "    - {name: kl_k3, coef: 0.04}\n")  # fmt: skip
    out = tmp_path / "grid"
    argv = ["compare", "--arms", str(arms), "--seeds", "0", "--output-dir", str(out), *SMALL,
            "--no-plots"]  # fmt: skip
    code, stdout, stderr = _call(gbmpo_cli, argv)
    assert code == 0, stderr
    results = json.loads((out / "results.json").read_text())
    (arm,) = results["grid"]["arms"]
    assert arm["regularizer"] == "prob_l2+kl_k3" and arm["coef"] == [0.05, 0.04]
    assert arm["regularizer_params"] == [{}, {}]
    assert (out / "report.md").is_file()
