"""``gbmpo compare``: run an arms x seed grid and report it.

    gbmpo compare --arms 'ratio:objective.surrogate.name=clip'
                         'atr:objective.surrogate.name=atr,objective.surrogate.params.delta=0.02'
                  --seeds 0,1,2 [--task T[,T2]] [--config FILE] [--backend serial|local|ray]
                  [--workers N] [--baseline LABEL] [--dry-run] --output-dir DIR
                  [any train override]
    gbmpo compare --arms ARMS.yaml ...
    gbmpo compare --regularizers kl_k3,prob_l2,neural_mirror,none [--coefs LABEL=V,...]
                  [--regularizer-params JSON] ...
    gbmpo compare [--arms ...|--regularizers ...] --sweep [ARM:]KEY=V1,V2,... ...
    gbmpo compare [--arms ...|--regularizers ...] --match-drift TARGET [--match-measure kl|term]
                  [--match-horizon H] ...

An arm is a label plus configuration overrides (any ``gbmpo train`` key); ``--regularizers`` is
the shorthand for arms that differ only in the regularizer. At most one of the two; without
either, ``--sweep`` sweeps the base configuration. ``--sweep`` runs each arm once per value of
one key (:mod:`gbmpo.experiments.sweep`: labels ``ARM@key=value``) and the report draws the
accuracy-versus-drift frontier (:mod:`gbmpo.experiments.frontier`). ``--match-drift TARGET``
gives every arm's regularizer a controlled coefficient (``objective.regularizer.control``:
target TARGET, the arm's coefficient as the first step's) so that the arms run at equal drift
(:func:`gbmpo.experiments.grid.match_drift`); an arm without a regularizer stays so.

Train overrides are the ``gbmpo train`` ones (``--optim.lr 1e-4``, ``--steps 200``,
``--time-budget 120``...); the keys the grid sets itself (regularizer name and coefficient,
seed, task, output directory) are rejected with the option to use instead.

:func:`run_compare` needs the unparsed train overrides: ``run_compare(args, extra)`` or
``args.overrides``. Exit codes: 0 success, 1 some grid runs failed (the report covers the
others), 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gbmpo.cli.args import parse_overrides, positive_int, report_errors
from gbmpo.cli.report import add_report_options, print_table
from gbmpo.config import canonical_key
from gbmpo.experiments.execute import (
    plan_action,
    run_grid,
)
from gbmpo.experiments.grid import (
    GridArm,
    GridError,
    check_overrides,
    match_drift,
    parse_arms,
    parse_coefs,
    parse_regularizers,
    parse_seeds,
    plan_arms,
    plan_grid,
)
from gbmpo.experiments.report import write_report
from gbmpo.experiments.runs import RunDirError, RunRecord, load_run
from gbmpo.experiments.sweep import BASE_ARM, Sweep, parse_sweep, sweep_runs, swept_value
from gbmpo.io import RunLock
from gbmpo.meta.backends import BACKENDS
from gbmpo.objectives.drift_control import MEASURES, DriftControl
from gbmpo.train import load_config

#: the coefficient's key (a sweep of it replaces --coefs)
_COEF = "objective.regularizer.coef"

__all__ = ["add_compare_parser", "run_compare"]


def add_compare_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``compare`` to an ``argparse`` subparsers object; returns the parser."""
    p = subparsers.add_parser(
        "compare",
        help="run arms (or regularizers) x seeds as trainer runs and report mean ± std",
        description=(
            "Run every arm (a label plus configuration overrides) or every regularizer with "
            "every seed (ordinary `gbmpo train` runs under "
            "DIR/runs/<task>/<label>/seed<k>/; finished runs are reused, unfinished ones "
            "resumed), then write DIR/results.json, DIR/report.md, DIR/report.html and "
            "learning-curve PNGs. Any `gbmpo train` setting can be added (--section.key VALUE)."
        ),
        allow_abbrev=False,
    )
    p.add_argument(
        "--arms",
        nargs="+",
        default=None,
        metavar="ARM",
        help="arms: LABEL:key=value,key=value (gbmpo train keys, e.g. "
        "'atr:objective.surrogate.name=atr,objective.surrogate.params.delta=0.02'; 'LABEL:' "
        "is the base configuration) or a YAML file mapping labels to settings",
    )
    p.add_argument(
        "--regularizers",
        default=None,
        help="shorthand for regularizer arms: comma-separated regularizer names, optionally "
        "labelled: kl_k3,nm_es=neural_mirror",
    )
    p.add_argument(
        "--sweep",
        action="append",
        default=None,
        metavar="[ARM:]KEY=V1,V2,...",
        help="run every arm (or the base configuration) once per value of KEY (any gbmpo train "
        "key or alias, e.g. objective.regularizer.coef=0.01,0.05,0.2); ARM:KEY=... gives one "
        "arm its own values (repeat the option; one KEY per grid); rows are labelled "
        "ARM@key=value and the report draws held-out accuracy against drift",
    )
    p.add_argument(
        "--match-drift",
        type=float,
        default=None,
        metavar="TARGET",
        help="compare at equal drift: every arm's regularizer gets a controlled coefficient "
        "(objective.regularizer.control) holding its measure at TARGET, the arm's coefficient "
        "as the first step's (arms without a regularizer stay so)",
    )
    p.add_argument("--match-measure", default="kl", choices=MEASURES,
                   help="with --match-drift: kl (the rollout's k3 against the reference, "
                   "reg/kl_k3, the same for every arm; default) or term (each arm's own "
                   "divergence)")  # fmt: skip
    p.add_argument("--match-horizon", type=float, default=10.0, metavar="H",
                   help="with --match-drift: the controller's horizon in steps (default 10)")
    p.add_argument("--seeds", default="0,1,2", help="seeds, e.g. 0,1,2 or 0-4 (default 0,1,2)")
    p.add_argument("--task", default=None, help="task name(s), comma-separated (default: config)")
    p.add_argument("--config", metavar="FILE", help="base YAML training configuration")
    p.add_argument(
        "--coefs",
        default=None,
        metavar="LABEL=V,...",
        help="coefficient per label (default: the config's for its own regularizer, else "
        "kl_k3 0.04, prob_l2 0.05, neural_mirror 1.0, none 0)",
    )
    p.add_argument(
        "--regularizer-params",
        default=None,
        metavar="JSON",
        help='parameters per label, e.g. \'{"nm_es": {"mirror": "es/best_mirror.json"}}\'',
    )
    p.add_argument(
        "--backend",
        default="serial",
        help="where runs execute: serial (this process, one at a time; default), local "
        "(process pool) or ray",
    )
    p.add_argument("--workers", type=positive_int, default=None, help="local backend: processes")
    p.add_argument("--ray-address", default=None, help="ray backend: cluster address")
    p.add_argument("--output-dir", required=True, metavar="DIR", help="grid and report directory")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="validate every run's configuration and show what would run; train nothing",
    )
    add_report_options(p)
    return p


