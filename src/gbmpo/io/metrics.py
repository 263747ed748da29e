"""One metrics schema for every engine's run directory.

``metrics.jsonl`` holds one row per RL step (and ``eval/*`` rows); ``summary.json`` one object
per run. A quantity every engine has gets one name and one definition here (:data:`STEP_METRICS`,
:data:`SUMMARY_KEYS`); what only a host library logs is kept under its prefix (``trl/`` or
``verl/``, :func:`host_name`). ``gbmpo compare`` and ``gbmpo report`` read these names only, so
run directories of every engine sit side by side.

Definitions (per RL step: one generation batch of ``prompts_per_step * num_generations``
completions and the ``mu`` passes over it):

* ``reg/<name>``: the masked per-token mean of regularizer ``<name>`` at the *rollout* policy
  against the frozen reference, :math:`D(\\pi_{old}\\,\\|\\,\\pi_{ref})`, over the batch's
  completion tokens, for the optimised regularizer and (with
  ``objective.monitor_regularizers``) every registered one; always the sampled-token formula,
  also for a term with ``estimator: full``. The one name of a monitored divergence on every
  engine (:data:`MONITOR_PREFIX`; GBMPOTrainer's own log uses it too, once per regularizer);
* ``reg_value``: the masked mean of the *optimised* regularizer during the update,
  :math:`D(\\pi_\\theta\\,\\|\\,\\text{anchor})` (for a term with ``estimator: full`` the
  exact full-vocabulary divergence, else the sampled-token formula); ``reg_loss``: its
  aggregated, coefficient-scaled term :math:`\\mathrm{agg}(\\lambda D)`; for a list of
  regularizer terms, ``reg_loss/<name>`` and ``reg_value/<name>`` per term and ``reg_loss`` /
  ``reg_value`` their sums (terms placed in the reward add nothing to them);
* ``reward_mean``: the task's reward, before any in-reward divergence; ``reward_penalty``: the
  batch mean of the per-sequence penalty :math:`\\beta \\sum_t D(\\pi_{old}\\,\\|\\,\\pi_{ref})`
  subtracted from it before the advantages (``placement: reward``; ``reward_penalty/<name>``
  per term of a list); ``advantage_penalty``: the batch mean of the per-sequence penalty
  :math:`\\beta \\sum_t D(\\pi_{old}\\,\\|\\,\\pi_{ref})` whose future part
  :math:`\\beta \\sum_{s\\ge t} D_s` is subtracted from each token's normalised advantage
  (``placement: advantage``; ``advantage_penalty/<name>`` per term of a list);
* ``loss`` / ``pg_loss``: the aggregated objective / surrogate term, averaged over the step's
  optimizer steps;
* ``rollout_correction/weight_mean|weight_min|weight_max|masked_frac``: the sampler / trainer
  mismatch correction (``objective.rollout_correction``), the same definition on every engine
  (TRL's ``sampling/importance_sampling_ratio/*`` and verl's ``rollout_corr/rollout_is_*`` stay
  under ``trl/`` and ``verl/`` with their own definitions);
* ``drift_coef/<name>`` / ``drift_measure/<name>``: a controlled coefficient
  (``objective.regularizer.control``): the coefficient term ``<name>`` had in this step and the
  measure its controller read (``reg/kl_k3`` or ``reg/<name>`` of this step's rollout), from
  which the next step's coefficient follows (:mod:`gbmpo.objectives.drift_control`).
"""

from __future__ import annotations

__all__ = [
    "DRIFT_COEF_PREFIX",
    "DRIFT_MEASURE_PREFIX",
    "HOST_PREFIXES",
    "MONITOR_PREFIX",
    "OBJECTIVE_METRICS",
    "STEP_METRICS",
    "SUMMARY_KEYS",
    "host_name",
    "is_shared",
]

