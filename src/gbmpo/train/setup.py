"""What a run is built from: the process settings, the objectives from their registries, the task
and its splits, the policy (+ LoRA), the frozen reference and the optimizer (fp32 master weights
for bf16 parameters)."""

from __future__ import annotations

import copy
import random
from typing import Any

import numpy as np
import torch
from torch import Tensor

from gbmpo.config import ConfigError, TrainConfig
from gbmpo.eval import resolve_task
from gbmpo.models import load_model_and_tokenizer, resolve_model_path
from gbmpo.objectives.spec import BuiltObjective
from gbmpo.registry import UnknownNameError
from gbmpo.train.allocator import keep_freed_memory
from gbmpo.train.batching import DataError
from gbmpo.train.precision import MasterWeightOptimizer, needs_master_weights

__all__ = [
    "build_objectives",
    "build_optimizer",
    "build_task",
    "configure_process",
    "eval_limit",
    "frozen_reference",
    "load_policy",
    "load_splits",
    "load_tokenizer",
    "seed_everything",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}



def configure_process(cfg: TrainConfig) -> None:
    """Torch's thread count and, optionally, malloc options that keep freed memory mapped."""
    if cfg.run.num_threads is not None:
        torch.set_num_threads(cfg.run.num_threads)
    if cfg.run.keep_freed_memory:
        keep_freed_memory()


def build_objectives(cfg: TrainConfig) -> BuiltObjective:
    """``cfg.objective`` built once by its spec (:meth:`gbmpo.objectives.spec.ObjectiveSpec.build`):
    advantage, surrogate, the regularizer terms (one is a list of one), aggregation, monitors."""
    return cfg.objective.build()


def load_tokenizer(cfg: TrainConfig) -> Any:
    """The tokenizer of ``cfg.model.path`` alone (cheap; used to build chat-templated tasks
    before the weights are loaded). A missing path raises FileNotFoundError naming it."""
    # deferred: transformers is heavy; gbmpo.train imports without it
    from transformers import AutoTokenizer

    source = resolve_model_path(cfg.model.path)
    return AutoTokenizer.from_pretrained(source, trust_remote_code=cfg.model.trust_remote_code)


def build_task(cfg: TrainConfig, tokenizer: Any = None) -> Any:
    """The task of ``cfg.task`` (as :func:`gbmpo.eval.resolve_task` builds it, so training and
    ``gbmpo eval`` see the same prompts); bad parameters raise :class:`ConfigError`."""
    try:
        return resolve_task(
            cfg.task.name, tokenizer=tokenizer, template=cfg.task.template, **cfg.task.params
        )
    except UnknownNameError:
        raise
    except (TypeError, ValueError) as err:
        raise ConfigError(f"task {cfg.task.name!r} with params {cfg.task.params}: {err}") from err


def seed_everything(seed: int) -> None:
    """Seed python ``random``, numpy and torch."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def load_splits(
    cfg: TrainConfig, task: Any, count_eval: bool = False
) -> tuple[list[dict[str, Any]], int, tuple[str, str]]:
    """``(training examples, eval examples or 0, (train split, eval split))`` of ``task``.

    Unreadable data (a missing column, an empty file, ...: the task's ``ValueError``) and empty
    splits raise :class:`DataError`, before anything is written. The eval split is loaded (and
    counted) when evaluation is on or ``count_eval`` is set.
    """
    train_split = cfg.task.train_split or task.train_split
    eval_split = cfg.eval.split or task.eval_split
    evaluating = bool(cfg.eval.before or cfg.eval.after or cfg.eval.every)
    try:
        train = task.split(train_split)
        n_eval = len(task.split(eval_split)) if evaluating or count_eval else 0
    except ValueError as err:
        raise DataError(f"task {cfg.task.name!r}: {err}") from err
    if not train:
        raise DataError(f"task {cfg.task.name!r}: training split {train_split!r} is empty")
    if evaluating and n_eval == 0:
        raise DataError(f"task {cfg.task.name!r}: eval split {eval_split!r} is empty")
    return train, n_eval, (train_split, eval_split)


def eval_limit(cfg: TrainConfig, n_eval: int) -> int | None:
    """Examples per evaluation: ``eval.limit``, else ``eval.auto_limit`` when the split is longer
    than it, else all (``None``)."""
    ev = cfg.eval
    if ev.limit is not None:
        return ev.limit
    if ev.auto_limit is not None and n_eval > ev.auto_limit:
        return ev.auto_limit
    return None



def load_policy(cfg: TrainConfig, model: Any = None, tokenizer: Any = None) -> tuple[Any, Any]:
    """``(model, tokenizer)``: ``cfg.model`` loaded on its device unless a model is given, with
    LoRA adapters when ``lora.enabled``."""
    if model is None:
        model, tokenizer = load_model_and_tokenizer(
            cfg.model.path,
            dtype=_DTYPES[cfg.model.dtype],
            device=cfg.model.device,
            trust_remote_code=cfg.model.trust_remote_code,
        )
    elif tokenizer is None:
        raise ValueError("pass the tokenizer together with the model")
    if cfg.lora.enabled:
        # deferred: peft is optional (the trl extra)
        from peft import LoraConfig, get_peft_model

        lora_cfg = LoraConfig(
            r=cfg.lora.r,
            lora_alpha=cfg.lora.alpha,
            lora_dropout=cfg.lora.dropout,
            target_modules=list(cfg.lora.target_modules),
            task_type="CAUSAL_LM",
        )
        try:
            model = get_peft_model(model, lora_cfg)
        except ValueError as err:
            raise ConfigError(f"'lora.target_modules': {err}") from err
    return model, tokenizer


def frozen_reference(model: Any, needs_ref: bool, lora: bool) -> Any:
    """pi_ref for full fine-tuning: a frozen copy of the initial weights; None when no reference
    is needed or with LoRA (the reference is then the model with its adapters disabled)."""
    if not needs_ref or lora:
        return None
    ref = copy.deepcopy(model).eval()
    ref.requires_grad_(False)
    return ref


def build_optimizer(params: list[Tensor], cfg: TrainConfig) -> tuple[Any, list[Tensor]]:
    """``(optimizer, parameters to clip)``: AdamW on ``params``; bf16 parameters are stepped
    through fp32 master copies (a small update applied to a bf16 weight directly rounds back to
    the same weight), and their gradients are clipped there. The learning rate is set each step
    (:func:`gbmpo.train.schedule.lr_at`)."""
    opt = cfg.optim

    def adamw(ps: list[Tensor]) -> torch.optim.AdamW:
        return _adamw(ps, lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay)

    if needs_master_weights(params):
        optimizer = MasterWeightOptimizer(params, adamw)
        return optimizer, optimizer.masters
    return adamw(params), params


def _adamw(params: list[Tensor], **kwargs: Any) -> torch.optim.AdamW:
    """torch's fused AdamW (each parameter's update in one kernel; what transformers' Trainer,
    and so TRL, uses by default) when it supports the parameters' device and dtype, else the
    for-loop implementation; the same update rule either way (updates equal to ~1e-7), about
    twice as fast on CPU (``benchmarks/RESULTS.md``, section 3.0.1, item 6)."""
    try:
        return torch.optim.AdamW(params, fused=True, **kwargs)
    except (RuntimeError, ValueError):  # e.g. a device or dtype without the fused kernel
        return torch.optim.AdamW(params, **kwargs)
