"""The rollout API under its original module name (re-exports; nothing is defined here).

Sampling lives in :mod:`gbmpo.rollout.sampling` (:class:`Rollout`, :func:`generate`) and the
log-probs of the sampled tokens in :mod:`gbmpo.rollout.logprobs` (:func:`completion_logprobs`,
:func:`selective_log_softmax`). This module keeps ``from gbmpo.rollout.hf import ...`` working
for users and benchmarks, and is where the evaluation looks :func:`generate` up at call time.
"""

from __future__ import annotations

from gbmpo.rollout.logprobs import (
    DEFAULT_CHUNK_ROWS,
    completion_logprobs,
    selective_log_softmax,
    selective_log_softmax_and_entropy,
    token_entropy,
)
from gbmpo.rollout.sampling import (
    ENGINES,
    Rollout,
    _decode,  # noqa: F401  (the gbmpo engine's decode loop, imported by its tests)
    _prefill,  # noqa: F401  (and its prefill)
    completion_mask_from_ids,
    eos_token_ids,
    filter_logits,
    generate,
    sample_from_logits,
)

__all__ = [
    "DEFAULT_CHUNK_ROWS",
    "ENGINES",
    "Rollout",
    "completion_logprobs",
    "completion_mask_from_ids",
    "eos_token_ids",
    "filter_logits",
    "generate",
    "sample_from_logits",
    "selective_log_softmax",
    "selective_log_softmax_and_entropy",
    "token_entropy",
]
