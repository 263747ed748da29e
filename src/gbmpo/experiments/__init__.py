"""Multi-seed comparisons of regularizers: the grid runner (``gbmpo compare``) with its sweeps,
run-directory readers, statistics over seeds, the accuracy-versus-drift frontier and the reports
(``gbmpo report``)."""

from gbmpo.experiments.execute import (
    ensure_final_eval,
    plan_action,
    run_grid,
)
from gbmpo.experiments.frontier import DRIFT_MEASURES, build_frontier, drift_grid, interpolate
from gbmpo.experiments.grid import (
    DEFAULT_COEFS,
    GridEntry,
    GridError,
    GridRun,
    parse_coefs,
    parse_regularizers,
    parse_seeds,
    plan_grid,
)
from gbmpo.experiments.report import write_report
from gbmpo.experiments.results import build_results, group_runs
from gbmpo.experiments.runs import RunDirError, RunRecord, load_run, run_status
from gbmpo.experiments.stats import Spread, StepBand, moving_average, spread, step_band
from gbmpo.experiments.sweep import Sweep, SweepPoint, parse_sweep, sweep_point, sweep_runs

__all__ = [
    "DEFAULT_COEFS",
    "DRIFT_MEASURES",
    "GridEntry",
    "GridError",
    "GridRun",
    "RunDirError",
    "RunRecord",
    "Spread",
    "StepBand",
    "Sweep",
    "SweepPoint",
    "build_frontier",
    "build_results",
    "drift_grid",
    "ensure_final_eval",
    "group_runs",
    "interpolate",
    "load_run",
    "moving_average",
    "parse_coefs",
    "parse_regularizers",
    "parse_seeds",
    "parse_sweep",
    "plan_action",
    "plan_grid",
    "run_grid",
    "run_status",
    "spread",
    "step_band",
    "sweep_point",
    "sweep_runs",
    "write_report",
]
