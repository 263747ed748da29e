"""The RL trainer: :class:`Trainer` holds a run's state and reads as the run does.

* :meth:`Trainer.train` — the training loop, resume, checkpoints, evaluation and summary, inside
  every engine's run lifecycle (:class:`gbmpo.lifecycle.RunLifecycle`: lock, status, signals;
  the run's pieces that hold no state: :mod:`gbmpo.train.run`);
* :meth:`Trainer.train_step` — one RL step, top to bottom, calling the functions of
  :mod:`gbmpo.train.step` (sample, reward, advantages, mini- and micro-batch loss and update)
  and :mod:`gbmpo.train.step_metrics`, each with the parts it reads as arguments; the state
  they change (step, counters, batch plans, controlled coefficients) changes here only;
* :mod:`gbmpo.train.setup` — the objectives, task, policy (+ LoRA), frozen reference and
  optimizer a run is built from;
* :mod:`gbmpo.train.dry_run` — the checks of ``gbmpo train --dry-run``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import Tensor

from gbmpo.config import ConfigError, TrainConfig, config_to_dict, dump_yaml, validate
from gbmpo.eval import evaluate
from gbmpo.eval.drift import final_drift, fmt_drift
from gbmpo.io import write_atomic
from gbmpo.lifecycle import (
    CONFIG_FILE,
    MODEL_DIR,
    RunLifecycle,
    default_run_dir,
    no_checkpoint_error,
    refuse_nonempty,
    resume_config,
)
from gbmpo.lifecycle.console import Console, fmt_eval
from gbmpo.lifecycle.logging import MetricsWriter, Reporters
from gbmpo.rollout.sampling import Rollout
from gbmpo.train import run as _run
from gbmpo.train import step as _step
from gbmpo.train.batching import BatchSizes, PromptSampler
from gbmpo.train.checkpoint import (
    latest_checkpoint,
    latest_valid_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from gbmpo.train.correction import sampler_weights
from gbmpo.train.device import check_device, check_single_process, peak_memory_bytes
from gbmpo.train.drift import control_drift, drift_state, restore_drift
from gbmpo.train.policy import PolicyModels
from gbmpo.train.precision import check_train_dtype
from gbmpo.train.schedule import lr_at
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
from gbmpo.train.step_metrics import Progress, StepTimes, step_record

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
        # while train() runs: when it started, and the metrics writer (its rows are checkpointed)
        self._t0 = time.perf_counter()
        self._writer: MetricsWriter | None = None
        self._resume_rows: int | None = None  # the metrics rows of the checkpoint resumed from
        # the policy moves before the batch is used up -> keep pi_old's log-probs
        batch = cfg.rollout.prompts_per_step * cfg.rollout.num_generations
        self.mini_batch = cfg.optim.mini_batch_size or batch
        self.micro_batch = cfg.optim.micro_batch_size or self.mini_batch
        # rows per no-grad log-prob pass (old policy, reference); on CUDA with
        # optim.micro_batch_size null both come from the memory plan, per prompt width
        # (gbmpo.train.step.plan_batches; the plans by width are kept in batch_plans)
        self.inference_batch = self.micro_batch
        self.batch_plans: dict[int, tuple[int, int]] = {}
        # whether the static decoder's buffers are freed after a rollout, by prompt width
        # (rollout.decode_buffers; gbmpo.train.step.release_decoder_buffers)
        self.decode_releases: dict[int, bool] = {}
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

    # ------------------------------------------------------------------------------ the run

    def train(self) -> dict[str, Any]:
        """Run (or resume) the whole training in the run's :class:`gbmpo.lifecycle.RunLifecycle`
        (lock, status, signals); returns the summary written to summary.json."""
        self._t0 = time.perf_counter()
        if self.run_dir is None:
            self.run_dir = default_run_dir(self.config)
            self.config.run.output_dir = str(self.run_dir)
        run_dir = self.run_dir
        # one process per run directory; the empty / finished checks again under the lock,
        # which another process may have taken (and used) since __init__
        life = RunLifecycle(
            run_dir, "gbmpo", resuming=self._resume_dir is not None, signals=True,
            step=lambda: self.step, checkpoint=lambda: latest_checkpoint(run_dir),
        )  # fmt: skip
        with life:
            return self._train_locked(run_dir, life)

    def _train_locked(self, run_dir: Path, life: RunLifecycle) -> dict[str, Any]:
        cfg = self.config
        resumed_from = latest_valid_checkpoint(run_dir) if self._resume_dir else None
        if self._resume_dir is not None and resumed_from is None and not self._restart:
            raise no_checkpoint_error(run_dir)
        if resumed_from is not None:
            self._restore(resumed_from)
            print(f"gbmpo: resuming {str(run_dir)!r} from {resumed_from.name} (step "
                  f"{self.step} of {cfg.run.steps})", file=sys.stderr, flush=True)  # fmt: skip
        elif self._resume_dir is not None:
            print(f"gbmpo: restarting {str(run_dir)!r} from step 0 (--restart)",
                  file=sys.stderr, flush=True)  # fmt: skip
        write_atomic(run_dir / CONFIG_FILE, dump_yaml(cfg))
        life.running(self.step, resumed_from=resumed_from)
        # on resume, drop what was logged after the checkpoint (everything if there is none):
        # the rows it counted, e.g. not the final evaluation's row logged after the last
        # periodic checkpoint at the same step (older checkpoints: the rows up to its step)
        keep = (self.step if resumed_from is not None else -1) if self._resume_dir else None
        rows = self._resume_rows if resumed_from is not None else None
        writer = self._writer = MetricsWriter(run_dir, keep_up_to_step=keep, keep_rows=rows)
        reporters: Reporters | None = None
        try:
            reporters = Reporters(
                cfg.run.report_to, run_dir, config_to_dict(cfg), run_name=run_dir.name
            )
            return self._loop(writer, reporters, life)
        finally:
            writer.close()
            if reporters is not None:
                reporters.close()

    def _loop(self, writer: MetricsWriter, reporters: Reporters,
              life: RunLifecycle) -> dict[str, Any]:  # fmt: skip
        cfg = self.config
        assert self.run_dir is not None
        budget = cfg.run.time_budget_seconds
        console = Console(cfg.run.progress)
        console.print(_run.placement(self.device, self.params[0].dtype, self.optimizer))
        if self.eval_limit is not None and self.eval_limit < self.n_eval:
            console.print(
                f"evaluating the first {self.eval_limit} of {self.n_eval} {self.eval_split!r} "
                "examples (eval.limit / eval.auto_limit)"
            )

        if cfg.eval.before and self.eval_before is None:
            record = self._eval_record(0)
            self.eval_before = self.last_eval[1] if self.last_eval else None
            _run.log(writer, reporters, {"step": 0, **record})
            console.print(f"held-out {fmt_eval(self.eval_before)} before training")

        stop_reason = "steps"
        with console.progress(cfg.run.steps, budget, self.step, self.rl_seconds) as bar:
            while self.step < cfg.run.steps:
                self._stop_if_asked(life)
                if budget is not None and self.rl_seconds >= budget:
                    stop_reason = "time_budget"
                    break
                record = self.train_step()
                if cfg.eval.every and self.step % cfg.eval.every == 0:
                    record.update(self._eval_record(self.step))
                _run.log(writer, reporters, record)
                every = cfg.run.checkpoint_every
                checkpointed = bool(every and self.step % every == 0)
                if checkpointed:
                    self._checkpoint()
                bar.update(self.step, self.rl_seconds, record, self.last_eval)
                self._stop_if_asked(life, checkpointed=checkpointed)
                life.running(self.step)  # the step, for whoever watches the run

        eval_after = None
        if cfg.eval.after:
            if self.last_eval is not None and self.last_eval[0] == self.step and self.step > 0:
                eval_after = self.last_eval[1]
            else:
                record = self._eval_record(self.step)
                eval_after = self.last_eval[1] if self.last_eval else None
                _run.log(writer, reporters, {"step": self.step, **record})
            console.print(f"held-out {fmt_eval(eval_after)} after {self.step} steps")
        drift, drift_seconds = final_drift(
            cfg, self.model, self.tokenizer, self.task, self.eval_split, self.eval_limit,
            reference=_run.drift_reference(self.ref_model, self.initial_model),
        )  # fmt: skip
        if drift is not None:
            console.print(fmt_drift(drift, drift_seconds))

        peak = peak_memory_bytes(self.device)
        if peak is not None:
            console.print(f"peak {self.device} memory {peak / 2**30:.2f} GiB")
        self._checkpoint()
        _run.export_model(self.model, self.tokenizer, self.run_dir / MODEL_DIR)
        summary = self._summary(eval_after, stop_reason)
        summary["drift"] = drift
        summary["drift_seconds"] = drift_seconds if drift is not None else None
        return life.finished(summary)  # summary.json last: the run is finished

    def _stop_if_asked(self, life: RunLifecycle, *, checkpointed: bool = False) -> None:
        """After a step (or before the first): on a requested stop, checkpoint this step
        (unless just done), record the stop (:meth:`RunLifecycle.stopped`) and raise it."""
        stop = life.stop
        signame = stop.poll() if stop is not None else None
        if signame is None:
            return
        assert self.run_dir is not None
        stop.immediate_second = True
        if not checkpointed:
            self._checkpoint()
        raise life.stopped(signame, self.step, latest_checkpoint(self.run_dir))

    def _eval_record(self, step: int) -> dict[str, Any]:
        """Evaluate now (kept as ``last_eval`` at ``step``); the ``eval/*`` metrics and time."""
        t = time.perf_counter()
        metrics = self.evaluate()
        self.last_eval = (step, metrics)
        record = {f"eval/{k}": v for k, v in metrics.items()}
        record["time/eval_seconds"] = time.perf_counter() - t
        return record

    def _checkpoint(self) -> None:
        """Checkpoint the current step: the model, the optimizer and :meth:`_state`
        (subclasses extend it)."""
        assert self.run_dir is not None
        save_checkpoint(self.run_dir, self.step, model=self.model, optimizer=self.optimizer,
                        state=self._state(), keep=self.config.run.keep_checkpoints)  # fmt: skip

    def _state(self) -> dict[str, Any]:
        """The progress a checkpoint keeps (``state.json``) besides the model and optimizer."""
        return {
            "sampler_position": self.sampler.position,
            "rl_seconds": self.rl_seconds,
            "wall_seconds": self.wall_seconds_before + (time.perf_counter() - self._t0),
            "reward_failures_total": self.reward_failures_total,
            "eval_before": self.eval_before,
            "last_eval": list(self.last_eval) if self.last_eval else None,
            # metrics.jsonl rows written so far: a resume keeps exactly these
            "metrics_rows": self._writer.rows if self._writer is not None else None,
            "drift_coefs": drift_state(self.objective),  # the next step's coefficients
        }

    def _restore(self, path: Path) -> None:
        """The model, optimizer and progress of the checkpoint at ``path``."""
        state = load_checkpoint(path, model=self.model, optimizer=self.optimizer)
        self.step = int(state["step"])
        self.sampler.position = int(state["sampler_position"])
        self.rl_seconds = float(state["rl_seconds"])
        self.wall_seconds_before = float(state["wall_seconds"])
        self.reward_failures_total = int(state["reward_failures_total"])
        self.eval_before = state["eval_before"]
        self.last_eval = tuple(state["last_eval"]) if state["last_eval"] else None  # type: ignore[assignment]
        self._resume_rows = state.get("metrics_rows")
        self.objective = restore_drift(self.objective, state.get("drift_coefs"))

    def _summary(self, eval_after: dict[str, Any] | None, stop_reason: str) -> dict[str, Any]:
        """summary.json's fields (:func:`gbmpo.train.run.run_summary`) for this run."""
        return _run.run_summary(
            self.config, steps=self.step, stop_reason=stop_reason,
            wall_seconds=self.wall_seconds_before + (time.perf_counter() - self._t0),
            rl_seconds=self.rl_seconds, eval_before=self.eval_before, eval_after=eval_after,
            reward_failures=self.reward_failures_total, device=self.device,
            weights_dtype=self.params[0].dtype, optimizer=self.optimizer,
            run_dir=self.run_dir, objective=self.objective,
        )  # fmt: skip

    # ----------------------------------------------------------------------------- the step

    def train_step(self) -> dict[str, Any]:
        """One RL step, sections 1-7 of :mod:`gbmpo.train.step`; returns its metrics."""
        cfg, G = self.config, self.config.rollout.num_generations
        t_start = time.perf_counter()
        examples = [self.train_data[i] for i in self.sampler.take(cfg.rollout.prompts_per_step)]
        prompts = [ex["prompt"] for ex in examples]  # 1
        batch = _step.sample_completions(self.model, self.tokenizer, prompts, cfg,  # 2
                                         self.step, self.device)  # fmt: skip
        _step.release_decoder_buffers(cfg, self.model, batch, self.device, self.decode_releases,
                                      needs_ref=self.ref_model is not None)  # fmt: skip
        self.micro_batch, self.inference_batch = _step.plan_batches(
            cfg, self.model, batch, self.device, self.batch_sizes, self.batch_plans,
            needs_ref=self.ref_model is not None,
        )
        models, sizes = self.models, self.batch_sizes
        t_generated = time.perf_counter()
        rewards, failures = _step.score(self.reward_fn, self.task, examples, batch, G,  # 3
                                        self.device)  # fmt: skip
        self.reward_failures_total += failures
        old_logp: Tensor | None = None  # 4
        ref_logp: Tensor | None = None
        if self.needs_old:
            old_logp = _step.no_grad_logprobs(models, batch, sizes.inference, reference=False)
        if self.needs_ref:
            ref_logp = _step.no_grad_logprobs(models, batch, sizes.inference, reference=True)
        mask = batch.completion_mask.float()
        # rollout correction: w = f(pi_old / mu) of the trainer's vs the sampler's log-probs
        correction = sampler_weights(cfg.objective.rollout_correction, batch, old_logp, mask)
        advantages, penalties, adv_penalties = _step.shaped_advantages(  # 5
            self.objective, models, sizes, rewards, batch, old_logp, ref_logp, G
        )
        t_scored = time.perf_counter()
        update = _step.optimise(  # 6
            models, self.optimizer, self.clip_params, self.objective, cfg, sizes, batch,
            advantages, old_logp, ref_logp, correction, lr=self.lr_at(), step=self.step,
            device=self.device,
        )  # fmt: skip
        self.step += 1
        times = StepTimes(t_start, t_generated, t_scored, time.perf_counter())
        self.rl_seconds += times.end - times.start
        record = step_record(  # 7
            self.objective, batch, rewards, failures, advantages, penalties, adv_penalties,
            ref_logp, update, times,
            Progress(self.step, self.rl_seconds, self.reward_failures_total),
            num_generations=G, task=self.task, device=self.device,
        )  # fmt: skip
        self.objective = control_drift(self.objective, record)  # the next step's coefficients
        return record

    @property
    def models(self) -> PolicyModels:
        """The policy, its reference and the settings of their forwards."""
        return PolicyModels(self.model, self.ref_model, self.config.rollout)

    @property
    def batch_sizes(self) -> BatchSizes:
        """Rows per optimizer step, per backward and per no-grad pass (the current plan's)."""
        return BatchSizes(self.mini_batch, self.micro_batch, self.inference_batch)

    def lr_at(self) -> float:
        """The learning rate of the coming step (:func:`gbmpo.train.schedule.lr_at` at this
        step and RL time)."""
        return lr_at(self.config.optim, self.config.run, self.step, self.rl_seconds)

    def logprobs(
        self, model: Any, batch: Rollout, *, with_entropy: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """Per-token log-probs (and entropies) of ``batch``'s completions under ``model``, with
        the rollout's temperature (:meth:`gbmpo.train.policy.PolicyModels.logprobs`)."""
        return self.models.logprobs(model, batch, with_entropy=with_entropy)

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
        _step.release_decoder_buffers(self.config, self.model, None, self.device,
                                      self.decode_releases,
                                      needs_ref=self.ref_model is not None)  # fmt: skip
        # numeric metrics only; the wall time is logged separately as time/eval_seconds
        return {
            k: v
            for k, v in result["metrics"].items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "seconds"
        }


def train(config: TrainConfig, **kwargs: Any) -> dict[str, Any]:
    """Build a :class:`Trainer` for ``config`` and run it; returns the summary."""
    return Trainer(config, **kwargs).train()
