"""Rollouts: sampling completions (:mod:`gbmpo.rollout.sampling`) and computing the log-probs
of the sampled tokens (:mod:`gbmpo.rollout.logprobs`); :class:`LeanDecoder` and
:class:`LeanForward` are the lean implementations of their forwards for Llama-shaped models,
:class:`StaticDecoder` the static-shape decode step (a CUDA graph on a GPU, LoRA included)."""

from gbmpo.rollout.decoder import LeanDecoder, lean_decoder_unsupported_reason
from gbmpo.rollout.lean_forward import LeanForward, lean_forward_unsupported_reason
from gbmpo.rollout.logprobs import (
    completion_logprobs,
    selective_log_softmax,
    selective_log_softmax_and_entropy,
    token_entropy,
)
from gbmpo.rollout.sampling import (
    Rollout,
    completion_mask_from_ids,
    eos_token_ids,
    generate,
)
from gbmpo.rollout.static_decoder import StaticDecoder, static_decoder_unsupported_reason

__all__ = [
    "LeanDecoder",
    "LeanForward",
    "Rollout",
    "StaticDecoder",
    "completion_logprobs",
    "completion_mask_from_ids",
    "eos_token_ids",
    "generate",
    "lean_decoder_unsupported_reason",
    "lean_forward_unsupported_reason",
    "selective_log_softmax",
    "selective_log_softmax_and_entropy",
    "static_decoder_unsupported_reason",
    "token_entropy",
]