@dataclass
class _Plan:
    """What ``gbmpo compare`` runs: the runs, the base configuration, the regularizer entries
    (``--regularizers``) or arms (``--arms`` / a base sweep), the seeds and the overrides."""

    runs: list[Any]
    base: Any
    entries: list[Any]
    arms: list[Any]
    seeds: list[int]
    overrides: list[tuple[str, Any]]
    use_arms: bool
    sweep: Sweep | None


def _compare(args: argparse.Namespace, tokens: list[str]) -> int:
    plan = _plan(args, tokens)
    _describe(plan)
    if args.dry_run:
        for run in plan.runs:
            action, ovr = plan_action(run)
            more = f" with {ovr}" if ovr else ""
            print(f"[compare] {run.name}: {action}{more}")
        print(f"dry run OK: {len(plan.runs)} runs")
        return 0
    backend_params = _backend_params(args, plan.base.run.num_threads)
    # one compare per output directory: a second one would delete and restart the runs the
    # first is training ("fresh" runs start from an empty directory)
    with RunLock(args.output_dir, "compare output"):
        outcome = run_grid(plan.runs, backend=args.backend, backend_params=backend_params)
        records: list[RunRecord] = []
        failures = dict(outcome.failures)
        for run in plan.runs:
            if run.name in failures:
                continue
            try:
                records.append(load_run(run.run_dir, label=run.label))
            except RunDirError as err:
                failures[run.name] = str(err)
        if not records:
            print("gbmpo compare: no run finished; nothing to report", file=sys.stderr)
            _print_failures(failures)
            return 1
        _report(args, plan, records, failures, outcome.actions)
        if failures:
            print(f"gbmpo compare: {len(failures)} run(s) failed:", file=sys.stderr)
            _print_failures(failures)
            return 1
        return 0