#: metrics.jsonl names every engine writes (where the engine computes the quantity) -> meaning
STEP_METRICS: dict[str, str] = {
    "step": "RL steps done (1-based)",
    "loss": "aggregated objective, mean over the step's optimizer steps",
    "pg_loss": "aggregated surrogate term alone, mean over the step's optimizer steps",
    "reg_loss": "aggregated coef * regularizer term alone (the sum over the terms in the loss)",
    "reg_value": "masked per-token mean of the optimised regularizer, D(pi_theta || anchor) "
                 "(estimator full: the exact full-vocabulary value)",
    "clip_frac_low": "fraction of valid tokens clipped at the lower bound",
    "clip_frac_high": "fraction of valid tokens clipped at the upper bound",
    "clip_frac_dual": "fraction of valid tokens clipped by the dual clip",
    "ratio_mean": "masked mean importance ratio pi_theta / pi_old",
    "ratio_min": "minimum importance ratio over valid tokens",
    "ratio_max": "maximum importance ratio over valid tokens",
    "entropy": "mean per-token entropy of the policy on the completions",
    "response_length_mean": "mean completion length in tokens",
    "response_length_max": "longest completion in tokens",
    "truncated_frac": "fraction of completions stopped by rollout.max_new_tokens",
    "accuracy": "fraction of completions with reward >= 1",
    "reward_mean": "mean task reward of the step's completions (before any in-reward penalty)",
    "reward_std": "standard deviation of the step's rewards (population)",
    "frac_reward_zero_std": "fraction of groups whose rewards are all equal",
    "lr": "learning rate used by the step",
    "grad_norm": "mean global gradient norm (before clipping) over the step's optimizer steps",
    "step_seconds": "wall-clock seconds of the RL step",
}

#: metrics.jsonl names written only where the objective has the quantity (every engine that
#: honours the setting writes them under these names)
OBJECTIVE_METRICS: dict[str, str] = {
    "reward_penalty": "mean per-sequence coef * sum_t D(pi_old || pi_ref) subtracted from the "
    "task reward before the advantages (regularizer terms with placement reward); reward_mean "
    "stays the task reward",
    "rollout_correction/weight_mean": "objective.rollout_correction: mean over the valid tokens "
    "of the correction weights w = f(pi_old / mu) (trainer's old vs sampler's log-probs; a "
    "sequence weight counts once per token)",
    "rollout_correction/weight_min": "objective.rollout_correction: smallest weight over the "
    "valid tokens",
    "rollout_correction/weight_max": "objective.rollout_correction: largest weight over the "
    "valid tokens",
    "rollout_correction/masked_frac": "objective.rollout_correction: fraction of valid tokens "
    "the correction removes from the gradient (weight 0 by mis / icepop, or dropped by the "
    "off-policy sequence mask), mean over the step's update passes",
    "advantage_penalty": "mean per-sequence coef * sum_t D(pi_old || pi_ref) whose future part "
    "sum_{s >= t} is subtracted from each token's normalised advantage (regularizer terms with "
    "placement advantage)",
}

#: summary.json keys every engine writes
SUMMARY_KEYS: tuple[str, ...] = (
    "status", "engine", "steps", "stop_reason", "wall_seconds", "eval_before", "eval_after",
    "model", "task", "advantage", "surrogate", "regularizer", "coef", "aggregation", "seed",
    "device", "dtype", "run_dir", "final_model", "rl_seconds", "reward_failures",
    "peak_memory_gib", "drift", "drift_seconds",
)  # fmt: skip

#: the one prefix of the monitored divergences, ``reg/<name>`` = D(pi_old || pi_ref), on every
#: engine (the own trainer's metrics, GBMPOTrainer's log, the run directory's metrics.jsonl)
MONITOR_PREFIX = "reg/"
#: a controlled coefficient's value in the step and the measure its controller read, per term
DRIFT_COEF_PREFIX = "drift_coef/"
DRIFT_MEASURE_PREFIX = "drift_measure/"

#: where host-only metrics go
HOST_PREFIXES: dict[str, str] = {"trl": "trl/", "verl": "verl/"}


def is_shared(name: str) -> bool:
    """Whether ``name`` is a schema name (``reg/<name>`` and ``eval/<metric>`` included)."""
    return name in STEP_METRICS or name in OBJECTIVE_METRICS or name.startswith(
        (MONITOR_PREFIX, "eval/", "reg_loss/", "reg_value/", "reward_penalty/",
         "advantage_penalty/", "time/", DRIFT_COEF_PREFIX, DRIFT_MEASURE_PREFIX)
    )


def host_name(host: str, name: str) -> str:
    """A host library's own metric ``name`` kept beside the schema: ``trl/<name>``."""
    return HOST_PREFIXES[host] + name
