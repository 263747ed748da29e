"""Dry-run checks shared by the engines, and the run-directory writing they share.

:func:`common_checks` runs what does not depend on the engine: config values and registry
names (:func:`gbmpo.config.validate`, which builds the objective once), the model
(resolved locally or from the hub cache), the tokenizer, the task and its splits, the device.
What needs a resource this machine lacks (a CUDA device, a hub model that is not cached and
cannot be downloaded, a mirror map that a ``gbmpo es`` run produces, and the data set of a
config meant for another machine) is recorded as *skipped*, with the reason, instead of
failing: the rest of the config is still checked. ``gbmpo train --dry-run`` prints each skipped
check as a warning.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "Check",
    "DryRunReport",
    "EngineUnavailable",
    "common_checks",
    "memory_check",
    "model_config_for",
    "plan_memory",
    "without_missing_mirror",
]


class EngineUnavailable(RuntimeError):
    """The engine cannot run here (its package, GPUs or launcher are missing); the message
    says what is missing. The CLI exits 2."""


@dataclass
class Check:
    """One dry-run check: ``status`` is ``ok`` or ``skipped`` (failures raise)."""

    name: str
    status: str
    detail: str = ""


@dataclass
class DryRunReport:
    """What a dry run checked (:attr:`checks`) and found (:attr:`info`); a
    :class:`gbmpo.engines.base.DryRun`."""

    engine: str
    checks: list[Check] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    def ok(self, name: str, detail: str = "") -> None:
        self.checks.append(Check(name, "ok", detail))

    def skip(self, name: str, reason: str) -> None:
        self.checks.append(Check(name, "skipped", reason))

    @property
    def skipped(self) -> list[Check]:
        return [c for c in self.checks if c.status == "skipped"]

    @property
    def notes(self) -> list[str]:
        """Lines for stdout (:class:`gbmpo.engines.base.DryRun`): none, the checks are in
        :meth:`to_dict`."""
        return []

    @property
    def warnings(self) -> list[str]:
        """Each skipped check as ``name: reason``."""
        return [f"{c.name}: {c.detail}" for c in self.skipped]

    def to_dict(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "checks": {c.name: f"{c.status}" + (f": {c.detail}" if c.detail else "")
                       for c in self.checks},  # fmt: skip
            **self.info,
        }


def without_missing_mirror(cfg: Any) -> Any:
    """``cfg``, or a copy using the mirror map's random initialisation when the configured
    mirror file does not exist yet (an ES run writes it), to check everything else."""
    if _missing_mirror(cfg) is None:
        return cfg
    checked = copy.deepcopy(cfg)
    for term in checked.objective.terms:
        term.params = {k: v for k, v in term.params.items() if k != "mirror"}
    return checked


def _missing_mirror(cfg: Any) -> str | None:
    """The configured mirror-map file when it does not exist (an ES run produces it)."""
    for term in cfg.objective.terms:
        mirror = term.params.get("mirror")
        if isinstance(mirror, str) and not Path(mirror).expanduser().exists():
            return mirror
    return None


def common_checks(cfg: Any, report: DryRunReport) -> tuple[Any, Any]:
    """The engine-independent checks of ``cfg`` into ``report``; returns ``(tokenizer, task)``
    (``None`` where skipped). Bad input raises (``ConfigError``, ``UnknownNameError``,
    ``DataError``, ``FileNotFoundError``), as the own trainer's dry run does."""
    # deferred: torch and what imports it (gbmpo.config, .models, .train), with gbmpo.tasks (0.1 s);
    # the engine registry imports without them
    import torch

    from gbmpo.config import validate
    from gbmpo.models import looks_like_hub_id, resolve_model_path
    from gbmpo.tasks import DataUnavailable
    from gbmpo.train.setup import build_task, load_splits, load_tokenizer

    mirror = _missing_mirror(cfg)
    if mirror is not None:
        report.skip("mirror map", f"{mirror} not found (a `gbmpo es` run writes it)")
    validate(without_missing_mirror(cfg))
    objective = cfg.objective
    report.ok(
        "config",
        f"objective {objective.advantage} / {objective.surrogate.name} / "
        + " + ".join(
            f"{t.name} (coef {t.coef:g}, anchor {t.anchor}"
            + (", in the reward)" if t.placement == "reward" else ")")
            for t in objective.terms
        )
        + f" / {objective.aggregation}",
    )

    tokenizer = None
    try:
        source = resolve_model_path(cfg.model.path)
    except FileNotFoundError as err:
        if not looks_like_hub_id(cfg.model.path) or Path(cfg.model.path).exists():
            raise
        why = str(err).split(". To use it")[0]
        report.skip("model", f"{cfg.model.path} is not available here: {why}")
    else:
        # deferred: transformers is heavy; the engine registry imports without it
        from transformers import AutoConfig

        model_cfg = AutoConfig.from_pretrained(
            source, trust_remote_code=cfg.model.trust_remote_code
        )
        tokenizer = load_tokenizer(cfg)
        report.ok("model", f"{source} ({getattr(model_cfg, 'model_type', '?')})")
        report.info["model"] = source

    task_cfg = cfg
    if tokenizer is None and cfg.task.template == "chat":
        # without the tokenizer the chat prompts cannot be rendered; the data can be counted
        task_cfg = copy.deepcopy(cfg)
        task_cfg.task.template = "base"
    device = cfg.model.device
    device_absent = device.startswith("cuda") and not torch.cuda.is_available()
    task = build_task(task_cfg, tokenizer)
    try:
        train, n_eval, (train_split, eval_split) = load_splits(task_cfg, task, count_eval=True)
    except DataUnavailable as err:
        if not device_absent and tokenizer is not None:  # a run meant for this machine
            raise
        # a config for another machine: like a model it cannot find, a warning
        report.skip("task", f"{cfg.task.name}: data not available here: {err}")
        task = None
    else:
        report.ok(
            "task",
            f"{cfg.task.name}: {len(train)} {train_split} / {n_eval} {eval_split} examples"
            + ("" if task_cfg is cfg else " (chat prompts not rendered: no tokenizer)"),
        )
        report.info.update(train_examples=len(train), eval_examples=n_eval)
        if tokenizer is not None and len(train):
            report.info["longest_prompt_tokens"] = max(
                len(tokenizer(ex["prompt"])["input_ids"]) for ex in train[:1000])

    if device_absent:
        report.skip("device", f"{device}: no CUDA device here (GPU-only checks skipped)")
    else:
        report.ok("device", device)
    if cfg.run.output_dir and Path(cfg.run.output_dir).exists():
        out = Path(cfg.run.output_dir)
        if out.is_dir() and any(out.iterdir()):
            # deferred: gbmpo.config imports torch; the engine registry imports without it
            from gbmpo.config import ConfigError

            raise ConfigError(f"output directory {str(out)!r} already exists and is not empty")
    return tokenizer, (task if task_cfg is cfg else None)


