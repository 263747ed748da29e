"""``gbmpo report`` on fabricated run directories: grouping, hand-computed statistics, files."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

KL = [0.70, 0.75, 0.83]
PL2 = [0.80, 0.72, 0.85]
NONE = [0.60, 0.70]


@pytest.fixture
def runs(tmp_path, make_run):
    root = tmp_path / "runs"
    for seed, v in enumerate(KL):
        make_run(root / f"kl{seed}", regularizer="kl_k3", coef=0.04, seed=seed, final=v,
                 wall=100 + 10 * seed)
    for seed, v in enumerate(PL2):
        make_run(root / f"pl{seed}", regularizer="prob_l2", seed=seed, final=v,
                 response_tokens=20.0 + seed)
    for seed, v in enumerate(NONE):
        make_run(root / f"none{seed}", regularizer="none", coef=0.0, seed=seed, final=v)
    return root


def _group(results, label, task="arithmetic"):
    t = next(t for t in results["tasks"] if t["task"] == task)
    return next(g for g in t["groups"] if g["label"] == label)


def test_report_statistics_hand_computed(runs, tmp_path, gbmpo_cli, capsys):
    out = tmp_path / "report"
    assert gbmpo_cli(["report", str(runs), "--output-dir", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["std"].startswith("sample standard deviation")
    kl = _group(results, "kl_k3")
    # mean 0.76, sample variance 0.0086 / 2
    assert kl["final"]["mean"] == pytest.approx(0.76)
    assert kl["final"]["std"] == pytest.approx(math.sqrt(0.0043))
    assert (kl["final"]["min"], kl["final"]["max"]) == (0.70, 0.83)
    assert kl["gain"]["mean"] == pytest.approx(0.26)
    assert kl["wall_seconds"]["mean"] == pytest.approx(110.0)
    assert kl["seeds"] == [0, 1, 2] and kl["coef"] == 0.04
    assert kl["paired_vs_baseline"] is None
    pl2 = _group(results, "prob_l2")
    # per-seed differences to kl_k3: +0.10, -0.03, +0.02 -> mean 0.03, variance 0.0086 / 2
    assert pl2["paired_vs_baseline"]["baseline"] == "kl_k3"
    assert pl2["paired_vs_baseline"]["mean"] == pytest.approx(0.03)
    assert pl2["paired_vs_baseline"]["std"] == pytest.approx(math.sqrt(0.0043))
    assert pl2["response_tokens"]["mean"] == pytest.approx(21.0)
    none = _group(results, "none")
    assert none["final"]["mean"] == pytest.approx(0.65)
    assert none["final"]["std"] == pytest.approx(math.sqrt(0.005))
    assert none["paired_vs_baseline"]["seeds"] == [0, 1]
    assert none["paired_vs_baseline"]["mean"] == pytest.approx(-0.075)  # -0.10, -0.05

    md = (out / "report.md").read_text()
    assert "| kl_k3 | 0.04 | 0,1,2 | 76.0 ± 6.6 | 70.0 – 83.0 |" in md
    assert "| none | 0 | 0,1 | 65.0 ± 7.1 | 60.0 – 70.0 |" in md
    assert "+3.0 ± 6.6" in md  # paired difference of prob_l2
    assert "ddof=1" in md and "curves_arithmetic.png" in md
    html = (out / "report.html").read_text()
    assert "<table>" in html and "curves_arithmetic.png" in html and "76.0 ± 6.6" in html
    png = (out / "curves_arithmetic.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    assert "76.0 ± 6.6" in capsys.readouterr().out


def test_report_groups_by_coef_and_task_and_warns_on_mixed_settings(tmp_path, make_run, gbmpo_cli):
    root = tmp_path / "runs"
    make_run(root / "a0", regularizer="prob_l2", coef=0.05, seed=0, final=0.7)
    make_run(root / "a1", regularizer="prob_l2", coef=0.05, seed=1, final=0.8, lr=1e-4)
    make_run(root / "b0", regularizer="prob_l2", coef=0.1, seed=0, final=0.6)
    make_run(root / "g0", regularizer="prob_l2", coef=0.05, seed=0, final=0.1, task="gsm8k")
    out = tmp_path / "report"
    assert gbmpo_cli(["report", str(root), "--output-dir", str(out), "--no-plots"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert [t["task"] for t in results["tasks"]] == ["arithmetic", "gsm8k"]
    arith = results["tasks"][0]
    assert [g["label"] for g in arith["groups"]] == ["prob_l2@0.05", "prob_l2@0.1"]
    assert arith["groups"][0]["config_differences_within_group"] == ["optim.lr"]
    assert arith["baseline"] is None
    assert "differ in optim.lr" in (out / "report.md").read_text()
    assert [g["label"] for g in results["tasks"][1]["groups"]] == ["prob_l2"]


def test_report_explicit_baseline_and_unknown_baseline(runs, tmp_path, gbmpo_cli, capsys):
    out = tmp_path / "r"
    assert gbmpo_cli(["report", str(runs), "--output-dir", str(out), "--no-plots",
                      "--baseline", "none"]) == 0
    results = json.loads((out / "results.json").read_text())
    # kl_k3 - none on seeds 0, 1: +0.10, +0.05
    assert _group(results, "kl_k3")["paired_vs_baseline"]["mean"] == pytest.approx(0.075)
    assert gbmpo_cli(["report", str(runs), "--output-dir", str(out), "--no-plots",
                      "--baseline", "kl_k9"]) == 2
    assert "baseline 'kl_k9' is not a group" in capsys.readouterr().err


def test_report_bad_inputs(tmp_path, make_run, gbmpo_cli, capsys):
    out = tmp_path / "r"
    unfinished = make_run(tmp_path / "u", regularizer="kl_k3", seed=0, final=0.5, finished=False)
    assert gbmpo_cli(["report", str(unfinished), "--output-dir", str(out)]) == 2
    assert "has not finished" in capsys.readouterr().err
    assert gbmpo_cli(["report", str(tmp_path / "nope"), "--output-dir", str(out)]) == 2
    assert "does not exist" in capsys.readouterr().err
    # the same seed twice in one group
    make_run(tmp_path / "d" / "x", regularizer="kl_k3", seed=0, final=0.5)
    make_run(tmp_path / "d" / "y", regularizer="kl_k3", seed=0, final=0.6)
    assert gbmpo_cli(["report", str(tmp_path / "d"), "--output-dir", str(out)]) == 2
    assert "appear in several runs" in capsys.readouterr().err
    assert not (out / "results.json").exists()


def test_report_skips_unfinished_runs_found_under_a_parent(tmp_path, make_run, gbmpo_cli, capsys):
    make_run(tmp_path / "p" / "done", regularizer="kl_k3", seed=0, final=0.5)
    make_run(tmp_path / "p" / "busy", regularizer="kl_k3", seed=1, final=0.5, finished=False)
    out = tmp_path / "r"
    assert gbmpo_cli(["report", str(tmp_path / "p"), "--output-dir", str(out), "--no-plots"]) == 0
    assert "skipping unfinished run" in capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    group = results["tasks"][0]["groups"][0]
    assert group["seeds"] == [0] and group["final"]["std"] is None
    assert "| kl_k3 | 0.05 | 0 | 50.0 | 50.0 – 50.0 |" in (out / "report.md").read_text()


def test_report_shows_run_to_run_spread_from_four_seeds(tmp_path, make_run, gbmpo_cli):
    root = tmp_path / "runs"
    wide = [0.60, 0.70, 0.80, 0.65, 0.75]
    narrow = [0.70, 0.71, 0.72, 0.70, 0.71]
    for seed, v in enumerate(wide):
        make_run(root / f"a{seed}", regularizer="kl_k3", coef=0.04, seed=seed, final=v)
    for seed, v in enumerate(narrow):
        make_run(root / f"b{seed}", regularizer="prob_l2", seed=seed, final=v)
    out = tmp_path / "report"
    assert gbmpo_cli(["report", str(root), "--output-dir", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    b = _group(results, "prob_l2")["seed_spread"]
    assert b["std"] == pytest.approx(float(np.std(narrow, ddof=1)))
    lo, hi = b["chi2_95"]
    assert lo < b["std"] < hi
    ratio = float(np.var(narrow, ddof=1) / np.var(wide, ddof=1))
    assert b["f_vs_baseline"]["F"] == pytest.approx(ratio)
    assert b["f_vs_baseline"]["p_value"] < 0.05  # 36x smaller variance on 5 seeds each
    md = (out / "report.md").read_text()
    assert "Run-to-run spread" in md and "| prob_l2 | 5 |" in md


def test_report_has_no_spread_table_below_four_seeds(runs, tmp_path, gbmpo_cli):
    out = tmp_path / "report"
    assert gbmpo_cli(["report", str(runs), "--output-dir", str(out)]) == 0
    assert "Run-to-run spread" not in (out / "report.md").read_text()


def test_report_shows_the_pass_at_k_curves_and_diversity(tmp_path, make_run, gbmpo_cli):
    """Runs evaluated with eval.samples > 1: the report tabulates pass@k for every k (mean ±
    std over seeds), distinct answers and token entropy, and draws passk_<task>.png."""
    root = tmp_path / "runs"
    curves = {"kl_k3": [(0.30, 0.45, 0.60), (0.34, 0.47, 0.64)],
              "fkl": [(0.28, 0.50, 0.70), (0.30, 0.52, 0.74)]}
    for reg, per_seed in curves.items():
        for seed, (p1, p2, p4) in enumerate(per_seed):
            extra = {"pass@1": p1, "pass@2": p2, "pass@4": p4, "samples": 4,
                     "distinct_answers": 1.5 + seed, "token_entropy": 0.2 + 0.1 * seed}
            make_run(root / f"{reg}{seed}", regularizer=reg, seed=seed, final=p1,
                     eval_extra=extra)
    out = tmp_path / "report"
    assert gbmpo_cli(["report", str(root), "--output-dir", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    fkl = _group(results, "fkl")
    assert list(fkl["pass_at_k"]) == ["pass@1", "pass@2", "pass@4"]
    assert fkl["pass_at_k"]["pass@4"]["mean"] == pytest.approx(0.72)
    assert fkl["pass_at_k"]["pass@4"]["std"] == pytest.approx(float(np.std([0.70, 0.74], ddof=1)))
    assert fkl["distinct_answers"]["mean"] == pytest.approx(2.0)
    assert fkl["token_entropy"]["mean"] == pytest.approx(0.25)
    md = (out / "report.md").read_text()
    assert "| regularizer | coef | pass@1 % | pass@2 % | pass@4 % | distinct answers |" in md
    assert ("| fkl | 0.05 | 29.0 ± 1.4 | 51.0 ± 1.4 | 72.0 ± 2.8 | 2.00 ± 0.71 | 0.250 ± 0.071 |"
            in md)
    assert (out / "passk_arithmetic.png").stat().st_size > 1000
    assert "passk_arithmetic.png" in md
    assert "passk_arithmetic.png" in (out / "report.html").read_text()


def test_report_has_no_pass_at_k_table_for_one_sample(runs, tmp_path, gbmpo_cli):
    out = tmp_path / "report"
    assert gbmpo_cli(["report", str(runs), "--output-dir", str(out)]) == 0
    assert "distinct answers" not in (out / "report.md").read_text()
    assert not (out / "passk_arithmetic.png").exists()


def test_report_draws_the_largest_pass_at_k_frontier(tmp_path, make_run, gbmpo_cli):
    """A sweep evaluated with several samples: beside the accuracy frontier, the frontier of
    the largest pass@k against drift (results.json frontier_passk, frontier_passk_<task>.png)."""
    root = tmp_path / "runs"
    for reg in ("kl_k3", "fkl"):
        for i, coef in enumerate((0.04, 0.64)):
            for seed in (0, 1):
                kl = 0.03 / (1 + 4 * i) + 0.001 * seed
                p4 = 0.6 + kl + (0.05 if reg == "fkl" else 0.0)
                drift = {"kl": kl, "kl_reverse": 2 * kl, "prob_l2": kl / 10, "tv": kl / 2,
                         "entropy": 1.0, "response_length": 20.0, "n_prompts": 8,
                         "n_tokens": 160}  # fmt: skip
                make_run(root / f"{reg}-{i}-{seed}", regularizer=reg, coef=coef, seed=seed,
                         final=0.4 + kl, drift=drift,
                         eval_extra={"pass@1": 0.4 + kl, "pass@2": 0.5, "pass@4": p4})
    out = tmp_path / "report"
    assert gbmpo_cli(["report", str(root), "--output-dir", str(out)]) == 0
    task = json.loads((out / "results.json").read_text())["tasks"][0]
    fr = task["frontier_passk"]
    assert fr["metric"] == "pass@4" and {a["arm"] for a in fr["arms"]} == {"kl_k3", "fkl"}
    assert task["frontier"]["metric"] == "accuracy"
    fkl = next(a for a in fr["arms"] if a["arm"] == "fkl")
    low = min(fkl["points"], key=lambda p: p["drift"]["mean"])
    assert low["accuracy"]["mean"] == pytest.approx(0.65 + low["drift"]["mean"])
    assert (out / "frontier_passk_arithmetic.png").stat().st_size > 1000
    md = (out / "report.md").read_text()
    assert "### pass@4 versus drift" in md and "frontier_passk_arithmetic.png" in md


def test_report_shows_the_drift_of_controlled_and_uncontrolled_arms(tmp_path, make_run,
                                                                     gbmpo_cli):  # fmt: skip
    """Runs of ``compare --match-drift``: the drift table holds the target, the controlled
    measure and coefficient over the last steps, every arm's rollout k3 and the held-out KL."""
    from gbmpo.objectives.drift_control import DriftControl

    root = tmp_path / "runs"
    control = DriftControl(target=0.02)
    for seed in (0, 1):
        make_run(root / f"kl{seed}", regularizer="kl_k3", seed=seed, final=0.6, coef=0.04,
                 control=control, drift={"kl": 0.01 * (seed + 1)})  # fmt: skip
        make_run(root / f"none{seed}", regularizer="none", seed=seed, final=0.5, coef=0.0,
                 drift={"kl": 0.05})  # fmt: skip
    out = tmp_path / "report"
    assert gbmpo_cli(["report", str(root), "--output-dir", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    kl, none = _group(results, "kl_k3"), _group(results, "none")
    # 20 steps: reg/kl_k3 = 1e-3 * s, so the last 10 steps' mean is 1e-3 * 15.5
    assert kl["drift_target"]["mean"] == 0.02
    assert kl["drift_measure_last"]["mean"] == pytest.approx(0.0155)
    assert kl["drift_coef_last"]["mean"] == pytest.approx(0.04 * (1 + 15.5 / 100))
    assert kl["drift_kl_final"]["mean"] == pytest.approx(0.015)
    assert none["drift_target"] is None
    assert none["train_kl_k3_last"]["mean"] == pytest.approx(0.0155)
    md = (out / "report.md").read_text()
    assert "| kl_k3 | 0.02 | 0.0155 ± 0.0000 | 0.0462 ± 0.0000 |" in md
    assert "| none | n/a | n/a | n/a | 0.0155 ± 0.0000 | 0.0500 ± 0.0000 |" in md
