"""The accuracy-versus-drift frontier on fabricated sweep runs with known numbers: interpolation,
the drift grid, the matched-drift table with its paired t-tests, the report's files and the
reports of runs without drift."""

from __future__ import annotations

import json
import math

import pytest
from scipy import stats as sstats

from gbmpo.experiments.frontier import build_frontier, drift_grid, interpolate
from gbmpo.experiments.results import group_runs
from gbmpo.experiments.runs import load_run
from gbmpo.experiments.sweep import sweep_labels_from_dirs


def drift(kl: float, *, entropy: float = 1.0, length: float = 20.0) -> dict:
    """A ``drift`` record as the trainer writes it (the other measures derived from ``kl``)."""
    return {"kl": kl, "kl_reverse": 2 * kl, "prob_l2": kl / 10, "tv": kl / 2,
            "entropy": entropy, "response_length": length, "n_prompts": 8,
            "n_tokens": 160}  # fmt: skip


# ------------------------------------------------------------------------------ pure parts


def test_interpolate_known_values():
    # unsorted input; the two points at x = 1 are averaged to y = 3
    assert interpolate([2.0, 0.0, 1.0, 1.0], [5.0, 1.0, 2.0, 4.0], [0.0, 0.5, 1.0, 1.5, 2.0]) == (
        pytest.approx([1.0, 2.0, 3.0, 4.0, 5.0])
    )
    assert interpolate([0.3], [0.7], [0.3]) == [0.7]
    with pytest.raises(ValueError, match="outside the points' range"):
        interpolate([0.0, 1.0], [0.0, 1.0], [1.01])
    with pytest.raises(ValueError, match="2 x values and 1 y values"):
        interpolate([0.0, 1.0], [0.0], [0.5])


def test_drift_grid_linear_and_geometric():
    assert drift_grid(0.2, 0.4) == pytest.approx([0.2, 0.25, 0.3, 0.35, 0.4])
    # a range over more than a factor 10 is gridded geometrically
    assert drift_grid(0.01, 1.0, 3) == pytest.approx([0.01, 0.1, 1.0])
    assert drift_grid(0.0, 1.0, 3) == pytest.approx([0.0, 0.5, 1.0])  # lo = 0: evenly
    assert drift_grid(0.3, 0.3) == [0.3]
    with pytest.raises(ValueError, match="empty range"):
        drift_grid(0.5, 0.4)


# --------------------------------------------------------------- a sweep with known numbers

# (arm, coef, seed) -> (drift.kl, accuracy); arm A's per-seed ranges are [0.1, 0.5] and
# [0.2, 0.6], B's [0.0, 0.4] and [0.1, 0.5]: the matched range is [0.2, 0.4]
POINTS = {
    ("A", "1", 0): (0.1, 0.6), ("A", "0.1", 0): (0.5, 0.8),
    ("A", "1", 1): (0.2, 0.5), ("A", "0.1", 1): (0.6, 0.9),
    ("B", "1", 0): (0.0, 0.7), ("B", "0.1", 0): (0.4, 0.75),
    ("B", "1", 1): (0.1, 0.6), ("B", "0.1", 1): (0.5, 0.7),
}  # fmt: skip


@pytest.fixture
def sweep_dir(tmp_path, make_run):
    """A sweep grid's layout: runs/arithmetic/<ARM@coef=V>/seed<k>, with drift (entropy = 1 +
    kl, length = 20 + 10 kl); plus an unswept arm ``none`` and a seed of A without drift."""
    root = tmp_path / "grid" / "runs" / "arithmetic"
    reg = {"A": "kl_k3", "B": "prob_l2"}
    for (arm, coef, seed), (kl, acc) in POINTS.items():
        make_run(root / f"{arm}@coef={coef}" / f"seed{seed}", regularizer=reg[arm],
                 coef=float(coef), seed=seed, final=acc,
                 drift=drift(kl, entropy=1.0 + kl, length=20.0 + 10 * kl))  # fmt: skip
    make_run(root / "A@coef=1" / "seed2", regularizer="kl_k3", coef=1.0, seed=2, final=0.4)
    for seed in (0, 1):
        make_run(root / "none" / f"seed{seed}", regularizer="none", coef=0.0, seed=seed,
                 final=0.3 + 0.1 * seed, drift=drift(1.0 + seed))  # fmt: skip
    return tmp_path / "grid"


