r"""``estimator: full`` and ``placement: reward`` on TRL: the logits GBMPOTrainer needs beside
TRL's sampled-token log-probs, and the in-reward penalty it subtracts before TRL's advantages.

* **in the loss** (:func:`logprobs_and_full`): per micro-batch, one policy forward returns the
  completion logits ``[b, C, V]`` (with grad; the sampled tokens' log-probs and entropies come
  from them), one no-grad forward of the reference (TRL's reference model, or the policy with
  its LoRA adapter switched off, TRL's mechanism) returns its logits, and
  :func:`gbmpo.objectives.estimators.full_divergence` sums the divergence over the vocabulary
  in chunks of token rows, with its gradient into the policy logits (one buffer the size of the
  micro-batch's logits). The reference's logits are freed once the divergence is computed, so
  the extra memory is about one logits tensor per micro-batch, as on the own engine
  (:mod:`gbmpo.train.full`);
* **in the reward** (:func:`sequence_penalties`, :func:`shaped_advantages`): each term's
  detached per-sequence penalty :math:`\beta_k \sum_t m_{i,t} D^{(k)}_{i,t}(\pi_{old}\,\|\,
  \pi_{ref})` (sampled-token formula on TRL's rollout and reference log-probs, or the exact
  divergence from no-grad forwards of the rollout policy and the reference, micro-batch by
  micro-batch) is subtracted from the weighted sum of the reward functions, and the group
  advantages are computed from the shaped rewards with TRL's formula (group mean; the
  unbiased std plus TRL's :data:`TRL_STD_EPS` when ``scale_rewards`` is ``group`` / ``batch``).
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate.utils import is_peft_model
from torch import Tensor
from trl.trainer.utils import use_adapter

from gbmpo.objectives.advantages import group_advantages
from gbmpo.objectives.estimators import full_divergence, full_potential
from gbmpo.objectives.loss import reward_penalty, sequence_divergence
from gbmpo.rollout.logprobs import selective_log_softmax_and_entropy

__all__ = [
    "TRL_STD_EPS",
    "completion_logits",
    "logprobs_and_full",
    "reference_logits",
    "sequence_penalties",
    "shaped_advantages",
]

#: TRL 1.16 adds this to the reward std of its group advantages (the own engine and verl: 1e-6)
TRL_STD_EPS = 1e-4


def completion_logits(
    trainer: Any, model: Any, input_ids: Tensor, attention_mask: Tensor, logits_to_keep: int,
    *, aux: bool = False,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """The logits ``[b, C, V]`` predicting the ``C = logits_to_keep`` completion tokens,
    divided by TRL's temperature (as TRL's fused LM head does), and the MoE auxiliary loss with
    ``aux``. The model's own forward (TRL's patched forward without ``fused_lm_head``), under
    TRL's autocast; bf16 / fp16 logits are cast to float32."""
    kw: dict[str, Any] = {"output_router_logits": True} if aux else {}
    with trainer.accelerator.autocast():
        out = model(input_ids=input_ids, attention_mask=attention_mask,
                    logits_to_keep=logits_to_keep + 1, use_cache=False, **kw)  # fmt: skip
    logits = out.logits[:, :-1, :]
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    if trainer.temperature != 1.0:
        logits = logits / trainer.temperature
    return logits, getattr(out, "aux_loss", None) if aux else None


@torch.no_grad()
def reference_logits(
    trainer: Any, input_ids: Tensor, attention_mask: Tensor, logits_to_keep: int
) -> Tensor:
    """The reference's completion logits, no grad: TRL's reference model, or (PEFT) the policy
    with its adapter disabled (the initial adapter ``ref`` when TRL keeps one), as TRL takes the
    reference's log-probs."""
    if trainer.ref_model is not None:
        return completion_logits(trainer, trainer.ref_model, input_ids, attention_mask,
                                 logits_to_keep)[0]  # fmt: skip
    model = trainer.accelerator.unwrap_model(trainer.model)
    if not is_peft_model(model):
        raise RuntimeError(
            "estimator 'full' needs the reference's logits, but the trainer has no reference "
            f"model (TRL builds one when beta != 0; beta={trainer.beta})"
        )
    with use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None):
        return completion_logits(trainer, trainer.model, input_ids, attention_mask,
                                 logits_to_keep)[0]  # fmt: skip


def _potential(term: Any) -> Any:
    return full_potential(term.name, term.regularizer)


