"""Rollouts: sampling completions and computing the log-probs of the sampled tokens."""

from gbmpo.rollout.decoder import LeanDecoder, lean_decoder_unsupported_reason
from gbmpo.rollout.hf import (
    Rollout,
    completion_logprobs,
    completion_mask_from_ids,
    eos_token_ids,
    generate,
    selective_log_softmax,
    selective_log_softmax_and_entropy,
    token_entropy,
)
from gbmpo.rollout.lean_forward import LeanForward, lean_forward_unsupported_reason

__all__ = [
    "LeanDecoder",
    "LeanForward",
    "Rollout",
    "completion_logprobs",
    "completion_mask_from_ids",
    "eos_token_ids",
    "generate",
    "lean_decoder_unsupported_reason",
    "lean_forward_unsupported_reason",
    "selective_log_softmax",
    "selective_log_softmax_and_entropy",
    "token_entropy",
]
