"""Running a planned comparison grid (:mod:`gbmpo.experiments.grid`): whether each run is reused,
resumed or started fresh (:func:`plan_action`), one run with its final held-out evaluation
(:func:`execute_run`, :func:`ensure_final_eval`), and the whole grid on an ES backend of
:mod:`gbmpo.meta.backends` (:func:`run_grid`).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import torch
import yaml

from gbmpo import engines, models
from gbmpo.config import config_from_dict, config_to_dict, rename_old_keys
from gbmpo.eval import evaluate
from gbmpo.experiments.grid import GridError, GridRun
from gbmpo.experiments.runs import (
    EVAL_FILE,
    IGNORED_CONFIG_KEYS,
    RunDirError,
    config_differences,
    flatten,
    main_metric,
    run_status,
)
from gbmpo.io import EXIT_CODES, RunStopped, write_atomic
from gbmpo.io.stop import STOP_FILE, handling
from gbmpo.lifecycle import RESUMABLE_OVERRIDES
from gbmpo.meta.backends import get_backend
from gbmpo.train import Trainer
from gbmpo.train.setup import build_task, eval_limit

__all__ = [
    "GridMember",
    "GridOutcome",
    "GridStopped",
    "ensure_final_eval",
    "execute_run",
    "plan_action",
    "run_grid",
]


def _resumable_keys() -> tuple[str, ...]:
    """The keys the trainer lets a resumed run change (imported here: the trainer needs torch)."""
    return tuple(RESUMABLE_OVERRIDES)


def _saved_config(run_dir: Path) -> dict[str, Any] | None:
    try:
        data = yaml.safe_load((run_dir / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return None
    if not isinstance(data, dict):
        return None
    # a run saved before a key was renamed compares under the new name, and one saved before a
    # key existed compares with that key's default (a new key's default keeps the old behaviour)
    data = rename_old_keys(data)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return config_to_dict(config_from_dict(data))
    except Exception:  # noqa: BLE001 - not a configuration this version reads: compare as saved
        return data


def plan_action(run: GridRun) -> tuple[str, list[tuple[str, Any]]]:
    """What to do with ``run.run_dir``: ``("reuse", [])``, ``("resume", overrides)`` (the
    resumable keys whose value changed) or ``("fresh", [])`` (see the module docstring).

    Raises :class:`GridError` for a finished run made with another configuration.
    """
    status = run_status(run.run_dir)
    if status == "missing":
        return "fresh", []
    wanted = config_to_dict(run.config)
    saved = _saved_config(run.run_dir)
    if status == "finished":
        diff = config_differences(saved or {}, wanted)
        if diff:
            raise GridError(
                f"{run.run_dir} holds a finished run with a different configuration "
                f"({', '.join(diff)}); use another --output-dir or delete that run"
            )
        return "reuse", []
    if status == "unfinished" and saved is not None and run.config.engine == "gbmpo":
        # (runs of the trl and verl engines are restarted: the own trainer resumes its own)
        diff = config_differences(saved, wanted, ignore=frozenset())
        resumable = set(_resumable_keys())
        if set(diff) <= resumable | IGNORED_CONFIG_KEYS:
            flat = {k: v for k, v in _flat(wanted).items() if k in diff and k in resumable}
            return "resume", sorted(flat.items())
    return "fresh", []


def _flat(config: dict[str, Any]) -> dict[str, Any]:
    return flatten(config)


# ----------------------------------------------------------------------------- execution


def ensure_final_eval(run_dir: str | Path) -> dict[str, Any]:
    """The held-out metrics of a finished run's final policy.

    The trainer's ``eval_after`` (greedy, the task's held-out split, ``eval.limit`` /
    ``eval.auto_limit`` / ``eval.max_new_tokens`` of the run) when present; otherwise the same
    evaluation is run here with :func:`gbmpo.eval.evaluate` on the exported ``model/`` and saved
    as ``compare_eval.json``.
    """
    p = Path(run_dir)
    summary = json.loads((p / "summary.json").read_text())
    if summary.get("eval_after"):
        return dict(summary["eval_after"])
    cached = p / EVAL_FILE
    if cached.is_file():
        return dict(json.loads(cached.read_text())["metrics"])
    model_dir = Path(summary.get("final_model") or p / "model")
    if (model_dir / "adapter_config.json").is_file():
        raise RunDirError(
            f"{p}: the final model is a LoRA adapter and the run has no eval_after; train with "
            "--eval.after true to evaluate LoRA runs"
        )

    cfg = config_from_dict(yaml.safe_load((p / "config.yaml").read_text()))
    model, tokenizer = models.load_model_and_tokenizer(
        str(model_dir), dtype=getattr(torch, cfg.model.dtype), device=cfg.model.device
    )
    task = build_task(cfg, tokenizer)
    split = cfg.eval.split or task.eval_split
    result = evaluate(
        model,
        tokenizer,
        task,
        split=split,
        limit=eval_limit(cfg, len(task.split(split))),  # as the trainer evaluates
        samples=cfg.eval.samples,
        temperature=cfg.rollout.temperature if cfg.eval.samples > 1 else 0.0,
        top_p=cfg.rollout.top_p if cfg.eval.samples > 1 else 1.0,
        max_new_tokens=cfg.eval.max_new_tokens,
        batch_size=cfg.eval.batch_size,
    )
    metrics = {
        k: v
        for k, v in result["metrics"].items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    # renamed into place: never half-written
    write_atomic(cached, json.dumps({"metrics": metrics, "config": result["config"]}, indent=2))
    return metrics


def execute_run(job: Mapping[str, Any]) -> float:
    """Train (``action`` fresh or resume) one grid run and make sure it has final held-out
    metrics; returns the wall seconds spent here. ``job`` is a plain dict (picklable for the
    process-pool and Ray backends): ``name``, ``action``, ``run_dir``, ``config`` (a config
    dict) and ``overrides`` (for resume)."""
    t0 = time.perf_counter()
    run_dir = Path(job["run_dir"])
    name = job["name"]
    print(f"[compare] {name}: {job['action']} -> {run_dir}", flush=True)
    if job["action"] == "fresh":
        if run_dir.exists():
            shutil.rmtree(run_dir)

        # an arm may name any engine (the own trainer, TRL's, verl's): same run directory
        engines.run(config_from_dict(job["config"]))
    elif job["action"] == "resume":
        # restart: a run stopped before its first checkpoint starts over in place
        Trainer.resume(run_dir, list(job.get("overrides") or []), restart=True).train()
    elif job["action"] != "reuse":
        raise ValueError(f"unknown action {job['action']!r}")
    metrics = ensure_final_eval(run_dir)
    key = main_metric(metrics)
    seconds = time.perf_counter() - t0
    result = f"{key} {100 * metrics[key]:.1f}%" if key else "no metric"
    print(f"[compare] {name}: done, held-out {result} ({seconds:.0f} s)", flush=True)
    return seconds


class GridMember:
    """Picklable ``fn(theta) -> float`` for :meth:`gbmpo.meta.backends.Backend.evaluate`:
    ``theta[0]`` is the index of the job to run. With ``stop_path``, a job whose turn comes
    after that file was written (the grid was asked to stop) is not started: it raises
    :class:`gbmpo.io.RunStopped` with the signal named in the file."""

    def __init__(self, jobs: Sequence[Mapping[str, Any]], stop_path: str | None = None) -> None:
        self.jobs = [dict(j) for j in jobs]
        self.stop_path = stop_path

    def __call__(self, theta: np.ndarray) -> float:
        if self.stop_path is not None:
            try:
                signame = Path(self.stop_path).read_text().strip()
            except OSError:
                signame = ""
            if signame:
                raise RunStopped(signame if signame in EXIT_CODES else "SIGTERM")
        return execute_run(self.jobs[int(round(float(np.asarray(theta).ravel()[0])))])


class GridStopped(RunStopped):
    """``gbmpo compare`` stopped on SIGTERM / SIGINT: the runs in flight saved a checkpoint
    after their step (or, without one yet, start over), the others did not start. ``str()`` is
    the one line the command prints; the exit code is the signal's (143 / 130)."""

    def __init__(self, signame: str, *, finished: int, total: int) -> None:
        self.finished, self.total = finished, total
        super().__init__(signame)

    def message(self) -> str:
        return (
            f"stopped ({self.state}, {self.signame}): {self.finished} of {self.total} runs "
            "finished; the runs in flight saved a checkpoint after their step and the rest did "
            "not start; run the same gbmpo compare command to go on (finished runs are reused, "
            "stopped ones resumed)"
        )


