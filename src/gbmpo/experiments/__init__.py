"""Multi-seed comparisons of regularizers: the grid runner (``gbmpo compare``), run-directory
readers, statistics over seeds and the reports (``gbmpo report``)."""

from gbmpo.experiments.grid import (
    DEFAULT_COEFS,
    GridEntry,
    GridError,
    GridRun,
    ensure_final_eval,
    parse_coefs,
    parse_regularizers,
    parse_seeds,
    plan_action,
    plan_grid,
    run_grid,
)
from gbmpo.experiments.report import build_results, group_runs, write_report
from gbmpo.experiments.runs import RunDirError, RunRecord, load_run, run_status
from gbmpo.experiments.stats import Spread, StepBand, moving_average, spread, step_band

__all__ = [
    "DEFAULT_COEFS",
    "GridEntry",
    "GridError",
    "GridRun",
    "RunDirError",
    "RunRecord",
    "Spread",
    "StepBand",
    "build_results",
    "ensure_final_eval",
    "group_runs",
    "load_run",
    "moving_average",
    "parse_coefs",
    "parse_regularizers",
    "parse_seeds",
    "plan_action",
    "plan_grid",
    "run_grid",
    "run_status",
    "spread",
    "step_band",
    "write_report",
]