def _check_options(args: argparse.Namespace, sweep: Sweep | None) -> tuple[bool, bool]:
    """Refuse conflicting options; return ``(use_arms, base_sweep)``: whether the grid is a list
    of arms (``--arms``, or the base configuration alone when only ``--sweep`` is given)."""
    use_arms = getattr(args, "arms", None) is not None
    if use_arms and args.regularizers is not None:
        raise GridError(
            "give exactly one of --arms (LABEL:key=value,... or a YAML file) and "
            "--regularizers (the regularizer shorthand)"
        )
    if not use_arms and args.regularizers is None and sweep is None:
        raise GridError(
            "give exactly one of --arms (LABEL:key=value,... or a YAML file) and "
            "--regularizers (the regularizer shorthand), or --sweep KEY=V1,V2,... alone"
        )
    base_sweep = not use_arms and args.regularizers is None
    if sweep is not None and args.regularizers is not None:
        if sweep.key == "objective.regularizer.name":
            raise GridError("--sweep objective.regularizer.name: use --regularizers")
        if sweep.key == _COEF and args.coefs is not None:
            raise GridError(
                "--coefs and --sweep objective.regularizer.coef both set coefficients; give "
                "an arm its own values with --sweep ARM:coef=V1,V2,..."
            )
    use_arms = use_arms or base_sweep
    if use_arms:
        for opt, value in (("--coefs", args.coefs), ("--regularizer-params",
                                                     args.regularizer_params)):
            if value is not None:
                raise GridError(
                    f"{opt} goes with --regularizers; with --arms set the regularizer in the "
                    "arm (objective.regularizer.coef=..., objective.regularizer.params.X=...)"
                )
    return use_arms, base_sweep


def _regularizer_params(text: str | None) -> dict[str, Any]:
    """``--regularizer-params`` (JSON mapping labels to objects) -> a dict."""
    if not text:
        return {}
    try:
        params = json.loads(text)
    except json.JSONDecodeError as err:
        raise GridError(f"--regularizer-params is not valid JSON: {err}") from None
    if not isinstance(params, dict) or not all(isinstance(v, dict) for v in params.values()):
        raise GridError('--regularizer-params must map labels to objects: {"label": {...}}')
    return params


def _coef_swept(sweep: Sweep | None, entries: Sequence[Any]) -> set[str]:
    """The ``--regularizers`` labels whose coefficients a sweep of the coefficient sets."""
    if sweep is None or sweep.key != _COEF:
        return set()
    return {e.label for e in entries if sweep.values_for(e.label) is not None}


