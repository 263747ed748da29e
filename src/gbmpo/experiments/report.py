"""Comparison reports: ``results.json``, ``report.md``, ``report.html`` and learning-curve PNGs.

:func:`write_report` writes them: the results dictionary
(:func:`gbmpo.experiments.results.build_results`: one table per task, one row per group of
seeds, the training dynamics and, for a sweep, the accuracy-versus-drift frontier) and its two
renderings, Markdown (:func:`render_markdown`) and HTML (:func:`render_html`), which share the
table builders so that a column is defined once for both. The plots are in
:mod:`gbmpo.experiments.plots`.
"""

from __future__ import annotations

import html
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gbmpo.experiments.frontier import DRIFT_LABELS
from gbmpo.experiments.plots import plot_curves, plot_frontier, plot_pass_at_k
from gbmpo.experiments.results import (
    DYNAMICS,
    LAST_STEPS,
    STD_NOTE,
    build_results,
    group_runs,
)
from gbmpo.experiments.runs import RunRecord
from gbmpo.io import write_atomic

__all__ = ["md_table", "render_html", "render_markdown", "summary_table", "write_report"]


# ------------------------------------------------------------------------------ rendering


def _pct(
    sp: Mapping[str, Any] | None, *, signed: bool = False, scale: float = 100.0, digits: int = 1
) -> str:
    if not sp:
        return "n/a"
    fmt = f"{{:+.{digits}f}}" if signed else f"{{:.{digits}f}}"
    mean = fmt.format(scale * sp["mean"])
    return mean if sp.get("std") is None else f"{mean} ± {scale * sp['std']:.{digits}f}"


def _range(sp: Mapping[str, Any] | None, scale: float = 100.0) -> str:
    if not sp:
        return "n/a"
    return f"{scale * sp['min']:.1f} – {scale * sp['max']:.1f}"


def _num(sp: Mapping[str, Any] | None, digits: int = 1) -> str:
    if not sp:
        return "n/a"
    mean = f"{sp['mean']:.{digits}f}"
    return mean if sp.get("std") is None else f"{mean} ± {sp['std']:.{digits}f}"


def _yaml(value: Any) -> str:
    return "null" if value is None else str(value)


def _coef(value: float | Sequence[float]) -> str:
    if isinstance(value, (list, tuple)):  # one per term of a sum of regularizers
        return "+".join(f"{v:g}" for v in value)
    return f"{value:g}"


def summary_table(
    task: Mapping[str, Any], row: str = "regularizer"
) -> tuple[list[str], list[list[str]]]:
    """The summary table of one task: one row per group (``row`` names the first column: the
    regularizer of a regularizer grid, the arm of an arms grid)."""
    metric = task["metric"]
    base = task.get("baseline")
    header = [
        row,
        "coef",
        "seeds",
        f"{metric} % (mean ± std)",
        "min – max",
        "before",
        "gain (points)",
        f"Δ vs {base} (paired)" if base else "Δ vs baseline",
        "p (paired t)",
        "response tokens",
        "RL steps",
        "wall s / run",
    ]
    rows = []
    for g in task["groups"]:
        paired = g.get("paired_vs_baseline")
        rows.append(
            [
                g["label"],
                _coef(g["coef"]),
                ",".join(str(s) for s in g["seeds"]),
                _pct(g["final"]),
                _range(g["final"]),
                _pct(g["before"]),
                _pct(g["gain"], signed=True),
                _pct(paired, signed=True) if paired else "–",
                _p_value(paired),
                _num(g["response_tokens"]),
                _num(g["steps"], 0),
                _num(g["wall_seconds"], 0),
            ]
        )
    return header, rows