def logprobs_and_full(
    trainer: Any, model: Any, input_ids: Tensor, attention_mask: Tensor, logits_to_keep: int,
    completion_ids: Tensor, mask: Tensor, terms: Any, *, aux: bool = False,
) -> tuple[Tensor, Tensor, Tensor | None, dict[str, Tensor]]:  # fmt: skip
    r"""For one micro-batch: the policy's sampled-token log-probs (with grad), its entropies,
    the MoE auxiliary loss (with ``aux``) and, per ``full`` term, the exact per-token divergence
    :math:`\sum_v D_h(\pi_\theta(v|h_t), \pi_{ref}(v|h_t))` ``[b, C]`` (with grad into the
    policy logits), from one policy forward and one no-grad reference forward."""
    logits, aux_loss = completion_logits(trainer, model, input_ids, attention_mask,
                                         logits_to_keep, aux=aux)  # fmt: skip
    logp, entropy = selective_log_softmax_and_entropy(logits, completion_ids)
    ref = reference_logits(trainer, input_ids, attention_mask, logits_to_keep)
    full_values = {t.name: full_divergence(logits, ref, _potential(t), mask) for t in terms}
    del ref
    return logp, entropy, aux_loss, full_values


@torch.no_grad()
def sequence_penalties(trainer: Any, output: dict[str, Any], terms: Any) -> dict[str, Tensor]:
    r"""Per in-reward term, the detached penalty :math:`\beta_k S^{(k)}_i` ``[n]`` of this
    process's rollout (``output``: TRL's generation batch), with :math:`S_i = \sum_t m_{i,t}
    D_{i,t}(\pi_{old}\,\|\,\pi_{ref})`: the sampled-token formula on TRL's rollout log-probs
    (``old_per_token_logps``, or one no-grad forward of the current policy when TRL skipped it:
    the policy has not moved since generation) and reference log-probs; ``estimator: full``
    terms take the exact divergence from the rollout policy's and the reference's logits,
    ``per_device_train_batch_size`` rows at a time."""
    ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
    attn = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
    k = output["completion_ids"].size(1)
    mask = output["completion_mask"]
    if output.get("tool_mask") is not None:
        mask = mask * output["tool_mask"]
    step = int(trainer.args.per_device_train_batch_size)
    sampled = [t for t in terms if t.estimator != "full"]
    full = [t for t in terms if t.estimator == "full"]
    old = output.get("old_per_token_logps")
    if old is None and sampled:
        old = torch.cat([trainer._get_per_token_logps_and_entropies(
            trainer.model, ids[s : s + step], attn[s : s + step], k)[0]
            for s in range(0, ids.size(0), step)])  # fmt: skip
    ref = output.get("ref_per_token_logps")
    seqs: dict[str, Tensor] = {}
    for t in sampled:
        seqs[t.name] = sequence_divergence(t.regularizer, rollout_logp=old, ref_logp=ref,
                                           mask=mask)  # fmt: skip
    if full:
        parts: dict[str, list[Tensor]] = {t.name: [] for t in full}
        for s in range(0, ids.size(0), step):
            rows = slice(s, s + step)
            pol, _ = completion_logits(trainer, trainer.model, ids[rows], attn[rows], k)
            refl = reference_logits(trainer, ids[rows], attn[rows], k)
            for t in full:
                parts[t.name].append(full_divergence(pol, refl, _potential(t), mask[rows]).sum(-1))
        seqs.update({name: torch.cat(p) for name, p in parts.items()})
    return {t.name: t.coef * seqs[t.name].float() for t in terms}


def shaped_advantages(
    rewards: Tensor, penalty: Tensor, num_generations: int, scale_rewards: str,
    eps: float = TRL_STD_EPS,
) -> Tensor:  # fmt: skip
    r"""TRL's group advantages (``sum_then_normalize``) of the shaped rewards
    :math:`\tilde r_i = r_i - \sum_k \beta_k S^{(k)}_i` (:func:`gbmpo.objectives.loss.
    reward_penalty`):

    .. math::
        A_i = \frac{\tilde r_i - \bar{\tilde r}_g}{\sigma + \epsilon}

    with :math:`\sigma` the unbiased std of the group (``scale_rewards="group"``) or of the
    batch (``"batch"``), no division for ``"none"``, :math:`\epsilon` = :data:`TRL_STD_EPS`
    (TRL 1.16 ``GRPOTrainer._generate_and_score_completions``); NaN rewards (unscorable) get
    advantage 0, as TRL. With a zero penalty this is TRL's advantage."""
    shaped = reward_penalty(rewards, [(1.0, penalty)])
    scale = {True: "group", False: "none"}.get(scale_rewards, scale_rewards)  # type: ignore[call-overload]
    return group_advantages(shaped, num_generations, scale=str(scale), eps=eps)

