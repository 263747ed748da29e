r"""The accuracy-versus-drift frontier of a sweep.

Each finished run may carry in its ``summary.json`` a ``drift`` record: divergences of the final
policy :math:`\pi` from the reference :math:`\pi_\text{ref}` measured on held-out prompts
(``kl`` = KL(:math:`\pi\|\pi_\text{ref}`), ``kl_reverse``, ``prob_l2``, ``tv``), and the
policy's ``entropy`` and ``response_length`` there. A sweep (:mod:`gbmpo.experiments.sweep`) gives
every arm several points ``ARM@key=value``; the frontier puts each point at (drift, held-out
accuracy), mean over seeds with the seed spread, one curve per arm through its points in sweep
order (:func:`build_frontier`).

**Matched drift.** Arms reach different drifts, so their accuracies are compared at equal drift:
for each arm and each seed that ran every point of the arm, the points (drift, accuracy),
(drift, entropy), (drift, length) are joined piecewise linearly in drift (:func:`interpolate`) and
read at a common grid of drifts (:func:`drift_grid`) inside the range every such seed of every
arm covers (no extrapolation); the table gives mean ± sample std over those per-seed readings.
At each drift the arm with the highest mean accuracy leads; its per-seed differences to every
other arm on the seeds both ran are tested with the two-sided paired t-test
(:func:`gbmpo.experiments.stats.paired_t_test`, at least two seeds).

Runs without ``drift`` (or without the chosen measure) are left out of the frontier and named;
when no run has it, there is no frontier and the report says so.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from gbmpo.experiments.runs import RunRecord, main_metric
from gbmpo.experiments.stats import paired_t_test, spread
from gbmpo.experiments.sweep import sweep_point

__all__ = [
    "DRIFT_LABELS",
    "DRIFT_MEASURES",
    "GRID_POINTS",
    "build_frontier",
    "drift_grid",
    "interpolate",
]

#: ``summary.json`` ``drift`` keys a frontier can be drawn against (``--drift-measure``)
DRIFT_MEASURES: tuple[str, ...] = ("kl", "kl_reverse", "prob_l2", "tv")
#: axis labels of the measures
DRIFT_LABELS: dict[str, str] = {
    "kl": "KL(π‖π_ref)",
    "kl_reverse": "KL(π_ref‖π)",
    "prob_l2": "ProbL2 ½‖π − π_ref‖²",
    "tv": "total variation ½‖π − π_ref‖₁",
}
#: number of drift values of the matched-drift table
GRID_POINTS = 5
#: a drift range wider than this ratio (and above zero) is gridded geometrically
_GEOMETRIC_RATIO = 10.0


def interpolate(xs: Sequence[float], ys: Sequence[float], at: Sequence[float]) -> list[float]:
    r"""Piecewise-linear :math:`y(x)` through the points :math:`(x_i, y_i)`, read at ``at``.

    Sorted by :math:`x`; points with equal :math:`x` are averaged into one. Between neighbours
    :math:`x_j \le x \le x_{j+1}`:

    .. math::
        y(x) = y_j + (y_{j+1} - y_j)\,\frac{x - x_j}{x_{j+1} - x_j}.

    Raises ``ValueError`` for an ``at`` outside :math:`[\min x, \max x]` (no extrapolation) or
    for unequal lengths / no points.
    """
    if len(xs) != len(ys) or not xs:
        raise ValueError(f"interpolate(): {len(xs)} x values and {len(ys)} y values")
    merged: dict[float, list[float]] = {}
    for x, y in zip(xs, ys, strict=True):
        merged.setdefault(float(x), []).append(float(y))
    px = sorted(merged)
    py = [math.fsum(merged[x]) / len(merged[x]) for x in px]
    out: list[float] = []
    for x in at:
        if x < px[0] or x > px[-1]:
            raise ValueError(f"interpolate(): {x} is outside the points' range [{px[0]}, {px[-1]}]")
        j = 0
        while j + 1 < len(px) and px[j + 1] < x:
            j += 1
        if j + 1 == len(px) or px[j] == x:
            out.append(py[j])
            continue
        w = (x - px[j]) / (px[j + 1] - px[j])
        out.append(py[j] + (py[j + 1] - py[j]) * w)
    return out


def drift_grid(lo: float, hi: float, n: int = GRID_POINTS) -> list[float]:
    r"""``n`` drift values from ``lo`` to ``hi`` inclusive: evenly spaced, or geometrically
    (:math:`d_i = lo\,(hi/lo)^{i/(n-1)}`) when :math:`lo > 0` and :math:`hi/lo > 10` (drifts
    of a coefficient sweep spread over orders of magnitude). One value when ``lo == hi``."""
    if hi < lo:
        raise ValueError(f"drift_grid(): empty range [{lo}, {hi}]")
    if hi == lo or n == 1:
        return [lo]
    if lo > 0 and hi / lo > _GEOMETRIC_RATIO:
        grid = [lo * (hi / lo) ** (i / (n - 1)) for i in range(n)]
    else:
        grid = [lo + (hi - lo) * i / (n - 1) for i in range(n)]
    grid[0], grid[-1] = lo, hi  # exact ends (no rounding just outside a range)
    return grid


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    v = float(value)
    return v if math.isfinite(v) else None


def _sort_key(value: str, index: int) -> tuple[int, float, int]:
    try:
        return 0, float(value), index
    except ValueError:
        return 1, 0.0, index


def _sp(values: Sequence[float]) -> dict[str, Any] | None:
    return spread(values).to_dict() if values else None


def build_frontier(
    groups: Mapping[str, Sequence[RunRecord]],
    *,
    metric: str | None = None,
    measure: str = "kl",
    points: int = GRID_POINTS,
) -> dict[str, Any] | None:
    """The frontier of one task's groups (``label -> runs``) for the ``results.json``:
    ``None`` when no label is a sweep point (``ARM@...``, :func:`gbmpo.experiments.sweep.
    sweep_point`); otherwise ``{"measure", "metric", "missing_drift", "arms", "matched"}``
    (module docstring). ``metric`` defaults to the runs' accuracy or pass@1."""
    if measure not in DRIFT_MEASURES:
        raise ValueError(
            f"unknown drift measure {measure!r}; valid: {', '.join(DRIFT_MEASURES)}"
        )
    parsed = {label: sweep_point(label) for label in groups}
    if not any(parsed.values()):
        return None
    if metric is None:
        metric = next(
            (m for runs in groups.values() for r in runs if (m := main_metric(r.final_eval))),
            "accuracy",
        )
    # arm -> [(value, label, [per-seed readings])]
    arms: dict[str, list[tuple[str, str, list[dict[str, Any]]]]] = {}
    missing: list[str] = []
    for label, runs in groups.items():
        sp = parsed[label]
        arm, value = (sp.arm, sp.value) if sp else (label, "")
        readings = []
        for run in runs:
            drift = run.summary.get("drift")
            d = _num(drift.get(measure)) if isinstance(drift, dict) else None
            acc = _num((run.final_eval or {}).get(metric))
            if d is None or acc is None:
                why = f"no drift.{measure}" if d is None else f"no held-out {metric}"
                missing.append(f"{label}/seed{run.seed} ({why})")
                continue
            readings.append(
                {
                    "seed": run.seed,
                    "drift": d,
                    "accuracy": acc,
                    "entropy": _num(drift.get("entropy")),
                    "response_length": _num(drift.get("response_length")),
                }
            )
        if readings:
            arms.setdefault(arm, []).append((value, label, readings))
    keys = sorted({(p.key or "coef") for p in parsed.values() if p is not None})
    result: dict[str, Any] = {
        "sweep_key": keys[0] if len(keys) == 1 else None,
        "measure": measure,
        "metric": metric,
        "missing_drift": missing,
        "arms": [],
        "matched": None,
    }
    if not arms:
        result["reason"] = f"no run has drift.{measure} in its summary.json"
        return result
    for arm, pts in arms.items():
        order = {label: _sort_key(value, i) for i, (value, label, _) in enumerate(pts)}
        pts.sort(key=lambda p: order[p[1]])
        result["arms"].append(
            {
                "arm": arm,
                "points": [
                    {
                        "label": label,
                        "value": value,
                        "seeds": [r["seed"] for r in rs],
                        **{
                            k: _sp([r[k] for r in rs if r[k] is not None])
                            for k in ("drift", "accuracy", "entropy", "response_length")
                        },
                    }
                    for value, label, rs in pts
                ],
            }
        )
    result["matched"] = _matched(arms, points)
    return result