def passk_table(
    task: Mapping[str, Any], row: str = "regularizer"
) -> tuple[list[str], list[list[str]]] | None:
    """The pass@k curve of each group's final evaluation (mean ± std over seeds, %) with the
    mean number of distinct final answers per problem and the mean token entropy; None when
    no group evaluated several samples per problem (``eval.samples`` 1)."""
    groups = [g for g in task["groups"] if len(g.get("pass_at_k") or {}) > 1]
    if not groups:
        return None
    ks = sorted({k for g in groups for k in g["pass_at_k"]}, key=lambda k: int(k[5:]))
    header = [row, "coef", *[f"{k} %" for k in ks], "distinct answers", "token entropy"]
    rows = []
    for g in groups:
        cells = [_pct(g["pass_at_k"].get(k)) for k in ks]
        rows.append([g["label"], _coef(g["coef"]), *cells, _num(g.get("distinct_answers"), 2),
                     _num(g.get("token_entropy"), 3)])  # fmt: skip
    return header, rows


#: key suffix of a task's largest-pass@k frontier image in the ``frontiers`` mapping
PASSK_SUFFIX = "#passk"

_PASSK_NOTE = (
    "pass@k of the final evaluation (unbiased estimator, Chen et al. 2021; eval.samples "
    "samples per problem at the rollout temperature), mean ± std over seeds; distinct answers: "
    "mean number of different final answers among a problem's samples; token entropy: mean "
    "per-token entropy of the sampling distribution along the samples (nats)"
)


def _p_value(paired: Mapping[str, Any] | None) -> str:
    if not paired or paired.get("p_value") is None:
        return "–"
    return f"{paired['p_value']:.2f}"


def _dynamics_table(task: Mapping[str, Any]) -> tuple[list[str], list[list[str]]] | None:
    """Entropy at the start / end of training and clip fractions per group (None when no run
    logged them)."""
    if not any(g.get(k) for g in task["groups"] for k in DYNAMICS):
        return None
    header = [
        "arm",
        f"entropy, first {LAST_STEPS} steps",
        f"entropy, last {LAST_STEPS} steps",
        "clipped low % (A<0, w<l)",
        "clipped high % (A>0, w>u)",
        "dual-clipped %",
        f"train reward, last {LAST_STEPS} steps",
    ]
    rows = [
        [
            g["label"],
            _num(g.get("entropy_first"), 3),
            _num(g.get("entropy_last"), 3),
            _pct(g.get("clip_frac_low"), scale=100.0, digits=2),
            _pct(g.get("clip_frac_high"), scale=100.0, digits=2),
            _pct(g.get("clip_frac_dual"), scale=100.0, digits=2),
            _num(g.get("train_reward_last"), 3),
        ]
        for g in task["groups"]
    ]
    return header, rows


def _drift_table(task: Mapping[str, Any], row: str) -> tuple[list[str], list[list[str]]] | None:
    """The drift per group: the controlled coefficient's target, its measure and coefficient
    over the last steps, the rollouts' k3 and the end-of-run held-out KL (None when no group
    has any of them)."""
    keys = ("drift_target", "drift_measure_last", "train_kl_k3_last", "drift_kl_final")
    if not any(g.get(k) for g in task["groups"] for k in keys):
        return None
    header = [row, "target", f"controlled measure, last {LAST_STEPS} steps",
              f"coefficient, last {LAST_STEPS} steps", f"reg/kl_k3, last {LAST_STEPS} steps",
              "held-out KL(π‖π_ref), end"]  # fmt: skip
    rows = [[g["label"], f"{g['drift_target']['mean']:g}" if g.get("drift_target") else "n/a",
             _num(g.get("drift_measure_last"), 4),
             _num(g.get("drift_coef_last"), 4), _num(g.get("train_kl_k3_last"), 4),
             _num(g.get("drift_kl_final"), 4)] for g in task["groups"]]  # fmt: skip
    return header, rows


_DRIFT_NOTE = (
    "Drift (mean ± sample std over seeds): a controlled coefficient's target, the measure its "
    "controller read (reg/kl_k3 or the term's reg/<name> of the rollouts) and the coefficient, "
    "beside every arm's rollout k3 and the exact KL of the final policy on held-out prompts"
)

