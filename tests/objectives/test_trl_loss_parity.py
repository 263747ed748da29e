"""Parity of the baseline surrogates with TRL 1.16's own ``GRPOTrainer._compute_loss``.

TRL's method is run as is, unbound, on a stand-in trainer whose model forward returns fixed
float64 log-probs (the only thing it needs a model for), so the reference is TRL's real code, not
a transcription. Each case compares the aggregated loss and its gradient with respect to the
log-probs with :func:`gbmpo.objectives.compute_policy_loss` in float64:

* ``cispo`` == ``cispo(eps_low=1, eps_high=epsilon_high - 1)`` + ``bnpo`` (TRL's token sum over
  ``num_items_in_batch``, here the batch's token count);
* ``sapo`` == ``sapo(tau_pos, tau_neg)`` + ``grpo``;
* ``vespo`` == ``vespo(k, lambda)`` + ``bnpo``;
* ``luspo`` (``importance_sampling_level="sequence"``) == ``gspo`` + ``seq_mean_token_sum``:
  LUSPO is GSPO with a sequence-sum aggregation, not a surrogate of its own.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import Tensor

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")

from gbmpo.objectives import compute_policy_loss, get_surrogate  # noqa: E402
from parity_record import record  # noqa: E402

F64 = torch.float64
#: float64 throughout: measured differences are 0 to 3e-17 (rounding order)
TOL = 1e-12


class _Accelerator:
    num_processes = 1
    sync_gradients = True

    @staticmethod
    def reduce(x: Tensor, reduction: str = "sum") -> Tensor:
        return x

    @staticmethod
    def gather(x: Tensor) -> Tensor:
        return x


def _batch(seed: int, b: int = 6, t: int = 8, spread: float = 0.4) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(2, t + 1, (b,), generator=g)
    lens[0] = t
    mask = (torch.arange(t)[None, :] < lens[:, None]).long()
    old = -torch.rand(b, t, generator=g, dtype=F64) * 3.0 - 0.05
    logp = old + torch.randn(b, t, generator=g, dtype=F64) * spread
    adv = torch.randn(b, generator=g, dtype=F64)
    adv[1] = 0.0  # a zero advantage takes the non-positive branch in SAPO / VESPO
    return {"logp": logp, "old": old, "adv": adv, "mask": mask}


def _trl_loss(x: dict[str, Tensor], loss_type: str, **args: Any) -> tuple[Tensor, Tensor]:
    """TRL's ``_compute_loss`` on the batch; returns (loss, d loss / d logp)."""
    logp = x["logp"].clone().requires_grad_(True)
    b, t = logp.shape
    level = args.pop("importance_sampling_level", "token")
    eps = args.pop("epsilon", 0.2)
    eps_high = args.pop("epsilon_high", eps)
    cfg = {"delta": None, "sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05,
           "vespo_k_pos": 2.0, "vespo_lambda_pos": 3.0, "vespo_k_neg": 3.0,
           "vespo_lambda_neg": 2.0, "use_bias_correction_kl": False, "steps_per_generation": 1,
           **args}  # fmt: skip
    stub = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp), None),
        get_gamma_weights=trl_grpo.GRPOTrainer.get_gamma_weights,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level=level,
        beta=0.0,
        loss_type=loss_type,
        epsilon_low=eps,
        epsilon_high=eps_high,
        args=SimpleNamespace(**cfg),
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        accelerator=_Accelerator(),
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
    )
    inputs = {
        "prompt_ids": torch.ones(b, 2, dtype=torch.long),
        "prompt_mask": torch.ones(b, 2, dtype=torch.long),
        "completion_ids": torch.ones(b, t, dtype=torch.long),
        "completion_mask": x["mask"],
        "advantages": x["adv"],
        "old_per_token_logps": x["old"],
        "num_items_in_batch": x["mask"].sum(),
    }
    loss = trl_grpo.GRPOTrainer._compute_loss(stub, None, inputs)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad


def _ours(x: dict[str, Tensor], surrogate: Any, aggregation: str) -> tuple[Tensor, Tensor]:
    logp = x["logp"].clone().requires_grad_(True)
    loss, _ = compute_policy_loss(
        logp=logp,
        old_logp=x["old"],
        advantages=x["adv"],
        mask=x["mask"],
        surrogate=surrogate,
        terms=(),
        aggregation=aggregation,
    )  # fmt: skip
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad


CASES = [
    ("cispo", {"epsilon_high": 5.0}, "cispo", {"eps_low": 1.0, "eps_high": 4.0}, "bnpo", 0.4),
    ("cispo", {"epsilon_high": 1.3}, "cispo", {"eps_low": 1.0, "eps_high": 0.3}, "bnpo", 0.4),
    ("sapo", {}, "sapo", {}, "grpo", 0.4),
    ("sapo", {"sapo_temperature_pos": 2.0, "sapo_temperature_neg": 3.0}, "sapo",
     {"tau_pos": 2.0, "tau_neg": 3.0}, "grpo", 0.8),
    ("vespo", {}, "vespo", {}, "bnpo", 0.15),
    ("vespo", {"vespo_k_pos": 1.0, "vespo_lambda_pos": 1.5, "vespo_k_neg": 4.0,
               "vespo_lambda_neg": 0.5}, "vespo",
     {"k_pos": 1.0, "lambda_pos": 1.5, "k_neg": 4.0, "lambda_neg": 0.5}, "bnpo", 0.15),
    ("luspo", {"importance_sampling_level": "sequence", "epsilon": 0.02, "epsilon_high": 0.03},
     "gspo", {"eps_low": 0.02, "eps_high": 0.03}, "seq_mean_token_sum", 0.1),
]  # fmt: skip


@pytest.mark.parametrize("loss_type,trl_args,name,params,aggregation,spread", CASES)
def test_loss_and_gradient_equal_trl(loss_type, trl_args, name, params, aggregation, spread):
    x = _batch(seed=len(loss_type) + len(params), spread=spread)
    l_trl, g_trl = _trl_loss(x, loss_type, **trl_args)
    l_gb, g_gb = _ours(x, get_surrogate(name, **params), aggregation)
    assert g_trl.abs().max() > 1e-3, "degenerate case: TRL's gradient is ~0"
    dl, dg = float((l_trl - l_gb).abs()), float((g_trl - g_gb).abs().max())
    assert dl <= TOL and dg <= TOL, (loss_type, dl, dg)
    record(dl, dg)


def test_cispo_cap_binds_and_parity_is_sensitive():
    """The batch really hits CISPO's cap, and a different cap is caught."""
    x = _batch(seed=3, spread=0.4)
    w = torch.exp(x["logp"] - x["old"])
    assert bool(((w > 1.3) & x["mask"].bool()).any())
    l_trl, g_trl = _trl_loss(x, "cispo", epsilon_high=1.3)
    _, g_other = _ours(x, get_surrogate("cispo", eps_low=1.0, eps_high=0.35), "bnpo")
    assert float((g_trl - g_other).abs().max()) > 1e-4


def test_vespo_weights_are_not_all_one():
    """The VESPO batch moves the sequence ratios enough for the gamma weight to matter."""
    x = _batch(seed=len("vespo"), spread=0.15)
    _, diag = get_surrogate("vespo")(
        logp=x["logp"], old_logp=x["old"], advantages=x["adv"], mask=x["mask"]
    )
    assert float(diag["ratio_max"]) > 1.2 and float(diag["ratio_min"]) < 0.8