def _groups(root):
    records = [load_run(p.parent) for p in sorted(root.rglob("summary.json"))]
    for r in records:
        r.label = r.path.parent.name
    return group_runs(records)["arithmetic"]


def test_matched_drift_table_known_numbers(sweep_dir):
    fr = build_frontier(_groups(sweep_dir), measure="kl")
    assert fr["metric"] == "accuracy" and fr["measure"] == "kl"
    assert fr["missing_drift"] == ["A@coef=1/seed2 (no drift.kl)"]
    arms = {a["arm"]: a for a in fr["arms"]}
    assert list(arms) == ["A", "B", "none"]
    # points in sweep order (numeric): 0.1 then 1
    assert [p["value"] for p in arms["A"]["points"]] == ["0.1", "1"]
    p01 = arms["A"]["points"][0]
    assert p01["drift"]["mean"] == pytest.approx(0.55)
    assert p01["accuracy"]["mean"] == pytest.approx(0.85)
    assert p01["accuracy"]["std"] == pytest.approx(math.sqrt(0.005))
    assert arms["A"]["points"][1]["seeds"] == [0, 1]  # seed 2 has no drift
    assert arms["none"]["points"][0]["value"] == ""
    m = fr["matched"]
    assert m["arms"] == ["A", "B"] and m["skipped"] == ["none (one sweep point)"]
    assert m["range"] == pytest.approx([0.2, 0.4])
    assert m["grid"] == pytest.approx([0.2, 0.25, 0.3, 0.35, 0.4])
    at = {round(r["drift"], 6): r for r in m["rows"]}
    # drift 0.3: A per seed 0.6 + 0.2 * 0.2/0.4 = 0.70 and 0.5 + 0.4 * 0.1/0.4 = 0.60;
    #            B per seed 0.7 + 0.05 * 0.3/0.4 = 0.7375 and 0.6 + 0.1 * 0.2/0.4 = 0.65
    row = at[0.3]
    assert row["arms"]["A"]["accuracy"]["mean"] == pytest.approx(0.65)
    assert row["arms"]["A"]["accuracy"]["std"] == pytest.approx(math.sqrt(0.005))
    assert row["arms"]["B"]["accuracy"]["mean"] == pytest.approx(0.69375)
    # entropy = 1 + kl at every point, so it reads 1.3 at drift 0.3; length 20 + 10 kl = 23
    assert row["arms"]["A"]["entropy"]["mean"] == pytest.approx(1.3)
    assert row["arms"]["B"]["response_length"]["mean"] == pytest.approx(23.0)
    assert row["leader"] == "B"
    (vs,) = row["vs"]
    ref = sstats.ttest_rel([0.7375, 0.65], [0.70, 0.60])
    assert vs["arm"] == "A" and vs["seeds"] == [0, 1]
    assert vs["mean"] == pytest.approx(0.04375)
    assert vs["t"] == pytest.approx(ref.statistic) and vs["p_value"] == pytest.approx(ref.pvalue)
    # drift 0.4: A 0.75 and 0.70 (mean 0.725) ahead of B 0.75 and 0.675 (mean 0.7125)
    row = at[0.4]
    assert row["leader"] == "A"
    assert row["arms"]["A"]["accuracy"]["mean"] == pytest.approx(0.725)
    assert row["arms"]["B"]["accuracy"]["mean"] == pytest.approx(0.7125)
    assert row["vs"][0]["mean"] == pytest.approx(0.0125)