_DYNAMICS_NOTE = (
    "Training dynamics (mean ± sample std over seeds; entropy of the sampled tokens in nats; "
    "clipped % = share of valid tokens whose gradient the clip removed, over a step's updates, "
    "averaged over the steps)"
)


def _arms_lines(results: Mapping[str, Any]) -> list[str]:
    arms = (results.get("grid") or {}).get("arms") or []
    lines = []
    for a in arms:
        ovr = ", ".join(f"{k}={v}" for k, v in a["overrides"]) or "(the base configuration)"
        surr = a["surrogate"] + (f" {a['surrogate_params']}" if a["surrogate_params"] else "")
        reg = f"{a['regularizer']} (coef {_coef(a['coef'])})"
        lines.append(f"`{a['label']}`: {ovr} -> surrogate {surr}, regularizer {reg}")
    return lines


def _run_table(
    task: Mapping[str, Any], row: str = "regularizer"
) -> tuple[list[str], list[list[str]]]:
    metric = task["metric"]
    header = [
        row, "seed", f"{metric} % before", f"{metric} % after", "response tokens",
        "train reward (last 10 steps)", "RL steps", "stop", "wall s", "run directory",
    ]
    rows = []
    for g in task["groups"]:
        for r in g["runs"]:
            rows.append(
                [
                    r["label"],
                    str(r["seed"]),
                    "n/a" if r["before"] is None else f"{100 * r['before']:.1f}",
                    "n/a" if r["final"] is None else f"{100 * r['final']:.1f}",
                    "n/a" if r["response_tokens"] is None else f"{r['response_tokens']:.1f}",
                    "n/a" if r["train_reward_last"] is None else f"{r['train_reward_last']:.3f}",
                    str(r["steps"]),
                    str(r["stop_reason"]),
                    "n/a" if r["wall_seconds"] is None else f"{r['wall_seconds']:.0f}",
                    r["run_dir"],
                ]
            )
    return header, rows


#: seeds an arm needs before the report shows its run-to-run spread with intervals
SPREAD_MIN_SEEDS = 4


def _spread_table(task: Mapping[str, Any]) -> tuple[list[str], list[list[str]]] | None:
    groups = [
        g for g in task["groups"] if g.get("seed_spread") and g["n_seeds"] >= SPREAD_MIN_SEEDS
    ]
    if not groups:
        return None

    def ci(v: Sequence[float] | None) -> str:
        return "–" if v is None else f"{100 * v[0]:.1f} – {100 * v[1]:.1f}"

    rows = []
    for g in groups:
        sp = g["seed_spread"]
        f = sp["f_vs_baseline"]
        rows.append([
            g["label"], str(g["n_seeds"]), f"{100 * sp['std']:.2f}", ci(sp["chi2_95"]),
            ci(sp["bootstrap_95"]),
            "–" if f is None else f"{f['F']:.2f} ({f['p_value']:.2f})",
        ])  # fmt: skip
    return (["arm", "seeds", "std (points)", "95% CI, chi-square", "95% CI, bootstrap",
             f"F = var / var({task['baseline']}) (p)"], rows)  # fmt: skip


_SPREAD_NOTE = (
    "Run-to-run spread of the final metric over seeds: sample std (ddof=1) with a 95% "
    "interval from the chi-square distribution (assumes normal seed-to-seed variation) and a "
    "percentile bootstrap (10,000 resamples); F = ratio of the variances to the baseline "
    "arm's, two-sided F-test"
)


