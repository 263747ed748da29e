r"""One RL step, top to bottom (:func:`train_step`).

Per step, with :math:`P` prompts and :math:`G` completions each (:math:`N = PG` sequences):

1. sample :math:`P` prompts :math:`q_g` from the training split (seeded permutation);
2. sample :math:`o_{g,1..G} \sim \pi_{\theta_{\text{old}}}(\cdot\mid q_g)` (``rollout.generator``);
3. rewards :math:`r_i = R(q, o_i)` from the task (per-sample failures -> 0, counted);
4. behaviour log-probs :math:`\log\pi_{\text{old}}` (only when the policy moves before the batch
   is used up, or a regularizer term is placed in the reward) and reference log-probs
   :math:`\log\pi_{\text{ref}}` (only when needed); with ``objective.rollout_correction`` the
   sampler's log-probs :math:`\log\mu` too, and the weights :math:`w = f(\pi_{old}/\mu)` that
   multiply each token's surrogate (:mod:`gbmpo.train.correction`);
5. the terms placed in the reward: :math:`\tilde r_i = r_i - \sum_k \beta_k \sum_t
   D^{(k)}_{i,t}(\pi_{old}\,\|\,\pi_{ref})` (detached); then group advantages
   :math:`A_i = (\tilde r_i - \bar{\tilde r}_g)` [:math:`/\,(\sigma_g+\epsilon)`]; then the
   terms placed in the advantage: :math:`A_{i,t} = A_i - \sum_k \beta_k \sum_{s\ge t}
   D^{(k)}_{i,s}` (detached, after the normalisation: FRPO);
6. ``mu`` epochs over mini-batches, each a gradient-accumulated sum over micro-batches of
   :math:`\mathcal L = \mathrm{agg}(\ell^{\text{surr}}_{i,t} + \sum_k \lambda_k D^{(k)}_{i,t})`
   (the terms placed in the loss) with the mini-batch's normalisers, so accumulation is exact;
   AdamW step after grad-norm clipping. A term with ``estimator: full`` uses the exact
   divergence over the vocabulary instead of its sampled-token formula, from the policy's and
   the reference's logits of each micro-batch (:mod:`gbmpo.train.exact`);
7. metrics.

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

from gbmpo.rewards.scoring import score_completions
from gbmpo.rollout.sampling import Rollout, generate
from gbmpo.train.batching import _Accumulator, _chunks, _MiniBatchStats, derive_seed, row_order
from gbmpo.train.correction import micro_correction, sampler_weights
from gbmpo.train.device import peak_memory_bytes
from gbmpo.train.exact import full_terms, logprobs_and_exact, sequence_exact, token_exact
from gbmpo.train.precision import MasterWeightOptimizer

if TYPE_CHECKING:
    from gbmpo.train.trainer import Trainer

__all__ = ["accumulate_gradients", "no_grad_logprobs", "train_step"]


def train_step(tr: Trainer) -> dict[str, Any]:
    """One RL step (sections 1-7 of the module docstring); returns its metrics."""
    cfg, ro, opt = tr.config, tr.config.rollout, tr.config.optim
    G = ro.num_generations
    t_start = time.perf_counter()

    # 1. prompts: the next P examples of the seeded permutation of the training split
    examples = [tr.train_data[i] for i in tr.sampler.take(ro.prompts_per_step)]
    prompts = [ex["prompt"] for ex in examples]

    # 2. G completions per prompt, o_{g,j} ~ pi_old(.|q_g); rows g*G..g*G+G-1 = prompt g
    batch = generate(
        tr.model, tr.tokenizer, prompts,
        num_return_sequences=G, max_new_tokens=ro.max_new_tokens, do_sample=True,
        temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k,
        generator_seed=derive_seed(cfg.run.seed, "rollout", tr.step),  # same seed, same samples
        batch_size=ro.batch_size, engine=ro.generator, lean_decoder=ro.lean_decoder,
        return_logprobs=cfg.objective.rollout_correction.active,  # the sampler's log mu
    ).to(tr.device)
    t_generated = time.perf_counter()
    mask = batch.completion_mask.float()
    n = len(batch)

    # 3. rewards r_i = R(q_i, o_i) on plain Python values; per-sample failures -> 0 (counted)
    columns = {
        k: [v for v in col for _ in range(G)] for k, col in tr.task.columns(examples).items()
    }
    scored = score_completions(
        tr.reward_fn, [p for p in prompts for _ in range(G)], batch.texts, columns
    )
    rewards = torch.tensor(scored.rewards, dtype=torch.float32, device=tr.device)
    tr.reward_failures_total += scored.failures

    # 4. log pi_old only if the policy moves before the batch is used up (mu > 1 or several
    #    mini-batches); log pi_ref only if the regularizer (or monitoring) needs it
    old_logp = no_grad_logprobs(tr, batch, reference=False) if tr.needs_old else None
    ref_logp = no_grad_logprobs(tr, batch, reference=True) if tr.needs_ref else None
    # rollout correction: w = f(pi_old / mu) of the trainer's vs the sampler's log-probs
    correction = sampler_weights(cfg.objective.rollout_correction, batch, old_logp, mask)

    # 5. terms placed in the reward: r_i - beta_k * sum_t D_k(pi_old || pi_ref) (detached), then
    #    group advantages: A_i = r_i - mean_g(r)  [/ (std_g + eps) for "grpo"]
    shaped, penalties = rewards, {}
    rollout = old_logp
    if tr.objective.reward_terms or tr.objective.advantage_terms:
        rollout = old_logp if old_logp is not None else no_grad_logprobs(tr, batch, reference=False)
    if tr.objective.reward_terms:
        shaped, penalties = in_reward_penalties(tr, rewards, rollout, ref_logp, mask, batch)
    advantages = tr.objective.advantage(shaped, G)
    adv_penalties: dict[str, Tensor] = {}
    if tr.objective.advantage_terms:  # FRPO: - beta * sum_{s >= t} D_s, after normalisation
        advantages, adv_penalties = in_advantage_penalties(
            tr, advantages, rollout, ref_logp, mask, batch
        )
    t_ref = time.perf_counter()

    # 6. mu epochs x mini-batches (one AdamW step each) x micro-batches (accumulated):
    #    L_mb = agg(l_surr + coef * D) with the mini-batch's normalisers (B_mb, tokens_mb,
    #    L_max), so the micro-batch losses sum exactly to the mini-batch loss.
    tr.model.train()
    diag = _Accumulator.empty()
    rollout_logp = (
        torch.zeros(n, mask.shape[1], device=tr.device) if old_logp is None else old_logp
    )
    entropy_sum = 0.0
    grad_norms: list[float] = []
    losses: list[float] = []
    pg_losses: list[float] = []
    lr = tr.lr_at()
    for group in tr.optimizer.param_groups:
        group["lr"] = lr
    for epoch in range(opt.mu):
        order = row_order(n, tr.mini_batch, cfg.run.seed, tr.step, epoch, tr.device)
        for rows in order.split(tr.mini_batch):
            tr.optimizer.zero_grad(set_to_none=True)
            stats = accumulate_gradients(
                tr, batch, rows, advantages, old_logp, ref_logp, diag, with_entropy=epoch == 0,
                correction=correction,
            )
            if isinstance(tr.optimizer, MasterWeightOptimizer):
                tr.optimizer.grads_to_masters()  # clip and step in fp32
            # g <- g * min(1, c / ||g||), then AdamW
            max_norm = opt.grad_clip if opt.grad_clip is not None else math.inf
            grad_norms.append(float(torch.nn.utils.clip_grad_norm_(tr.clip_params, max_norm)))
            tr.optimizer.step()
            losses.append(stats.loss)
            pg_losses.append(stats.pg_loss)
            entropy_sum += stats.entropy_sum
            if old_logp is None:  # on-policy: the current log-probs are pi_old's
                rollout_logp[rows] = stats.logp
    tr.optimizer.zero_grad(set_to_none=True)

    # 7. metrics
    tr.step += 1
    t_end = time.perf_counter()
    step_seconds = t_end - t_start
    tr.rl_seconds += step_seconds
    n_tokens = float(mask.sum())
    group_std = rewards.view(-1, G).std(dim=1, unbiased=False)
    record: dict[str, Any] = {
        "step": tr.step,
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std(unbiased=False)),
        "accuracy": float((rewards >= 1.0).float().mean()),
        "frac_reward_zero_std": float((group_std == 0).float().mean()),
        "reward_failures": scored.failures,
        "reward_failures_total": tr.reward_failures_total,
        "response_length_mean": n_tokens / n,
        "response_length_max": int(max(batch.num_tokens)),
        "truncated_frac": sum(batch.truncated) / n,
        "advantage_abs_mean": float(
            advantages.abs().mean() if advantages.dim() == 1
            else (advantages.abs() * mask).sum() / mask.sum().clamp_min(1.0)
        ),
        "loss": sum(losses) / len(losses),
        "pg_loss": sum(pg_losses) / len(pg_losses),
        "entropy": entropy_sum / max(n_tokens, 1.0),
        "lr": lr,
        "grad_norm": sum(grad_norms) / len(grad_norms),
        "grad_norm_max": max(grad_norms),
    }
    record.update(diag.result())
    if penalties:  # reward_mean stays the task's reward; the penalty is logged beside it
        total = sum(penalties.values())
        record["reward_penalty"] = float(total.mean())
        if len(tr.objective.terms) > 1:
            for name, value in penalties.items():
                record[f"reward_penalty/{name}"] = float(value.mean())
    if adv_penalties:  # the mean per-sequence penalty beta * sum_t D_t (its value at t = 0)
        record["advantage_penalty"] = float(sum(adv_penalties.values()).mean())
        if len(tr.objective.terms) > 1:
            for name, value in adv_penalties.items():
                record[f"advantage_penalty/{name}"] = float(value.mean())
    if ref_logp is not None and tr.objective.monitors:
        # value of every registered regularizer at pi_old, vs the frozen reference
        from gbmpo.objectives.tensors import masked_mean

        with torch.no_grad():
            for name, reg in tr.objective.monitors.items():
                values = reg(
                    logp=rollout_logp, old_logp=rollout_logp, ref_logp=ref_logp, mask=mask
                )
                record[f"reg/{name}"] = float(masked_mean(values, mask))
    record["step_seconds"] = step_seconds
    record["tokens_per_second"] = n_tokens / max(step_seconds, 1e-9)
    record["time/generate_seconds"] = t_generated - t_start
    record["time/logprob_seconds"] = t_ref - t_generated
    record["time/update_seconds"] = t_end - t_ref
    record["time/rl_seconds"] = tr.rl_seconds
    peak = peak_memory_bytes(tr.device)
    if peak is not None:
        record["memory/peak_gib"] = peak / 2**30
    return record


def in_reward_penalties(
    tr: Trainer, rewards: Tensor, rollout_logp: Tensor, ref_logp: Tensor | None, mask: Tensor,
    batch: Rollout | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The rewards minus the penalties of the terms placed in the reward
    (:func:`gbmpo.objectives.loss.reward_penalty`) and each term's per-sequence penalty
    ``beta_k * sum_t D_k(pi_old || pi_ref)`` ([N], by name); a term with ``estimator: full``
    takes the exact divergence from the logits of ``batch`` (:func:`gbmpo.train.exact.
    sequence_exact`)."""
    from gbmpo.objectives.loss import reward_penalty, sequence_divergence

    terms = tr.objective.reward_terms
    full = full_terms(terms)  # estimator full: the exact divergence from the logits
    exact = sequence_exact(tr, batch, full, mask) if full else {}
    penalties: dict[str, Tensor] = {}
    for term in terms:
        seq = exact.get(term.name)
        if seq is None:
            seq = sequence_divergence(
                term.regularizer, rollout_logp=rollout_logp, ref_logp=ref_logp, mask=mask
            )
        penalties[term.name] = term.coef * seq.to(rewards.dtype)
    shaped = reward_penalty(rewards, [(1.0, p) for p in penalties.values()])
    return shaped, penalties


