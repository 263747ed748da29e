"""``gbmpo report``: report existing run directories.

    gbmpo report RUN_DIR_OR_PARENT... --output-dir DIR [--baseline LABEL] [--title T]

Runs are grouped by task and regularizer (runs of a ``gbmpo compare --sweep`` grid by their
directory's label ``ARM@key=value``); seeds are aggregated as mean ± sample std. A sweep with drift
measurements also gets its accuracy-versus-drift frontier (``--drift-measure``). Exit codes:
0 success, 2 bad input.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from gbmpo.cli.args import positive_int, report_errors
from gbmpo.experiments.frontier import DRIFT_MEASURES
from gbmpo.experiments.report import md_table, summary_table, write_report
from gbmpo.experiments.runs import RunDirError, assign_labels, find_run_dirs, load_run
from gbmpo.experiments.sweep import sweep_labels_from_dirs

__all__ = ["add_report_options", "add_report_parser", "print_table", "run_report"]


def add_report_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--baseline",
        default=None,
        metavar="LABEL",
        help="row the others are compared with seed by seed (default: the first arm with "
        "--arms unless it is swept, else kl_k3 if present)",
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
    p.add_argument(
        "--drift-measure",
        choices=DRIFT_MEASURES,
        default="kl",
        help="x-axis of a sweep's accuracy-versus-drift frontier: the summary's drift.<measure> "
        "(default kl = KL(pi||pi_ref) on held-out prompts)",
    )


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
    add_report_options(p)
    return p


def print_table(results: dict[str, Any]) -> None:
    for task in results["tasks"]:
        print(f"\n{task['task']} ({task['metric']}, mean ± sample std over seeds):")
        print(md_table(*summary_table(task)))
        _print_frontier(task)


def _print_frontier(task: dict[str, Any]) -> None:
    """One line per matched drift: which arm is ahead (or why there is no frontier)."""
    fr = task.get("frontier")
    if not fr:
        return
    if fr.get("reason"):
        print(f"\nno accuracy-versus-drift frontier: {fr['reason']}")
        return
    matched = fr.get("matched") or {}
    if not matched.get("rows"):
        why = matched.get("reason", "no arm has two sweep points")
        print(f"\nfrontier drawn; no matched-drift comparison: {why}")
        return
    print(f"\nat matched drift.{fr['measure']} ({fr['metric']}, mean over seeds):")
    for row in matched["rows"]:
        cells = ", ".join(
            f"{arm} {100 * cell['accuracy']['mean']:.1f}%" for arm, cell in row["arms"].items()
        )
        print(f"  {row['drift']:.4g}: {cells}; ahead: {row['leader']}")



def run_report(args: argparse.Namespace) -> int:
    """Run ``gbmpo report``: group the finished runs under ``args.run_dirs`` and write the
    report into ``args.output_dir``. Returns the exit code (0, or 2 for bad input)."""
    return report_errors("report", lambda: _report(args), extra=(ValueError,))


def _report(args: argparse.Namespace) -> int:
    finished, unfinished = find_run_dirs(args.run_dirs)
    for d in unfinished:
        print(f"gbmpo report: skipping unfinished run {d}", file=sys.stderr)
    if not finished:
        raise RunDirError("no finished run directories to report")

    records = [load_run(d) for d in finished]
    assign_labels(records)
    sweep_labels_from_dirs(records)
    results = write_report(
        records,
        args.output_dir,
        baseline=args.baseline,
        title=args.title or "Regularizer comparison",
        window=args.smooth,
        extra={"sources": [str(p) for p in args.run_dirs]},
        plots=not args.no_plots,
        drift_measure=args.drift_measure,
    )
    print_table(results)
    print(f"\nreport: {Path(args.output_dir) / 'report.md'} (also report.html, results.json)")
    return 0
