r"""Drift from the reference: exact full-vocabulary divergences along the policy's own samples.

:func:`measure_drift` samples one completion per held-out prompt from the policy
:math:`\pi` at temperature 1 (no top-p, no top-k: the model's own distribution), then, at every
completion token :math:`t` with history :math:`h_t`, compares the two whole next-token
distributions :math:`p = \pi(\cdot\mid h_t)` and :math:`q = \pi_{\text{ref}}(\cdot\mid h_t)`
over the full vocabulary (:func:`drift_rows`):

* ``kl``: :math:`\mathrm{KL}(p\,\|\,q) = \sum_v p_v (\log p_v - \log q_v)`;
* ``kl_reverse``: :math:`\mathrm{KL}(q\,\|\,p)`;
* ``prob_l2``: :math:`\sum_v (p_v - q_v)^2 = \|p - q\|_2^2`, the full-vocabulary form of the
  project's ProbL2 (the Bregman divergence of :math:`h(y) = y^2`, no factor 1/2, as the
  ``prob_l2`` regularizer and :func:`~gbmpo.objectives.full_vocab.full_vocab_bregman` with
  ``square`` define it);
* ``tv``: :math:`\tfrac12 \|p - q\|_1`, the total-variation distance, in [0, 1];
* ``entropy``: :math:`H(p) = -\sum_v p_v \log p_v` (nats).

Each is averaged over all completion tokens of all prompts (a token-weighted mean, EOS
included); ``response_length`` is the mean number of completion tokens per prompt, and
``n_prompts`` / ``n_tokens`` say how much was measured. The keys are :data:`DRIFT_KEYS`, the same
for every engine: the own trainer writes them to ``summary.json`` under ``drift``, and
``gbmpo eval --model DIR --reference MODEL`` measures any saved model (TRL's, verl's after
merging) with the same function.

Why sampling at temperature 1 and not greedy decoding: the divergences are properties of the
policy's distribution. By the chain rule, the sequence-level
:math:`\mathrm{KL}(\pi\,\|\,\pi_{\text{ref}})` over completions is
:math:`\mathbb E_{o\sim\pi}[\sum_t \mathrm{KL}_t]` with :math:`\mathrm{KL}_t` the exact
divergence of the next-token distributions at token :math:`t`, so the sum over each sample's
tokens is an unbiased estimate of it (with less variance than the sampled log-ratio), and
dividing the total by the number of tokens gives the per-token figures the regularizers act on.
A greedy path is one mode of :math:`\pi` and would bias them. The sampling is seeded
(``seed``): the same models, prompts, seed and ``batch_size`` give the same numbers (another
``batch_size`` draws other samples, as in :func:`gbmpo.rollout.generate`).

Memory: the logits of both models are computed for a few sequences at a time (at most
:data:`FORWARD_ELEMENTS` logits per model per forward) and the divergences ``chunk_size``
token rows at a time, so nothing grows with the number of prompts or with tokens x vocabulary.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from gbmpo.config import TrainConfig
from gbmpo.eval.evaluation import held_out_examples
from gbmpo.models import load_model_and_tokenizer
from gbmpo.objectives.full_vocab import bregman_rows, total_variation_rows
from gbmpo.objectives.potentials import NegEntropy, Square
from gbmpo.objectives.tensors import compute_dtype
from gbmpo.rollout import sampling
from gbmpo.rollout.logprobs import logits_forward

__all__ = [
    "DRIFT_KEYS",
    "FORWARD_ELEMENTS",
    "INITIAL",
    "drift_rows",
    "final_drift",
    "fmt_drift",
    "measure_drift",
]

#: the keys of :func:`measure_drift`'s result, in order
DRIFT_KEYS: tuple[str, ...] = (
    "kl", "kl_reverse", "prob_l2", "tv", "entropy", "response_length", "n_prompts", "n_tokens",
)  # fmt: skip

#: per-token quantities of :func:`drift_rows` (averaged over tokens by :func:`measure_drift`)
_TOKEN_KEYS = ("kl", "kl_reverse", "prob_l2", "tv", "entropy")

#: at most this many logits per model per forward in :func:`measure_drift` (128 MiB of float32)
FORWARD_ELEMENTS = 1 << 25


def drift_rows(policy_logits: Tensor, ref_logits: Tensor) -> dict[str, Tensor]:
    """Per-row exact divergences between p = softmax(policy_logits) and q = softmax(ref_logits).

    ``policy_logits`` and ``ref_logits`` are [N, V]; returns ``{"kl", "kl_reverse", "prob_l2",
    "tv", "entropy"}``, each [N] (float32; float64 for float64 input):

    * kl = sum_v p_v (log p_v - log q_v) and kl_reverse = sum_v q_v (log q_v - log p_v)
      (:func:`~gbmpo.objectives.full_vocab.bregman_rows` with the negative entropy);
    * prob_l2 = sum_v (p_v - q_v)^2 (``bregman_rows`` with h(y) = y^2: GBMPO's ProbL2, arXiv
      2602.04380, over the whole vocabulary);
    * tv = 1/2 sum_v |p_v - q_v| (:func:`~gbmpo.objectives.full_vocab.total_variation_rows`);
    * entropy = -sum_v p_v log p_v (0 log 0 = 0).
    """
    if policy_logits.shape != ref_logits.shape or policy_logits.dim() != 2:
        raise ValueError(
            f"policy_logits {tuple(policy_logits.shape)} and ref_logits "
            f"{tuple(ref_logits.shape)} must both be [N, V]"
        )
    dt = compute_dtype(policy_logits, ref_logits)
    log_p = torch.log_softmax(policy_logits.to(dt), dim=-1)
    p = log_p.exp()
    return {
        "kl": bregman_rows(policy_logits, ref_logits, NegEntropy()),
        "kl_reverse": bregman_rows(ref_logits, policy_logits, NegEntropy()),
        "prob_l2": bregman_rows(policy_logits, ref_logits, Square()),
        "tv": total_variation_rows(policy_logits, ref_logits),
        "entropy": -torch.where(p > 0, p * log_p, torch.zeros((), dtype=dt)).sum(-1),
    }


def _vocab_size(model: Any) -> int | None:
    head = getattr(model, "get_output_embeddings", lambda: None)()
    weight = getattr(head, "weight", None)
    return int(weight.shape[0]) if weight is not None else None


@contextlib.contextmanager
def _eval_mode(*models: Any) -> Iterator[None]:
    modes = [(m, m.training) for m in models]
    for m, _ in modes:
        m.eval()
    try:
        yield
    finally:
        for m, was in modes:
            m.train(was)


def _logits(model: Any, rows: tuple[Tensor, Tensor, Tensor, Tensor], adapters_off: bool,
            lean: bool) -> Tensor:  # fmt: skip
    """[b, C, V] logits predicting each completion token (the forward of the log-probs)."""
    device = next(model.parameters()).device
    rows = tuple(t.to(device) for t in rows)  # type: ignore[assignment]
    ctx = model.disable_adapter() if adapters_off else contextlib.nullcontext()
    with ctx:
        pieces = logits_forward(model, lean=lean and not adapters_off).sequence_logits(*rows)
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)


@torch.no_grad()
def measure_drift(
    policy: Any,
    reference: Any,
    tokenizer: Any,
    task: Any,
    *,
    split: str | None = None,
    limit: int | None = None,
    max_new_tokens: int = 256,
    batch_size: int = 8,
    seed: int = 0,
    generator: str = "gbmpo",
    chunk_size: int = 256,
    lean: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Drift of ``policy`` from ``reference`` on a task's held-out prompts (module docstring):
    ``DRIFT_KEYS``, the per-token means ``kl``, ``kl_reverse``, ``prob_l2``, ``tv``, ``entropy``,
    ``response_length`` (mean completion tokens per prompt), ``n_prompts``, ``n_tokens``.

    ``reference=None`` is the policy with its LoRA adapters disabled (a peft model; anything
    else is refused); a reference model must share the policy's vocabulary and ``tokenizer``.
    ``task``: a :class:`~gbmpo.tasks.Task` or a name; ``split`` defaults to
    ``task.eval_split``, ``limit`` keeps the first prompts. Chunk ``i`` of ``batch_size`` prompts
    is sampled with seed ``seed + i`` (``generator`` of :func:`gbmpo.rollout.generate`), then
    ``progress(done, total)`` is called; a forward takes at most :data:`FORWARD_ELEMENTS` logits,
    divergences ``chunk_size`` token rows at a time, through ``LeanForward`` when ``lean``."""
    if batch_size < 1 or chunk_size < 1 or max_new_tokens < 1:
        raise ValueError("batch_size, chunk_size and max_new_tokens must be >= 1")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    adapters_off = reference is None
    if adapters_off and not hasattr(policy, "disable_adapter"):
        raise ValueError(
            "reference=None means the policy with its LoRA adapters disabled, but the policy "
            "has no adapters; pass the reference model"
        )
    if not adapters_off:
        v_pol, v_ref = _vocab_size(policy), _vocab_size(reference)
        if v_pol is not None and v_ref is not None and v_pol != v_ref:
            raise ValueError(
                f"the policy's vocabulary ({v_pol}) and the reference's ({v_ref}) differ: drift "
                "compares distributions over one vocabulary"
            )
    _, _, examples = held_out_examples(task, split, limit, tokenizer)

    sums = dict.fromkeys(_TOKEN_KEYS, 0.0)
    n_tokens = 0
    models = [policy] if adapters_off else [policy, reference]
    with _eval_mode(*models):
        for chunk_i, lo in enumerate(range(0, len(examples), batch_size)):
            prompts = [ex["prompt"] for ex in examples[lo : lo + batch_size]]
            ro = sampling.generate(
                policy, tokenizer, prompts, num_return_sequences=1, max_new_tokens=max_new_tokens,
                do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                generator_seed=seed + chunk_i, generator=generator,
            )  # fmt: skip
            width = max(int(ro.completion_ids.shape[1]), 1)
            vocab = _vocab_size(policy) or 1
            step = max(1, min(len(ro), FORWARD_ELEMENTS // (width * vocab)))
            for s in range(0, len(ro), step):
                rows = (
                    ro.prompt_ids[s : s + step], ro.prompt_mask[s : s + step],
                    ro.completion_ids[s : s + step], ro.completion_mask[s : s + step],
                )  # fmt: skip
                mask = rows[3].bool()
                pol = _logits(policy, rows, False, lean)
                mask = mask.to(pol.device)
                x = pol[mask]
                del pol
                ref = _logits(policy if adapters_off else reference, rows, adapters_off, lean)
                y = ref.to(x.device)[mask]
                del ref
                for c in range(0, x.shape[0], chunk_size):
                    vals = drift_rows(x[c : c + chunk_size], y[c : c + chunk_size])
                    for k in _TOKEN_KEYS:
                        sums[k] += float(vals[k].double().sum())
                n_tokens += int(x.shape[0])
            if progress is not None:
                progress(min(lo + batch_size, len(examples)), len(examples))
    n_prompts = len(examples)
    out: dict[str, Any] = {k: sums[k] / max(n_tokens, 1) for k in _TOKEN_KEYS}
    out["response_length"] = n_tokens / n_prompts
    out["n_prompts"] = n_prompts
    out["n_tokens"] = n_tokens
    return {k: out[k] for k in DRIFT_KEYS}



#: ``final_drift``'s default reference: the initial weights (LoRA: the adapters disabled)
INITIAL = "initial"


def final_drift(
    cfg: TrainConfig,
    policy: Any,
    tokenizer: Any,
    task: Any,
    split: str,
    limit: int | None,
    *,
    reference: Any = INITIAL,
) -> tuple[dict[str, Any] | None, float]:
    """``(drift, seconds)`` of a run's final policy from the reference (``summary.json``
    ``drift``, the keys of :data:`DRIFT_KEYS`), or ``(None, 0.0)`` unless ``eval.drift`` and
    ``eval.after`` are set: :func:`measure_drift` on the prompts the final evaluation uses
    (``split``, ``limit``), ``eval.max_new_tokens`` tokens, seed ``run.seed``.

    ``reference``: a model, ``None`` (the policy with its LoRA adapters disabled) or
    :data:`INITIAL`: with LoRA the adapters disabled, otherwise ``model.path`` loaded again on
    the policy's device in the policy's dtype (and freed afterwards). Every engine that measures
    drift calls this function.
    """
    if not (cfg.eval.drift and cfg.eval.after):
        return None, 0.0
    t = time.perf_counter()
    if isinstance(reference, str) and reference == INITIAL:
        if cfg.lora.enabled:
            reference = None
        else:
            weight = next(policy.parameters())
            reference, _ = load_model_and_tokenizer(
                cfg.model.path, dtype=weight.dtype, device=str(weight.device),
                trust_remote_code=cfg.model.trust_remote_code,
            )  # fmt: skip
    drift = measure_drift(
        policy, reference, tokenizer, task, split=split, limit=limit,
        max_new_tokens=cfg.eval.max_new_tokens, batch_size=cfg.eval.batch_size,
        seed=cfg.run.seed,
        generator="gbmpo" if cfg.rollout.generator == "vllm" else cfg.rollout.generator,
        lean=cfg.rollout.lean_forward,
    )  # fmt: skip
    return drift, time.perf_counter() - t


def fmt_drift(drift: dict[str, Any], seconds: float) -> str:
    """One console line for :func:`final_drift`'s result."""
    return (
        f"drift from the reference: KL {drift['kl']:.4g} (reverse {drift['kl_reverse']:.4g}), "
        f"ProbL2 {drift['prob_l2']:.4g}, TV {drift['tv']:.4g} per token over "
        f"{drift['n_tokens']} tokens of {drift['n_prompts']} prompts ({seconds:.1f} s)"
    )
