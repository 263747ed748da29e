"""The comparison grid: tasks x arms x seeds, each an ordinary trainer run.

An *arm* is a label plus configuration overrides (:class:`GridArm`, :func:`parse_arms`, e.g.
``atr:objective.surrogate.name=atr,objective.surrogate.params.delta=0.02``), so one grid can
compare surrogates (clip measures), RPG forms, regularizers or any other setting. A regularizer
grid (:class:`GridEntry`, ``--regularizers kl_k3,prob_l2``) is the shorthand whose arms set the
regularizer's name, coefficient and parameters.

Layout: ``<output_dir>/runs/<task>/<label>/seed<k>/`` is a normal run directory of
:class:`gbmpo.train.Trainer` (``config.yaml``, ``metrics.jsonl``, ``summary.json``...). In a
regularizer grid the ``label`` is the regularizer's name unless the grid gives it another one
(``nm_es=neural_mirror`` runs the ``neural_mirror`` regularizer under the label ``nm_es``), so one
grid can hold the same regularizer twice with different coefficients or parameters. A sweep
(``--sweep``, :mod:`gbmpo.experiments.sweep`) runs each arm once per value of one key under the
label ``<arm>@<key>=<value>``.

Re-invoking the same grid is cheap and safe (:func:`plan_action`):

* a finished run (complete ``summary.json``) with the same configuration is **reused**;
  a finished run with a *different* configuration is an error (choose another output directory);
* an unfinished run with the same configuration (up to the keys the trainer may change on
  resume) is **resumed** from its last checkpoint through :meth:`Trainer.resume`;
* anything else in the way (an unfinished run of another configuration, an empty directory) is
  deleted and the run is started **fresh**.

Runs are executed by an ES backend of :mod:`gbmpo.meta.backends`: ``serial`` (in this
process, one after another; the default), ``local`` (a process pool) or ``ray``.

Why one module of ~690 lines: planning a grid (arms, seeds, coefficients), deciding whether a run is
reused, resumed or restarted, and executing a run all follow the same run-directory layout, whose
rules are kept in one place. Reports are in :mod:`gbmpo.experiments.report`.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from gbmpo.experiments.runs import (
    EVAL_FILE,
    IGNORED_CONFIG_KEYS,
    RunDirError,
    config_differences,
    main_metric,
    run_status,
)
from gbmpo.io import write_atomic
from gbmpo.train.config import (
    ConfigError,
    TrainConfig,
    canonical_key,
    config_from_dict,
    config_to_dict,
    validate,
)

__all__ = [
    "DEFAULT_COEFS",
    "GridArm",
    "GridEntry",
    "GridError",
    "GridRun",
    "ensure_final_eval",
    "execute_run",
    "parse_arms",
    "parse_coefs",
    "parse_regularizers",
    "parse_seeds",
    "plan_action",
    "plan_arms",
    "plan_grid",
    "run_grid",
]

#: Coefficient used for a grid regularizer when neither ``--coefs`` nor the base configuration
#: (same regularizer name) sets one. Sources:
#:   kl_k3: 0.04, the GRPO KL beta of DeepSeekMath / TRL's former default (the GBMPO baseline's
#:          beta is unknown, docs/methods.md "Choices" item 6); also configs/tiny-kl.yaml;
#:   prob_l2: 0.05, the trainer's default (the paper's lambda is unknown; the authors' code
#:          defaults are 0.1 and 1e-4, docs/methods.md "Choices" item 5);
#:   neural_mirror: 1.0, configs/tiny-neural-mirror.yaml: at the random init (scale 0.01) this
#:          puts coef * D_h on the scale of ProbL2 at 0.05 (docs/methods.md, "Neural mirror
#:          map", Scale); the authors' 1e-4 makes the term ~1e-6 per token (docs/methods.md
#:          "Choices" item 5);
#:   none: 0 (the lambda = 0 ablation; the value is irrelevant since D = 0).
DEFAULT_COEFS: dict[str, float] = {
    "kl_k3": 0.04,
    "prob_l2": 0.05,
    "neural_mirror": 1.0,
    "none": 0.0,
}

RUNS_DIR = "runs"
_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+@-]*")
#: keys the grid sets itself; overriding them on the command line is a usage error
_GRID_KEYS = {
    "objective.regularizer.name": "--regularizers",
    "objective.regularizer.coef": "--coefs",
    "run.seed": "--seeds",
    "run.output_dir": "--output-dir",
    "task.name": "--task",
}


class GridError(ConfigError):
    """A grid that cannot be run as asked (bad specification, conflicting existing runs)."""


# ----------------------------------------------------------------------------- specification


@dataclass(frozen=True)
class GridEntry:
    """One row of the comparison: a label, the registered regularizer, its coefficient and
    parameters."""

    label: str
    regularizer: str
    coef: float | None = None
    params: dict[str, Any] = field(default_factory=dict)


def parse_regularizers(text: str) -> list[GridEntry]:
    """``"kl_k3,prob_l2,nm_es=neural_mirror"`` -> entries (``label=name`` or ``name``).

    Names are checked against the ``REGULARIZERS`` registry later (:func:`plan_grid`); labels
    must be unique and usable as directory names.
    """
    entries: list[GridEntry] = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        label, _, name = item.partition("=")
        label, name = label.strip(), (name.strip() or label.strip())
        if not _LABEL.fullmatch(label):
            raise GridError(
                f"--regularizers: bad label {label!r} (letters, digits and _ . + @ - only)"
            )
        if any(e.label == label for e in entries):
            raise GridError(
                f"--regularizers: {label!r} appears twice; give the second one another label, "
                f"e.g. {label}_b={name}"
            )
        entries.append(GridEntry(label=label, regularizer=name))
    if not entries:
        raise GridError("--regularizers is empty")
    return entries


def parse_seeds(text: str) -> list[int]:
    """``"0,1,2"`` or ``"0-2"`` (inclusive ranges, combinable: ``"0-2,7"``) -> distinct seeds."""
    seeds: list[int] = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        m = re.fullmatch(r"(\d+)\s*-\s*(\d+)", item)
        try:
            chunk = list(range(int(m[1]), int(m[2]) + 1)) if m else [int(item)]
        except ValueError:
            raise GridError(f"--seeds: {item!r} is not an integer or a range like 0-2") from None
        if m and int(m[1]) > int(m[2]):
            raise GridError(f"--seeds: empty range {item!r}")
        for s in chunk:
            if s < 0:
                raise GridError(f"--seeds: seeds must be >= 0, got {s}")
            if s in seeds:
                raise GridError(f"--seeds: seed {s} appears twice")
            seeds.append(s)
    if not seeds:
        raise GridError("--seeds is empty")
    return seeds


def parse_coefs(text: str | None) -> dict[str, float]:
    """``"kl_k3=0.04,prob_l2=0.1"`` -> ``{label: coef}``."""
    out: dict[str, float] = {}
    for item in (s.strip() for s in (text or "").split(",")):
        if not item:
            continue
        label, sep, value = item.partition("=")
        if not sep:
            raise GridError(f"--coefs: {item!r} must look like LABEL=VALUE")
        try:
            out[label.strip()] = float(value)
        except ValueError:
            raise GridError(f"--coefs: {value!r} (for {label.strip()!r}) is not a number") from None
    return out


@dataclass
class GridRun:
    """One cell of the grid: where it runs and with which configuration."""

    task: str
    label: str
    seed: int
    run_dir: Path
    config: TrainConfig
    #: how the coefficient was chosen: "--coefs", "config", "default" or "--sweep"
    coef_source: str = ""
    #: the arm (grid row before a sweep, :mod:`gbmpo.experiments.sweep`); default ``label``
    arm: str = ""

    def __post_init__(self) -> None:
        if not self.arm:
            self.arm = self.label

    @property
    def name(self) -> str:
        return f"{self.task}/{self.label}/seed{self.seed}"


def check_overrides(overrides: Sequence[tuple[str, Any]], *, arms: bool = False) -> None:
    """Reject command-line overrides of the keys the grid sets itself (naming the option to
    use instead). With ``arms`` the regularizer's name and coefficient are ordinary settings
    (the same for every arm unless an arm overrides them)."""
    for key, _ in overrides:
        k = canonical_key(key)
        if k in _GRID_KEYS and not (arms and k.startswith("objective.regularizer.")):
            raise GridError(f"--{key} is set by the grid; use {_GRID_KEYS[k]} instead")


def _resolve_coef(
    entry: GridEntry, base: TrainConfig, coefs: Mapping[str, float]
) -> tuple[float, str]:
    if entry.label in coefs:
        return coefs[entry.label], "--coefs"
    if entry.regularizer == "none":
        return 0.0, "default"
    terms = base.objective.terms
    if len(terms) == 1 and entry.regularizer == terms[0].name:
        return terms[0].coef, "config"
    if entry.regularizer in DEFAULT_COEFS:
        return DEFAULT_COEFS[entry.regularizer], "default"
    raise GridError(
        f"no coefficient for {entry.label!r} ({entry.regularizer}): pass --coefs "
        f"{entry.label}=VALUE"
    )


def _grid_run(
    cfg: TrainConfig,
    task: str,
    label: str,
    seed: int,
    out: Path,
    progress: bool | None,
    source: str,
) -> GridRun:
    """The grid run of ``cfg`` (already set up for its arm) on ``task`` (another task than the
    configured one starts from that task's defaults) for ``seed``: its own run directory
    ``out/runs/<task>/<label>/seed<k>``, validated (a bad setting names the run)."""
    if task != cfg.task.name:
        cfg.task.name = task
        cfg.task.params = {}
        cfg.task.train_split = None
    cfg.run.seed = int(seed)
    run_dir = out / RUNS_DIR / task / label / f"seed{seed}"
    cfg.run.output_dir = str(run_dir)
    if progress is not None:
        cfg.run.progress = progress
    try:
        validate(cfg)
    except ValueError as err:  # ConfigError, UnknownNameError
        raise GridError(f"{task}/{label}: {err}") from err
    return GridRun(task, label, int(seed), run_dir, cfg, source)


def plan_grid(
    base: TrainConfig,
    entries: Sequence[GridEntry],
    seeds: Sequence[int],
    output_dir: str | Path,
    *,
    tasks: Sequence[str] | None = None,
    coefs: Mapping[str, float] | None = None,
    params: Mapping[str, Mapping[str, Any]] | None = None,
    progress: bool | None = False,
) -> list[GridRun]:
    """The validated configuration of every run of the grid (nothing is created on disk).

    Each run is ``base`` with the task, the regularizer (name, coefficient, parameters), the
    seed and the output directory replaced. Task parameters of ``base`` are kept only for its
    own task and regularizer parameters only for its own regularizer. ``progress`` sets
    ``run.progress`` (``None``: keep ``base``'s).
    """
    from gbmpo.objectives.regularizers import REGULARIZERS

    coefs = dict(coefs or {})
    params = {k: dict(v) for k, v in (params or {}).items()}
    for entry in entries:
        if entry.regularizer not in REGULARIZERS:
            raise GridError(
                f"--regularizers: unknown regularizer {entry.regularizer!r}; valid names: "
                f"{', '.join(REGULARIZERS.names())}"
            )
    labels = {e.label for e in entries}
    for what, keys in (("--coefs", coefs), ("--regularizer-params", params)):
        unknown = sorted(set(keys) - labels)
        if unknown:
            raise GridError(
                f"{what}: unknown label(s) {', '.join(unknown)}; the grid has "
                f"{', '.join(e.label for e in entries)}"
            )
    out = Path(output_dir)
    runs: list[GridRun] = []
    for task in tasks or [base.task.name]:
        if not _LABEL.fullmatch(task):
            raise GridError(f"--task: bad task name {task!r}")
        for entry in entries:
            coef, source = _resolve_coef(entry, base, coefs)
            for seed in seeds:
                cfg = copy.deepcopy(base)
                reg = cfg.objective.regularizer
                if entry.regularizer != reg.name:
                    reg.params = {}
                reg.name = entry.regularizer
                reg.coef = float(coef)
                reg.params.update(entry.params)
                reg.params.update(params.get(entry.label, {}))
                runs.append(_grid_run(cfg, task, entry.label, seed, out, progress, source))
    return runs


# ------------------------------------------------------------------------------------ arms

#: keys an arm may not set (the grid sets them per run)
_ARM_FORBIDDEN = {k: v for k, v in _GRID_KEYS.items() if not k.startswith("objective.regularizer")}
_ARM_SPLIT = re.compile(r",(?=\s*[A-Za-z_][A-Za-z0-9_.+-]*\s*=)")


@dataclass(frozen=True)
class GridArm:
    """One row of an arms comparison: a label and the configuration overrides (dotted keys or
    ``gbmpo train`` aliases, values as text or typed) applied on top of the base configuration."""

    label: str
    overrides: tuple[tuple[str, Any], ...] = ()


def _check_arm(label: str, overrides: Sequence[tuple[str, Any]], where: str) -> GridArm:
    if not _LABEL.fullmatch(label):
        raise GridError(
            f"{where}: bad arm label {label!r} (letters, digits and _ . + @ - only, not "
            "starting with a symbol)"
        )
    for key, _ in overrides:
        k = canonical_key(key)
        if not k:
            raise GridError(f"{where}: arm {label!r} has an empty key")
        if k in _ARM_FORBIDDEN:
            raise GridError(
                f"{where}: arm {label!r} sets {k}, which the grid sets per run; use "
                f"{_ARM_FORBIDDEN[k]} instead"
            )
    return GridArm(label, tuple((canonical_key(k), v) for k, v in overrides))


def _flatten_arm(value: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        out: list[tuple[str, Any]] = []
        for key, sub in value.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            out += _flatten_arm(sub, path)
        return out
    return [(prefix, value)]


def _arms_file(path: Path) -> list[GridArm]:
    """Arms of a YAML file: a mapping ``label -> {dotted.key: value}`` (nested mappings are
    flattened to dotted keys), optionally under a top-level ``arms:`` key."""
    where = f"--arms {path}"
    if not path.is_file():
        raise GridError(f"{where}: the arms file does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise GridError(f"{where}: not valid YAML: {err}") from None
    if isinstance(data, dict) and set(data) == {"arms"}:
        data = data["arms"]
    if not isinstance(data, dict) or not data:
        raise GridError(
            f"{where}: expected a mapping of arm labels to settings, e.g. "
            "'atr: {objective.surrogate.name: atr, objective.surrogate.params.delta: 0.02}'"
        )
    arms = []
    for label, settings in data.items():
        if settings is None:
            settings = {}
        if not isinstance(settings, dict):
            raise GridError(
                f"{where}: arm {label!r} must map setting keys to values, got "
                f"{type(settings).__name__}"
            )
        arms.append(_check_arm(str(label), _flatten_arm(settings), where))
    return arms


def parse_arms(items: Sequence[str]) -> list[GridArm]:
    """``--arms`` values -> arms. Each item is ``LABEL:key=value,key=value`` (keys as in
    ``gbmpo train --key value``: dotted config keys or aliases; a value may contain commas
    unless they are followed by ``key=``) or a YAML file (``.yaml`` / ``.yml``, see
    :func:`_arms_file`). ``LABEL:`` alone is the base configuration. Labels must be unique."""
    arms: list[GridArm] = []
    for raw in items:
        item = raw.strip()
        if not item:
            continue
        if item.endswith((".yaml", ".yml")) and "=" not in item:
            arms += _arms_file(Path(item))
            continue
        label, sep, rest = item.partition(":")
        if not sep:
            raise GridError(
                f"--arms: {item!r} must look like LABEL:key=value,key=value (or be a .yaml "
                "file of arms)"
            )
        overrides: list[tuple[str, Any]] = []
        for part in (p.strip() for p in _ARM_SPLIT.split(rest)):
            if not part:
                continue
            key, eq, value = part.partition("=")
            if not eq or not key.strip():
                raise GridError(
                    f"--arms: {part!r} in arm {label.strip()!r} must look like key=value"
                )
            overrides.append((key.strip(), value.strip()))
        arms.append(_check_arm(label.strip(), overrides, "--arms"))
    if not arms:
        raise GridError("--arms is empty")
    seen: set[str] = set()
    for arm in arms:
        if arm.label in seen:
            raise GridError(f"--arms: the label {arm.label!r} appears twice")
        seen.add(arm.label)
    return arms


def _arm_config(base: TrainConfig, arm: GridArm) -> TrainConfig:
    """``base`` with ``arm``'s overrides. An arm that switches the surrogate or the regularizer
    to another name drops the base's parameters of that component (they belong to the other
    one); its own ``...params.X`` overrides then apply."""
    from gbmpo.train.config import apply_overrides

    data = config_to_dict(base)
    keys = dict(arm.overrides)
    for comp in ("surrogate", "regularizer"):
        name = keys.get(f"objective.{comp}.name")
        section = data["objective"][comp]
        if name is not None and isinstance(section, dict) and name != section["name"]:
            data["objective"][comp]["params"] = {}
    try:
        apply_overrides(data, list(arm.overrides))
        return config_from_dict(data)
    except ConfigError as err:
        raise GridError(f"arm {arm.label!r}: {err}") from None


def plan_arms(
    base: TrainConfig,
    arms: Sequence[GridArm],
    seeds: Sequence[int],
    output_dir: str | Path,
    *,
    tasks: Sequence[str] | None = None,
    progress: bool | None = False,
) -> list[GridRun]:
    """The validated configuration of every run of an arms grid (nothing is created on disk):
    ``base`` with each arm's overrides (:func:`_arm_config`), then the task, the seed and the
    output directory of the run. ``progress`` as in :func:`plan_grid`."""
    out = Path(output_dir)
    runs: list[GridRun] = []
    for task in tasks or [base.task.name]:
        if not _LABEL.fullmatch(task):
            raise GridError(f"--task: bad task name {task!r}")
        for arm in arms:
            arm_cfg = _arm_config(base, arm)
            for seed in seeds:
                cfg = copy.deepcopy(arm_cfg)
                runs.append(_grid_run(cfg, task, arm.label, seed, out, progress, "arm"))
    return runs


# --------------------------------------------------------------------------------- reuse


def _resumable_keys() -> tuple[str, ...]:
    """The keys the trainer lets a resumed run change (imported here: the trainer needs torch)."""
    from gbmpo.train.run import RESUMABLE_OVERRIDES

    return tuple(RESUMABLE_OVERRIDES)


def _saved_config(run_dir: Path) -> dict[str, Any] | None:
    try:
        data = yaml.safe_load((run_dir / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return None
    return data if isinstance(data, dict) else None


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
    from gbmpo.experiments.runs import flatten

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
    import torch

    from gbmpo.eval import evaluate
    from gbmpo.models import load_model_and_tokenizer
    from gbmpo.train.setup import build_task, eval_limit

    cfg = config_from_dict(yaml.safe_load((p / "config.yaml").read_text()))
    model, tokenizer = load_model_and_tokenizer(
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
        samples=1,
        temperature=0.0,
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
    from gbmpo.train import Trainer

    t0 = time.perf_counter()
    run_dir = Path(job["run_dir"])
    name = job["name"]
    print(f"[compare] {name}: {job['action']} -> {run_dir}", flush=True)
    if job["action"] == "fresh":
        if run_dir.exists():
            shutil.rmtree(run_dir)
        cfg = config_from_dict(job["config"])
        if cfg.engine == "gbmpo":
            Trainer(cfg).train()
        else:  # an arm may be an engine: TRL's or verl's trainer, same run directory
            from gbmpo import engines

            engines.run(cfg)
    elif job["action"] == "resume":
        Trainer.resume(run_dir, list(job.get("overrides") or [])).train()
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
    ``theta[0]`` is the index of the job to run."""

    def __init__(self, jobs: Sequence[Mapping[str, Any]]) -> None:
        self.jobs = [dict(j) for j in jobs]

    def __call__(self, theta: np.ndarray) -> float:
        return execute_run(self.jobs[int(round(float(np.asarray(theta).ravel()[0])))])


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
    from gbmpo.meta.backends import get_backend

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
        with get_backend(backend, **dict(backend_params or {})) as pool:
            results = pool.evaluate(
                GridMember(todo), [np.array([float(i)]) for i in range(len(todo))]
            )
        for job, res in zip(todo, results, strict=True):
            if isinstance(res, BaseException):
                failures[job["name"]] = f"{type(res).__name__}: {res}"
                log(f"[compare] {job['name']}: FAILED: {type(res).__name__}: {res}")
            else:
                seconds[job["name"]] = float(res)
    return GridOutcome(actions=actions, failures=failures, seconds=seconds)
