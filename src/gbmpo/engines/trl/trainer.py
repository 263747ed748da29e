r"""``GBMPOTrainer``: TRL's ``GRPOTrainer`` whose per-micro-batch loss is gbmpo's objective
(:mod:`gbmpo.integrations.trl`), with gbmpo's metrics.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

import torch
import trl
from torch import Tensor
from trl import GRPOTrainer

from gbmpo.engines.trl.config import GBMPOConfig
from gbmpo.engines.trl.correction import log_rollout_correction
from gbmpo.engines.trl.formulas import (
    adaptive_entropy_coef,
    dapo_normalizer,
    entropy_bonus,
    window_means,
)
from gbmpo.engines.trl.full import (
    TRL_STD_EPS,
    logprobs_and_full,
    sequence_penalties,
    shaped_advantages,
)
from gbmpo.engines.trl.internals import (
    _FORWARD_KEYS,
    _TRAINER_ATTRIBUTES,
    SUPPORTED_TRL,
    TRLInternalsError,
    _quiet_host_warnings,
    check_trl_internals,
)
from gbmpo.engines.trl.objective import LOSS_TYPE_SURROGATES, build_objective
from gbmpo.io.metrics import DRIFT_COEF_PREFIX, DRIFT_MEASURE_PREFIX, MONITOR_PREFIX
from gbmpo.objectives.loss import LossTerm, compute_policy_loss, loss_terms
from gbmpo.objectives.regularizers import kl_k3
from gbmpo.objectives.spec import BuiltObjective
from gbmpo.objectives.tensors import masked_mean

__all__ = ["DRIFT_STATE_FILE", "GBMPOTrainer"]

#: the controlled coefficients in a checkpoint directory, by term (JSON)
DRIFT_STATE_FILE = "gbmpo_drift_state.json"

#: Loss types whose TRL normaliser is the generation batch's token count (:func:`dapo_normalizer`).
_GLOBAL_TOKEN_LOSS_TYPES: tuple[str, ...] = ("dapo", "cispo", "vespo")


@dataclass(frozen=True)
class _PolicyForward:
    """One micro-batch's policy forward (:meth:`GBMPOTrainer._policy_forward`)."""

    #: sampled-token log-probs ``[B, T]`` (with grad)
    logp: Tensor
    #: per-token entropies ``[B, T]``
    entropies: Tensor
    #: the MoE router's auxiliary loss (``None`` unless TRL's ``aux_loss_enabled``)
    aux_loss: Tensor | None
    #: the valid completion tokens ``[B, T]`` (TRL's tool mask applied)
    mask: Tensor
    #: per-token values of the terms with ``estimator: full``, by name (empty without)
    full_values: dict[str, Tensor]


def _valid_tokens(batch: dict[str, Any]) -> Tensor:
    """The valid completion tokens of one buffered micro-batch (TRL's tool mask applied)."""
    mask = batch["completion_mask"]
    if batch.get("tool_mask") is not None:
        mask = mask * batch["tool_mask"]
    return mask.sum().float()


def _one_input_grad_hook(model: Any) -> None:
    """Make ``model.enable_input_require_grads`` replace its previous hooks instead of adding
    to them. transformers 5 registers a new forward hook on the input embeddings at every
    activation-checkpointing enable and removes them on disable only for its own PEFT
    integration, and TRL 1.16 re-enables checkpointing after every generation and every
    no-grad log-prob pass: the hooks pile up (two a step; each sets ``requires_grad`` on the
    same output, so one does what many do), and ``torch.compile`` guards on their number, so a
    compiled decode step would be recompiled at every generation."""
    enable = model.enable_input_require_grads

    def enable_replacing() -> None:
        model.disable_input_require_grads()
        enable()

    model.enable_input_require_grads = enable_replacing


