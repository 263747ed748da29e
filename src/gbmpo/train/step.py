r"""One RL step, top to bottom (:func:`train_step`).

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
   :func:`gbmpo.train.policy_loss.policy_loss`). A term with ``estimator: full`` uses the exact
   divergence over the vocabulary instead of its sampled-token formula, from the policy's and
   the reference's logits of each micro-batch (:mod:`gbmpo.train.full`);
7. metrics (:func:`gbmpo.train.step_metrics.step_record`); then each controlled coefficient
   moves from the drift this step measured (:mod:`gbmpo.train.drift`).

``tr`` is the :class:`~gbmpo.train.Trainer` holding the model, optimizer and objectives; every
tensor of the step lives on its device (``tr.device``).
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from gbmpo.objectives.loss import unpack_metrics
from gbmpo.rewards.scoring import score_completions
from gbmpo.rollout.sampling import Rollout, generate
from gbmpo.train.batching import _Accumulator, _chunks, _MiniBatchStats, derive_seed, row_order
from gbmpo.train.correction import micro_correction, sampler_weights
from gbmpo.train.device import device_memory_bytes
from gbmpo.train.drift import control_drift
from gbmpo.train.full import full_terms, logprobs_and_full
from gbmpo.train.memory import memory_plan
from gbmpo.train.penalties import in_advantage_penalties, in_reward_penalties
from gbmpo.train.policy_loss import policy_loss_packed
from gbmpo.train.precision import MasterWeightOptimizer
from gbmpo.train.step_metrics import StepTimes, UpdateStats, per_term_breakdown, step_record

if TYPE_CHECKING:
    from gbmpo.train.trainer import Trainer

__all__ = [
    "accumulate_gradients",
    "no_grad_logprobs",
    "plan_batches",
    "planned_batches",
    "train_step",
]


def train_step(tr: Trainer) -> dict[str, Any]:
    """One RL step (sections 1-7 of the module docstring); returns its metrics."""
    t_start = time.perf_counter()
    examples = [tr.train_data[i] for i in tr.sampler.take(tr.config.rollout.prompts_per_step)]
    batch = sample_completions(tr, [ex["prompt"] for ex in examples])  # 1, 2
    plan_batches(tr, batch)
    t_generated = time.perf_counter()
    rewards, failures = score(tr, examples, batch)  # 3
    old_logp = no_grad_logprobs(tr, batch, reference=False) if tr.needs_old else None  # 4
    ref_logp = no_grad_logprobs(tr, batch, reference=True) if tr.needs_ref else None
    mask = batch.completion_mask.float()
    # rollout correction: w = f(pi_old / mu) of the trainer's vs the sampler's log-probs
    correction = sampler_weights(tr.config.objective.rollout_correction, batch, old_logp, mask)
    advantages, penalties, adv_penalties = shaped_advantages(  # 5
        tr, rewards, batch, old_logp, ref_logp
    )
    t_scored = time.perf_counter()
    update = optimise(tr, batch, advantages, old_logp, ref_logp, correction)  # 6
    tr.step += 1
    times = StepTimes(t_start, t_generated, t_scored, time.perf_counter())
    record = step_record(tr, batch, rewards, failures, advantages, penalties,  # 7
                         adv_penalties, ref_logp, update, times)  # fmt: skip
    control_drift(tr, record)  # the controlled coefficients of the next step
    return record


def sample_completions(tr: Trainer, prompts: list[Any]) -> Rollout:
    r"""G completions per prompt, :math:`o_{g,j} \sim \pi_{old}(\cdot\mid q_g)` from
    ``rollout.generator``; rows ``g*G .. g*G+G-1`` are prompt ``g``'s. The seed depends on the
    run's seed and the step only, so a resumed run samples the same completions."""
    cfg, ro = tr.config, tr.config.rollout
    return generate(
        tr.model, tr.tokenizer, prompts,
        num_return_sequences=ro.num_generations, max_new_tokens=ro.max_new_tokens,
        do_sample=True, temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k,
        generator_seed=derive_seed(cfg.run.seed, "rollout", tr.step),
        batch_size=ro.batch_size, generator=ro.generator, lean_decoder=ro.lean_decoder,
        decode_step=ro.decode_step,
        return_logprobs=cfg.objective.rollout_correction.active,  # the sampler's log mu
    ).to(tr.device)  # fmt: skip