def _plan(args: argparse.Namespace, tokens: list[str]) -> _Plan:
    """Every run of the grid, validated (nothing written)."""
    sweep_items = getattr(args, "sweep", None)
    sweep = parse_sweep(sweep_items) if sweep_items else None
    use_arms, base_sweep = _check_options(args, sweep)
    overrides = parse_overrides(tokens, flags=getattr(args, "own_flags", ()))
    check_overrides(overrides, arms=use_arms)
    if args.backend not in BACKENDS:
        raise GridError(
            f"--backend: unknown backend {args.backend!r}; valid: {', '.join(BACKENDS.names())}"
        )
    seeds = parse_seeds(args.seeds)
    tasks = [t.strip() for t in args.task.split(",") if t.strip()] if args.task else None
    keep_progress = any(canonical_key(k) == "run.progress" for k, _ in overrides)
    progress = None if keep_progress else False
    entries: list[Any] = []
    arms: list[Any] = []
    if use_arms:
        arms = [GridArm(BASE_ARM)] if base_sweep else parse_arms(args.arms)
        base = load_config(args.config, overrides)
        runs = plan_arms(base, arms, seeds, args.output_dir, tasks=tasks, progress=progress)
    else:
        entries = parse_regularizers(args.regularizers)
        coefs = parse_coefs(args.coefs)
        params = _regularizer_params(args.regularizer_params)
        base = load_config(args.config, overrides)
        runs = plan_grid(base, entries, seeds, args.output_dir, tasks=tasks, coefs=coefs,
                         params=params, progress=progress,
                         coef_swept=_coef_swept(sweep, entries))  # fmt: skip
    if sweep is not None:
        runs = sweep_runs(runs, sweep, args.output_dir, progress=progress)
    control = _match_control(args, sweep)
    if control is not None:
        runs = match_drift(runs, control)
    return _Plan(runs, base, entries, arms, seeds, overrides, use_arms, sweep)


def _match_control(args: argparse.Namespace, sweep: Sweep | None) -> DriftControl | None:
    """The control ``--match-drift`` sets on every arm (``None`` without it)."""
    target = getattr(args, "match_drift", None)
    if target is None:
        return None
    if sweep is not None and sweep.key == _COEF:
        raise GridError("--match-drift sets every coefficient by its controller; a sweep of "
                        "objective.regularizer.coef would change the first step's only")
    try:
        return DriftControl.from_dict(
            {"target": target, "measure": getattr(args, "match_measure", "kl"),
             "horizon": getattr(args, "match_horizon", 10.0)}, lambda v, k: float(v))
    except ValueError as err:
        raise GridError(f"--match-drift: {err}") from None


def _term_text(t: Any, sep: str) -> str:
    c = t.control
    return (f"{t.name}{sep}coef {t.coef:g}"
            + (f" (controlled: {c.measure} -> {c.target:g})" if c is not None else "")
            + (f", in the {t.placement}" if t.placement != "loss" else "")
            + (f", params {t.params}" if t.params else ""))  # fmt: skip


def _describe(plan: _Plan) -> None:
    """One ``[compare]`` line per row: its surrogate (arms) and regularizer."""
    seen: set[str] = set()
    sweep = plan.sweep
    for run in plan.runs:
        if run.label in seen:
            continue
        seen.add(run.label)
        o = run.config.objective
        if len(o.terms) == 1:
            reg_text = _term_text(o.terms[0], ", ")
        else:
            reg_text = " + ".join(f"{_term_text(t, ' (')})" for t in o.terms)
        extra = ""
        if sweep is not None and run.label != run.arm and sweep.key != _COEF:
            extra += f", {sweep.key} {swept_value(run.config, sweep.key)}"
        if plan.use_arms:
            surr = o.surrogate
            sp = f" {surr.params}" if surr.params else ""
            print(
                f"[compare] {run.label}: surrogate {surr.name}{sp}, regularizer {reg_text}{extra}"
            )
        else:
            print(
                f"[compare] {run.label}: regularizer {reg_text} (from {run.coef_source}){extra}"
            )


