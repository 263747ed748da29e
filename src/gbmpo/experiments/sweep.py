"""Sweeps: one configuration key over a list of values, inside each arm of a grid.

``gbmpo compare --sweep KEY=V1,V2,...`` runs every arm (or the base configuration, labelled
``base``) once per value and seed; ``--sweep ARM:KEY=V1,...`` gives one arm its own values (a
coefficient scale differs between regularizers), and an arm without values runs once, unswept.
All ``--sweep`` options of a grid name the same key: the frontier report
(:mod:`gbmpo.experiments.frontier`) draws each arm as one curve through its sweep points.

Label scheme: the run of arm ``A`` at value ``V`` of key ``K`` is the grid row
``A@k=v`` (directory ``runs/<task>/A@k=v/seed<n>/``) where ``k`` is the last dotted component of
``K`` (``objective.regularizer.coef`` -> ``coef``) and ``v`` is the value as typed with every
character other than letters, digits and ``_ . + -`` replaced by ``_``: ``kl_k3@coef=0.04``.
Only letters, digits and ``_ . + - @ =`` appear, so the label is a file name on every system.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gbmpo.config import (
    ConfigError,
    TrainConfig,
    annotation_at,
    canonical_key,
    config_to_dict,
)
from gbmpo.experiments.grid import (
    _ARM_FORBIDDEN,
    GridArm,
    GridError,
    GridRun,
    _arm_config,
    _grid_run,
)
from gbmpo.experiments.runs import RunRecord, flatten

__all__ = [
    "BASE_ARM",
    "Sweep",
    "SweepPoint",
    "parse_sweep",
    "sweep_label",
    "sweep_labels_from_dirs",
    "sweep_point",
    "sweep_runs",
    "swept_value",
]

#: the arm label of a sweep of the base configuration (no ``--arms`` / ``--regularizers``)
BASE_ARM = "base"
_COEF = "objective.regularizer.coef"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.+-]")
#: ``ARM@key=value`` (a sweep label) or ``ARM@value`` (``gbmpo report``'s label of a regularizer
#: run next to runs of the same regularizer at other coefficients)
_POINT = re.compile(r"(?P<arm>[^@]+)@(?:(?P<key>[A-Za-z0-9_]+)=)?(?P<value>[^@=]+)")


@dataclass(frozen=True)
class Sweep:
    """The swept key (canonical dotted form), the values for every arm (``default``, ``None``
    when only some arms are swept) and per-arm values (``ARM:KEY=...``), each as typed."""

    key: str
    default: tuple[str, ...] | None = None
    per_arm: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def short(self) -> str:
        """The key's name in labels: its last dotted component."""
        return self.key.rsplit(".", 1)[-1]

    def values_for(self, arm: str) -> tuple[str, ...] | None:
        """The values arm ``arm`` runs with (``None``: it runs once, unswept)."""
        return self.per_arm.get(arm, self.default)


def sweep_label(arm: str, short_key: str, value: str) -> str:
    """The grid label of ``arm`` at ``value`` (module docstring)."""
    return f"{arm}@{short_key}={_UNSAFE.sub('_', value.strip())}"


@dataclass(frozen=True)
class SweepPoint:
    """What a grid label says about its sweep: the arm, the key's short name (``None`` when the
    label does not name it) and the value as in the label."""

    arm: str
    key: str | None
    value: str


def sweep_point(label: str) -> SweepPoint | None:
    """``"kl_k3@coef=0.04"`` -> ``SweepPoint("kl_k3", "coef", "0.04")``; ``"kl_k3@0.04"``
    (``gbmpo report``'s label for one of several coefficients) -> key ``None``; a label without
    ``@`` is no sweep point (``None``)."""
    m = _POINT.fullmatch(label)
    if m is None:
        return None
    return SweepPoint(m["arm"], m["key"], m["value"])