class GBMPOTrainer(GRPOTrainer):
    r"""``GRPOTrainer`` whose loss is gbmpo's (:mod:`gbmpo.integrations.trl`); same constructor.

    ``args`` must be a :class:`GBMPOConfig` (``None`` builds a default one, like TRL).
    ``_compute_loss`` is gbmpo's; generation, rewards, reference and old log-probs, vLLM importance
    ratios and the rest stay TRL's, with three additions (:mod:`gbmpo.engines.trl.full`): a term
    with ``estimator: full`` takes the exact divergence from each micro-batch's policy logits and a
    no-grad reference forward; a ``placement: reward`` term's detached per-sequence penalty is
    subtracted from the rewards before TRL's advantages; ``loss_type="bnpo"`` divides by the
    optimizer step's valid tokens over every process (the own engine's mini-batch token mean).

    Metrics (averaged over processes by token count): TRL's names with TRL's definitions, gbmpo's
    under the run directory's names (:mod:`gbmpo.io.metrics`; both listed in docs/engines.md), and
    ``reward_penalty`` with in-reward terms. ``use_adaptive_entropy`` runs TRL's controller
    (:func:`adaptive_entropy_coef`) on TRL's checkpointed state. A term with ``control`` moves its
    coefficient after the last micro-step on a generation batch, from the batch's token mean of
    :math:`D(\pi_{old}\,\|\,\pi_{ref})` on every process (:meth:`_control_drift`), logs
    ``drift_coef/<term>`` and ``drift_measure/<term>``, and saves the coefficients in each
    checkpoint (:data:`DRIFT_STATE_FILE`), restored on resume."""

    _tag_names = ["trl", "grpo", "gbmpo"]

    def __init__(
        self,
        model: Any,
        reward_funcs: Any = None,
        args: GBMPOConfig | None = None,
        *trl_args: Any,
        **trl_kwargs: Any,
    ) -> None:
        check_trl_internals()
        _quiet_host_warnings()
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = GBMPOConfig(f"{os.path.basename(str(name).rstrip('/'))}-GBMPO")
        if not isinstance(args, GBMPOConfig):
            raise TypeError(
                f"GBMPOTrainer needs a GBMPOConfig, got {type(args).__name__}; build one with "
                "the same fields plus gbmpo's (regularizer, regularizer_coef, clip_mode, ...)"
            )
        self._gbmpo = build_objective(args)
        super().__init__(model, reward_funcs, args, *trl_args, **trl_kwargs)
        for attr in _TRAINER_ATTRIBUTES:
            if not hasattr(self, attr):
                raise TRLInternalsError(
                    f"GRPOTrainer.__init__ no longer sets self.{attr} (TRL {trl.__version__}); "
                    f"GBMPOTrainer reads it and supports trl{SUPPORTED_TRL}"
                )
        if self.beta != args.beta:  # pragma: no cover - guarded by check_trl_internals
            raise TRLInternalsError("GRPOTrainer.__init__ no longer copies args.beta to self.beta")
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        _one_input_grad_hook(base)  # TRL re-enables checkpointing twice a step
        if args.compile_generation:
            self._allow_generation_compile()

    def _allow_generation_compile(self) -> None:
        """``compile_generation``: clear the ``disable_compile`` TRL sets on the generation
        config it passes to ``generate``, so that transformers compiles the decode step (its
        own criteria: a static cache on CUDA; the CPU runs it uncompiled); the one
        input-gradient hook on the embeddings that ``__init__`` keeps
        (:func:`_one_input_grad_hook`) is what spares a recompilation at every generation."""
        generation_config = getattr(self, "generation_config", None)
        if generation_config is None:  # pragma: no cover - guarded by check_trl_internals
            raise TRLInternalsError(
                f"GRPOTrainer.__init__ no longer sets self.generation_config (TRL "
                f"{trl.__version__}); GBMPOTrainer's compile_generation needs it"
            )
        generation_config.disable_compile = False

    def _last_of_generation(self) -> bool:
        """Whether this micro-step is the last one on its generation batch (the last of
        ``steps_per_generation * num_iterations``; TRL advances ``_step`` after it): the end of
        the own engine's RL step, where a controlled coefficient moves."""
        return (self._step + 1) % (self.args.steps_per_generation * self.num_iterations) == 0

    def _first_pass(self) -> bool:
        """Whether this micro-step is in the first of the ``num_iterations`` passes over its
        generation batch (the ``entropy`` metric averages that pass only: the rollout policy's
        entropy on its own samples, the own engine's first epoch)."""
        per_generation = self.args.steps_per_generation
        return (self._step % (per_generation * self.num_iterations)) < per_generation

    def _prepare_inputs(self, generation_batch: Any) -> Any:
        """TRL's batch, plus (``loss_type="bnpo"``, training) ``mini_batch_tokens``: the valid
        tokens of the optimizer step this micro-batch belongs to, over every process, so that
        bnpo is the token mean of the optimizer step (the own engine's mini-batch) whatever the
        micro-batch size and the number of processes."""
        inputs = super()._prepare_inputs(generation_batch)
        if self.args.loss_type != "bnpo" or not self.model.training:
            return inputs
        buffers = self._buffered_inputs
        accum = self.args.gradient_accumulation_steps
        if getattr(self, "_mini_tokens_of", None) is not buffers:
            local = torch.stack([_valid_tokens(b) for b in buffers])
            groups = local.view(-1, accum).sum(dim=1)  # S / accum optimizer steps
            self._mini_tokens = self.accelerator.reduce(groups, reduction="sum")
            self._mini_tokens_of = buffers
        index = (self._step % self.args.steps_per_generation) // accum
        return {**inputs, "mini_batch_tokens": self._mini_tokens[index]}

    def _calculate_rewards(self, inputs: Any, prompts: Any, completions: Any,
                           completion_ids_list: Any) -> Tensor:  # fmt: skip
        """TRL's rewards (every process's), kept for the in-reward terms."""
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._rewards_per_func = rewards
        return rewards

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        r"""TRL's generation batch; with terms placed in the reward, its advantages are those of
        the shaped rewards :math:`r_i - \sum_k \beta_k S^{(k)}_i` (:func:`sequence_penalties`
        from the batch's rollout and reference log-probs, :func:`shaped_advantages` with TRL's
        formula), and ``reward_penalty`` (per term ``reward_penalty/<name>`` for several) is
        logged beside TRL's ``reward`` (the task's, as on the own engine)."""
        output = super()._generate_and_score_completions(inputs)
        terms = self._gbmpo.reward_terms
        if not terms:
            return output
        mode = "train" if self.model.training else "eval"
        rpf = self._rewards_per_func
        rewards = (rpf * self.reward_weights.to(rpf.device).unsqueeze(0)).nansum(dim=1)
        rewards[torch.isnan(rpf).all(dim=1)] = torch.nan  # unscorable: advantage 0, as TRL
        penalties = sequence_penalties(self, output, terms)
        local = sum(penalties.values())
        total = self.accelerator.gather(local.to(rewards.device))
        n = local.shape[0]
        group = self.num_generations if mode == "train" else self.num_generations_eval
        advantages = shaped_advantages(rewards, total, group, self.scale_rewards, TRL_STD_EPS)
        rank = self.accelerator.process_index
        output["advantages"] = advantages[rank * n : (rank + 1) * n].to(output["advantages"])
        self._metrics[mode]["reward_penalty"].append(float(total.mean()))
        if len(self._gbmpo.terms) > 1:
            for name, value in penalties.items():
                self._metrics[mode][f"reward_penalty/{name}"].append(
                    float(self.accelerator.gather(value.to(rewards.device)).mean())
                )
        return output

    @property
    def objective(self) -> BuiltObjective:
        """The built objective (surrogate, terms with their coefficients, aggregation,
        monitors): the object the own engine's trainer uses, from the spec as is."""
        return self._gbmpo

    # ---- the loss: named steps, read top to bottom --------------------------------------------

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> Tensor:
        """gbmpo's loss of one micro-batch in TRL's place: the policy forward, TRL's token
        weights of the surrogate, the terms placed in the loss with their anchors' log-probs,
        the objective with TRL's normalisers, TRL's entropy bonus and auxiliary loss, and the
        metrics."""
        obj = self._gbmpo
        mode = "train" if self.model.training else "eval"
        accum = self.current_gradient_accumulation_steps if mode == "train" else 1
        fwd = self._policy_forward(model, inputs)
        old_in = inputs.get("old_per_token_logps")
        old_logp = fwd.logp.detach() if old_in is None else old_in
        ref_logp = inputs.get("ref_per_token_logps")
        weights, entropy_mask = self._surrogate_weights(inputs, fwd, old_logp, mode)
        terms = self._loss_terms(ref_logp, old_logp, fwd.full_values)
        loss, m = compute_policy_loss(
            logp=fwd.logp,
            old_logp=old_logp,
            advantages=inputs["advantages"],
            mask=fwd.mask,
            surrogate=obj.surrogate,
            terms=terms,
            aggregation=obj.aggregation,
            max_len=int(self.args.max_completion_length) if obj.aggregation == "dr_grpo" else None,
            token_weights=weights,
            **self._normalisers(inputs, fwd, mode, accum),
        )
        loss = self._add_entropy_and_aux(loss, fwd, entropy_mask, accum, mode)
        self._log_gbmpo_metrics(mode, fwd, terms, ref_logp, old_logp, m, accum)
        self._log_trl_metrics(mode, fwd.logp.detach(), old_logp, inputs["advantages"], fwd.mask)
        if mode == "train" and ref_logp is not None:
            self._add_monitored_divergences(old_logp, ref_logp, fwd.mask)
        if mode == "train" and obj.controlled and self._last_of_generation():
            self._control_drift()
        return loss

    def _policy_forward(self, model: Any, inputs: dict[str, Any]) -> _PolicyForward:
        """The policy's sampled-token log-probs (with grad), entropies and MoE auxiliary loss:
        TRL's own helper (fused LM head, multimodal inputs), or, with terms of ``estimator:
        full`` in the loss, the completion logits (:func:`logprobs_and_full`), which also give
        those terms' per-token values."""
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        logits_to_keep = completion_ids.size(1)
        mask = completion_mask
        if "tool_mask" in inputs:
            mask = completion_mask * inputs["tool_mask"]
        full = self._gbmpo.full_loss_terms
        if not full:
            logp, entropies, aux_loss = self._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                logits_to_keep,
                compute_entropy=True,
                compute_aux_loss=self.aux_loss_enabled,
                **{k: inputs.get(k) for k in _FORWARD_KEYS},
            )
            return _PolicyForward(logp, entropies, aux_loss, mask, {})
        extra = [k for k in _FORWARD_KEYS if inputs.get(k) is not None]
        if extra:
            raise ValueError(
                f"estimator 'full' takes the logits of a text-only forward; this batch has "
                f"{', '.join(extra)}: use estimator 'sample' with multimodal inputs"
            )
        logp, entropies, aux_loss, full_values = logprobs_and_full(
            self, model, input_ids, attention_mask, logits_to_keep, completion_ids, mask, full,
            aux=self.aux_loss_enabled,
        )  # fmt: skip
        return _PolicyForward(logp, entropies, aux_loss, mask, full_values)

    def _surrogate_weights(
        self, inputs: dict[str, Any], fwd: _PolicyForward, old_logp: Tensor, mode: str
    ) -> tuple[Tensor | None, Tensor | None]:
        """TRL's token weights ([B, T] or [B, 1]; ``None``: none) and its high-entropy mask:
        the high-entropy mask, the off-policy mask and the vLLM importance-sampling ratio,
        multiplied. They weight the surrogate only, before the regularizer is added
        (:func:`compute_policy_loss`'s ``token_weights``); the rollout correction's metrics are
        logged (``rollout_correction/*``, :mod:`gbmpo.io.metrics`)."""
        weights: Tensor | None = None
        entropy_mask = keep = ratio = None
        if self.top_entropy_quantile < 1.0:
            threshold = 1 - self.top_entropy_quantile
            entropy_mask = self.get_high_entropy_mask(fwd.entropies, fwd.mask, threshold)
            weights = entropy_mask.to(fwd.logp.dtype)
        if self.off_policy_mask_threshold is not None:
            advantages = inputs["advantages"]
            adv2 = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
            keep = self.get_off_policy_mask(
                advantages=adv2,
                per_token_logps=fwd.logp,
                sampling_per_token_logps=inputs.get("sampling_per_token_logps", old_logp),
                mask=fwd.mask,
                off_policy_threshold=self.off_policy_mask_threshold,
            )
            weights = keep if weights is None else weights * keep
        if self.use_vllm and self.vllm_importance_sampling_correction:
            ratio = inputs["importance_sampling_ratio"]
            weights = ratio if weights is None else weights * ratio
        if ratio is not None or keep is not None:
            log_rollout_correction(self, mode, ratio, keep, fwd.mask)
        return weights, entropy_mask

    def _loss_terms(
        self, ref_logp: Tensor | None, old_logp: Tensor, full_values: dict[str, Tensor]
    ) -> list[LossTerm]:
        """The terms placed in the loss, each with its anchor's log-probs (the frozen
        reference's, or the rollout policy's), built as on the own engine
        (:func:`gbmpo.objectives.loss.loss_terms`). TRL computes the reference's log-probs only
        when ``beta != 0``: an active term anchored on the reference without them is a
        ``RuntimeError`` naming that switch."""
        missing = [t.name for t in self._gbmpo.loss_terms
                   if t.active and t.needs_ref and ref_logp is None]  # fmt: skip
        if missing:
            raise RuntimeError(
                f"regularizers {missing} are anchored on the reference model but the batch has "
                f"no 'ref_per_token_logps'; TRL computes them when beta != 0 (beta={self.beta})"
            )
        return loss_terms(self._gbmpo.terms, {"ref": ref_logp, "old": old_logp}, full_values)

    def _normalisers(
        self, inputs: dict[str, Any], fwd: _PolicyForward, mode: str, accum: int
    ) -> dict[str, Any]:
        """The aggregation's normalisers as TRL's (the whole accumulation window, so no further
        division): ``bnpo`` the optimizer step's valid tokens over every process (the own
        engine's mini-batch token mean; the data-parallel average of the processes' gradients
        divides by P), or this micro-batch's outside training; dapo / cispo / vespo TRL's global
        token count; the others the window's sequences."""
        loss_type = self.args.loss_type
        if loss_type == "bnpo" and mode == "train":
            if "mini_batch_tokens" not in inputs:
                raise KeyError(
                    "loss_type='bnpo' needs the batch's 'mini_batch_tokens' (the optimizer step's "
                    "valid tokens over all processes), which GBMPOTrainer._prepare_inputs adds"
                )
            tokens = max(float(inputs["mini_batch_tokens"]), 1.0)
            return {"num_tokens": tokens / self.accelerator.num_processes}
        if loss_type == "bnpo":
            return {"num_tokens": max(float(fwd.mask.sum()), 1.0)}
        if loss_type in _GLOBAL_TOKEN_LOSS_TYPES:
            # TRL: token sum / Z with Z = global tokens / processes (scaled to the window); Z may
            # be below this process's token count, which aggregate accepts.
            return {"num_tokens": float(dapo_normalizer(
                inputs["num_items_in_batch"],
                num_processes=self.accelerator.num_processes,
                accumulation_steps=accum,
                steps_per_generation=self.args.steps_per_generation,
                training=mode == "train",
            ))}  # fmt: skip
        return {"num_sequences": int(fwd.logp.size(0)) * accum}

    def _add_entropy_and_aux(
        self, loss: Tensor, fwd: _PolicyForward, entropy_mask: Tensor | None, accum: int,
        mode: str,
    ) -> Tensor:  # fmt: skip
        """TRL's entropy bonus (logging TRL's ``policy_loss``, the loss before it, per
        micro-batch: not divided by the accumulation steps except for the global-token loss
        types, as TRL) and the MoE router's auxiliary loss (``aux_loss``)."""
        if self._entropy_bonus_enabled:
            scale = 1 if self.args.loss_type in _GLOBAL_TOKEN_LOSS_TYPES else accum
            policy = loss.detach() * scale
            self._metrics[mode]["policy_loss"].append(self._mean_over_processes(float(policy)))
            eff_mask = fwd.mask if entropy_mask is None else fwd.mask * entropy_mask
            loss = loss - self._entropy_term(fwd.entropies, eff_mask, accum, mode)
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * fwd.aux_loss / accum
            self._metrics[mode]["aux_loss"].append(
                self.accelerator.gather_for_metrics(fwd.aux_loss).mean().item()
            )
        return loss

    def _entropy_term(self, entropies: Tensor, mask: Tensor, accum: int, mode: str) -> Tensor:
        """TRL's entropy bonus times its coefficient (subtracted from the loss). With
        ``use_adaptive_entropy`` the coefficient applies only while the previous window's entropy
        is at most ``entropy_target``, and is updated at each optimizer step from this window's
        token-mean entropy over all processes (:func:`adaptive_entropy_coef`); the state lives in
        TRL's attributes, which TRL saves with checkpoints."""
        args = self.args
        bonus = entropy_bonus(entropies, mask, accum)
        coef = self.entropy_coef
        if self.use_adaptive_entropy and self._last_world_entropy > args.entropy_target:
            coef = 0.0
        if self.use_adaptive_entropy and mode == "train":
            stats = torch.stack([(entropies * mask).sum(), mask.sum()]).detach().float()
            window = getattr(self, "_entropy_window_stats", None)
            self._entropy_window_stats = stats if window is None else window + stats
            if self.accelerator.sync_gradients:
                totals = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
                world = float(totals[0] / totals[1].clamp(min=1.0))
                self.entropy_coef = adaptive_entropy_coef(
                    self.entropy_coef, world, target=args.entropy_target,
                    delta=args.entropy_coef_delta, coef_min=args.entropy_coef_min,
                    coef_max=args.entropy_coef_max,
                )  # fmt: skip
                self._last_world_entropy = world
                self._entropy_window_stats = None
        if mode == "train" and self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
        return coef * bonus

    # ---- logging ------------------------------------------------------------------------------

    @torch.no_grad()
    def _add_monitored_divergences(self, old_logp: Tensor, ref_logp: Tensor, mask: Tensor) -> None:
        r"""Add this micro-batch's token sums of :math:`D(\pi_{old}\,\|\,\pi_{ref})` for every
        monitored regularizer (the built objective's ``monitors``: the optimised ones and, with
        ``monitor_regularizers``, every registered one). :meth:`log` logs the mean over the
        logging window's tokens as ``reg/<name>``, once per regularizer; every pass over a
        batch adds the same values, so ``num_iterations`` > 1 leaves the mean unchanged."""
        mf = mask.to(torch.float32)
        sums = getattr(self, "_monitor_sums", None)
        if sums is None:
            sums = self._monitor_sums = {}
            self._monitor_tokens = 0.0
        old, ref = old_logp.detach().float(), ref_logp.detach().float()
        reads = {t.control.monitor(t.name) for t in self._gbmpo.controlled if t.control}
        window = getattr(self, "_drift_sums", None)
        if reads and window is None:
            window = self._drift_sums = dict.fromkeys(reads, 0.0) | {"": 0.0}
        for name, reg in self._gbmpo.monitors.items():
            value = float((reg(logp=old, old_logp=old, anchor_logp=ref, mask=mask) * mf).sum())
            sums[name] = sums.get(name, 0.0) + value
            if name in reads and window is not None:
                window[name] += value
        self._monitor_tokens += float(mf.sum())
        if window is not None:
            window[""] += float(mf.sum())

    def _control_drift(self) -> None:
        """At the end of a generation batch: each controlled term's measure (the batch's token
        mean of its monitored divergence over every process; each of the ``num_iterations``
        passes adds the same values, so the mean is the batch's), logged with the coefficient
        the batch used (``drift_coef/<term>``, ``drift_measure/<term>``), moves its coefficient
        for the next batch (:meth:`DriftControl.step`, the own engine's update)."""
        window = getattr(self, "_drift_sums", None)
        if window is None:
            raise RuntimeError("a controlled coefficient reads D(pi_old || pi_ref), but this step "
                               "had no reference log-probs (TRL computes them when beta != 0)")
        names = sorted(window)
        local = torch.tensor([window[n] for n in names], dtype=torch.float64,
                             device=self.accelerator.device)  # fmt: skip
        totals = dict(zip(names, self.accelerator.reduce(local, reduction="sum").tolist(),
                          strict=True))  # fmt: skip
        tokens = max(totals[""], 1.0)
        metrics, new = self._metrics["train"], {}
        for t in self._gbmpo.controlled:
            assert t.control is not None
            measure = totals[t.control.monitor(t.name)] / tokens
            metrics[DRIFT_COEF_PREFIX + t.name].append(t.coef)
            metrics[DRIFT_MEASURE_PREFIX + t.name].append(measure)
            new[t.name] = t.control.step(t.coef, measure)
        self._gbmpo = self._gbmpo.with_coefs(new)
        self._drift_sums = None

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """TRL's checkpoint, plus the controlled coefficients (:data:`DRIFT_STATE_FILE`)."""
        super()._save_checkpoint(model, trial)
        if self._gbmpo.controlled and self.args.should_save:
            folder = f"checkpoint-{self.state.global_step}"
            path = os.path.join(self._get_output_dir(trial=trial), folder, DRIFT_STATE_FILE)
            with open(path, "w") as f:
                json.dump({t.name: t.coef for t in self._gbmpo.controlled}, f)

    def _load_optimizer_and_scheduler(self, checkpoint: Any) -> None:
        """TRL's, plus the controlled coefficients of ``checkpoint``; a checkpoint without them
        for a controlled term is a ``ValueError`` (its continuation would not be the run's)."""
        super()._load_optimizer_and_scheduler(checkpoint)
        if not self._gbmpo.controlled or checkpoint is None:
            return
        path = os.path.join(checkpoint, DRIFT_STATE_FILE)
        if not os.path.exists(path):
            raise ValueError(f"{checkpoint} holds no {DRIFT_STATE_FILE}: it was written without "
                             "the controlled coefficients this run has")
        with open(path) as f:
            coefs = json.load(f)
        self._gbmpo = self._gbmpo.with_coefs(
            {t.name: float(coefs[t.name]) for t in self._gbmpo.controlled})
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """TRL's log, with ``reg/<name>`` (token means over every process since the last log),
        GBMPOTrainer's per-micro-batch means weighted by their valid tokens and ``ratio/min`` /
        ``ratio/max`` as the window's extremes (TRL would average the micro-batches' values
        plainly)."""
        mode = "train" if self.model.training else "eval"
        metrics = self._metrics[mode]
        # token-weighted means over the window's micro-batches (TRL averages them plainly), so
        # that e.g. the clip fraction is the fraction of the window's valid tokens
        window_means(metrics, getattr(self, "_token_weights", {}).get(mode, {}))
        sums = getattr(self, "_monitor_sums", None)
        if mode == "train" and sums:
            names = sorted(sums)
            local = torch.tensor([sums[n] for n in names] + [self._monitor_tokens],
                                 dtype=torch.float64, device=self.accelerator.device)  # fmt: skip
            totals = self.accelerator.reduce(local, reduction="sum")
            tokens = float(totals[-1].clamp(min=1.0))
            for i, name in enumerate(names):
                metrics[MONITOR_PREFIX + name] = [float(totals[i]) / tokens]
            self._monitor_sums = None
        super().log(logs, start_time)

    @torch.no_grad()
    def _log_trl_metrics(
        self, mode: str, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor
    ) -> None:
        """The loss-type metrics TRL logs under its own names, with TRL's definitions:
        ``clip_ratio/low_min`` / ``clip_ratio/high_max`` (per-sequence clip fractions, min / max
        over the batch) for the clip loss types with TRL's clip (``clip_mode="ratio"``),
        ``cispo_clip_ratio`` (tokens whose weight the cap binds, with :math:`A > 0`) and
        ``vespo/phi_seq_mean`` (the mean VESPO sequence weight)."""
        obj = self._gbmpo
        adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
        mf = mask.to(torch.float32)
        log_ratio = (logp - old_logp).float()
        name, loss_type = obj.spec.surrogate.name, self.args.loss_type
        if name in ("clip", "gspo") and loss_type not in LOSS_TYPE_SURROGATES:
            if name == "gspo":
                seq = (log_ratio * mf).sum(-1) / mf.sum(-1).clamp(min=1.0)
                ratio = torch.exp(seq).unsqueeze(-1).expand_as(log_ratio)
            else:
                ratio = torch.exp(log_ratio)
            # the surrogate's own interval (= TRL's 1 - epsilon, 1 + epsilon_high when mapped)
            sur: Any = obj.surrogate
            lo, hi = 1.0 - float(sur.eps_low), 1.0 + float(sur.eps_high)
            low = ((ratio < lo) & (adv < 0)).float()
            high = ((ratio > hi) & (adv > 0)).float()
            per_seq = torch.stack([(x * mf).sum(-1) / mf.sum(-1) for x in (low, high)], dim=-1)
            gathered = self.accelerator.gather(per_seq)
            low_seq, high_seq = gathered[:, 0], gathered[:, 1]
            low_seq, high_seq = low_seq[~low_seq.isnan()], high_seq[~high_seq.isnan()]
            nan = float("nan")
            self._metrics[mode]["clip_ratio/low_min"].append(
                float(low_seq.min()) if low_seq.numel() else nan
            )
            self._metrics[mode]["clip_ratio/high_max"].append(
                float(high_seq.max()) if high_seq.numel() else nan
            )
        elif loss_type == "cispo":
            cap = 1.0 + float(obj.surrogate.eps_high)  # TRL's epsilon_high (loss_type_surrogate)
            hit = ((torch.exp(log_ratio) > cap) & (adv > 0)).float()
            totals = self.accelerator.reduce(torch.stack([(hit * mf).sum(), mf.sum()]), "sum")
            self._metrics[mode]["cispo_clip_ratio"].append(float(totals[0] / totals[1].clamp(1.0)))
        elif loss_type == "vespo":
            a = self.args
            phi = self.get_gamma_weights(
                advantages=adv, log_ratio_per_token=log_ratio, mask=mf,
                importance_sampling_ratio=None, k_pos=a.vespo_k_pos, lambda_pos=a.vespo_lambda_pos,
                k_neg=a.vespo_k_neg, lambda_neg=a.vespo_lambda_neg,
            )  # fmt: skip
            count = torch.tensor(float(phi.shape[0]), device=phi.device)
            totals = self.accelerator.reduce(torch.stack([phi.sum().float(), count]), "sum")
            self._metrics[mode]["vespo/phi_seq_mean"].append(
                float(totals[0] / totals[1].clamp(1.0))
            )

    def _mean_over_processes(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float32, device=self.accelerator.device)
        return float(self.accelerator.gather(t).mean())

    def _log_gbmpo_metrics(
        self,
        mode: str,
        fwd: _PolicyForward,
        terms: list[LossTerm],
        ref_logp: Tensor | None,
        old_logp: Tensor,
        m: dict[str, float],
        accum: int,
    ) -> None:
        """gbmpo's metrics of one micro-batch under the run directory's names
        (:mod:`gbmpo.io.metrics`): token-weighted means over all processes (one reduce) of
        ``entropy``, TRL's ``kl``, ``reg_value`` (and ``reg_value/<name>`` per term of a sum),
        the clip fractions and the mean ratio; min / max over processes of the ratio; the two
        parts of the loss per optimizer step, ``pg_loss`` and ``reg_loss`` (and
        ``reg_loss/<name>`` per term of a sum)."""
        obj = self._gbmpo
        mask = fwd.mask
        mf = mask.to(torch.float32)
        n_local = mf.sum()
        values: dict[str, Tensor] = {}
        several = len(obj.terms) > 1

        def token_mean(x: Tensor) -> Tensor:
            return masked_mean(x, mf)

        if mode != "train" or self._first_pass():  # the rollout policy's entropy (own engine's)
            values["entropy"] = token_mean(fwd.entropies)
        with torch.no_grad():
            lp = fwd.logp.detach()
            if ref_logp is not None:
                # TRL's kl: k3, times the token ratio with use_bias_correction_kl (kl_k3_is)
                kl = kl_k3(lp.float(), ref_logp.float())
                if self.args.use_bias_correction_kl:
                    kl = kl * torch.exp(lp.float() - old_logp.float())
                values["kl"] = token_mean(kl)
            # the summed value (0 with every term outside the loss; not logged when the loss's
            # terms were left out for want of an anchor), then each term's for a sum
            if terms or not obj.loss_terms:
                values["reg_value"] = torch.tensor(m["reg_value"], device=mf.device)
                for t in terms if several else ():
                    values[f"reg_value/{t.name}"] = torch.tensor(
                        m[f"reg_value/{t.name}"], device=mf.device
                    )
        values["clip_ratio/low_mean"] = torch.tensor(m["clip_frac_low"], device=mf.device)
        values["clip_ratio/high_mean"] = torch.tensor(m["clip_frac_high"], device=mf.device)
        values["clip_ratio/region_mean"] = torch.tensor(
            m["clip_frac_low"] + m["clip_frac_high"], device=mf.device
        )
        values["clip_ratio/dual_mean"] = torch.tensor(m["clip_frac_dual"], device=mf.device)
        values["ratio/mean"] = torch.tensor(m["ratio_mean"], device=mf.device)

        keys = list(values)
        stacked = torch.stack([values[k].float() * n_local for k in keys] + [n_local])
        totals = self.accelerator.reduce(stacked, reduction="sum")
        denom = totals[-1].clamp(min=1.0)
        for i, k in enumerate(keys):
            self._metrics[mode][k].append(float(totals[i] / denom))
        # the micro-batch's valid tokens (all processes): log() weights these means by them
        weights = getattr(self, "_token_weights", None)
        if weights is None:
            weights = self._token_weights = {"train": {}, "eval": {}}
        for k in keys:
            weights[mode].setdefault(k, []).append(float(totals[-1]))
        extremes = torch.tensor([m["ratio_min"], -m["ratio_max"]], device=mf.device)
        if n_local == 0:  # no valid token here: do not let the 0 placeholders win
            extremes = torch.full_like(extremes, math.inf)
        gathered = self.accelerator.gather(extremes.unsqueeze(0)).view(-1, 2).min(dim=0).values
        self._metrics[mode]["ratio/min"].append(float(gathered[0]))
        self._metrics[mode]["ratio/max"].append(float(-gathered[1]))
        # the loss's two parts, scaled to the optimizer step (summed over its micro-batches)
        self._metrics[mode]["pg_loss"].append(self._mean_over_processes(m["pg_loss"] * accum))
        self._metrics[mode]["reg_loss"].append(self._mean_over_processes(m["reg_loss"] * accum))
        for t in terms if several else ():
            self._metrics[mode][f"reg_loss/{t.name}"].append(
                self._mean_over_processes(m[f"reg_loss/{t.name}"] * accum)
            )