def _backend_params(args: argparse.Namespace, threads: int | None) -> dict[str, Any]:
    """The execution backend's parameters from ``--workers`` / ``--ray-address``."""
    if args.workers is not None and args.backend != "local":
        raise GridError("--workers is for --backend local")
    if args.backend == "local":
        return {"workers": args.workers, "threads_per_worker": threads}
    if args.backend == "ray":
        return {"address": args.ray_address, "cpus_per_member": threads or 1}
    if args.backend == "serial":
        return {"threads": threads}
    return {}


def _print_failures(failures: dict[str, str]) -> None:
    for name, err in failures.items():
        print(f"  {name}: {err}", file=sys.stderr)


def _report(args: argparse.Namespace, plan: _Plan, records: list[RunRecord],
            failures: dict[str, str], actions: Any) -> None:  # fmt: skip
    """Write results.json, report.md / report.html and the plots; print the table."""
    runs, sweep = plan.runs, plan.sweep
    grid_spec: dict[str, Any] = {
        "regularizers": [
            {
                "label": e.label,
                "regularizer": e.regularizer,
                "coef": next(r.config.objective.regularizer.coef for r in runs
                             if r.arm == e.label),
                "coef_source": next(r.coef_source for r in runs if r.arm == e.label),
                "params": next(r.config.objective.regularizer.params for r in runs
                               if r.arm == e.label),
            }
            for e in plan.entries
        ],
        "seeds": plan.seeds,
        "tasks": sorted({r.task for r in runs}),
        "config_file": args.config,
        "overrides": [[k, v] for k, v in plan.overrides],
        "backend": args.backend,
        "actions": actions,
    }
    control = _match_control(args, sweep)
    if control is not None:
        grid_spec["match_drift"] = control.to_dict()
    if plan.use_arms:
        grid_spec["arms"] = [_arm_spec(arm, runs) for arm in plan.arms]
    if sweep is not None:
        grid_spec["sweep"] = {
            "key": sweep.key,
            "label_key": sweep.short,
            "points": {
                r.label: {"arm": r.arm, "value": swept_value(r.config, sweep.key)}
                for r in runs
                if r.label != r.arm
            },
        }
    baseline = args.baseline
    if baseline is None and plan.use_arms and any(r.label == plan.arms[0].label for r in runs):
        baseline = plan.arms[0].label
    results = write_report(
        records,
        args.output_dir,
        baseline=baseline,
        title=args.title or ("Comparison" if plan.use_arms else "Regularizer comparison"),
        window=args.smooth,
        extra={"grid": grid_spec, "failures": failures},
        plots=not args.no_plots,
        drift_measure=args.drift_measure,
    )
    print_table(results)
    print(f"\nreport: {Path(args.output_dir) / 'report.md'} (also report.html, results.json)")


def _arm_spec(arm: Any, runs: Sequence[Any]) -> dict[str, Any]:
    """What an arm ran: its overrides and the resulting surrogate and regularizer."""
    cfg = next(r.config for r in runs if r.arm == arm.label)
    o = cfg.objective
    return {
        "label": arm.label,
        "overrides": [[k, v] for k, v in arm.overrides],
        "surrogate": o.surrogate.name,
        "surrogate_params": dict(o.surrogate.params),
        # one regularizer, or a sum (its names joined by "+", its coefficients and
        # parameters term by term)
        "regularizer": o.regularizer_label,
        "coef": o.coef_label,
        "regularizer_params": (
            [dict(t.params) for t in o.terms] if len(o.terms) > 1 else dict(o.terms[0].params)
        ),
        "advantage": o.advantage,
        "aggregation": o.aggregation,
    }


def run_compare(args: argparse.Namespace, extra: Sequence[str] | None = None) -> int:
    """Run ``gbmpo compare``; ``extra`` (or ``args.overrides``) are the unparsed train
    overrides (``["--lr", "1e-4", ...]``). Returns the exit code (module docstring)."""
    tokens = list(getattr(args, "overrides", None) or []) + list(extra or [])
    return report_errors("compare", lambda: _compare(args, tokens))
