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

Re-invoking the same grid is cheap and safe (:func:`gbmpo.experiments.execute.plan_action`):

* a finished run (complete ``summary.json``) with the same configuration is **reused**;
  a finished run with a *different* configuration is an error (choose another output directory);
* an unfinished run with the same configuration (up to the keys the trainer may change on
  resume) is **resumed** from its last checkpoint through :meth:`Trainer.resume`;
* anything else in the way (an unfinished run of another configuration, an empty directory) is
  deleted and the run is started **fresh**.

Runs are executed by an ES backend of :mod:`gbmpo.meta.backends`: ``serial`` (in this
process, one after another; the default), ``local`` (a process pool) or ``ray``.

Running the planned runs (reuse, resume, fresh; the backends) is
:mod:`gbmpo.experiments.execute`; reports are in :mod:`gbmpo.experiments.report`.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from gbmpo.config import (
    ConfigError,
    TrainConfig,
    apply_overrides,
    canonical_key,
    config_from_dict,
    config_to_dict,
    validate,
)
from gbmpo.objectives.drift_control import DriftControl
from gbmpo.objectives.regularizers import REGULARIZERS

__all__ = [
    "DEFAULT_COEFS",
    "GridArm",
    "GridEntry",
    "GridError",
    "GridRun",
    "match_drift",
    "parse_arms",
    "parse_coefs",
    "parse_regularizers",
    "parse_seeds",
    "plan_arms",
    "plan_grid",
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
    entry: GridEntry, base: TrainConfig, coefs: Mapping[str, float], swept: Collection[str] = ()
) -> tuple[float, str]:
    if entry.label in coefs:
        return coefs[entry.label], "--coefs"
    if entry.label in swept:  # the sweep sets every run's coefficient (sweep_runs)
        return 0.0, "--sweep"
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
    coef_swept: Collection[str] = (),
) -> list[GridRun]:
    """The validated configuration of every run of the grid (nothing is created on disk).

    Each run is ``base`` with the task, the regularizer (name, coefficient, parameters), the
    seed and the output directory replaced. Task parameters of ``base`` are kept only for its
    own task and regularizer parameters only for its own regularizer. ``progress`` sets
    ``run.progress`` (``None``: keep ``base``'s). Labels in ``coef_swept`` take their
    coefficients from a sweep of ``objective.regularizer.coef`` (:func:`sweep_runs`), so they
    need neither ``--coefs`` nor a default coefficient.
    """
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
            coef, source = _resolve_coef(entry, base, coefs, coef_swept)
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


def match_drift(runs: Sequence[GridRun], control: DriftControl) -> list[GridRun]:
    """``gbmpo compare --match-drift``: every run with ``control`` on each active term of its
    regularizer (a name other than ``none`` with a nonzero coefficient, which becomes the first
    step's), so the arms are compared at equal drift by construction; a run without an active
    term stays as it is (its drift is reported beside the others). A run whose terms already
    have a control, or a sum of active terms sharing the measure ``kl``, is a
    :class:`GridError` naming it (validated here, before anything runs)."""
    out = []
    for run in runs:
        cfg = copy.deepcopy(run.config)
        active = [t for t in cfg.objective.terms if t.name != "none" and t.coef != 0]
        if any(t.control is not None for t in cfg.objective.terms):
            raise GridError(f"{run.name}: its regularizer has a control already; --match-drift "
                            "sets one on every arm")
        for t in active:
            t.control = control
        try:
            validate(cfg)
        except ValueError as err:
            raise GridError(f"{run.name} with --match-drift: {err}") from err
        out.append(replace(run, config=cfg))
    return out