def parse_sweep(items: Sequence[str]) -> Sweep:
    """``--sweep`` values -> :class:`Sweep`. Each item is ``KEY=V1,V2,...`` (every arm) or
    ``ARM:KEY=V1,V2,...`` (one arm); keys are dotted config keys or ``gbmpo train`` aliases and
    must all be the same key. Values must be distinct; their types are checked against the key
    by :func:`sweep_runs`."""
    key: str | None = None
    default: tuple[str, ...] | None = None
    per_arm: dict[str, tuple[str, ...]] = {}
    for raw in items:
        item = raw.strip()
        head, eq, rest = item.partition("=")
        arm, colon, raw_key = head.rpartition(":")
        raw_key, arm = raw_key.strip(), arm.strip()
        if not eq or not raw_key or (colon and not arm):
            raise GridError(
                f"--sweep: {raw!r} must look like KEY=V1,V2,... or ARM:KEY=V1,V2,... (e.g. "
                "objective.regularizer.coef=0.01,0.05,0.2)"
            )
        k = canonical_key(raw_key)
        try:
            annotation_at(k.split("."))
        except ConfigError as err:
            raise GridError(f"--sweep {raw_key}: {err}") from None
        if k in _ARM_FORBIDDEN:
            raise GridError(f"--sweep: {k} is set by the grid per run; use {_ARM_FORBIDDEN[k]}")
        if key is not None and k != key:
            raise GridError(
                f"--sweep: one key per grid (the frontier's curves run along it); got {key} "
                f"and {k}"
            )
        key = k
        values = tuple(v.strip() for v in rest.split(","))
        if not values or any(not v for v in values):
            raise GridError(f"--sweep {item}: empty value (values are V1,V2,...)")
        labels = [_UNSAFE.sub("_", v) for v in values]
        for i, lab in enumerate(labels):
            if lab in labels[:i]:
                raise GridError(
                    f"--sweep {item}: the values {values[labels.index(lab)]!r} and "
                    f"{values[i]!r} give the same run label ({lab})"
                )
        if colon:
            if arm in per_arm:
                raise GridError(f"--sweep: arm {arm!r} is given values twice")
            per_arm[arm] = values
        else:
            if default is not None:
                raise GridError(
                    "--sweep: values for every arm given twice; give one KEY=V1,V2,... "
                    "(ARM:KEY=... for one arm's own values)"
                )
            default = values
    if key is None:
        raise GridError("--sweep is empty")
    return Sweep(key=key, default=default, per_arm=per_arm)


def swept_value(cfg: TrainConfig, key: str) -> Any:
    """The value of the dotted ``key`` in ``cfg`` (a key inside a ``params`` dict too;
    ``None`` when unset)."""
    flat = flatten(config_to_dict(cfg))
    if key in flat:
        return flat[key]
    head, _, tail = key.partition(".params.")
    params = flat.get(f"{head}.params") if tail else None
    return params.get(tail) if isinstance(params, dict) else None


def sweep_runs(
    runs: Sequence[GridRun],
    sweep: Sweep,
    output_dir: str | Path,
    *,
    progress: bool | None = False,
) -> list[GridRun]:
    """The runs of ``runs`` (one per task, arm and seed, as planned by ``plan_arms`` /
    ``plan_grid``) once per value of the arm's sweep values: ``label`` becomes
    ``ARM@key=value``; arms without values stay as they are. Order: task, arm, value, seed.

    Every value is applied to its arm's configuration and validated here, before anything runs;
    a bad one raises :class:`GridError` naming the key and the value.
    """
    arms = list(dict.fromkeys(r.label for r in runs))
    unknown = sorted(set(sweep.per_arm) - set(arms))
    if unknown:
        raise GridError(
            f"--sweep: unknown arm(s) {', '.join(unknown)}; the grid has {', '.join(arms)}"
        )
    out = Path(output_dir)
    groups: dict[tuple[str, str], list[GridRun]] = {}
    for run in runs:
        groups.setdefault((run.task, run.label), []).append(run)
    planned: list[GridRun] = []
    for (task, arm), members in groups.items():
        values = sweep.values_for(arm)
        if values is None:
            planned += members
            continue
        seen: dict[str, str] = {}
        for value in values:
            label = sweep_label(arm, sweep.short, value)
            where = f"--sweep {sweep.key}={value} (arm {arm})"
            for run in members:
                try:
                    cfg = _arm_config(run.config, GridArm(label, ((sweep.key, value),)))
                except GridError as err:
                    msg = str(err).split(": ", 1)[-1]
                    raise GridError(f"{where}: {msg}") from None
                source = "--sweep" if sweep.key == _COEF else run.coef_source
                try:
                    new = _grid_run(cfg, task, label, run.seed, out, progress, source)
                except GridError as err:
                    raise GridError(f"{where}: {str(err).split(': ', 1)[-1]}") from None
                new.arm = arm
                planned.append(new)
            setting = repr(swept_value(planned[-1].config, sweep.key))
            if setting in seen:
                raise GridError(
                    f"--sweep {sweep.key}: the values {seen[setting]!r} and {value!r} are the "
                    f"same setting ({setting}) for arm {arm}"
                )
            seen[setting] = value
    return planned


def sweep_labels_from_dirs(records: Sequence[RunRecord]) -> int:
    """Give each run laid out as a sweep run of a grid (``.../ARM@key=value/seed<n>/``, ``n``
    its seed) that directory's label, so ``gbmpo report`` on a sweep's directory groups its
    rows as ``gbmpo compare`` did; returns how many runs were relabelled."""
    n = 0
    for rec in records:
        parent = rec.path.parent.name
        point = sweep_point(parent)
        if rec.path.name == f"seed{rec.seed}" and point is not None and point.key is not None:
            rec.label = parent
            n += 1
    return n