#: the prompt length a memory plan assumes when the data or the tokenizer is not here
ASSUMED_PROMPT_TOKENS = 256


def model_config_for(cfg: Any) -> Any:
    """The model's shape for a memory plan: the known shape of a model the paper configs name
    (:func:`gbmpo.train.memory.model_shape`), else its config.json where the model is here;
    ``OSError`` / ``ValueError`` where neither is."""
    # deferred: gbmpo.models and gbmpo.train import torch; the engine registry imports without it
    from gbmpo.models import resolve_model_path
    from gbmpo.train.memory import model_shape

    model_cfg = model_shape(cfg.model.path)
    if model_cfg is None:
        # deferred: transformers is heavy; the engine registry imports without it
        from transformers import AutoConfig

        model_cfg = AutoConfig.from_pretrained(
            resolve_model_path(cfg.model.path),
            trust_remote_code=cfg.model.trust_remote_code)  # fmt: skip
    return model_cfg


def plan_memory(cfg: Any, model_cfg: Any, prompt_tokens: int) -> dict[str, Any]:
    """The memory plan per GPU of ``cfg`` on its engine (:func:`gbmpo.train.memory.memory_plan`)
    for the model shape ``model_cfg`` and prompts of ``prompt_tokens`` tokens, against the
    configured device's memory; a reference model is counted where a term anchored at it needs
    one or a regularizer is monitored."""
    # deferred: gbmpo.objectives and gbmpo.train import torch; the engine registry imports without
    # them
    from gbmpo.objectives.regularizers import get_regularizer
    from gbmpo.train.device import device_memory_bytes
    from gbmpo.train.memory import memory_plan

    objective = without_missing_mirror(cfg).objective
    needs_ref = bool(objective.monitor_regularizers) or any(
        t.anchor == "ref" and get_regularizer(t.name, **t.params).needs_ref
        for t in objective.terms)
    return memory_plan(cfg, model_cfg, prompt_tokens, needs_ref=needs_ref,
                       device_bytes=device_memory_bytes(cfg.model.device))  # fmt: skip


def memory_check(cfg: Any, report: DryRunReport) -> None:
    """The memory plan per GPU of ``cfg`` on its engine (:func:`plan_memory`) as the check
    ``memory``: the model's shape (:func:`model_config_for`); the longest prompt found by
    :func:`common_checks`, else :data:`ASSUMED_PROMPT_TOKENS`. A plan that does not fit is
    reported, not refused."""
    # deferred: gbmpo.train imports torch; the engine registry imports without it
    from gbmpo.train.memory import plan_line

    try:
        model_cfg = model_config_for(cfg)
    except (OSError, ValueError) as err:
        report.skip("memory", f"no shape for {cfg.model.path!r} here ({err})")
        return
    prompt = report.info.get("longest_prompt_tokens")
    assumed = prompt is None
    plan = plan_memory(cfg, model_cfg, prompt or ASSUMED_PROMPT_TOKENS)
    line = plan_line(plan, cfg.model.device)
    if assumed:
        line += f" (prompts assumed {ASSUMED_PROMPT_TOKENS} tokens: the data is not here)"
    report.ok("memory", line)
    report.info["memory_plan"] = {k: v for k, v in plan.items() if k != "notes"}


def run_identity(cfg: Any) -> dict[str, Any]:
    """The part of an engine's ``summary.json`` that names what ran: model, task, the
    objective (advantage, surrogate, regularizer and coefficient, aggregation) and seed; the
    same keys as the own trainer's summary, so reports group runs of every engine alike."""
    objective = cfg.objective
    return {
        "model": cfg.model.path,
        "task": cfg.task.name,
        "advantage": objective.advantage,
        "surrogate": objective.surrogate.name,
        "regularizer": objective.regularizer_label,
        "coef": objective.coef_label,
        "aggregation": objective.aggregation,
        "seed": cfg.run.seed,
    }
