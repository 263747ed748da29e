"""Fitness of an ES member: a short training run with its mirror map, scored on held-out data.

A member's fitness (GBMPO NM-GRPO-ES, docs/methods.md, section "Evolution strategies") is the
validation score of a policy trained for ``T`` RL steps by :class:`gbmpo.train.Trainer` with the
``neural_mirror`` regularizer frozen to that member's map,
``NeuralMirrorMap.from_unconstrained(theta)``. Every member starts from the same base model with the
same seed; only the map differs. No evaluation runs during the inner training; afterwards the policy
is scored greedily on a validation split that is **disjoint** from the inner training prompts:

:class:`HeldOutSplitTask` carves the validation set out of the base task's training split with
a seeded shuffle and removes every validation prompt from the inner training data (duplicates
of the training stream included), then checks the two are disjoint. On GSM8K this replaces the
authors' inner split (the first 80% of the unshuffled train split), which overlaps their
shuffled validation 20% (docs/methods.md, "Choices" item 10). The task's own test split stays
untouched for the final evaluation.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gbmpo.eval import evaluation
from gbmpo.tasks.base import Example, Task

__all__ = ["HeldOutSplitTask", "TrainingFitness", "default_inner_config"]

#: splits of :class:`HeldOutSplitTask` that it defines itself
INNER_SPLIT, VALIDATION_SPLIT = "train", "validation"


class HeldOutSplitTask(Task):
    """A task whose ``"validation"`` split is carved out of ``base``'s training split.

    ``"validation"``: ``size`` distinct prompts of ``base.split(source_split)`` (default: the base
    task's ``train_split``) picked by a shuffle seeded with ``seed``. ``"train"``: every other
    example of that split whose prompt is not a validation prompt. Other split names are the
    base task's (e.g. its held-out ``"test"``). Reward, kind and grading are the base task's.
    """

    train_split = INNER_SPLIT
    eval_split = VALIDATION_SPLIT

    def __init__(
        self, base: Task, size: int, seed: int = 0, source_split: str | None = None
    ) -> None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"validation size must be a positive integer, got {size!r}")
        self.base = base
        self.name = f"{base.name}+heldout"
        self.kind = base.kind
        self.source_split = source_split or base.train_split
        source = base.split(self.source_split)
        first: dict[str, int] = {}
        for i, ex in enumerate(source):
            first.setdefault(ex["prompt"], i)
        if size >= len(first):
            raise ValueError(
                f"validation size {size} leaves no training prompts: split "
                f"{self.source_split!r} of task {base.name!r} has {len(first)} distinct prompts"
            )
        unique = list(first.values())
        order = np.random.default_rng(seed).permutation(len(unique))
        val_idx = sorted(unique[j] for j in order[:size])
        self._validation = [dict(source[i]) for i in val_idx]
        held = {ex["prompt"] for ex in self._validation}
        self._inner = [dict(ex) for ex in source if ex["prompt"] not in held]
        overlap = held & {ex["prompt"] for ex in self._inner}
        if overlap:  # cannot happen by construction; checked because leakage is the failure mode
            raise RuntimeError(f"validation and inner training share {len(overlap)} prompts")
        self.size, self.seed = size, seed

    def split(self, name: str) -> list[Example]:
        if name == INNER_SPLIT:
            return [dict(ex) for ex in self._inner]
        if name == VALIDATION_SPLIT:
            return [dict(ex) for ex in self._validation]
        return self.base.split(name)

    def reward(
        self, prompts: Sequence[str], completions: Sequence[str], **columns: Any
    ) -> list[float | None]:
        return self.base.reward(prompts, completions, **columns)

    def columns(self, examples: Sequence[Example]) -> dict[str, list[Any]]:
        return self.base.columns(examples)

    def __getattr__(self, attr: str) -> Any:  # e.g. ``grade`` of tasks that define it
        if attr == "base":
            raise AttributeError(attr)
        return getattr(self.base, attr)


def default_inner_config() -> dict[str, Any]:
    """The inner training run of the embedded ``gbmpo es`` default (a ``TrainConfig`` dict).

    The tiny model on the built-in arithmetic task, Dr. GRPO with the neural-mirror regularizer
    (the map itself is set per member), 8 prompts x 8 completions, 40 new tokens, LR 5e-5
    (the learning rate that gave a steady RL gain on the 2M model; docs/development.md,
    "The embedded tiny model").
    """
    return {
        "model": {"path": "tiny"},
        "task": {"name": "arithmetic", "params": {}},
        "rollout": {"prompts_per_step": 8, "num_generations": 8, "max_new_tokens": 40},
        "objective": {
            "advantage": "dr_grpo",
            "aggregation": "dr_grpo",
            "regularizer": {"name": "neural_mirror", "coef": 1.0},
        },
        "optim": {"lr": 5e-5},
        "eval": {"max_new_tokens": 40},
    }


# per-process caches: a worker evaluates many members with the same base model and data
_MODELS: dict[tuple[Any, ...], tuple[Any, Any]] = {}
_TASKS: dict[tuple[Any, ...], HeldOutSplitTask] = {}


@dataclass(frozen=True)
class TrainingFitness:
    """``fitness(theta)``: train ``steps`` RL steps with the member's mirror map, return the
    validation score (``accuracy`` for math tasks, ``pass@1`` for code). Picklable.

    ``train_config`` is a ``TrainConfig`` dict (see :func:`default_inner_config`); the ES sets
    its regularizer to ``neural_mirror`` with the member's map, ``run.steps = steps``, no
    evaluation, no time budget, no run directory. ``validation_size`` prompts carved from the
    training split with ``validation_seed`` form the validation set (``validation_limit``
    scores only the first ones). A non-finite loss raises, so the member is recorded as failed.
    ``device="auto"`` trains on the GPU when the member's process sees one (a Ray task with
    ``num_gpus=1`` sees exactly its own), else on ``train_config``'s ``model.device``.
    """

    train_config: dict[str, Any] = field(default_factory=default_inner_config)
    steps: int = 10
    validation_size: int = 200
    validation_seed: int = 0
    metric: str | None = None
    device: str = "auto"

    def __post_init__(self) -> None:
        for name, low in (("steps", 1), ("validation_size", 1), ("validation_seed", 0)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                what = "inner steps T" if name == "steps" else f"fitness {name}"
                raise ValueError(f"{what} must be an integer >= {low}, got {v!r}")
        if self.metric is not None and not isinstance(self.metric, str):
            raise ValueError(f"fitness metric must be a metric name or null, got {self.metric!r}")
        if not isinstance(self.device, str):
            raise ValueError(f"fitness device must be a string, got {self.device!r}")
        cfg = self.resolved_config(None)
        # deferred: gbmpo.config imports torch; ES's workers import gbmpo.meta without it
        from gbmpo.config import validate

        validate(cfg)  # a bad inner config fails here, before any worker starts

    def resolved_config(self, mirror: Any) -> Any:
        """The member's ``TrainConfig`` (``mirror``: its map, or None for a validation pass)."""
        # deferred: gbmpo.config imports torch; ES's workers import gbmpo.meta without it
        from gbmpo.config import config_from_dict

        cfg = config_from_dict(copy.deepcopy(self.train_config))
        reg = cfg.objective.regularizer
        if isinstance(reg, list) or reg.name != "neural_mirror":
            raise ValueError(
                "ES searches neural mirror maps: the inner config's objective.regularizer.name "
                f"must be 'neural_mirror' (one term), got {cfg.objective.regularizer_label!r}"
            )
        reg.params = {"mirror": mirror}
        cfg.objective.monitor_regularizers = False
        cfg.run.steps = self.steps
        cfg.run.time_budget_seconds = None
        cfg.run.output_dir = None
        cfg.run.progress = False
        cfg.run.num_threads = None  # keep the worker's pinning
        cfg.run.checkpoint_every = 0
        cfg.eval = dataclasses.replace(
            cfg.eval, every=0, before=False, after=False, split=VALIDATION_SPLIT
        )
        if self.device != "auto":
            cfg.model.device = self.device
        elif mirror is not None:
            # deferred: torch is heavy; ES's workers import gbmpo.meta without it
            import torch

            if torch.cuda.is_available():
                cfg.model.device = "cuda"
        return cfg

    def _base(self, cfg: Any) -> tuple[Any, Any]:
        # deferred: torch and gbmpo.models are heavy; ES's workers import gbmpo.meta without them
        import torch

        from gbmpo.models import load_model_and_tokenizer

        key = (cfg.model.path, cfg.model.dtype, cfg.model.device, cfg.model.trust_remote_code)
        if key not in _MODELS:
            _MODELS[key] = load_model_and_tokenizer(
                cfg.model.path,
                dtype=getattr(torch, cfg.model.dtype),  # validated: float32|bfloat16|float16
                device=cfg.model.device,
                trust_remote_code=cfg.model.trust_remote_code,
            )
        model, tokenizer = _MODELS[key]
        return copy.deepcopy(model), tokenizer

    def task(self, tokenizer: Any = None) -> HeldOutSplitTask:
        """The inner-training / validation task (cached per process)."""
        # deferred: gbmpo.config imports torch; ES's workers import gbmpo.meta without it
        from gbmpo.config import config_from_dict

        cfg = config_from_dict(copy.deepcopy(self.train_config))
        key = (
            cfg.task.name,
            repr(sorted(cfg.task.params.items())),
            cfg.task.template,
            cfg.task.train_split,
            self.validation_size,
            self.validation_seed,
            id(tokenizer),
        )
        if key not in _TASKS:
            base = evaluation.resolve_task(
                cfg.task.name, tokenizer=tokenizer, template=cfg.task.template, **cfg.task.params
            )
            _TASKS[key] = HeldOutSplitTask(
                base, self.validation_size, self.validation_seed, cfg.task.train_split
            )
        return _TASKS[key]

    def __call__(self, theta: np.ndarray) -> float:
        # deferred: gbmpo.objectives, gbmpo.train import torch; ES workers import gbmpo.meta without
        from gbmpo.objectives.mirror import NeuralMirrorMap
        from gbmpo.train import Trainer

        mirror = NeuralMirrorMap.from_unconstrained(np.asarray(theta, dtype=np.float64))
        cfg = self.resolved_config(mirror)
        model, tokenizer = self._base(cfg)
        task = self.task(tokenizer)
        trainer = Trainer(cfg, model=model, tokenizer=tokenizer, task=task)
        for _ in range(self.steps):
            record = trainer.train_step()
            if not math.isfinite(record["loss"]):
                raise FloatingPointError(
                    f"non-finite inner loss {record['loss']} at step {record['step']}"
                )
        metrics = trainer.evaluate()
        key = self.metric or ("accuracy" if task.kind == "math" else "pass@1")
        if key not in metrics:
            raise KeyError(f"validation metrics have no {key!r}: {sorted(metrics)}")
        return float(metrics[key])
