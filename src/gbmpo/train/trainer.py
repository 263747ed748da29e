"""The RL trainer: :class:`Trainer` wires the parts of a run together.

* :mod:`gbmpo.train.step` — one RL step, top to bottom (sample, reward, advantages, mini- and
  micro-batch loss and update, metrics);
* :mod:`gbmpo.train.setup` — the objectives, task, policy (+ LoRA), frozen reference and
  optimizer a run is built from;
* :mod:`gbmpo.train.run` — the training loop, resume, checkpoints, evaluation and summary,
  inside every engine's run lifecycle (:class:`gbmpo.lifecycle.RunLifecycle`: lock, status,
  signals);
* :mod:`gbmpo.train.dry_run` — the checks of ``gbmpo train --dry-run``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import Tensor

from gbmpo.config import ConfigError, TrainConfig, validate
from gbmpo.eval import evaluate
from gbmpo.lifecycle import RunLifecycle, no_checkpoint_error, refuse_nonempty, resume_config
from gbmpo.lifecycle.logging import MetricsWriter
from gbmpo.rollout.logprobs import completion_logprobs
from gbmpo.rollout.sampling import Rollout
from gbmpo.train import run as _run
from gbmpo.train import step as _step
from gbmpo.train.batching import PromptSampler
from gbmpo.train.checkpoint import latest_valid_checkpoint
from gbmpo.train.device import check_device, check_single_process
from gbmpo.train.precision import check_train_dtype
from gbmpo.train.setup import (
    build_objectives,
    build_optimizer,
    build_task,
    configure_process,
    eval_limit,
    frozen_reference,
    load_policy,
    load_splits,
    load_tokenizer,
    seed_everything,
)

__all__ = ["Trainer", "train"]


class Trainer:
    """GRPO-family RL on a causal LM with a selectable objective (:mod:`gbmpo.train.step`).

    Args:
        config: the resolved configuration (validated here, before anything is loaded).
        model, tokenizer: an already-loaded policy and tokenizer (default: load
            ``config.model.path`` with :func:`gbmpo.models.load_model_and_tokenizer`).
        task: a :class:`gbmpo.tasks.Task` (default: ``config.task``).
        reward_fn: ``fn(prompts, completions, **columns) -> list[float | None]`` (default: the
            task's reward).
    """

    def __init__(
        self,
        config: TrainConfig,
        *,
        model: Any = None,
        tokenizer: Any = None,
        task: Any = None,
        reward_fn: Callable[..., Any] | None = None,
        _resume_dir: str | Path | None = None,
        _restart: bool = False,
    ) -> None:
        cfg = self.config = validate(config)
        # refuse what cannot run here before anything is loaded or written
        check_single_process()
        if model is None:
            check_device(cfg.model.device)
            check_train_dtype(cfg.model.dtype, cfg.lora.enabled)
        self._resume_dir = Path(_resume_dir) if _resume_dir is not None else None
        self._restart = _restart
        if (  # before anything is loaded
            self._resume_dir is not None
            and not _restart
            and latest_valid_checkpoint(self._resume_dir, log=lambda _: None) is None
        ):
            raise no_checkpoint_error(self._resume_dir)
        self.run_dir = self._resume_dir or (
            Path(cfg.run.output_dir) if cfg.run.output_dir else None
        )
        if self._resume_dir is None and self.run_dir is not None:
            refuse_nonempty(self.run_dir)
        configure_process(cfg)

        # objectives, by name from the registries
        self.objective = build_objectives(cfg)  # built once; the step uses it as is

        # task and data
        if task is None:
            task = build_task(cfg, tokenizer if tokenizer is not None else load_tokenizer(cfg))
        self.task = task
        # a reward that runs model-written code starts its sandbox (or refuses) before any write
        task.prepare_reward(allow_unsandboxed_code=cfg.run.allow_unsandboxed_code)
        self.train_data, self.n_eval, (self.train_split, self.eval_split) = load_splits(cfg, task)
        self.eval_limit = eval_limit(cfg, self.n_eval)
        self.reward_fn = reward_fn if reward_fn is not None else task.reward

        # model (+ LoRA) and the frozen reference
        seed_everything(cfg.run.seed)
        self.model, self.tokenizer = load_policy(cfg, model, tokenizer)
        self.needs_ref = self.objective.needs_ref
        self.ref_model: Any = frozen_reference(self.model, self.needs_ref, cfg.lora.enabled)
        # the end-of-run drift compares with the initial weights: without a reference holding
        # them, a model passed in as an object is copied now (one from model.path is reloaded)
        keep = model is not None and cfg.eval.drift and cfg.eval.after and self.ref_model is None
        self.initial_model: Any = frozen_reference(self.model, keep, cfg.lora.enabled)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if not self.params:
            raise ConfigError("the model has no trainable parameters")
        # every tensor of a step lives where the policy's weights are
        self.device = self.params[0].device
        self.optimizer, self.clip_params = build_optimizer(self.params, cfg)

        # progress (saved in checkpoints)
        self.sampler = PromptSampler(len(self.train_data), cfg.run.seed)
        self.step = 0
        self.rl_seconds = 0.0
        self.wall_seconds_before = 0.0
        self.reward_failures_total = 0
        self.eval_before: dict[str, Any] | None = None
        self.last_eval: tuple[int, dict[str, Any]] | None = None
        self._writer: MetricsWriter | None = None
        self._resume_rows: int | None = None
        self._life: RunLifecycle | None = None  # while train() runs: lock, status, signals
        # the policy moves before the batch is used up -> keep pi_old's log-probs
        batch = cfg.rollout.prompts_per_step * cfg.rollout.num_generations
        self.mini_batch = cfg.optim.mini_batch_size or batch
        self.micro_batch = cfg.optim.micro_batch_size or self.mini_batch
        # rows per no-grad log-prob pass (old policy, reference); on CUDA with
        # optim.micro_batch_size null both come from the memory plan, per prompt width
        # (gbmpo.train.step.plan_batches)
        self.inference_batch = self.micro_batch
        self.batch_plans: dict[int, tuple[int, int]] = {}
        self.needs_old = cfg.optim.mu > 1 or self.mini_batch < batch
        # the rollout correction compares pi_old's log-probs with the sampler's
        self.needs_old = self.needs_old or cfg.objective.rollout_correction.active

    @classmethod
    def resume(
        cls, run_dir: str | Path, overrides: list[tuple[str, Any]] | None = None, *,
        restart: bool = False, **kwargs: Any,
    ) -> Trainer:  # fmt: skip
        """A trainer continuing ``run_dir`` from its last checkpoint (config from the run dir;
        only the keys in :data:`RESUMABLE_OVERRIDES` may be overridden). Without an intact
        checkpoint: :class:`gbmpo.io.CheckpointError` before anything changes, unless
        ``restart`` (start over from step 0 in the same directory, its metrics dropped)."""
        cfg, path = resume_config(run_dir, overrides)
        return cls(cfg, _resume_dir=path, _restart=restart, **kwargs)

    def train(self) -> dict[str, Any]:
        """Run (or resume) the whole training; returns the summary written to summary.json."""
        return _run.run(self)

    def _checkpoint(self) -> None:
        """Checkpoint the current step (:func:`gbmpo.train.run.checkpoint`)."""
        _run.checkpoint(self)

    def train_step(self) -> dict[str, Any]:
        """One RL step (:func:`gbmpo.train.step.train_step`); returns its metrics."""
        return _step.train_step(self)

    def lr_at(self) -> float:
        r"""Learning rate of the coming step: linear warm-up over ``warmup_steps``, then
        ``constant``, or ``cosine`` decay to ``min_lr_ratio * lr`` at the end of the run,
        :math:`\eta = \eta_0\,(r + (1-r)\tfrac12(1+\cos\pi u))`. The progress :math:`u`
        is the larger of :math:`(s-w)/(S-w)` (steps, ``run.steps``) and RL seconds used /
        ``run.time_budget_seconds``: the decay ends when the run ends, whichever limit stops it
        (with a time budget the LR therefore depends on timing)."""
        opt, run = self.config.optim, self.config.run
        if self.step < opt.warmup_steps:
            return opt.lr * (self.step + 1) / opt.warmup_steps
        if opt.schedule == "constant":
            return opt.lr
        progress = (self.step - opt.warmup_steps) / max(1, run.steps - opt.warmup_steps)
        if run.time_budget_seconds is not None:
            progress = max(progress, self.rl_seconds / run.time_budget_seconds)
        progress = min(1.0, max(0.0, progress))
        r = opt.min_lr_ratio
        return opt.lr * (r + (1 - r) * 0.5 * (1 + math.cos(math.pi * progress)))

    def logprobs(
        self, model: Any, batch: Rollout, *, with_entropy: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """Per-token log-probs (and entropies) of ``batch``'s completions under ``model``, with
        the rollout's temperature (every forward of the step goes through here)."""
        ro = self.config.rollout
        return completion_logprobs(
            model,
            batch.prompt_ids,
            batch.prompt_mask,
            batch.completion_ids,
            batch.completion_mask,
            temperature=ro.temperature,
            with_entropy=with_entropy,
            share_prompts=ro.share_prompts,
            lean=ro.lean_forward,
        )

    def evaluate(self) -> dict[str, Any]:
        """Greedy held-out metrics (``accuracy`` for math tasks) via :func:`gbmpo.eval.evaluate`."""
        ev = self.config.eval
        result = evaluate(
            self.model,
            self.tokenizer,
            self.task,
            split=self.eval_split,
            limit=self.eval_limit,
            samples=ev.samples,
            temperature=self.config.rollout.temperature if ev.samples > 1 else 0.0,
            top_p=self.config.rollout.top_p if ev.samples > 1 else 1.0,
            max_new_tokens=ev.max_new_tokens,
            batch_size=ev.batch_size,
            generator=self.config.rollout.generator,
        )
        # numeric metrics only; the wall time is logged separately as time/eval_seconds
        return {
            k: v
            for k, v in result["metrics"].items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "seconds"
        }


def train(config: TrainConfig, **kwargs: Any) -> dict[str, Any]:
    """Build a :class:`Trainer` for ``config`` and run it; returns the summary."""
    return Trainer(config, **kwargs).train()
