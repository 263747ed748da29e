r"""The rollout-training mismatch correction on the own engine (``objective.rollout_correction``).

Where the own engine's sampler and trainer differ. The sampler (``rollout.generator`` ``gbmpo``
or ``hf``) draws each token from ``filter_logits(z)``: the temperature-scaled logits with top-k
and top-p applied, computed by a KV-cached decode loop in eval mode. The trainer's old log-probs
:math:`\log\pi_{old}` come from a full forward at the same weights, with the temperature but
*without* top-k / top-p. So:

* with ``top_p = 1`` and ``top_k = 0`` the two are the same distribution, and the log-probs
  agree up to float rounding of the two forwards (about 1e-5 in float32 on the embedded model):
  the weights are 1 up to that rounding, and the correction has nothing to correct;
* with ``top_p < 1`` or ``top_k > 0`` the sampler's distribution is the truncated one, whose
  log-prob of a drawn token is :math:`\log\pi - \log\sum_{v\in S}\pi_v \ge \log\pi`: the ratio
  :math:`\pi_{old}/\mu \le 1` is a real mismatch, which the correction reweights;
* bf16 weights add the rounding of a bf16 decode against a bf16 forward.

``optim.mu > 1`` is no mismatch here: the surrogate's own ratio :math:`\pi_\theta/\pi_{old}`
handles the policy's moves. Per step: the sampler returns its log-probs
(:attr:`gbmpo.rollout.Rollout.sampling_logp`), the trainer computes :math:`\log\pi_{old}`,
:func:`sampler_weights` gives the weights once, and each micro-batch multiplies its surrogate by
them and, with ``off_policy_mask_threshold``, by the off-policy sequence mask of its current
log-probs (:func:`micro_correction`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor

from gbmpo.objectives.rollout_correction import (
    correction_weights,
    off_policy_sequence_mask,
    weight_stats,
)

if TYPE_CHECKING:
    from gbmpo.rollout.sampling import Rollout

__all__ = ["METRIC_PREFIX", "micro_correction", "sampler_weights"]

#: the metrics' prefix on every engine (gbmpo.io.metrics)
METRIC_PREFIX = "rollout_correction/"


def sampler_weights(spec: Any, batch: Rollout, old_logp: Tensor | None,
                    mask: Tensor) -> Tensor | None:  # fmt: skip
    """The ``[N, T]`` correction weights of ``spec`` (an ``objective.rollout_correction``
    section) from the trainer's old log-probs and the sampler's; ``None`` when the correction is
    off, ones when only the off-policy sequence mask is on."""
    if not spec.active:
        return None
    if batch.sampling_logp is None or old_logp is None:
        raise RuntimeError("objective.rollout_correction needs the sampler's and the trainer's "
                           "old log-probs of the batch")  # fmt: skip
    sampler = batch.sampling_logp.to(old_logp.device)
    return correction_weights(spec.mode, old_logp, sampler, mask, level=spec.level,
                              low=spec.low, high=spec.high)  # fmt: skip


def micro_correction(
    spec: Any, weights: Tensor | None, sampler_logp: Tensor | None, logp: Tensor,
    advantages: Tensor, mask: Tensor,
) -> tuple[Tensor | None, dict[str, float]]:  # fmt: skip
    r"""The token weights of one micro-batch (``weights`` times, with
    ``off_policy_mask_threshold``, the off-policy sequence mask of the current log-probs
    ``logp`` against the sampler's) and its ``rollout_correction/*`` metrics (weight mean, min,
    max, masked fraction over its valid tokens); ``(None, {})`` when the correction is off."""
    if weights is None:
        return None, {}
    keep = None
    if spec.off_policy_mask_threshold is not None:
        assert sampler_logp is not None
        keep = off_policy_sequence_mask(advantages, logp, sampler_logp.to(logp.device), mask,
                                        spec.off_policy_mask_threshold)  # fmt: skip
    stats = weight_stats(weights, mask, keep)
    token_weights = weights if keep is None else weights * keep.to(weights.dtype)
    return token_weights, {METRIC_PREFIX + k: v for k, v in stats.items()}
