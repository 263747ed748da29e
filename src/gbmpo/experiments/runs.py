"""Reading trainer run directories: configuration, summary, metrics and the final evaluation.

A run directory (written by :class:`gbmpo.train.Trainer`) holds ``config.yaml``,
``metrics.jsonl`` and, once the run has finished, ``summary.json`` (written last). The final
held-out metrics of a run are the summary's ``eval_after`` (the trainer's greedy evaluation of
the final policy on the task's held-out split) or, when the run was trained without it,
``compare_eval.json`` written by :func:`gbmpo.experiments.execute.ensure_final_eval`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gbmpo.config import rename_old_keys

__all__ = [
    "EVAL_FILE",
    "IGNORED_CONFIG_KEYS",
    "RunDirError",
    "RunRecord",
    "assign_labels",
    "config_differences",
    "default_label",
    "find_run_dirs",
    "flatten",
    "group_key",
    "load_run",
    "main_metric",
    "run_status",
]

CONFIG_FILE = "config.yaml"
SUMMARY_FILE = "summary.json"
METRICS_FILE = "metrics.jsonl"
#: final held-out metrics computed by ``gbmpo compare`` for runs trained without ``eval.after``
EVAL_FILE = "compare_eval.json"
#: configuration keys that do not change what a run computes (where it is written, how it
#: reports progress, how many threads it used)
IGNORED_CONFIG_KEYS = frozenset(
    {"run.output_dir", "run.progress", "run.num_threads", "run.report_to"}
)


class RunDirError(ValueError):
    """A run directory that cannot be read (missing, unfinished, corrupt); the message names it."""


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists and ``params`` dicts stay values)."""
    if not isinstance(data, dict) or prefix.endswith("params"):
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and not path.endswith("params"):
            out.update(flatten(value, path))
        else:
            out[path] = value
    return out


def config_differences(
    a: dict[str, Any], b: dict[str, Any], ignore: frozenset[str] = IGNORED_CONFIG_KEYS
) -> list[str]:
    """Dotted keys whose values differ between two nested configuration dicts."""
    fa, fb = flatten(a), flatten(b)
    keys = sorted((set(fa) | set(fb)) - ignore)
    return [k for k in keys if _normal(fa.get(k)) != _normal(fb.get(k))]


def _normal(value: Any) -> Any:
    # tuples come back from YAML as lists; 5e-5 may be stored as a float or a string
    if isinstance(value, tuple):
        return [_normal(v) for v in value]
    if isinstance(value, list):
        return [_normal(v) for v in value]
    if isinstance(value, dict):
        return {k: _normal(v) for k, v in value.items()}
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise RunDirError(f"{path} is not valid JSON: {err}") from err


def run_status(path: str | Path) -> str:
    """``"finished"`` (complete ``summary.json``), ``"unfinished"`` (a ``config.yaml`` but no
    complete summary), ``"empty"`` (a directory without ``config.yaml``) or ``"missing"``."""
    p = Path(path)
    if not p.is_dir():
        return "missing"
    summary = p / SUMMARY_FILE
    if summary.is_file():
        try:
            data = json.loads(summary.read_text())
        except json.JSONDecodeError:
            data = None
        if isinstance(data, dict) and data.get("status") == "finished":
            return "finished"
    if (p / CONFIG_FILE).is_file():
        return "unfinished"
    return "empty"


def main_metric(metrics: dict[str, Any] | None) -> str | None:
    """``accuracy`` (math tasks) or ``pass@1`` (code tasks), whichever the metrics hold."""
    for key in ("accuracy", "pass@1"):
        if metrics and key in metrics:
            return key
    return None


@dataclass
class RunRecord:
    """One finished run, as read back from its directory."""

    path: Path
    config: dict[str, Any]
    summary: dict[str, Any]
    metrics: list[dict[str, Any]]
    #: held-out metrics of the final policy (``None`` if the run has none)
    final_eval: dict[str, Any] | None
    #: held-out metrics before training (``None`` if not evaluated)
    eval_before: dict[str, Any] | None
    #: the group (row) this run belongs to; default :func:`default_label`
    label: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def task(self) -> str:
        return str(self.config["task"]["name"])

    @property
    def seed(self) -> int:
        return int(self.config["run"]["seed"])

    @property
    def regularizer(self) -> str:
        """The regularizer's name (terms of a sum joined by ``+``, e.g. ``prob_l2+kl_k3``)."""
        return "+".join(str(t["name"]) for t in _terms(self.config))

    @property
    def coef(self) -> float | tuple[float, ...]:
        """The coefficient (one per term for a sum of regularizers)."""
        coefs = tuple(float(t["coef"]) for t in _terms(self.config))
        return coefs[0] if len(coefs) == 1 else coefs

    @property
    def terms(self) -> list[dict[str, Any]]:
        """The regularizer terms of the configuration (a list of one for one regularizer)."""
        return _terms(self.config)

    @property
    def regularizer_params(self) -> dict[str, Any]:
        terms = _terms(self.config)
        if len(terms) == 1:
            return dict(terms[0].get("params") or {})
        return {str(t["name"]): dict(t.get("params") or {}) for t in terms}


