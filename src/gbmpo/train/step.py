r"""One RL step, top to bottom, in the order :meth:`gbmpo.train.Trainer.train_step` calls it.

Per step, with :math:`P` prompts and :math:`G` completions each (:math:`N = PG` sequences):

1. sample :math:`P` prompts :math:`q_g` from the training split (seeded permutation);
2. sample :math:`o_{g,1..G} \sim \pi_{\theta_{\text{old}}}(\cdot\mid q_g)` with the
   generator ``rollout.generator`` (:func:`sample_completions`);
3. rewards :math:`r_i = R(q, o_i)` from the task (per-sample failures -> 0, counted;
   :func:`score`);
4. behaviour log-probs :math:`\log\pi_{\text{old}}` (only when the policy moves before the batch
   is used up, or a regularizer term is placed in the reward) and reference log-probs
   :math:`\log\pi_{\text{ref}}` (only when needed); with ``objective.rollout_correction`` the
   sampler's log-probs :math:`\log\mu` too, and the weights :math:`w = f(\pi_{old}/\mu)` that
   multiply each token's surrogate (:mod:`gbmpo.train.correction`);
5. the terms placed in the reward: :math:`\tilde r_i = r_i - \sum_k \beta_k \sum_t
   D^{(k)}_{i,t}(\pi_{old}\,\|\,\pi_{ref})` (detached); then group advantages
   :math:`A_i = (\tilde r_i - \bar{\tilde r}_g)` [:math:`/\,(\sigma_g+\epsilon)`]; then the
   terms placed in the advantage: :math:`A_{i,t} = A_i - \sum_k \beta_k \sum_{s\ge t}
   D^{(k)}_{i,s}` (detached, after the normalisation: FRPO; :func:`shaped_advantages`,
   :mod:`gbmpo.train.penalties`);
6. ``mu`` epochs over mini-batches, each a gradient-accumulated sum over micro-batches of
   :math:`\mathcal L = \mathrm{agg}(\ell^{\text{surr}}_{i,t} + \sum_k \lambda_k D^{(k)}_{i,t})`
   (the terms placed in the loss) with the mini-batch's normalisers, so accumulation is exact;
   AdamW step after grad-norm clipping (:func:`optimise`, :func:`accumulate_gradients`,
   :func:`policy_loss`, which hands the terms to
   :func:`gbmpo.objectives.loss.compute_policy_loss_packed`). A term with ``estimator: full``
   uses the exact divergence over the vocabulary instead of its sampled-token formula, from the
   policy's and the reference's logits of each micro-batch (:mod:`gbmpo.train.full`);
7. metrics (:func:`gbmpo.train.step_metrics.step_record`); then each controlled coefficient
   moves from the drift this step measured (:mod:`gbmpo.train.drift`).

:meth:`gbmpo.train.Trainer.train_step` calls these in order and keeps the run's state (step,
counters, batch plans, controlled coefficients); each function here takes what it reads as
arguments (the models, ``optimizer``, ``objective``, the settings ``cfg``, the batch sizes) and
returns what it computes. Every tensor of the step lives where the policy's weights are.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from gbmpo.config import TrainConfig
from gbmpo.objectives.loss import compute_policy_loss_packed, loss_terms, unpack_metrics
from gbmpo.objectives.spec import BuiltObjective
from gbmpo.rewards.scoring import score_completions
from gbmpo.rollout.sampling import Rollout, generate
from gbmpo.rollout.static_decoder import release_static_decoder
from gbmpo.train.batching import (
    BatchSizes,
    _Accumulator,
    _chunks,
    _MiniBatchStats,
    derive_seed,
    row_order,
)
from gbmpo.train.correction import micro_correction
from gbmpo.train.device import device_memory_bytes
from gbmpo.train.full import full_terms, logprobs_and_full
from gbmpo.train.memory import memory_plan
from gbmpo.train.penalties import in_advantage_penalties, in_reward_penalties
from gbmpo.train.policy import PolicyModels
from gbmpo.train.precision import MasterWeightOptimizer
from gbmpo.train.step_metrics import UpdateStats, per_term_breakdown

__all__ = [
    "accumulate_gradients",
    "no_grad_logprobs",
    "optimise",
    "plan_batches",
    "planned_batches",
    "release_decoder_buffers",
    "releases_decoder_buffers",
    "policy_loss",
    "policy_loss_packed",
    "sample_completions",
    "score",
    "shaped_advantages",
]


def sample_completions(model: Any, tokenizer: Any, prompts: list[Any], cfg: TrainConfig,
                       step: int, device: torch.device) -> Rollout:  # fmt: skip
    r"""G completions per prompt, :math:`o_{g,j} \sim \pi_{old}(\cdot\mid q_g)` from
    ``rollout.generator``, on ``device``; rows ``g*G .. g*G+G-1`` are prompt ``g``'s. The seed
    depends on the run's seed and the ``step`` only, so a resumed run samples the same
    completions."""
    ro = cfg.rollout
    return generate(
        model, tokenizer, prompts,
        num_return_sequences=ro.num_generations, max_new_tokens=ro.max_new_tokens,
        do_sample=True, temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k,
        generator_seed=derive_seed(cfg.run.seed, "rollout", step),
        batch_size=ro.batch_size, generator=ro.generator, lean_decoder=ro.lean_decoder,
        decode_step=ro.decode_step,
        return_logprobs=cfg.objective.rollout_correction.active,  # the sampler's log mu
    ).to(device)  # fmt: skip


def plan_batches(
    cfg: TrainConfig, model: Any, batch: Rollout, device: torch.device, sizes: BatchSizes,
    plans: dict[int, tuple[int, int]], *, needs_ref: bool,
) -> tuple[int, int]:
    """(micro-batch, rows per no-grad pass) of this step. On CUDA with
    ``optim.micro_batch_size: null``: the memory plan's for this step's prompt width rounded up
    to a multiple of 64 tokens (:func:`planned_batches`, once per such width: ``plans`` is the
    caller's memo by width, which this adds to; a plan builds the model's shape on the meta
    device, and rounding up only plans more memory); elsewhere ``sizes``' (the CPU keeps the
    mini-batch)."""
    if cfg.optim.micro_batch_size is not None or device.type != "cuda":
        return sizes.micro, sizes.inference
    width = -(-int(batch.prompt_ids.shape[1]) // 64) * 64
    if width not in plans:
        plans[width] = planned_batches(cfg, model.config, width,
                                       device_memory_bytes(str(device)), sizes,
                                       needs_ref=needs_ref)  # fmt: skip
    return plans[width]


def planned_batches(cfg: TrainConfig, model_config: Any, prompt_tokens: int,
                    device_bytes: int | None, sizes: BatchSizes, *, needs_ref: bool
                    ) -> tuple[int, int]:  # fmt: skip
    """(micro-batch, rows per no-grad pass) that :func:`gbmpo.train.memory.memory_plan` plans
    for ``cfg`` and a model of ``model_config`` on a device of ``device_bytes`` with prompts of
    ``prompt_tokens`` tokens (``sizes``' without a device size)."""
    if device_bytes is None:
        return sizes.micro, sizes.inference
    plan = memory_plan(cfg, model_config, prompt_tokens, needs_ref=needs_ref,
                       device_bytes=device_bytes)  # fmt: skip
    micro = int(plan["micro_batch_rows"])
    return micro, max(micro, int(plan["inference_rows"] or micro))


def releases_decoder_buffers(cfg: TrainConfig, model_config: Any, prompt_tokens: int,
                             device: torch.device, *, needs_ref: bool) -> bool:
    """Whether the static decoder's buffers are freed after each rollout and evaluation
    (``rollout.decode_buffers``): ``release``; ``auto``: the memory plan's choice on CUDA for
    prompts of ``prompt_tokens`` tokens (:func:`gbmpo.train.memory.memory_plan`), else kept."""
    choice = cfg.rollout.decode_buffers
    if choice != "auto" or device.type != "cuda":
        return choice == "release"
    plan = memory_plan(cfg, model_config, prompt_tokens, needs_ref=needs_ref,
                       device_bytes=device_memory_bytes(str(device)))  # fmt: skip
    return plan["decode_buffers_mode"] == "release"


def release_decoder_buffers(cfg: TrainConfig, model: Any, batch: Rollout | None,
                            device: torch.device, plans: dict[int, bool], *,
                            needs_ref: bool) -> bool:  # fmt: skip
    """Free ``model``'s static decoder buffers
    (:func:`~gbmpo.rollout.static_decoder.release_static_decoder`) after a rollout ``batch``
    when :func:`releases_decoder_buffers` says so for its prompt width rounded up to 64 tokens
    (``plans``: the caller's memo by width); after an evaluation (``batch`` ``None``) when the
    last rollout's choice was to release, or, before the first rollout (no plan yet), with
    ``release`` or ``auto`` on CUDA (the next rollout only allocates them again). Whether it
    freed them."""
    if batch is not None:
        width = -(-int(batch.prompt_ids.shape[1]) // 64) * 64
        release = plans.pop(width) if width in plans else releases_decoder_buffers(
            cfg, model.config, width, device, needs_ref=needs_ref)
        plans[width] = release  # (re)inserted last: the latest rollout's choice
    elif plans:
        release = list(plans.values())[-1]
    else:  # an evaluation before the first rollout: the update's plan is not made yet
        release = cfg.rollout.decode_buffers == "release" or (
            cfg.rollout.decode_buffers == "auto" and device.type == "cuda")
    return release and release_static_decoder(model)


def score(reward_fn: Any, task: Any, examples: list[dict[str, Any]], batch: Rollout,
          num_generations: int, device: torch.device) -> tuple[Tensor, int]:  # fmt: skip
    """Rewards :math:`r_i = R(q_i, o_i)` ``[N]`` on ``device`` from ``reward_fn`` on plain Python
    values, with ``task``'s columns of ``examples`` repeated ``num_generations`` times, and the
    number of per-sample failures (scored 0)."""
    G = num_generations
    columns = {k: [v for v in col for _ in range(G)]
               for k, col in task.columns(examples).items()}  # fmt: skip
    prompts = [ex["prompt"] for ex in examples for _ in range(G)]
    scored = score_completions(reward_fn, prompts, batch.texts, columns)
    return torch.tensor(scored.rewards, dtype=torch.float32, device=device), scored.failures


def shaped_advantages(
    objective: BuiltObjective, models: PolicyModels, sizes: BatchSizes, rewards: Tensor,
    batch: Rollout, old_logp: Tensor | None, ref_logp: Tensor | None, num_generations: int,
) -> tuple[Tensor, dict[str, Tensor], dict[str, Tensor]]:
    r"""Advantages with the terms placed outside the loss: the rewards minus the in-reward
    penalties :math:`\beta_k \sum_t D_k(\pi_{old}\,\|\,\pi_{ref})` (detached), the group
    advantages of those, minus the in-advantage future penalties (after the normalisation:
    FRPO). Returns the advantages and each placement's per-sequence penalties by term."""
    mask = batch.completion_mask.float()
    rollout = old_logp
    if rollout is None and (objective.reward_terms or objective.advantage_terms):
        rollout = no_grad_logprobs(models, batch, sizes.inference, reference=False)
    shaped, penalties = rewards, {}
    if objective.reward_terms:
        assert rollout is not None
        shaped, penalties = in_reward_penalties(objective.reward_terms, rewards, rollout, ref_logp,
                                                mask, models, batch, sizes.micro)  # fmt: skip
    advantages = objective.advantage(shaped, num_generations)
    adv_penalties: dict[str, Tensor] = {}
    if objective.advantage_terms:
        assert rollout is not None
        advantages, adv_penalties = in_advantage_penalties(
            objective.advantage_terms, advantages, rollout, ref_logp, mask, models, batch,
            sizes.micro,
        )
    return advantages, penalties, adv_penalties


def optimise(
    models: PolicyModels, optimizer: Any, clip_params: list[Tensor], objective: BuiltObjective,
    cfg: TrainConfig, sizes: BatchSizes, batch: Rollout, advantages: Tensor,
    old_logp: Tensor | None, ref_logp: Tensor | None, correction: Tensor | None, *,
    lr: float, step: int, device: torch.device,
) -> UpdateStats:
    r"""``optim.mu`` epochs over seeded mini-batches (the seed: the run's, ``step``, the
    epoch), one ``optimizer`` step each at the rate ``lr`` after clipping the norm of
    ``clip_params``' gradient (:math:`g \leftarrow g \min(1, c/\|g\|)`), the gradient
    accumulated over micro-batches (:func:`accumulate_gradients`); ``device``: the batch's."""
    opt, model = cfg.optim, models.model
    n, width = len(batch), batch.completion_mask.shape[1]
    model.train()
    update = UpdateStats(
        lr=lr,
        rollout_logp=(torch.zeros(n, width, device=device) if old_logp is None else old_logp),
    )
    for group in optimizer.param_groups:
        group["lr"] = update.lr
    max_norm = opt.grad_clip if opt.grad_clip is not None else math.inf
    for epoch in range(opt.mu):
        order = row_order(n, sizes.mini, cfg.run.seed, step, epoch, device)
        for rows in order.split(sizes.mini):
            optimizer.zero_grad(set_to_none=True)
            stats = accumulate_gradients(
                models, objective, cfg, sizes.micro, batch, rows, advantages, old_logp,
                ref_logp, update.diag, with_entropy=epoch == 0, correction=correction,
            )  # fmt: skip
            if isinstance(optimizer, MasterWeightOptimizer):
                optimizer.grads_to_masters()  # clip and step in fp32
            update.grad_norms.append(
                float(torch.nn.utils.clip_grad_norm_(clip_params, max_norm))
            )
            optimizer.step()
            update.losses.append(stats.loss)
            update.pg_losses.append(stats.pg_loss)
            update.entropy_sum += stats.entropy_sum
            if old_logp is None:  # on-policy: the current log-probs are pi_old's
                update.rollout_logp[rows] = stats.logp
    optimizer.zero_grad(set_to_none=True)
    return update


def accumulate_gradients(
    models: PolicyModels,
    objective: BuiltObjective,
    cfg: TrainConfig,
    micro_batch: int,
    batch: Rollout,
    rows: Tensor,
    advantages: Tensor,
    old_logp: Tensor | None,
    ref_logp: Tensor | None,
    diag: _Accumulator | None = None,
    *,
    with_entropy: bool = False,
    correction: Tensor | None = None,
) -> _MiniBatchStats:
    r"""Backpropagate ``objective``'s loss of the mini-batch ``rows`` into ``.grad`` (summed
    over micro-batches of ``micro_batch`` rows).

    Each micro-batch loss uses the mini-batch's normalisers (``num_sequences = |rows|``,
    ``num_tokens`` = valid tokens of ``rows``, ``max_len = L_max``), so
    :math:`\sum_{\text{micro}} \mathcal L_{\text{micro}} = \mathcal L_{\text{mini}}`
    and the accumulated gradient equals the one-batch gradient. ``correction``: the step's
    rollout-correction weights ``[N, T]`` (:mod:`gbmpo.train.correction`), which multiply the
    surrogate of each token.
    """
    mask = batch.completion_mask.float()
    n_seq, n_tok = len(rows), float(mask[rows].sum())
    stats = _MiniBatchStats(logp=torch.zeros(len(rows), mask.shape[1], device=mask.device))
    full_loss_terms = full_terms(objective.loss_terms)
    # the rows on the host once per mini-batch, so that the loop below reads nothing back: the
    # metrics stay on the device until every micro-batch's backward is queued
    micros = list(zip(_split_list(rows.tolist(), micro_batch), rows.split(micro_batch),
                      strict=True))
    packs, tokens, entropy_sums, corrections = [], [], [], []
    layout = None
    offset = 0
    for host, micro in micros:
        sub = batch.select(host, index=micro)
        m = mask[micro]
        full_values: dict[str, Tensor] = {}  # estimator full: per-token divergences, by term
        if full_loss_terms:
            logp, entropy, full_values = logprobs_and_full(
                models, sub, m, full_loss_terms, with_entropy=with_entropy
            )
        else:
            logp, entropy = models.logprobs(models.model, sub, with_entropy=with_entropy)
        old = old_logp[micro] if old_logp is not None else None
        anchors = {  # each term's anchor: the frozen reference, or the rollout policy (RPG)
            "ref": ref_logp[micro] if ref_logp is not None else None,
            "old": old if old is not None else logp.detach(),
        }
        weights, corrected = micro_correction(
            cfg.objective.rollout_correction,
            None if correction is None else correction[micro],
            None if batch.sampling_logp is None else batch.sampling_logp[micro],
            logp, advantages[micro], m,
        )  # fmt: skip
        loss, packed, layout = policy_loss_packed(
            objective, cfg.rollout.max_new_tokens, logp, old, anchors, advantages[micro], m,
            n_seq, n_tok, full_values=full_values, token_weights=weights,
        )  # fmt: skip
        loss.backward()
        packs.append(packed.detach())
        tokens.append(m.sum())
        corrections.append(corrected)
        if entropy is not None:
            entropy_sums.append((entropy * m).sum())
        stats.logp[offset : offset + len(host)] = logp.detach()
        offset += len(host)
    # one read back for every micro-batch: its metrics, valid tokens and entropy sum
    k = len(packs)
    values = torch.cat([torch.stack(packs).flatten(),
                        torch.stack([*tokens, *entropy_sums]).to(torch.float64)]).tolist()
    width = packs[0].numel() if packs else 0
    for i in range(k):
        # the micro-batch losses are parts of the mini-batch loss: they add up
        metrics = unpack_metrics(values[i * width : (i + 1) * width], layout)
        metrics.update(corrections[i])
        stats.loss += metrics.pop("loss")
        stats.pg_loss += metrics.pop("pg_loss")
        if diag is not None:
            diag.add(per_term_breakdown(objective, metrics), values[k * width + i])
    for e in values[k * width + k :]:
        stats.entropy_sum += e
    return stats


def _split_list(items: list[int], size: int) -> list[list[int]]:
    return [items[s : s + size] for s in range(0, len(items), size)]


def policy_loss(
    objective: BuiltObjective,
    max_len: int,
    logp: Tensor,
    old: Tensor | None,
    anchors: dict[str, Tensor | None],
    advantages: Tensor,
    mask: Tensor,
    num_sequences: int,
    num_tokens: float,
    *,
    full_values: dict[str, Tensor] | None = None,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """``objective``'s loss (:func:`gbmpo.objectives.compute_policy_loss`) of one micro-batch,
    normalised as its mini-batch (``num_sequences``, ``num_tokens``, ``max_len`` =
    ``rollout.max_new_tokens``): the surrogate plus the terms placed in the loss
    (:func:`gbmpo.objectives.loss.loss_terms`), each with its anchor's log-probs (``anchors``:
    ``ref`` / ``old``); ``full_values``: the per-token values of the terms with ``estimator:
    full``, by name, used instead of their sampled-token formulas; ``token_weights``: constants
    multiplying the surrogate per token, the rollout correction."""
    loss, packed, layout = policy_loss_packed(
        objective, max_len, logp, old, anchors, advantages, mask, num_sequences, num_tokens,
        full_values=full_values, token_weights=token_weights,
    )  # fmt: skip
    return loss, unpack_metrics(packed.tolist(), layout)


def policy_loss_packed(
    objective: BuiltObjective,
    max_len: int,
    logp: Tensor,
    old: Tensor | None,
    anchors: dict[str, Tensor | None],
    advantages: Tensor,
    mask: Tensor,
    num_sequences: int,
    num_tokens: float,
    *,
    full_values: dict[str, Tensor] | None = None,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, Tensor, Any]:
    """:func:`policy_loss` with its metrics left on the device: ``(loss, packed, layout)``
    (:func:`gbmpo.objectives.loss.compute_policy_loss_packed`), so that the micro-batch loop
    reads nothing back."""
    return compute_policy_loss_packed(
        logp=logp, old_logp=old, advantages=advantages, mask=mask, surrogate=objective.surrogate,
        terms=loss_terms(objective.terms, anchors, full_values), aggregation=objective.aggregation,
        max_len=max_len, num_sequences=num_sequences, num_tokens=num_tokens,
        token_weights=token_weights,
    )  # fmt: skip


@torch.no_grad()
def no_grad_logprobs(models: PolicyModels, batch: Rollout, rows_per_pass: int, *,
                     reference: bool) -> Tensor:  # fmt: skip
    """log pi_old (current weights) or log pi_ref (frozen copy / adapters disabled), in
    chunks of ``rows_per_pass`` rows (the step's ``BatchSizes.inference``: at least the
    micro-batch, as no backward is pending; :func:`gbmpo.train.memory.inference_rows`), eval
    mode, without gradients (inference mode measured no faster here, and the device-placement
    simulation cannot follow it)."""
    parts = []
    for rows in _chunks(len(batch), rows_per_pass):
        sub = batch.select(rows)
        with models.scoring(reference=reference) as model:
            logp, _ = models.logprobs(model, sub)
        parts.append(logp)
    return torch.cat(parts)
