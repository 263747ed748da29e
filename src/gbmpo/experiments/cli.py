"""``gbmpo compare`` (run an arms x seed grid and report it) and ``gbmpo report`` (report
existing run directories).

    gbmpo compare --arms 'ratio:objective.surrogate.name=clip'
                         'atr:objective.surrogate.name=atr,objective.surrogate.params.delta=0.02'
                  --seeds 0,1,2 [--task T[,T2]] [--config FILE] [--backend serial|local|ray]
                  [--workers N] [--baseline LABEL] [--dry-run] --output-dir DIR
                  [any train override]
    gbmpo compare --arms ARMS.yaml ...
    gbmpo compare --regularizers kl_k3,prob_l2,neural_mirror,none [--coefs LABEL=V,...]
                  [--regularizer-params JSON] ...

An arm is a label plus configuration overrides (any ``gbmpo train`` key); ``--regularizers`` is
the shorthand for arms that differ only in the regularizer. Exactly one of the two is required.

    gbmpo report RUN_DIR_OR_PARENT... --output-dir DIR [--baseline LABEL] [--title T]

Train overrides are the ``gbmpo train`` ones (``--optim.lr 1e-4``, ``--steps 200``,
``--time-budget 120``...); the keys the grid sets itself (regularizer name and coefficient,
seed, task, output directory) are rejected with the option to use instead.

The main CLI (:mod:`gbmpo.cli`) adds the subcommands with :func:`add_compare_parser` /
:func:`add_report_parser` and runs them with :func:`run_compare` (which needs the unparsed
train overrides: ``run_compare(args, extra)`` or ``args.overrides``) and :func:`run_report`.
Until then (or without the main CLI) the same commands run as
``python -m gbmpo.experiments.cli compare|report ...``.
Exit codes: 0 success, 1 some grid runs failed (the report covers the others), 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gbmpo.cli import positive_int
from gbmpo.experiments.grid import (
    GridError,
    parse_arms,
    parse_coefs,
    parse_regularizers,
    parse_seeds,
    plan_action,
    plan_arms,
    plan_grid,
    run_grid,
)
from gbmpo.experiments.runs import (
    RunDirError,
    RunRecord,
    default_label,
    group_key,
    load_run,
    run_status,
)

__all__ = [
    "add_compare_parser",
    "add_report_parser",
    "assign_labels",
    "find_run_dirs",
    "main",
    "run_compare",
    "run_report",
]


def _add_report_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--baseline",
        default=None,
        metavar="LABEL",
        help="row the others are compared with seed by seed (default: the first arm with "
        "--arms, else kl_k3 if present)",
    )
    p.add_argument(
        "--smooth",
        type=positive_int,
        default=10,
        metavar="N",
        help="moving-average window (steps) for training curves (default 10)",
    )
    p.add_argument("--title", default="", help="report title")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG learning curves")


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
    _add_report_options(p)
    return p


def add_report_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``report`` to an ``argparse`` subparsers object; returns the parser."""
    p = subparsers.add_parser(
        "report",
        help="report finished run directories (grouped by task and regularizer)",
        description=(
            "Render results.json, report.md, report.html and learning curves from finished run "
            "directories. A directory that is not itself a run is searched for runs. Runs are "
            "grouped by task and regularizer (name, coefficient, parameters); seeds are "
            "aggregated as mean ± sample std."
        ),
        allow_abbrev=False,
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories or parents")
    p.add_argument("--output-dir", required=True, metavar="DIR", help="where to write the report")
    _add_report_options(p)
    return p


# ------------------------------------------------------------------------------- helpers


def find_run_dirs(paths: Sequence[str | Path]) -> tuple[list[Path], list[Path]]:
    """``(finished, unfinished)`` run directories: each path itself if it is a run, else every
    run directory below it. A path that is neither raises :class:`RunDirError`."""
    finished: list[Path] = []
    unfinished: list[Path] = []
    for raw in paths:
        p = Path(raw)
        status = run_status(p)
        if status == "missing":
            raise RunDirError(f"{str(p)!r} does not exist")
        if status == "finished":
            finished.append(p)
            continue
        if status == "unfinished":
            raise RunDirError(
                f"run {str(p)!r} has not finished (no complete summary.json); resume it with "
                "`gbmpo train --resume` first"
            )
        found = sorted(c.parent for c in p.rglob("config.yaml"))
        runs_here = [d for d in found if run_status(d) == "finished"]
        if not found:
            raise RunDirError(f"no run directories (config.yaml) found under {str(p)!r}")
        finished += runs_here
        unfinished += [d for d in found if run_status(d) == "unfinished"]
    seen: set[Path] = set()
    unique = [d for d in finished if not (d.resolve() in seen or seen.add(d.resolve()))]
    return unique, unfinished


def assign_labels(records: Sequence[RunRecord]) -> None:
    """Give every run its group label from its configuration: the regularizer name (plus its
    parameters), with ``@coef`` appended where one task has that name at several
    coefficients."""
    by_label: dict[tuple[str, str], set[tuple[str, str, float, str]]] = {}
    for r in records:
        by_label.setdefault((r.task, default_label(r.config)), set()).add(group_key(r.config))
    for r in records:
        base = default_label(r.config)
        clash = len(by_label[(r.task, base)]) > 1
        r.label = f"{base}@{r.coef:g}" if clash else base


def _bad_input() -> tuple[type[BaseException], ...]:
    from gbmpo.registry import UnknownNameError
    from gbmpo.train import ConfigError, DataError

    try:
        from gbmpo.cli import UsageError

        usage: tuple[type[BaseException], ...] = (UsageError,)
    except ImportError:  # pragma: no cover
        usage = ()
    return (GridError, RunDirError, ConfigError, DataError, UnknownNameError,
            FileNotFoundError, *usage)


def _print_table(results: dict[str, Any]) -> None:
    from gbmpo.experiments.report import _md_table, _table

    for task in results["tasks"]:
        print(f"\n{task['task']} ({task['metric']}, mean ± sample std over seeds):")
        print(_md_table(*_table(task)))


# ------------------------------------------------------------------------------- compare


def _compare(args: argparse.Namespace, tokens: list[str]) -> int:
    from gbmpo.cli import parse_overrides
    from gbmpo.experiments.grid import check_overrides
    from gbmpo.experiments.report import write_report
    from gbmpo.meta.backends import BACKENDS
    from gbmpo.train import load_config
    from gbmpo.train.config import canonical_key

    use_arms = getattr(args, "arms", None) is not None
    if use_arms == (args.regularizers is not None):
        raise GridError(
            "give exactly one of --arms (LABEL:key=value,... or a YAML file) and "
            "--regularizers (the regularizer shorthand)"
        )
    if use_arms:
        for opt, value in (("--coefs", args.coefs), ("--regularizer-params",
                                                     args.regularizer_params)):
            if value is not None:
                raise GridError(
                    f"{opt} goes with --regularizers; with --arms set the regularizer in the "
                    "arm (objective.regularizer.coef=..., objective.regularizer.params.X=...)"
                )
    overrides = parse_overrides(tokens)
    check_overrides(overrides, arms=use_arms)
    if args.backend not in BACKENDS:
        raise GridError(
            f"--backend: unknown backend {args.backend!r}; valid: {', '.join(BACKENDS.names())}"
        )
    seeds = parse_seeds(args.seeds)
    tasks = [t.strip() for t in args.task.split(",") if t.strip()] if args.task else None
    keep_progress = any(canonical_key(k) == "run.progress" for k, _ in overrides)
    progress = None if keep_progress else False
    if use_arms:
        arms = parse_arms(args.arms)
        base = load_config(args.config, overrides)
        runs = plan_arms(base, arms, seeds, args.output_dir, tasks=tasks, progress=progress)
        entries: list[Any] = []
    else:
        entries = parse_regularizers(args.regularizers)
        coefs = parse_coefs(args.coefs)
        params: dict[str, Any] = {}
        if args.regularizer_params:
            try:
                params = json.loads(args.regularizer_params)
            except json.JSONDecodeError as err:
                raise GridError(f"--regularizer-params is not valid JSON: {err}") from None
            if not isinstance(params, dict) or not all(
                isinstance(v, dict) for v in params.values()
            ):
                raise GridError(
                    '--regularizer-params must map labels to objects: {"label": {...}}'
                )
        base = load_config(args.config, overrides)
        runs = plan_grid(
            base,
            entries,
            seeds,
            args.output_dir,
            tasks=tasks,
            coefs=coefs,
            params=params,
            progress=progress,
        )
    seen: set[str] = set()
    for run in runs:
        if run.label in seen:
            continue
        seen.add(run.label)
        reg = run.config.objective.regularizer
        extra = f", params {reg.params}" if reg.params else ""
        if use_arms:
            surr = run.config.objective.surrogate
            sp = f" {surr.params}" if surr.params else ""
            print(
                f"[compare] {run.label}: surrogate {surr.name}{sp}, regularizer {reg.name}, "
                f"coef {reg.coef:g}{extra}"
            )
        else:
            print(
                f"[compare] {run.label}: regularizer {reg.name}, coef {reg.coef:g} "
                f"(from {run.coef_source}){extra}"
            )
    if args.dry_run:
        for run in runs:
            action, ovr = plan_action(run)
            more = f" with {ovr}" if ovr else ""
            print(f"[compare] {run.name}: {action}{more}")
        print(f"dry run OK: {len(runs)} runs")
        return 0

    backend_params: dict[str, Any] = {}
    threads = base.run.num_threads
    if args.backend == "local":
        backend_params = {"workers": args.workers, "threads_per_worker": threads}
    elif args.backend == "ray":
        backend_params = {"address": args.ray_address, "cpus_per_member": threads or 1}
    elif args.backend == "serial":
        backend_params = {"threads": threads}
    if args.workers is not None and args.backend != "local":
        raise GridError("--workers is for --backend local")
    from gbmpo.train.checkpoint import RunLock

    # one compare per output directory: a second one would delete and restart the runs the
    # first is training ("fresh" runs start from an empty directory)
    with RunLock(args.output_dir, "compare output"):
        outcome = run_grid(runs, backend=args.backend, backend_params=backend_params)

        records: list[RunRecord] = []
        failures = dict(outcome.failures)
        for run in runs:
            if run.name in failures:
                continue
            try:
                records.append(load_run(run.run_dir, label=run.label))
            except RunDirError as err:
                failures[run.name] = str(err)
        if not records:
            print("gbmpo compare: no run finished; nothing to report", file=sys.stderr)
            for name, err in failures.items():
                print(f"  {name}: {err}", file=sys.stderr)
            return 1
        grid_spec: dict[str, Any] = {
            "regularizers": [
                {
                    "label": e.label,
                    "regularizer": e.regularizer,
                    "coef": next(r.config.objective.regularizer.coef for r in runs
                                 if r.label == e.label),
                    "coef_source": next(r.coef_source for r in runs if r.label == e.label),
                    "params": next(r.config.objective.regularizer.params for r in runs
                                   if r.label == e.label),
                }
                for e in entries
            ],
            "seeds": seeds,
            "tasks": sorted({r.task for r in runs}),
            "config_file": args.config,
            "overrides": [[k, v] for k, v in overrides],
            "backend": args.backend,
            "actions": outcome.actions,
        }
        if use_arms:
            grid_spec["arms"] = [_arm_spec(arm, runs) for arm in arms]
        baseline = args.baseline
        if baseline is None and use_arms:
            baseline = arms[0].label
        results = write_report(
            records,
            args.output_dir,
            baseline=baseline,
            title=args.title or ("Comparison" if use_arms else "Regularizer comparison"),
            window=args.smooth,
            extra={"grid": grid_spec, "failures": failures},
            plots=not args.no_plots,
        )
        _print_table(results)
        out = Path(args.output_dir)
        print(f"\nreport: {out / 'report.md'} (also report.html, results.json)")
        if failures:
            print(f"gbmpo compare: {len(failures)} run(s) failed:", file=sys.stderr)
            for name, err in failures.items():
                print(f"  {name}: {err}", file=sys.stderr)
            return 1
        return 0


def _arm_spec(arm: Any, runs: Sequence[Any]) -> dict[str, Any]:
    """What an arm ran: its overrides and the resulting surrogate and regularizer."""
    cfg = next(r.config for r in runs if r.label == arm.label)
    o = cfg.objective
    return {
        "label": arm.label,
        "overrides": [[k, v] for k, v in arm.overrides],
        "surrogate": o.surrogate.name,
        "surrogate_params": dict(o.surrogate.params),
        "regularizer": o.regularizer.name,
        "coef": o.regularizer.coef,
        "regularizer_params": dict(o.regularizer.params),
        "advantage": o.advantage,
        "aggregation": o.aggregation,
    }


def run_compare(args: argparse.Namespace, extra: Sequence[str] | None = None) -> int:
    """Run ``gbmpo compare``; ``extra`` (or ``args.overrides``) are the unparsed train
    overrides (``["--lr", "1e-4", ...]``). Returns the exit code (module docstring)."""
    tokens = list(getattr(args, "overrides", None) or []) + list(extra or [])
    try:
        return _compare(args, tokens)
    except _bad_input() as err:
        print(f"gbmpo compare: error: {err}", file=sys.stderr)
        return 2


# -------------------------------------------------------------------------------- report


def run_report(args: argparse.Namespace) -> int:
    """Run ``gbmpo report``: group the finished runs under ``args.run_dirs`` and write the
    report into ``args.output_dir``. Returns the exit code (0, or 2 for bad input)."""
    from gbmpo.experiments.report import write_report

    try:
        finished, unfinished = find_run_dirs(args.run_dirs)
        for d in unfinished:
            print(f"gbmpo report: skipping unfinished run {d}", file=sys.stderr)
        if not finished:
            raise RunDirError("no finished run directories to report")
        records = [load_run(d) for d in finished]
        assign_labels(records)
        results = write_report(
            records,
            args.output_dir,
            baseline=args.baseline,
            title=args.title or "Regularizer comparison",
            window=args.smooth,
            extra={"sources": [str(p) for p in args.run_dirs]},
            plots=not args.no_plots,
        )
    except (*_bad_input(), ValueError) as err:
        print(f"gbmpo report: error: {err}", file=sys.stderr)
        return 2
    _print_table(results)
    print(f"\nreport: {Path(args.output_dir) / 'report.md'} (also report.html, results.json)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m gbmpo.experiments.cli compare|report ...`` (the same subcommands as
    ``gbmpo compare`` / ``gbmpo report``); returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m gbmpo.experiments.cli", allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    add_compare_parser(sub)
    add_report_parser(sub)
    args, extra = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    if args.command == "compare":
        return run_compare(args, extra)
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return run_report(args)


if __name__ == "__main__":
    sys.exit(main())