def in_advantage_penalties(
    tr: Trainer, advantages: Tensor, rollout_logp: Tensor, ref_logp: Tensor | None,
    mask: Tensor, batch: Rollout | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The per-token advantages minus each ``placement: advantage`` term's future penalty
    ``beta_k * sum_{s >= t} D_k,s(pi_old || pi_ref)`` (:func:`gbmpo.objectives.placement.
    advantage_penalty`, after the normalisation), and each term's per-sequence penalty
    ``beta_k * sum_t D_k,t`` ([N], by name); a term with ``estimator: full`` takes the exact
    per-token divergence from the logits of ``batch``."""
    from gbmpo.objectives.placement import advantage_penalty

    terms = tr.objective.advantage_terms
    full = full_terms(terms)
    exact = token_exact(tr, batch, full, mask) if full else {}
    pairs: list[tuple[float, Tensor]] = []
    totals: dict[str, Tensor] = {}
    m = mask.to(torch.bool)
    for term in terms:
        values = exact.get(term.name)
        if values is None:
            with torch.no_grad():
                old = rollout_logp.detach()
                values = term.regularizer(logp=old, old_logp=old, ref_logp=ref_logp, mask=mask)
        values = torch.where(m, values, torch.zeros((), dtype=values.dtype,
                                                    device=values.device))
        pairs.append((term.coef, values))
        totals[term.name] = term.coef * values.sum(-1)
    return advantage_penalty(advantages, pairs, mask), totals


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
    anchor_old = tr.objective.anchor == "old"
    n_seq, n_tok = len(rows), float(mask[rows].sum())
    stats = _MiniBatchStats(logp=torch.zeros(len(rows), mask.shape[1], device=mask.device))
    exact_terms = full_terms(tr.objective.loss_terms)
    offset = 0
    for micro in rows.split(tr.micro_batch):
        m = mask[micro]
        exact: dict[str, Tensor] = {}  # estimator full: per-token exact divergences, by term
        if exact_terms:
            logp, entropy, exact = logprobs_and_exact(
                tr, batch.select(micro), m, exact_terms, with_entropy=with_entropy
            )
        else:
            logp, entropy = tr.logprobs(tr.model, batch.select(micro), with_entropy=with_entropy)
        old = old_logp[micro] if old_logp is not None else None
        if anchor_old:  # RPG-style iterative reference: the rollout policy
            anchor = old if old is not None else logp.detach()
        else:
            anchor = ref_logp[micro] if ref_logp is not None else None
        anchors = {  # each term's own anchor, for a sum of terms
            "ref": ref_logp[micro] if ref_logp is not None else None,
            "old": old if old is not None else logp.detach(),
        }
        weights, corrected = micro_correction(
            tr.config.objective.rollout_correction,
            None if correction is None else correction[micro],
            None if batch.sampling_logp is None else batch.sampling_logp[micro],
            logp, advantages[micro], m,
        )  # fmt: skip
        loss, metrics = policy_loss(
            tr, logp, old, anchor, advantages[micro], m, n_seq, n_tok, anchors=anchors,
            exact=exact, token_weights=weights,
        )  # fmt: skip
        metrics.update(corrected)
        loss.backward()
        # the micro-batch losses are parts of the mini-batch loss: they add up
        stats.loss += metrics.pop("loss")
        stats.pg_loss += metrics.pop("pg_loss")
        if diag is not None:
            diag.add(metrics, float(m.sum()))
        if entropy is not None:
            stats.entropy_sum += float((entropy * m).sum())
        stats.logp[offset : offset + len(micro)] = logp.detach()
        offset += len(micro)
    return stats


def policy_loss(
    tr: Trainer,
    logp: Tensor,
    old: Tensor | None,
    anchor: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    num_sequences: int,
    num_tokens: float,
    *,
    anchors: dict[str, Tensor | None] | None = None,
    exact: dict[str, Tensor] | None = None,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The configured objective (:func:`gbmpo.objectives.compute_policy_loss`) of one
    micro-batch, normalised as its mini-batch: the surrogate plus the terms placed in the loss
    (``anchor``: the single term's anchor log-probs; ``anchors``: ``ref`` / ``old`` log-probs,
    each term taking its own, for a sum of terms; ``exact``: the per-token values of the terms
    with ``estimator: full``, by name, used instead of their sampled-token formulas;
    ``token_weights``: constants multiplying the surrogate per token, the rollout correction)."""
    from gbmpo.objectives import compute_policy_loss
    from gbmpo.objectives.estimators import ExactValues

    exact = exact or {}

    def regularizer_of(name: str, sampled: Any) -> Any:
        return ExactValues(name, exact[name]) if name in exact else sampled

    o = tr.objective
    common: dict[str, Any] = {
        "surrogate": o.surrogate, "aggregation": o.aggregation,
        "max_len": tr.config.rollout.max_new_tokens,
        "num_sequences": num_sequences, "num_tokens": num_tokens, "token_weights": token_weights,
    }  # fmt: skip
    if o.single_loss_term:  # one regularizer in the loss
        return compute_policy_loss(
            logp=logp, old_logp=old, ref_logp=anchor, advantages=advantages, mask=mask,
            regularizer=regularizer_of(o.terms[0].name, o.regularizer), coef=o.coef, **common,
        )  # fmt: skip
    # a sum of terms, or terms placed in the reward (which add nothing to the loss)
    from gbmpo.objectives.loss import LossTerm

    by_anchor = anchors if anchors is not None else {o.anchor: anchor}
    for t in o.loss_terms:
        if t.anchor not in by_anchor:
            raise ValueError(f"term {t.name!r} is anchored on {t.anchor!r}: pass anchors=")
    terms = [LossTerm(t.name, regularizer_of(t.name, t.regularizer), t.coef, by_anchor[t.anchor])
             for t in o.loss_terms]
    return compute_policy_loss(
        logp=logp, old_logp=old, ref_logp=None, advantages=advantages, mask=mask,
        regularizer=None, terms=terms, **common,
    )  # fmt: skip


@torch.no_grad()
def no_grad_logprobs(tr: Trainer, batch: Rollout, *, reference: bool) -> Tensor:
    """log pi_old (current weights) or log pi_ref (frozen copy / adapters disabled), in
    micro-batches, eval mode, no grad."""
    parts = []
    for rows in _chunks(len(batch), tr.micro_batch):
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