def _terms(config: dict[str, Any]) -> list[dict[str, Any]]:
    """The regularizer terms of a configuration (one mapping, or a list of them)."""
    reg = config["objective"]["regularizer"]
    return list(reg) if isinstance(reg, list) else [reg]


def _term_label(term: dict[str, Any]) -> str:
    params = dict(term.get("params") or {})
    if term.get("placement", "loss") != "loss":
        params["placement"] = term["placement"]
    if term.get("estimator", "sample") != "sample":
        params["estimator"] = term["estimator"]
    if not params:
        return str(term["name"])
    inner = ",".join(f"{k}={params[k]}" for k in sorted(params))
    return f"{term['name']}[{inner}]"


def default_label(config: dict[str, Any]) -> str:
    """Row label from the configuration: the regularizer name, plus its parameters if any
    (e.g. ``neural_mirror[mirror=es/best_mirror.json]``), a placement other than the loss and an
    estimator other than the sampled token; the terms of a sum joined by ``+``."""
    return "+".join(_term_label(t) for t in _terms(config))


def group_key(config: dict[str, Any]) -> tuple[str, str, float | tuple[float, ...], str]:
    """Runs with equal keys are seeds of one setting: task, regularizer name, coefficient and
    regularizer parameters (placement and a non-default estimator included; per term for a
    sum)."""
    terms = _terms(config)

    def keyed(t: dict[str, Any]) -> dict[str, Any]:
        out = {**(t.get("params") or {}), "placement": t.get("placement", "loss")}
        if t.get("estimator", "sample") != "sample":
            out["estimator"] = t["estimator"]
        return out

    first = terms[0]
    plain = (len(terms) == 1 and first.get("placement", "loss") == "loss"
             and first.get("estimator", "sample") == "sample")
    params = json.dumps(
        terms[0].get("params") or {} if plain else [keyed(t) for t in terms],
        sort_keys=True,
        default=str,
    )
    coefs = tuple(float(t["coef"]) for t in terms)
    names = "+".join(str(t["name"]) for t in terms)
    return (str(config["task"]["name"]), names, coefs[0] if len(coefs) == 1 else coefs, params)


def load_run(path: str | Path, *, label: str | None = None) -> RunRecord:
    """Read a finished run directory (raises :class:`RunDirError` naming what is missing)."""
    p = Path(path)
    status = run_status(p)
    if status == "missing":
        raise RunDirError(f"run directory {str(p)!r} does not exist")
    if status == "empty":
        raise RunDirError(f"{str(p)!r} is not a run directory (no {CONFIG_FILE})")
    if status == "unfinished":
        raise RunDirError(
            f"run {str(p)!r} has not finished (no complete {SUMMARY_FILE}); resume it with "
            "`gbmpo train --resume` or re-run `gbmpo compare`"
        )
    config = yaml.safe_load((p / CONFIG_FILE).read_text())
    if not isinstance(config, dict) or "task" not in config or "objective" not in config:
        raise RunDirError(f"{p / CONFIG_FILE} is not a gbmpo training configuration")
    config = rename_old_keys(config)  # a run saved before a key was renamed: the new names
    summary = _read_json(p / SUMMARY_FILE)
    metrics: list[dict[str, Any]] = []
    metrics_path = p / METRICS_FILE
    if metrics_path.is_file():
        for i, line in enumerate(metrics_path.read_text().splitlines()):
            if not line.strip():
                continue
            try:
                metrics.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise RunDirError(f"{metrics_path} line {i + 1} is not valid JSON: {err}") from err
    final = summary.get("eval_after")
    if not final and (p / EVAL_FILE).is_file():
        final = _read_json(p / EVAL_FILE).get("metrics")
    return RunRecord(
        path=p,
        config=config,
        summary=summary,
        metrics=metrics,
        final_eval=final or None,
        eval_before=summary.get("eval_before") or None,
        label=label if label is not None else default_label(config),
    )


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
