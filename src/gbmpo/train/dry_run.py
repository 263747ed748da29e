"""``gbmpo train --dry-run``: everything but the weights, checked without writing anything."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from gbmpo.config import TrainConfig, validate
from gbmpo.lifecycle import refuse_nonempty
from gbmpo.models import resolve_model_path
from gbmpo.objectives import get_surrogate
from gbmpo.objectives.regularizers import get_regularizer
from gbmpo.tasks import DataUnavailable
from gbmpo.train.device import (
    ONE_DEVICE_REFERENCE_BYTES,
    device_absent_reason,
    device_memory_bytes,
    estimate_memory,
)
from gbmpo.train.memory import memory_plan, plan_line
from gbmpo.train.precision import check_train_dtype
from gbmpo.train.setup import build_task, eval_limit, load_splits, load_tokenizer

__all__ = ["dry_run"]


def dry_run(config: TrainConfig) -> dict[str, Any]:
    """Validate ``config`` and build everything but the weights: objectives, task splits,
    tokenizer and model config; check the device and estimate the memory the run needs on it.
    Creates no run directory. Returns a short description; ``warnings`` lists what a real run
    here would trip on (an absent device, a run that does not fit one device, and, for a config
    meant for another machine (its device is absent here), a model not available here), ``notes``
    the memory estimate in words. A model or a data set that cannot be found is an error
    (``FileNotFoundError``) when the configured device is present; for a config meant for
    another machine each is a warning and the rest is still checked."""
    cfg = validate(config)
    check_train_dtype(cfg.model.dtype, cfg.lora.enabled)
    objective = cfg.objective
    get_surrogate(objective.surrogate.name, **objective.surrogate.params)
    regs = [get_regularizer(t.name, **t.params) for t in objective.terms]
    warnings: list[str] = []
    absent = device_absent_reason(cfg.model.device)
    if absent is not None:
        warnings.append(
            f"model.device {cfg.model.device!r}: {absent}; a real run here stops at once"
        )
    tokenizer = model_cfg = None
    try:
        source = resolve_model_path(cfg.model.path)
        tokenizer = load_tokenizer(cfg)
        model_cfg = _model_config(source, cfg.model.trust_remote_code)
    except FileNotFoundError as err:
        if absent is None:  # a run meant for this machine needs its model here
            raise
        source = cfg.model.path  # a config for another machine: check the rest without it
        warnings.append(f"{err}; checked without it: prompts in the base template, memory unknown")
    task_cfg = cfg
    if tokenizer is None and cfg.task.template == "chat":
        task_cfg = copy.deepcopy(cfg)
        task_cfg.task.template = "base"
    task = build_task(task_cfg, tokenizer)
    try:
        train_data, n_eval, _ = load_splits(cfg, task, count_eval=True)
    except DataUnavailable as err:
        if absent is None and model_cfg is not None:  # a run meant for this machine
            raise
        # a config for another machine: like a model it cannot find, check the rest without it
        warnings.append(f"task {cfg.task.name!r}: {err}; checked without its data")
        train_data, n_eval = [], None
    n_train = len(train_data) if n_eval is not None else None
    if cfg.run.output_dir:
        refuse_nonempty(Path(cfg.run.output_dir))
    needs_ref = bool(
        any(r.needs_ref and t.anchor == "ref" for r, t in zip(regs, objective.terms, strict=True))
        or objective.monitor_regularizers
    )
    memory: dict[str, Any] | None = None
    notes: list[str] = []
    if model_cfg is not None and tokenizer is not None and train_data:
        longest = max(len(tokenizer(ex["prompt"])["input_ids"]) for ex in train_data[:1000])
        memory = estimate_memory(cfg, model_cfg, longest, needs_ref)
        memory["device_bytes"] = device_memory_bytes(cfg.model.device)
        fits, line = _memory_verdict(memory, cfg.model.device)
        memory["fits_one_device"] = fits
        notes.append(line)
        plan = memory_plan(cfg, model_cfg, longest, needs_ref=needs_ref,
                           device_bytes=memory["device_bytes"])  # fmt: skip
        memory["plan"] = {k: v for k, v in plan.items() if k != "notes"}
        notes.append(plan_line(plan, cfg.model.device))
        if not fits:
            warnings.append(
                f"the run does not fit one device ({line}); use an engine that shards it over "
                "several GPUs: TRL (--engine trl, gbmpo.integrations.trl) or verl (--engine "
                "verl, gbmpo.integrations.verl)"
            )
    limit = eval_limit(cfg, n_eval) if n_eval is not None else None
    if limit is not None and n_eval is not None and limit < n_eval:
        notes.append(f"evaluation on the first {limit} of {n_eval} held-out examples")
    return {
        "model": source,
        "model_type": getattr(model_cfg, "model_type", None),
        "vocab_size": len(tokenizer) if tokenizer is not None else None,
        "task": cfg.task.name,
        "train_examples": n_train,
        "eval_examples": n_eval,
        "eval_limit": limit,
        "regularizer_needs_ref": any(bool(r.needs_ref) for r in regs),
        "batch_sequences": cfg.rollout.prompts_per_step * cfg.rollout.num_generations,
        "device": cfg.model.device,
        "device_available": absent is None,
        "memory": memory,
        "warnings": warnings,
        "notes": notes,
    }


def _model_config(source: str, trust_remote_code: bool) -> Any:
    """The model's config (config.json) from ``source`` without network access: a local
    directory or the local Hugging Face cache; FileNotFoundError when neither has it."""
    # deferred: transformers is heavy; gbmpo.train imports without it
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    except OSError as err:
        raise FileNotFoundError(f"model {source!r}: no config.json here ({err})") from err


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _memory_verdict(memory: dict[str, Any], device: str) -> tuple[bool, str]:
    """Whether the estimate fits the device (or, when the device is absent, one 80 GiB GPU) and
    a one-line account of it."""
    parts = ", ".join(
        f"{name} {_size(memory[name])}"
        for name in ("weights", "reference", "gradients", "optimizer", "kv_cache")
        if memory.get(name)
    )
    capacity = memory.get("device_bytes")
    where = f"{device} has {_size(capacity)}" if capacity else None
    if capacity is None:
        capacity = ONE_DEVICE_REFERENCE_BYTES
        where = f"{device} absent here: compared with one {_size(capacity)} GPU"
    fits = memory["total"] <= capacity
    line = f"memory estimate {_size(memory['total'])} ({parts}; activations not included); {where}"
    return fits, line