def test_other_drift_measure(sweep_dir):
    fr = build_frontier(_groups(sweep_dir), measure="tv")  # tv = kl / 2 here
    assert fr["matched"]["range"] == pytest.approx([0.1, 0.2])
    with pytest.raises(ValueError, match="unknown drift measure 'js'; valid: kl, kl_reverse"):
        build_frontier(_groups(sweep_dir), measure="js")


def test_no_overlap_and_no_sweep(tmp_path, make_run):
    root = tmp_path / "g"
    for arm, kls in (("A", (0.1, 0.2)), ("B", (0.5, 0.6))):
        for i, kl in enumerate(kls):
            make_run(root / f"{arm}@coef={i}" / "seed0", regularizer="kl_k3", seed=0,
                     final=0.5, drift=drift(kl))  # fmt: skip
    fr = build_frontier(_groups(root))
    assert "do not overlap" in fr["matched"]["reason"] and fr["matched"]["rows"] == []
    # labels without '@' are no sweep: no frontier at all
    plain = tmp_path / "p"
    make_run(plain / "kl" / "seed0", regularizer="kl_k3", seed=0, final=0.5, drift=drift(0.1))
    assert build_frontier(_groups(plain)) is None


def test_report_draws_the_frontier(sweep_dir, tmp_path, gbmpo_cli):
    out = tmp_path / "report"
    assert gbmpo_cli(["report", str(sweep_dir), "--output-dir", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    (task,) = results["tasks"]
    # the sweep directories' labels, not the regularizer names
    assert [g["label"] for g in task["groups"]] == ["A@coef=0.1", "A@coef=1", "B@coef=0.1",
                                                   "B@coef=1", "none"]  # fmt: skip
    assert task["frontier"]["matched"]["arms"] == ["A", "B"]
    assert results["frontier_images"] == {"arithmetic": "frontier_arithmetic.png"}
    assert (out / "frontier_arithmetic.png").read_bytes()[:4] == b"\x89PNG"
    md = (out / "report.md").read_text()
    assert "### Accuracy versus drift" in md and "![held-out accuracy against drift.kl]" in md
    assert "| 0.3 | B | A | +4.4 ± 0.9 | 0,1 |" in md  # leader, Δ points, seeds
    assert "| 0.3 | A | 0,1 | 65.0 ± 7.1 | 1.300 ± 0.000 | 23.0 ± 0.0 |" in md
    assert "left out (no drift measurement): A@coef=1/seed2 (no drift.kl)" in md
    html = (out / "report.html").read_text()
    assert "frontier_arithmetic.png" in html and "Accuracy versus drift" in html
    # another measure on the x-axis
    out2 = tmp_path / "report2"
    assert gbmpo_cli(["report", str(sweep_dir), "--output-dir", str(out2), "--no-plots",
                      "--drift-measure", "prob_l2"]) == 0  # fmt: skip
    md2 = (out2 / "report.md").read_text()
    assert "drift.prob_l2" in md2 and not (out2 / "frontier_arithmetic.png").exists()


def test_report_without_drift_says_so(tmp_path, make_run, gbmpo_cli):
    root = tmp_path / "g" / "runs" / "arithmetic"
    for arm in ("A", "B"):
        for coef in ("0.1", "1"):
            make_run(root / f"{arm}@coef={coef}" / "seed0", regularizer="kl_k3",
                     coef=float(coef), seed=0, final=0.5)  # fmt: skip
    out = tmp_path / "report"
    assert gbmpo_cli(["report", str(tmp_path / "g"), "--output-dir", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert "No frontier: no run has drift.kl in its summary.json" in md
    assert not (out / "frontier_arithmetic.png").exists()
    assert (out / "curves_arithmetic.png").is_file()


def test_sweep_labels_only_for_sweep_dirs(sweep_dir):
    records = [load_run(p.parent) for p in sorted(sweep_dir.rglob("summary.json"))]
    assert sweep_labels_from_dirs(records) == 9  # the 'none' runs keep their own label
    assert sorted({r.label for r in records}) == ["A@coef=0.1", "A@coef=1", "B@coef=0.1",
                                                  "B@coef=1", "none"]  # fmt: skip