def _complete_seeds(pts: Sequence[tuple[str, str, list[dict[str, Any]]]]) -> list[int]:
    seeds = {r["seed"] for r in pts[0][2]}
    for _, _, rs in pts[1:]:
        seeds &= {r["seed"] for r in rs}
    return sorted(seeds)


def _matched(
    arms: Mapping[str, Sequence[tuple[str, str, list[dict[str, Any]]]]], n: int
) -> dict[str, Any]:
    """The matched-drift comparison (module docstring) of the arms with two or more points."""
    curves: dict[str, dict[int, list[dict[str, Any]]]] = {}
    skipped: list[str] = []
    for arm, pts in arms.items():
        seeds = _complete_seeds(pts) if len(pts) >= 2 else []
        if not seeds:
            why = "one sweep point" if len(pts) < 2 else "no seed ran every point"
            skipped.append(f"{arm} ({why})")
            continue
        curves[arm] = {
            s: [next(r for r in rs if r["seed"] == s) for _, _, rs in pts] for s in seeds
        }
    out: dict[str, Any] = {"arms": list(curves), "skipped": skipped, "rows": []}
    if not curves:
        out["reason"] = "no arm has two sweep points run by a common seed"
        return out
    lo = max(min(r["drift"] for r in c) for cs in curves.values() for c in cs.values())
    hi = min(max(r["drift"] for r in c) for cs in curves.values() for c in cs.values())
    out["seeds"] = {arm: sorted(cs) for arm, cs in curves.items()}
    if lo > hi:
        out["reason"] = (
            f"the arms' drift ranges (per seed) do not overlap: the highest lower end is "
            f"{lo:.4g}, the lowest upper end {hi:.4g}"
        )
        return out
    grid = drift_grid(lo, hi, n)
    out["range"] = [lo, hi]
    out["grid"] = grid
    # arm -> quantity -> seed -> readings at the grid
    read: dict[str, dict[str, dict[int, list[float]]]] = {}
    for arm, cs in curves.items():
        read[arm] = {}
        for q in ("accuracy", "entropy", "response_length"):
            per_seed: dict[int, list[float]] = {}
            for seed, c in cs.items():
                if all(r[q] is not None for r in c):
                    xs = [r["drift"] for r in c]
                    per_seed[seed] = interpolate(xs, [r[q] for r in c], grid)
            read[arm][q] = per_seed
    for i, x in enumerate(grid):
        cells = {
            arm: {
                q: _sp([v[i] for v in read[arm][q].values()]) if read[arm][q] else None
                for q in ("accuracy", "entropy", "response_length")
            }
            for arm in curves
        }
        leader = max(curves, key=lambda a: cells[a]["accuracy"]["mean"])
        vs = []
        acc = {a: read[a]["accuracy"] for a in curves}
        for other in curves:
            if other == leader:
                continue
            shared = sorted(set(acc[leader]) & set(acc[other]))
            diffs = [acc[leader][s][i] - acc[other][s][i] for s in shared]
            test = paired_t_test(diffs) if len(diffs) >= 2 else None
            vs.append(
                {
                    "arm": other,
                    "seeds": shared,
                    **(spread(diffs).to_dict() if diffs else {}),
                    "t": None if test is None else test[0],
                    "p_value": None if test is None else test[1],
                }
            )
        out["rows"].append({"drift": x, "arms": cells, "leader": leader, "vs": vs})
    return out
