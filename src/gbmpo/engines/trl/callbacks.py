"""The TRL engine's run-directory side: TRL's log rows under the metrics schema's names
(:func:`schema_record`), the RL-step state (:class:`RLProgress`: learning rate, RL seconds,
gradient norms, evaluations), the callback that writes ``metrics.jsonl`` and evaluates every
``eval.every`` RL steps (:class:`RunDirCallback`), and :class:`gbmpo.integrations.trl.GBMPOTrainer`
with the engine's additions (:func:`engine_trainer_class`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gbmpo.engines.trl.args import lr_at
from gbmpo.io.metrics import DRIFT_COEF_PREFIX, DRIFT_MEASURE_PREFIX, MONITOR_PREFIX, host_name

__all__ = ["RLProgress", "RunDirCallback", "all_reduce", "engine_trainer_class", "schema_record"]


#: TRL's metric names -> the schema's (gbmpo.io.metrics); GBMPOTrainer logs gbmpo's own
#: quantities under the schema's names already (:data:`_GBMPO_PREFIXES`); the rest -> trl/<name>
_SCHEMA_NAMES = {
    "loss": "loss",
    "pg_loss": "pg_loss",
    "reg_loss": "reg_loss",
    "reg_value": "reg_value",
    "clip_ratio/low_mean": "clip_frac_low",
    "clip_ratio/high_mean": "clip_frac_high",
    "clip_ratio/dual_mean": "clip_frac_dual",
    "ratio/mean": "ratio_mean",
    "ratio/min": "ratio_min",
    "ratio/max": "ratio_max",
    "entropy": "entropy",
    "completions/mean_length": "response_length_mean",
    "completions/max_length": "response_length_max",
    "completions/clipped_ratio": "truncated_frac",
    "reward": "reward_mean",
    "frac_reward_zero_std": "frac_reward_zero_std",
    "gbmpo/accuracy": "accuracy",
    "gbmpo/reward_std": "reward_std",
    # GBMPOTrainer's rollout correction (gbmpo.engines.trl.correction)
    **{f"rollout_correction/{k}": f"rollout_correction/{k}"
       for k in ("weight_mean", "weight_min", "weight_max", "masked_frac")},
    "reward_penalty": "reward_penalty",
}

#: GBMPOTrainer's per-name metrics, logged under the schema's names: the monitored divergences
#: (``reg/<name>``) and, for a sum of terms, each term's value and part of the loss; the controlled
#: coefficients and their measures (``drift_coef/<name>``, ``drift_measure/<name>``)
_GBMPO_PREFIXES: tuple[str, ...] = (MONITOR_PREFIX, "reg_value/", "reg_loss/", "reward_penalty/",
                                    DRIFT_COEF_PREFIX, DRIFT_MEASURE_PREFIX)


def schema_record(logs: dict[str, Any]) -> dict[str, Any]:
    """One TRL log row under the schema's names (:mod:`gbmpo.io.metrics`): TRL's shared
    quantities renamed (:data:`_SCHEMA_NAMES`), GBMPOTrainer's (``pg_loss``, ``reg_loss``,
    ``reg_value``, ``reg/<name>``, ...) kept as they are, TRL's other metrics kept as
    ``trl/<name>``."""
    record: dict[str, Any] = {}
    for key, value in logs.items():
        if key == "completions/max_length":  # a token count, an int as on the own engine
            record["response_length_max"] = int(round(value))
        elif key in _SCHEMA_NAMES:
            record[_SCHEMA_NAMES[key]] = value
        elif key.startswith(_GBMPO_PREFIXES):
            record[key] = value
        else:
            record[host_name("trl", key)] = value
    return record


class RLProgress:
    """The run's RL-step state, shared by the TRL callback and the trainer: RL seconds
    (generation and updates; evaluation and checkpoints excluded, as on the own engine), the
    learning rate of each RL step, the gradient norms of its optimizer steps, evaluations, the
    stop reason."""

    def __init__(self, cfg: Any, k: int) -> None:
        self.cfg, self.k = cfg, k
        self.rl_seconds = 0.0
        self.step_start: float | None = None
        self.step_seconds = 0.0
        self.lrs: dict[int, float] = {}
        self.grad_norms: list[float] = []
        self.stop_reason = "steps"
        self.last_eval: tuple[int, dict[str, Any]] | None = None
        self.pending_eval: dict[str, Any] | None = None

    def lr(self, rl_step: int) -> float:
        """The rate of RL step ``rl_step``, fixed when the step starts (every optimizer step
        of an RL step uses it, as on the own engine)."""
        if rl_step not in self.lrs:
            self.lrs[rl_step] = lr_at(self.cfg, rl_step, self.rl_seconds)
        return self.lrs[rl_step]


def all_reduce(value: float, op: str = "max") -> float:
    """``value``'s maximum (``op="max"``) or sum (``"sum"``) over the processes (itself with
    one process)."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    on_gpu = dist.get_backend() == "nccl"  # NCCL reduces CUDA tensors only
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else None
    buffer = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(buffer, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return float(buffer.item())


class RunDirCallback:
    """The run's TRL callback: gbmpo's learning rate per RL step, RL time, evaluation every
    ``eval.every`` RL steps, the time budget, metrics.jsonl rows (main process) and the
    console's progress bar."""

    def __init__(self, cfg: Any, progress: RLProgress, writer: Any, evaluate: Any,
                 bar: Any) -> None:  # fmt: skip
        self.cfg, self.progress, self.writer = cfg, progress, writer
        self.evaluate, self.bar = evaluate, bar

    def as_trainer_callback(self) -> Any:
        # deferred: transformers is heavy; loaded only when TRL trains
        from transformers import TrainerCallback

        outer = self
        progress = self.progress

        class Callback(TrainerCallback):  # type: ignore[misc]
            def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                if state.global_step % progress.k == 0:
                    progress.step_start = time.perf_counter()
                lr = progress.lr(state.global_step // progress.k)
                optimizer = kw.get("optimizer")
                if optimizer is not None:
                    for group in optimizer.param_groups:
                        group["lr"] = lr

            def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                if state.global_step % progress.k or progress.step_start is None:
                    return
                progress.step_seconds = time.perf_counter() - progress.step_start
                # every process agrees on the RL time: the rate and the stop depend on it
                progress.rl_seconds = all_reduce(progress.rl_seconds + progress.step_seconds)
                progress.step_start = None
                step = state.global_step // progress.k
                every = outer.cfg.eval.every
                if every and step % every == 0:
                    outer.evaluate_now(step, kw.get("model"))
                budget = outer.cfg.run.time_budget_seconds
                over_budget = budget is not None and progress.rl_seconds >= budget
                if over_budget and step < outer.cfg.run.steps:
                    progress.stop_reason = "time_budget"
                    control.should_training_stop = True
                    control.should_save = True  # the run's final checkpoint, as at max_steps

            def on_log(self, args: Any, state: Any, control: Any, logs: Any = None,
                       **kw: Any) -> None:  # fmt: skip
                if logs is None or "loss" not in logs:
                    return
                outer.write_row(state.global_step // progress.k, logs)

        return Callback()

    def evaluate_now(self, step: int, model: Any) -> None:
        """gbmpo's evaluation on the main process (the others wait), outside the RL time."""
        # deferred: accelerate is optional (the trl extra)
        from accelerate import PartialState

        state = PartialState()
        if state.is_main_process and model is not None:
            eval_start = time.perf_counter()
            was_training = model.training
            model.eval()
            metrics = self.evaluate(model)
            model.train(was_training)
            self.progress.last_eval = (step, metrics)
            self.progress.pending_eval = {
                **{f"eval/{k}": v for k, v in metrics.items()},
                "time/eval_seconds": time.perf_counter() - eval_start,
            }
        state.wait_for_everyone()

    def write_row(self, step: int, logs: dict[str, Any]) -> None:
        progress = self.progress
        record: dict[str, Any] = {"step": step}
        record.update(schema_record(logs))
        record.pop("trl/learning_rate", None)  # the scheduler's base rate; "lr" is the used one
        record["lr"] = progress.lr(step - 1)
        if progress.grad_norms:  # the schema's mean over the step's optimizer steps (TRL: the last)
            record.pop("trl/grad_norm", None)
            record["grad_norm"] = sum(progress.grad_norms) / len(progress.grad_norms)
            record["grad_norm_max"] = max(progress.grad_norms)
            progress.grad_norms.clear()
        record["step_seconds"] = progress.step_seconds
        record["time/rl_seconds"] = progress.rl_seconds
        if progress.pending_eval is not None:
            record.update(progress.pending_eval)
            progress.pending_eval = None
        if self.writer is not None:
            self.writer.write(record)
        if self.bar is not None:
            self.bar.update(step, progress.rl_seconds, record, progress.last_eval)


def engine_trainer_class() -> type:
    """:class:`gbmpo.integrations.trl.GBMPOTrainer` with the engine's additions: the schema's
    reward metrics (``accuracy`` = fraction of rewards >= 1, the population ``reward_std``),
    weight decay on every parameter (the own engine's AdamW; transformers exempts biases and
    norms) and the gradient norm of every optimizer step."""
    # deferred: trl is optional (the trl extra)
    from gbmpo.engines.trl.trainer import GBMPOTrainer

    class EngineTrainer(GBMPOTrainer):
        progress: RLProgress | None = None
        #: called on every process with each saved checkpoint's directory (gbmpo's state)
        on_checkpoint: Callable[[Path], None] | None = None

        def _save_checkpoint(self, model: Any, trial: Any) -> None:
            # TRL's files first, without its rotation: on_checkpoint completes the checkpoint
            # and only then removes older ones (a kill in between keeps a complete one)
            limit = self.args.save_total_limit
            self.args.save_total_limit = None
            try:
                super()._save_checkpoint(model, trial)
            finally:
                self.args.save_total_limit = limit
            if self.on_checkpoint is not None:
                out = Path(self._get_output_dir(trial=trial))
                self.on_checkpoint(out / f"checkpoint-{self.state.global_step}")

        def _generate_and_score_completions(self, inputs: Any) -> Any:
            out = super()._generate_and_score_completions(inputs)
            if self.model.training:
                rewards = [r for values in self._logs["rewards"].values() for r in values]
                if rewards:
                    self._metrics["train"]["gbmpo/accuracy"].append(
                        sum(r >= 1.0 for r in rewards) / len(rewards)
                    )
                    self._metrics["train"]["gbmpo/reward_std"].append(statistics.pstdev(rewards))
            return out

        def get_decay_parameter_names(self, model: Any) -> list[str]:
            return [n for n, _ in model.named_parameters()]

        def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
            norm = super()._get_grad_norm(model, grad_norm=grad_norm)
            if self.progress is not None and norm is not None:
                self.progress.grad_norms.append(float(norm))
            return norm

    return EngineTrainer