@contextlib.contextmanager
def _stop_on_signals(pool: Any, stop_path: Path) -> Iterator[list[str]]:
    """For the length of the block, SIGTERM / SIGINT to this process ask the grid to stop:
    the first writes ``stop_path`` (no further run starts) and each is passed on to the
    backend (:meth:`~gbmpo.meta.backends.Backend.request_stop`). Yields the list of the
    signals received (empty: none)."""
    received: list[str] = []

    def handle(signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if not received:
            with contextlib.suppress(OSError):
                write_atomic(stop_path, name + "\n")
        received.append(name)
        pool.request_stop(name)

    with handling(handle):
        yield received


@dataclass
class GridOutcome:
    """What :func:`run_grid` did: per run its action, and the error for failed runs."""

    actions: dict[str, str]
    failures: dict[str, str]
    seconds: dict[str, float]


def run_grid(
    runs: Sequence[GridRun],
    *,
    backend: str = "serial",
    backend_params: Mapping[str, Any] | None = None,
    log: Callable[[str], None] = print,
) -> GridOutcome:
    """Run every grid run that is not finished yet (reusing and resuming as
    :func:`plan_action` says) on the backend ``backend`` of :mod:`gbmpo.meta.backends`.

    A failing run does not stop the others; its error is in ``GridOutcome.failures``.
    """
    actions: dict[str, str] = {}
    jobs: list[dict[str, Any]] = []
    for run in runs:
        action, overrides = plan_action(run)
        actions[run.name] = action
        jobs.append(
            {
                "name": run.name,
                "action": action,
                "run_dir": str(run.run_dir),
                "config": config_to_dict(run.config),
                "overrides": overrides,
            }
        )
    counts = {a: sum(1 for v in actions.values() if v == a) for a in ("reuse", "resume", "fresh")}
    log(
        f"[compare] {len(runs)} runs: {counts['reuse']} finished (reused), "
        f"{counts['resume']} to resume, {counts['fresh']} to train"
    )
    failures: dict[str, str] = {}
    seconds: dict[str, float] = {}
    # reused runs only need their final metrics: do them here, not on the workers
    todo = [j for j in jobs if j["action"] != "reuse"]
    for job in jobs:
        if job["action"] == "reuse":
            try:
                ensure_final_eval(job["run_dir"])
            except Exception as err:  # reported with the other failures
                failures[job["name"]] = f"{type(err).__name__}: {err}"
    if todo:
        thetas = [np.array([float(i)]) for i in range(len(todo))]
        with (tempfile.TemporaryDirectory(prefix="gbmpo-grid-") as tmp,
              get_backend(backend, **dict(backend_params or {})) as pool):  # fmt: skip
            stop_path = Path(tmp) / STOP_FILE
            with _stop_on_signals(pool, stop_path) as received:
                try:
                    results = pool.evaluate(GridMember(todo, str(stop_path)), thetas)
                except RunStopped as err:  # serial: the run in this process stopped
                    received.append(err.signame)
                    results = []
            stopped = [r for r in results if isinstance(r, RunStopped)]
            if received or stopped:
                signame = next((n for n in received if n in EXIT_CODES), "SIGTERM")
                done = sum(run_status(j["run_dir"]) == "finished" for j in jobs)
                raise GridStopped(signame, finished=done, total=len(jobs))
        for job, res in zip(todo, results, strict=True):
            if isinstance(res, BaseException):
                failures[job["name"]] = f"{type(res).__name__}: {res}"
                log(f"[compare] {job['name']}: FAILED: {type(res).__name__}: {res}")
            else:
                seconds[job["name"]] = float(res)
    return GridOutcome(actions=actions, failures=failures, seconds=seconds)