def plan_batches(tr: Trainer, batch: Rollout) -> None:
    """On CUDA with ``optim.micro_batch_size: null``: ``tr.micro_batch`` and
    ``tr.inference_batch`` from the memory plan of this step's prompt width rounded up to a
    multiple of 64 tokens (:func:`planned_batches`, planned once per such width: a plan builds
    the model's shape on the meta device, and rounding up only plans more memory); elsewhere
    they stay as configured (the CPU keeps the mini-batch, as before)."""
    if tr.config.optim.micro_batch_size is not None or tr.device.type != "cuda":
        return
    width = -(-int(batch.prompt_ids.shape[1]) // 64) * 64
    if width not in tr.batch_plans:
        tr.batch_plans[width] = planned_batches(tr, width, device_memory_bytes(str(tr.device)))
    tr.micro_batch, tr.inference_batch = tr.batch_plans[width]


def planned_batches(tr: Trainer, prompt_tokens: int, device_bytes: int | None
                    ) -> tuple[int, int]:  # fmt: skip
    """(micro-batch, rows per no-grad pass) that :func:`gbmpo.train.memory.memory_plan` plans
    for ``tr``'s config and model on a device of ``device_bytes`` with prompts of
    ``prompt_tokens`` tokens (the configured ones without a device size)."""
    if device_bytes is None:
        return tr.micro_batch, tr.inference_batch
    plan = memory_plan(tr.config, tr.model.config, prompt_tokens,
                       needs_ref=tr.ref_model is not None, device_bytes=device_bytes)
    micro = int(plan["micro_batch_rows"])
    return micro, max(micro, int(plan["inference_rows"] or micro))


def score(tr: Trainer, examples: list[dict[str, Any]], batch: Rollout) -> tuple[Tensor, int]:
    """Rewards :math:`r_i = R(q_i, o_i)` ``[N]`` on plain Python values and the number of
    per-sample failures (scored 0, counted in ``tr.reward_failures_total``)."""
    G = tr.config.rollout.num_generations
    columns = {k: [v for v in col for _ in range(G)]
               for k, col in tr.task.columns(examples).items()}  # fmt: skip
    prompts = [ex["prompt"] for ex in examples for _ in range(G)]
    scored = score_completions(tr.reward_fn, prompts, batch.texts, columns)
    tr.reward_failures_total += scored.failures
    return torch.tensor(scored.rewards, dtype=torch.float32, device=tr.device), scored.failures


def shaped_advantages(
    tr: Trainer, rewards: Tensor, batch: Rollout, old_logp: Tensor | None,
    ref_logp: Tensor | None,
) -> tuple[Tensor, dict[str, Tensor], dict[str, Tensor]]:
    r"""Advantages with the terms placed outside the loss: the rewards minus the in-reward
    penalties :math:`\beta_k \sum_t D_k(\pi_{old}\,\|\,\pi_{ref})` (detached), the group
    advantages of those, minus the in-advantage future penalties (after the normalisation:
    FRPO). Returns the advantages and each placement's per-sequence penalties by term."""
    o, mask = tr.objective, batch.completion_mask.float()
    rollout = old_logp
    if rollout is None and (o.reward_terms or o.advantage_terms):
        rollout = no_grad_logprobs(tr, batch, reference=False)
    shaped, penalties = rewards, {}
    if o.reward_terms:
        assert rollout is not None
        shaped, penalties = in_reward_penalties(tr, rewards, rollout, ref_logp, mask, batch)
    advantages = o.advantage(shaped, tr.config.rollout.num_generations)
    adv_penalties: dict[str, Tensor] = {}
    if o.advantage_terms:
        assert rollout is not None
        advantages, adv_penalties = in_advantage_penalties(
            tr, advantages, rollout, ref_logp, mask, batch
        )
    return advantages, penalties, adv_penalties


def optimise(
    tr: Trainer, batch: Rollout, advantages: Tensor, old_logp: Tensor | None,
    ref_logp: Tensor | None, correction: Tensor | None,
) -> UpdateStats:
    r"""``optim.mu`` epochs over seeded mini-batches, one AdamW step each after grad-norm
    clipping (:math:`g \leftarrow g \min(1, c/\|g\|)`), the gradient accumulated over
    micro-batches (:func:`accumulate_gradients`)."""
    cfg, opt = tr.config, tr.config.optim
    n, width = len(batch), batch.completion_mask.shape[1]
    tr.model.train()
    update = UpdateStats(
        lr=tr.lr_at(),
        rollout_logp=(torch.zeros(n, width, device=tr.device) if old_logp is None else old_logp),
    )
    for group in tr.optimizer.param_groups:
        group["lr"] = update.lr
    max_norm = opt.grad_clip if opt.grad_clip is not None else math.inf
    for epoch in range(opt.mu):
        order = row_order(n, tr.mini_batch, cfg.run.seed, tr.step, epoch, tr.device)
        for rows in order.split(tr.mini_batch):
            tr.optimizer.zero_grad(set_to_none=True)
            stats = accumulate_gradients(
                tr, batch, rows, advantages, old_logp, ref_logp, update.diag,
                with_entropy=epoch == 0, correction=correction,
            )  # fmt: skip
            if isinstance(tr.optimizer, MasterWeightOptimizer):
                tr.optimizer.grads_to_masters()  # clip and step in fp32
            update.grad_norms.append(
                float(torch.nn.utils.clip_grad_norm_(tr.clip_params, max_norm))
            )
            tr.optimizer.step()
            update.losses.append(stats.loss)
            update.pg_losses.append(stats.pg_loss)
            update.entropy_sum += stats.entropy_sum
            if old_logp is None:  # on-policy: the current log-probs are pi_old's
                update.rollout_logp[rows] = stats.logp
    tr.optimizer.zero_grad(set_to_none=True)
    return update


def accumulate_gradients(
    tr: Trainer,
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
    r"""Backpropagate the loss of the mini-batch ``rows`` into ``.grad`` (summed over
    micro-batches of ``optim.micro_batch_size`` rows).

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
    full_loss_terms = full_terms(tr.objective.loss_terms)
    # the rows on the host once per mini-batch, so that the loop below reads nothing back: the
    # metrics stay on the device until every micro-batch's backward is queued
    micros = list(zip(_split_list(rows.tolist(), tr.micro_batch), rows.split(tr.micro_batch),
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
                tr, sub, m, full_loss_terms, with_entropy=with_entropy
            )
        else:
            logp, entropy = tr.logprobs(tr.model, sub, with_entropy=with_entropy)
        old = old_logp[micro] if old_logp is not None else None
        anchors = {  # each term's anchor: the frozen reference, or the rollout policy (RPG)
            "ref": ref_logp[micro] if ref_logp is not None else None,
            "old": old if old is not None else logp.detach(),
        }
        weights, corrected = micro_correction(
            tr.config.objective.rollout_correction,
            None if correction is None else correction[micro],
            None if batch.sampling_logp is None else batch.sampling_logp[micro],
            logp, advantages[micro], m,
        )  # fmt: skip
        loss, packed, layout = policy_loss_packed(
            tr, logp, old, anchors, advantages[micro], m, n_seq, n_tok, full_values=full_values,
            token_weights=weights,
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
            diag.add(per_term_breakdown(tr, metrics), values[k * width + i])
    for e in values[k * width + k :]:
        stats.entropy_sum += e
    return stats


def _split_list(items: list[int], size: int) -> list[list[int]]:
    return [items[s : s + size] for s in range(0, len(items), size)]


@torch.no_grad()
def no_grad_logprobs(tr: Trainer, batch: Rollout, *, reference: bool) -> Tensor:
    """log pi_old (current weights) or log pi_ref (frozen copy / adapters disabled), in
    chunks of ``tr.inference_batch`` rows (at least the micro-batch: no backward is pending, so
    a pass can take more rows; :func:`gbmpo.train.memory.inference_rows`), eval mode, without
    gradients (inference mode measured no faster here, and the device-placement simulation
    cannot follow it)."""
    parts = []
    for rows in _chunks(len(batch), tr.inference_batch):
        sub = batch.select(rows)
        if reference and tr.ref_model is not None:
            logp, _ = tr.logprobs(tr.ref_model, sub)
        else:
            ctx = tr.model.disable_adapter() if reference else contextlib.nullcontext()
            was_training = tr.model.training
            tr.model.eval()
            with ctx:
                logp, _ = tr.logprobs(tr.model, sub)
            tr.model.train(was_training)
        parts.append(logp)
    return torch.cat(parts)
