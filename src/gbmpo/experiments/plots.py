"""Learning curves of a comparison: one line per group (regularizer), a band over seeds.

For every group, each seed's ``metrics.jsonl`` gives a curve ``{step: value}``; training metrics
are smoothed per seed with a trailing moving average, then the seeds are aligned by step and
summarised as mean +- sample std (:func:`gbmpo.experiments.stats.step_band`; only the steps every
seed of the group reached are drawn). Panels: sampled training reward, held-out accuracy (or
pass@1; in %, a dot at each evaluation), training response length, policy entropy, the
fractions of tokens clipped below and above (the surrogate's ``clip_frac_low`` /
``clip_frac_high``), and the value of each regularizer of the grid measured against the frozen
reference (the trainer's ``reg/<name>`` monitors; without monitoring, the
optimised regularizer's own ``reg_value``).

matplotlib is imported lazily with the ``Agg`` backend (``pip install 'gbmpo[report]'``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gbmpo.experiments.frontier import DRIFT_LABELS
from gbmpo.experiments.runs import RunRecord
from gbmpo.experiments.stats import moving_average, step_band
from gbmpo.io.metrics import MONITOR_PREFIX

__all__ = ["Panel", "curve", "panels_for", "plot_curves", "plot_frontier"]


@dataclass(frozen=True)
class Panel:
    """One subplot: the metrics key, its title and whether it is smoothed (training metric)."""

    key: str
    title: str
    smooth: bool


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    v = float(value)
    return v if math.isfinite(v) else None


def curve(run: RunRecord, key: str, *, window: int = 1) -> dict[int, float]:
    """``{step: value}`` of ``key`` in a run's metrics (trailing moving average over ``window``
    logged points). A ``reg/<name>`` key falls back to ``reg_value`` for runs that optimise
    ``<name>`` without monitoring."""
    points = [
        (int(r["step"]), v)
        for r in run.metrics
        if "step" in r and (v := _number(r.get(key))) is not None
    ]
    if (not points and key.startswith(MONITOR_PREFIX)
            and run.regularizer == key[len(MONITOR_PREFIX):]):  # fmt: skip
        points = [
            (int(r["step"]), v)
            for r in run.metrics
            if "step" in r and (v := _number(r.get("reg_value"))) is not None
        ]
    points.sort()
    steps = [s for s, _ in points]
    values = moving_average([v for _, v in points], window) if points else []
    return dict(zip(steps, values, strict=True))


def panels_for(groups: Mapping[str, Sequence[RunRecord]], metric: str) -> list[Panel]:
    """The panels for a task's groups: reward, held-out ``metric``, response length, entropy,
    the two clip fractions, then one per regularizer (other than ``none``) present in the
    groups."""
    panels = [
        Panel("reward_mean", "training reward (sampled)", True),
        Panel(f"eval/{metric}", f"held-out {metric} % (greedy)", False),
        Panel("response_length_mean", "training response length (tokens)", True),
        Panel("entropy", "policy entropy (sampled tokens, nats)", True),
        Panel("clip_frac_low", "clipped low (A<0, w<l), token fraction", True),
        Panel("clip_frac_high", "clipped high (A>0, w>u), token fraction", True),
    ]
    seen: list[str] = []
    for runs in groups.values():
        for run in runs:
            if run.regularizer not in ("none", *seen):
                seen.append(run.regularizer)
    for name in seen:
        panels.append(Panel(MONITOR_PREFIX + name, f"{name} vs reference (per token)", True))
    return panels


def plot_curves(
    groups: Mapping[str, Sequence[RunRecord]],
    path: str | Path,
    *,
    metric: str = "accuracy",
    title: str = "",
    window: int = 10,
) -> Path:
    """Draw the learning curves of ``groups`` (``label -> runs``, one run per seed) to a PNG."""
    # deferred: matplotlib is optional (the report extra)
    import matplotlib

    matplotlib.use("Agg", force=True)
    # deferred: matplotlib is optional; pyplot only after the Agg backend is set
    import matplotlib.pyplot as plt

    panels = panels_for(groups, metric)
    ncols = 3
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.7 * nrows), squeeze=False)
    # a sweep has more rows than tab10 has colours
    colors = plt.get_cmap("tab10" if len(groups) <= 10 else "tab20").colors
    for ax, panel in zip(axes.flat, panels, strict=False):
        drawn = False
        for gi, (label, runs) in enumerate(groups.items()):
            w = window if panel.smooth else 1
            series = [c for run in runs if (c := curve(run, panel.key, window=w))]
            if not series or len(series) < len(runs):
                continue  # some seed lacks this metric: no honest band
            if panel.key.startswith("eval/"):  # held-out accuracy and pass@k in %, as tables
                series = [{s: 100 * v for s, v in c.items()} for c in series]
            band = step_band(series)
            if not band.steps:
                continue
            color = colors[gi % len(colors)]
            marker = "o" if not panel.smooth else None
            ax.plot(band.steps, band.mean, color=color, label=f"{label} (n={band.n})",
                    marker=marker, markersize=3)
            if band.n >= 2:
                lo = [m - (s or 0.0) for m, s in zip(band.mean, band.std, strict=True)]
                hi = [m + (s or 0.0) for m, s in zip(band.mean, band.std, strict=True)]
                ax.fill_between(band.steps, lo, hi, color=color, alpha=0.2, linewidth=0)
            drawn = True
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
        if not drawn:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if not handles:
        handles, labels = axes.flat[1].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), fontsize=9,
                   frameon=False)
    caption = (
        f"line: mean over seeds, band: +- 1 sample std (ddof=1); training metrics: trailing "
        f"moving average over {window} steps; curves end at the shortest run of each group"
    )
    fig.suptitle((title + "\n" if title else "") + caption, fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 0.95))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_frontier(frontier: Mapping[str, Any], path: str | Path, *, title: str = "") -> Path:
    """Draw a task's frontier (:func:`gbmpo.experiments.frontier.build_frontier`) to a PNG:
    held-out metric against drift, one curve per arm through its sweep points in sweep order,
    mean over seeds with ± 1 sample std error bars on both axes, each point labelled with its
    sweep value; the matched-drift range is shaded."""
    # deferred: matplotlib is optional (the report extra)
    import matplotlib

    matplotlib.use("Agg", force=True)
    # deferred: matplotlib is optional; pyplot only after the Agg backend is set
    import matplotlib.pyplot as plt

    measure, metric = frontier["measure"], frontier["metric"]
    fig, ax = plt.subplots(figsize=(7.5, 5.2))
    colors = plt.get_cmap("tab10").colors
    xs_all: list[float] = []
    for i, arm in enumerate(frontier["arms"]):
        pts = [p for p in arm["points"] if p["drift"] and p["accuracy"]]
        x = [p["drift"]["mean"] for p in pts]
        y = [100 * p["accuracy"]["mean"] for p in pts]
        xerr = [p["drift"]["std"] or 0.0 for p in pts]
        yerr = [100 * (p["accuracy"]["std"] or 0.0) for p in pts]
        n = sorted({len(p["seeds"]) for p in pts})
        seeds = "/".join(str(k) for k in n)
        ax.errorbar(x, y, xerr=xerr, yerr=yerr, color=colors[i % len(colors)], marker="o",
                    markersize=5, capsize=3, linewidth=1.5, label=f"{arm['arm']} (n={seeds})")
        for p, px, py in zip(pts, x, y, strict=True):
            if p["value"]:
                ax.annotate(p["value"], (px, py), textcoords="offset points", xytext=(4, 4),
                            fontsize=8, color=colors[i % len(colors)])
        xs_all += x
    matched = frontier.get("matched") or {}
    if matched.get("range"):
        lo, hi = matched["range"]
        ax.axvspan(lo, hi, color="0.85", alpha=0.5, linewidth=0, label="matched-drift range")
    if xs_all and min(xs_all) > 0 and max(xs_all) / min(xs_all) > 20:
        ax.set_xscale("log")
    ax.set_xlabel(f"drift.{measure}: {DRIFT_LABELS.get(measure, measure)} on held-out prompts")
    ax.set_ylabel(f"held-out {metric} %")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9, frameon=False)
    key = frontier.get("sweep_key")
    caption = (
        "point: mean over seeds, bars: ± 1 sample std (ddof=1); labels: "
        + (f"{key} values" if key else "sweep values")
    )
    ax.set_title((title + "\n" if title else "") + caption, fontsize=10)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_pass_at_k(task: Mapping[str, Any], path: str | Path, *, title: str = "") -> Path:
    """Draw a task's pass@k curves (``build_results``' groups with ``pass_at_k``) to a PNG:
    pass@k % against k (log2 axis), one line per group, mean over seeds with ± 1 sample std
    error bars."""
    # deferred: matplotlib is optional (the report extra)
    import matplotlib

    matplotlib.use("Agg", force=True)
    # deferred: matplotlib is optional; pyplot only after the Agg backend is set
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 4.8))
    colors = plt.get_cmap("tab10").colors
    for i, g in enumerate(x for x in task["groups"] if len(x.get("pass_at_k") or {}) > 1):
        items = sorted(g["pass_at_k"].items(), key=lambda kv: int(kv[0][5:]))
        ks = [int(k[5:]) for k, sp in items if sp]
        y = [100 * sp["mean"] for _, sp in items if sp]
        err = [100 * (sp.get("std") or 0.0) for _, sp in items if sp]
        ax.errorbar(ks, y, yerr=err, color=colors[i % len(colors)], marker="o", markersize=4,
                    capsize=3, linewidth=1.5, label=f"{g['label']} (n={g['n_seeds']})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k (samples per problem drawn)")
    ax.set_ylabel("held-out pass@k %")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9, frameon=False)
    caption = "unbiased pass@k (Chen et al. 2021); mean over seeds, bars ± 1 sample std"
    ax.set_title((title + "\n" if title else "") + caption, fontsize=10)
    fig.tight_layout()
    p = Path(path)
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p
