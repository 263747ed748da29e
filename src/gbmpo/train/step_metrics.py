"""The metrics of one RL step of the own trainer (step 7 of :meth:`gbmpo.train.Trainer.train_step`):
rewards and lengths of the rollout, the update's losses and gradient norms, the regularizer
terms' penalties and values, the monitored divergences and the step's timings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

from gbmpo.io.metrics import MONITOR_PREFIX
from gbmpo.objectives.spec import BuiltObjective
from gbmpo.objectives.tensors import masked_mean
from gbmpo.rollout.sampling import Rollout
from gbmpo.train.batching import _Accumulator
from gbmpo.train.device import peak_memory_bytes

__all__ = ["Progress", "StepTimes", "UpdateStats", "per_term_breakdown", "step_record"]


@dataclass
class UpdateStats:
    """What the optimisation of one step (its epochs and mini-batches) reports."""

    #: the learning rate of the step
    lr: float
    #: the rollout policy's log-probs ``[N, T]`` (filled in during the first epoch when the
    #: policy does not move before the batch is used up)
    rollout_logp: Tensor
    #: token-weighted means of the micro-batches' loss metrics
    diag: _Accumulator = field(default_factory=_Accumulator.empty)
    losses: list[float] = field(default_factory=list)
    pg_losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    entropy_sum: float = 0.0


@dataclass
class StepTimes:
    """``time.perf_counter()`` at the start of the step, after the generation, after the
    log-probs and advantages, and at the end of the update."""

    start: float
    generated: float
    scored: float
    end: float


class Progress(NamedTuple):
    """The run's counters after the step."""

    #: steps done (this one included)
    step: int
    #: seconds of RL steps in all (this one included; no evaluation or checkpoint time)
    rl_seconds: float
    #: per-sample reward failures in all (this step's included)
    reward_failures_total: int


def per_term_breakdown(objective: BuiltObjective, metrics: dict[str, float]) -> dict[str, float]:
    """``metrics`` without the per-term ``reg_loss/<name>`` / ``reg_value/<name>`` of an
    objective of one term (they repeat ``reg_loss`` / ``reg_value``): the breakdown by term is
    logged for several terms, as ``reward_penalty/<name>`` is."""
    if len(objective.terms) > 1:
        return metrics
    return {k: v for k, v in metrics.items()
            if not k.startswith(("reg_loss/", "reg_value/"))}  # fmt: skip


def step_record(
    objective: BuiltObjective, batch: Rollout, rewards: Tensor, failures: int,
    advantages: Tensor, penalties: dict[str, Tensor], adv_penalties: dict[str, Tensor],
    ref_logp: Tensor | None, update: UpdateStats, times: StepTimes, progress: Progress, *,
    num_generations: int, task: Any, device: Any,
) -> dict[str, Any]:
    """The step's metrics: of the rollout ``batch`` (``num_generations`` rows per prompt), its
    rewards, advantages and penalties, the ``update``, the ``objective``'s monitors (with
    ``ref_logp``), the ``times``, the run's counters after the step (``progress``), a code
    ``task``'s unjudged tests and the peak memory of ``device``."""
    G = num_generations
    mask = batch.completion_mask.float()
    n = len(batch)
    step_seconds = times.end - times.start
    n_tokens = float(mask.sum())
    group_std = rewards.view(-1, G).std(dim=1, unbiased=False)
    record: dict[str, Any] = {
        "step": progress.step,
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std(unbiased=False)),
        "accuracy": float((rewards >= 1.0).float().mean()),
        "frac_reward_zero_std": float((group_std == 0).float().mean()),
        "reward_failures": failures,
        "reward_failures_total": progress.reward_failures_total,
        "response_length_mean": n_tokens / n,
        "response_length_max": int(max(batch.num_tokens)),
        "truncated_frac": sum(batch.truncated) / n,
        "advantage_abs_mean": float(
            advantages.abs().mean() if advantages.dim() == 1
            else (advantages.abs() * mask).sum() / mask.sum().clamp_min(1.0)
        ),
        "loss": sum(update.losses) / len(update.losses),
        "pg_loss": sum(update.pg_losses) / len(update.pg_losses),
        "entropy": update.entropy_sum / max(n_tokens, 1.0),
        "lr": update.lr,
        "grad_norm": sum(update.grad_norms) / len(update.grad_norms),
        "grad_norm_max": max(update.grad_norms),
    }
    record.update(update.diag.result())
    unjudged = getattr(task, "unjudged_tests", None)  # code tasks: verdicts
    if isinstance(unjudged, int):  # not decidable from plain data (they earned nothing)
        record["code_unjudged_tests_total"] = unjudged
    several = len(objective.terms) > 1
    if penalties:  # reward_mean stays the task's reward; the penalty is logged beside it
        record["reward_penalty"] = float(sum(penalties.values()).mean())
        if several:
            for name, value in penalties.items():
                record[f"reward_penalty/{name}"] = float(value.mean())
    if adv_penalties:  # the mean per-sequence penalty beta * sum_t D_t (its value at t = 0)
        record["advantage_penalty"] = float(sum(adv_penalties.values()).mean())
        if several:
            for name, value in adv_penalties.items():
                record[f"advantage_penalty/{name}"] = float(value.mean())
    if ref_logp is not None and objective.monitors:
        # value of every registered regularizer at pi_old, vs the frozen reference
        lp = update.rollout_logp
        with torch.no_grad():
            for name, reg in objective.monitors.items():
                values = reg(logp=lp, old_logp=lp, anchor_logp=ref_logp, mask=mask)
                record[MONITOR_PREFIX + name] = float(masked_mean(values, mask))
    record["step_seconds"] = step_seconds
    record["tokens_per_second"] = n_tokens / max(step_seconds, 1e-9)
    record["time/generate_seconds"] = times.generated - times.start
    record["time/logprob_seconds"] = times.scored - times.generated
    record["time/update_seconds"] = times.end - times.scored
    record["time/rl_seconds"] = progress.rl_seconds
    peak = peak_memory_bytes(device)
    if peak is not None:
        record["memory/peak_gib"] = peak / 2**30
    return record