def md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    def esc(cell: str) -> str:
        return cell.replace("|", "\\|")

    lines = ["| " + " | ".join(esc(h) for h in header) + " |",
             "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(esc(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _eval_desc(task: Mapping[str, Any]) -> str:
    s = task["settings"]
    n = ", ".join(str(x) for x in task["eval_n"]) or "?"
    split = s.get("eval.split") or "the task's held-out split"
    samples = s.get("eval.samples")
    decoding = ("greedy decoding" if samples in (None, 1) else
                f"the share of correct samples ({samples} per problem at the rollout temperature "
                f"{s.get('rollout.temperature')}: pass@1)")  # fmt: skip
    return (
        f"held-out {task['metric']} of the final policy, {decoding}, {n} problems "
        f"({split}; at most {s.get('eval.max_new_tokens')} new tokens)"
    )


def _notes(task: Mapping[str, Any]) -> list[str]:
    notes = [
        f"± is the {STD_NOTE}; min – max is the range over seeds; all in percentage points.",
        "gain = final minus before-training value of the same run; Δ vs baseline = per-seed "
        "difference to the baseline row with the same seed (same prompts, same initial model), "
        "then mean ± std over seeds; p = two-sided paired t-test of a zero mean difference "
        "(n - 1 degrees of freedom; with 3 seeds only large effects can reach p < 0.05).",
        "response tokens: mean completion length on the held-out evaluation (greedy).",
    ]
    for g in task["groups"]:
        if g["config_differences_within_group"]:
            notes.append(
                f"warning: the runs of {g['label']!r} differ in "
                f"{', '.join(g['config_differences_within_group'])}"
            )
    return notes


def render_markdown(
    results: Mapping[str, Any],
    images: Mapping[str, str] | None = None,
    title: str = "",
    frontiers: Mapping[str, str] | None = None,
    passk_images: Mapping[str, str] | None = None,
) -> str:
    """``report.md``: per task the summary table, notes, settings, learning curves, the
    frontier of a sweep and the per-run table. ``images`` / ``frontiers`` map task -> PNG path
    (learning curves / frontier) relative to the report."""
    images = images or {}
    frontiers = frontiers or {}
    passk_images = passk_images or {}
    out = [f"# {title or 'Regularizer comparison'}", ""]
    out.append(f"Generated {results['generated']}.")
    machine = results.get("machine") or {}
    if machine:
        out.append(
            "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()) + "."
        )
    out.append("")
    arms = _arms_lines(results)
    if arms:
        out += ["Arms:", ""] + [f"- {a}" for a in arms] + [""]
    row = "arm" if arms else "regularizer"
    for task in results["tasks"]:
        out += [f"## Task `{task['task']}`", "", _eval_desc(task) + ":", ""]
        out += [md_table(*summary_table(task, row)), ""]
        out += [f"- {n}" for n in _notes(task)]
        dyn = _dynamics_table(task)
        if dyn is not None:
            out += ["", _DYNAMICS_NOTE + ":", "", md_table(*dyn)]
        drift = _drift_table(task, row)
        if drift is not None:
            out += ["", _DRIFT_NOTE + ":", "", md_table(*drift)]
        spread_table = _spread_table(task)
        if spread_table is not None:
            out += ["", _SPREAD_NOTE + ":", "", md_table(*spread_table)]
        pk = passk_table(task, row)
        if pk is not None:
            out += ["", _PASSK_NOTE + ":", "", md_table(*pk)]
            if task["task"] in passk_images:
                out += ["", f"![pass@k, {task['task']}]({passk_images[task['task']]})"]
        settings = ", ".join(f"`{k}`={_yaml(v)}" for k, v in task["settings"].items())
        out += ["", f"Settings: {settings}.", ""]
        if task["task"] in images:
            out += [f"![learning curves, {task['task']}]({images[task['task']]})", ""]
        out += _frontier_md(_frontier_blocks(task, frontiers.get(task["task"])))
        out += _frontier_md(_frontier_blocks(task, frontiers.get(task["task"] + PASSK_SUFFIX),
                                             "frontier_passk"))
        out += ["### Per-run results", "", md_table(*_run_table(task, row)), ""]
    failures = results.get("failures") or {}
    if failures:
        out += ["## Failed runs", ""]
        out += [f"- `{name}`: {err}" for name, err in failures.items()]
        out.append("")
    return "\n".join(out)



# ------------------------------------------------------------------------------ frontier


def _frontier_points_table(fr: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    m = fr["measure"]
    header = ["arm", "sweep value", "seeds", f"drift.{m}", f"{fr['metric']} %",
              "entropy (nats)", "response length"]  # fmt: skip
    rows = [
        [
            a["arm"],
            p["value"] or "–",
            ",".join(str(x) for x in p["seeds"]),
            _num(p["drift"], 4),
            _pct(p["accuracy"]),
            _num(p["entropy"], 3),
            _num(p["response_length"]),
        ]
        for a in fr["arms"]
        for p in a["points"]
    ]
    return header, rows


def _matched_table(fr: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    m = fr["measure"]
    header = [f"drift.{m}", "arm", "seeds", f"{fr['metric']} %", "entropy (nats)",
              "response length"]  # fmt: skip
    matched = fr["matched"]
    rows = [
        [
            f"{row['drift']:.4g}",
            arm,
            ",".join(str(x) for x in matched["seeds"][arm]),
            _pct(cell["accuracy"]),
            _num(cell["entropy"], 3),
            _num(cell["response_length"]),
        ]
        for row in matched["rows"]
        for arm, cell in row["arms"].items()
    ]
    return header, rows


def _ahead_table(fr: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    header = [f"drift.{fr['measure']}", "ahead", "vs", "Δ points (paired, mean ± std)", "seeds",
              "p (paired t)"]  # fmt: skip
    rows = []
    for row in fr["matched"]["rows"]:
        for v in row["vs"] or [{"arm": "–"}]:
            rows.append(
                [
                    f"{row['drift']:.4g}",
                    row["leader"],
                    v["arm"],
                    _pct(v, signed=True) if "mean" in v else "–",
                    ",".join(str(x) for x in v.get("seeds", [])) or "–",
                    _p_value(v),
                ]
            )
    return header, rows


def _frontier_blocks(
    task: Mapping[str, Any], image: str | None, key: str = "frontier"
) -> list[tuple[str, Any]]:
    """The frontier section of a task as blocks ``("h", text)``, ``("p", text)``,
    ``("ul", [items])``, ``("table", (header, rows))`` and ``("img", (src, alt))``, rendered by
    both the Markdown and the HTML report (``key``: ``frontier``, or ``frontier_passk`` for the
    largest pass@k)."""
    fr = task.get(key)
    if not fr:
        return []
    m = fr["measure"]
    head = "Accuracy versus drift" if key == "frontier" else f"{fr['metric']} versus drift"
    blocks: list[tuple[str, Any]] = [("h", head)]
    if fr.get("reason"):
        blocks.append(("p", f"No frontier: {fr['reason']} (the drift measurement of the final "
                            "policy on held-out prompts is missing)."))  # fmt: skip
        return blocks

    blocks.append(
        ("p", f"Held-out {fr['metric']} of the final policy against its drift from the "
              f"reference, drift.{m} = {DRIFT_LABELS.get(m, m)} on held-out prompts; one curve "
              "per arm through its sweep points, mean ± sample std over seeds:")
    )  # fmt: skip
    if image:
        blocks.append(("img", (image, f"held-out {fr['metric']} against drift.{m}")))
    blocks.append(("table", _frontier_points_table(fr)))
    notes = []
    if fr["missing_drift"]:
        notes.append("left out (no drift measurement): " + ", ".join(fr["missing_drift"]))
    matched = fr["matched"] or {}
    if matched.get("skipped"):
        notes.append("not in the matched-drift comparison: " + ", ".join(matched["skipped"]))
    if matched.get("rows"):
        lo, hi = matched["range"]
        blocks.append(
            ("p", f"Matched drift: each arm's per-seed curve (only seeds that ran every sweep "
                  f"point of the arm) joined linearly in drift.{m} and read at "
                  f"{len(matched['grid'])} drift values within [{lo:.4g}, {hi:.4g}], the range "
                  "all those curves cover; mean ± sample std over seeds:")
        )  # fmt: skip
        blocks.append(("table", _matched_table(fr)))
        blocks.append(
            ("p", "Ahead at each matched drift: the arm with the highest mean; Δ = its per-seed "
                  "difference to each other arm on the seeds both ran; p = two-sided paired "
                  "t-test (at least two seeds with differing differences):")
        )  # fmt: skip
        blocks.append(("table", _ahead_table(fr)))
    elif matched.get("reason"):
        notes.append(f"no matched-drift comparison: {matched['reason']}")
    if notes:
        blocks.append(("ul", notes))
    return blocks


def _frontier_md(blocks: Sequence[tuple[str, Any]]) -> list[str]:
    out: list[str] = []
    for kind, content in blocks:
        if kind == "h":
            out += [f"### {content}", ""]
        elif kind == "p":
            out += [content, ""]
        elif kind == "ul":
            out += [f"- {c}" for c in content] + [""]
        elif kind == "table":
            out += [md_table(*content), ""]
        elif kind == "img":
            out += [f"![{content[1]}]({content[0]})", ""]
    return out


def _frontier_html(blocks: Sequence[tuple[str, Any]]) -> list[str]:
    esc = html.escape
    out: list[str] = []
    for kind, content in blocks:
        if kind == "h":
            out.append(f"<h3>{esc(content)}</h3>")
        elif kind == "p":
            out.append(f"<p>{esc(content)}</p>")
        elif kind == "ul":
            out.append("<ul>" + "".join(f"<li>{esc(c)}</li>" for c in content) + "</ul>")
        elif kind == "table":
            out.append(_html_table(*content))
        elif kind == "img":
            out.append(f"<p><img src='{esc(content[0])}' alt='{esc(content[1])}'></p>")
    return out


def _html_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


_CSS = (
    "body{font-family:system-ui,sans-serif;margin:2em;max-width:1400px}"
    "table{border-collapse:collapse;margin:1em 0;font-size:14px}"
    "th,td{border:1px solid #ccc;padding:4px 8px;text-align:right}"
    "th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}"
    "img{max-width:100%}code{background:#f6f6f6}"
)


def render_html(
    results: Mapping[str, Any],
    images: Mapping[str, str] | None = None,
    title: str = "",
    frontiers: Mapping[str, str] | None = None,
    passk_images: Mapping[str, str] | None = None,
) -> str:
    """``report.html``: the same content as :func:`render_markdown`, self-contained HTML."""
    images = images or {}
    frontiers = frontiers or {}
    passk_images = passk_images or {}
    esc = html.escape
    t = title or "Regularizer comparison"
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{esc(t)}</title>"
             f"<style>{_CSS}</style></head><body><h1>{esc(t)}</h1>",
             f"<p>Generated {esc(str(results['generated']))}.</p>"]
    machine = results.get("machine") or {}
    if machine:
        parts.append(
            "<p>Machine: " + esc(", ".join(f"{k} {v}" for k, v in machine.items())) + ".</p>"
        )
    arms = _arms_lines(results)
    if arms:
        parts.append("<p>Arms:</p><ul>" + "".join(f"<li>{esc(a)}</li>" for a in arms) + "</ul>")
    row = "arm" if arms else "regularizer"
    for task in results["tasks"]:
        parts.append(f"<h2>Task <code>{esc(task['task'])}</code></h2>")
        parts.append(f"<p>{esc(_eval_desc(task))}:</p>")
        parts.append(_html_table(*summary_table(task, row)))
        parts.append("<ul>" + "".join(f"<li>{esc(n)}</li>" for n in _notes(task)) + "</ul>")
        dyn = _dynamics_table(task)
        if dyn is not None:
            parts.append(f"<p>{esc(_DYNAMICS_NOTE)}:</p>")
            parts.append(_html_table(*dyn))
        drift = _drift_table(task, row)
        if drift is not None:
            parts.append(f"<p>{esc(_DRIFT_NOTE)}:</p>")
            parts.append(_html_table(*drift))
        pk = passk_table(task, row)
        if pk is not None:
            parts.append(f"<p>{esc(_PASSK_NOTE)}:</p>")
            parts.append(_html_table(*pk))
            if task["task"] in passk_images:
                src = esc(passk_images[task["task"]])
                parts.append(f"<p><img src='{src}' alt='pass@k {esc(task['task'])}'></p>")
        settings = ", ".join(f"{k}={_yaml(v)}" for k, v in task["settings"].items())
        parts.append(f"<p>Settings: {esc(settings)}.</p>")
        if task["task"] in images:
            src = esc(images[task["task"]])
            parts.append(f"<p><img src='{src}' alt='learning curves {esc(task['task'])}'></p>")
        parts += _frontier_html(_frontier_blocks(task, frontiers.get(task["task"])))
        parts += _frontier_html(_frontier_blocks(
            task, frontiers.get(task["task"] + PASSK_SUFFIX), "frontier_passk"))
        parts.append("<h3>Per-run results</h3>")
        parts.append(_html_table(*_run_table(task, row)))
    failures = results.get("failures") or {}
    if failures:
        parts.append("<h2>Failed runs</h2><ul>")
        parts += [f"<li><code>{esc(n)}</code>: {esc(e)}</li>" for n, e in failures.items()]
        parts.append("</ul>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)


def write_report(
    records: Sequence[RunRecord],
    output_dir: str | Path,
    *,
    baseline: str | None = None,
    title: str = "",
    window: int = 10,
    extra: Mapping[str, Any] | None = None,
    plots: bool = True,
    drift_measure: str = "kl",
) -> dict[str, Any]:
    """Write ``results.json``, ``report.md``, ``report.html``, ``curves_<task>.png``, with
    ``eval.samples`` > 1 ``passk_<task>.png`` (the pass@k curves) and, for a
    sweep with drift measurements, ``frontier_<task>.png`` (against ``drift.<drift_measure>``)
    into ``output_dir``; returns the results dict."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = build_results(
        records, baseline=baseline, output_dir=out, extra=extra, drift_measure=drift_measure
    )
    images: dict[str, str] = {}
    frontiers: dict[str, str] = {}
    passk_images: dict[str, str] = {}
    if plots:
        for task, groups in group_runs(records).items():
            metric = next(t["metric"] for t in results["tasks"] if t["task"] == task)
            name = f"curves_{_slug(task)}.png"
            # name the task in the figure unless the title already does
            fig_title = title if task in title else (f"{title}: {task}" if title else task)
            plot_curves(groups, out / name, metric=metric, title=fig_title, window=window)
            images[task] = name
            task_results = next(t for t in results["tasks"] if t["task"] == task)
            if passk_table(task_results) is not None:
                name = f"passk_{_slug(task)}.png"
                plot_pass_at_k(task_results, out / name, title=fig_title)
                passk_images[task] = name
            fr = next(t["frontier"] for t in results["tasks"] if t["task"] == task)
            if fr and fr["arms"]:
                name = f"frontier_{_slug(task)}.png"
                plot_frontier(fr, out / name, title=fig_title)
                frontiers[task] = name
            fr = task_results.get("frontier_passk")
            if fr and fr.get("arms"):
                name = f"frontier_passk_{_slug(task)}.png"
                plot_frontier(fr, out / name, title=fig_title)
                frontiers[task + PASSK_SUFFIX] = name
    results["images"] = images
    results["frontier_images"] = frontiers
    results["passk_images"] = passk_images
    # each file replaces the previous report whole: a kill leaves the old or the new one
    write_atomic(out / "results.json", json.dumps(results, indent=2, default=str) + "\n")
    write_atomic(out / "report.md",
                 render_markdown(results, images, title, frontiers, passk_images))
    write_atomic(out / "report.html",
                 render_html(results, images, title, frontiers, passk_images))
    return results
