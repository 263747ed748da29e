"""RPG's surrogates (arXiv 2505.17508): ``rpg_clip`` (dual-clip with the KL-regularized
advantage) and ``rpg_reinforce`` (REINFORCE form with the KL component), with their formulas."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from gbmpo.objectives.surrogates.base import (
    SURROGATES,
    _check_beta,
    _check_dual,
    _check_eps,
    _check_variant,
    _eps_bounds,
    clip_diagnostics,
    masked_clip_loss,
    prepare_inputs,
)

__all__ = [
    "RPGClipSurrogate",
    "RPGReinforceSurrogate",
    "RPG_VARIANTS",
    "rpg_kl_component",
    "rpg_regularized_advantage",
    "rpg_reinforce_loss",
]


#: KL variants of RPG (arXiv 2505.17508, Tables 1, 2, 4).
RPG_VARIANTS: tuple[str, ...] = ("fkl", "rkl", "ufkl", "urkl")


def rpg_regularized_advantage(adv: Tensor, log_w: Tensor, variant: str, beta: float) -> Tensor:
    r"""RPG regularized advantage for clipping (arXiv 2505.17508 App. G.2), a constant:

    * ``urkl``: :math:`\hat A = A - \beta\log w`;
    * ``rkl``: :math:`\hat A = A - \beta(\log w + 1)`;
    * ``fkl``, ``ufkl``, ``none``: :math:`\hat A = A` (the FKL weights do not factor as
      :math:`w\times(\cdot)`; add their KL through a regularizer instead).

    With :math:`\hat A` detached, :math:`\nabla(-w\hat A) = -w\hat A\nabla\log\pi_\theta`, the
    Table 1 gradient weight of URKL / RKL.
    """
    log_w = log_w.detach()
    if variant == "urkl":
        return adv - beta * log_w
    if variant == "rkl":
        return adv - beta * (log_w + 1.0)
    if variant in ("fkl", "ufkl", "none"):
        return adv
    raise ValueError(f"unknown RPG variant {variant!r}; valid: none, {', '.join(RPG_VARIANTS)}")


def rpg_kl_component(w_bar: Tensor, variant: str, beta: float) -> Tensor:
    r"""RPG KL component :math:`C_{KL}` of the REINFORCE weight :math:`wA + C_{KL}`
    (arXiv 2505.17508 Table 2 / App. F; the authors' ``compute_policy_loss_reinforce``), from the
    clipped ratio :math:`\bar w = \mathrm{clip}(w, 1-\epsilon_1, 1+\epsilon_2)`:

    * ``fkl``: :math:`+\beta`;
    * ``ufkl``: :math:`\beta(1-\bar w)`;
    * ``rkl``: :math:`-\beta\bar w(\log\bar w + 1)`;
    * ``urkl``: :math:`-\beta\bar w\log\bar w`.
    """
    w_bar = w_bar.detach()
    if variant == "fkl":
        return torch.full_like(w_bar, beta)
    if variant == "ufkl":
        return beta * (1.0 - w_bar)
    if variant == "rkl":
        return -beta * w_bar * (torch.log(w_bar) + 1.0)
    if variant == "urkl":
        return -beta * w_bar * torch.log(w_bar)
    raise ValueError(f"unknown RPG variant {variant!r}; valid: {', '.join(RPG_VARIANTS)}")


def rpg_reinforce_loss(
    logp: Tensor,
    ratio: Tensor,
    adv: Tensor,
    c_kl: Tensor,
    low: float,
    high: float,
    c: float | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    r"""RPG-REINFORCE with RPG-Style Clip, per token (arXiv 2505.17508 Algorithm 2, §3.3):
    :math:`L = (\tilde w A_R + C_{KL})\,\ell`, :math:`\ell = -\log\pi_\theta`, with
    :math:`\tilde w = w` on the active branches and the bound the ratio crossed elsewhere (then
    :math:`\ell` is stop-gradient): for :math:`wA_R + C_{KL} \ge 0` active while
    :math:`w < h = 1+\epsilon_2`; otherwise active while :math:`l = 1-\epsilon_1 < w < c`
    (the dual clip ``c``; None: none). :math:`w`, :math:`A_R`, :math:`C_{KL}` are constants.

    The value is continuous in :math:`w`; the active gradient
    :math:`-(wA_R + C_{KL})\nabla\log\pi_\theta` is Table 2's REINFORCE weight (Prop. 4.1:
    unbiased for Table 1's loss). The branch is on :math:`A' = A_R + C_{KL}/w` (the paper's),
    not on :math:`A_R` as the authors' unused ``clip_ppo`` code. Returns ``(loss,
    clipped_low, clipped_high, clipped_dual)``, the last three bool masks.
    """
    w = ratio.detach()
    adv = adv.detach()
    c_kl = c_kl.detach()
    ell = -logp
    weight = w * adv + c_kl
    pos = weight >= 0
    hit_high = pos & (w >= high)
    hit_low = ~pos & (w <= low)
    hit_dual = ~pos & ~hit_low & (w >= c) if c is not None else torch.zeros_like(pos)
    w_const = torch.where(pos, torch.full_like(w, high), torch.full_like(w, low))
    if c is not None:
        w_const = torch.where(hit_dual, torch.full_like(w, c), w_const)
    const = (w_const * adv + c_kl) * ell.detach()
    active = ~(hit_high | hit_low | hit_dual)
    loss = torch.where(active, weight * ell, const)
    return loss, hit_low, hit_high, hit_dual


@SURROGATES.register("rpg_clip")
@dataclass(frozen=True)
class RPGClipSurrogate:
    r"""RPG-Style Clip (arXiv 2505.17508 §3.3; docs/methods.md, section "RPG"
    :math:`L^{\text{RPG-Clip}}`):

    .. math::
        L = \begin{cases} \max(-w\hat A, -\mathrm{clip}(w, 1-\epsilon_1, 1+\epsilon_2)\hat A)
        & \hat A \ge 0\\ \min(\max(-w\hat A, -\mathrm{clip}(w,\cdot)\hat A), -c\hat A)
        & \hat A < 0\end{cases}

    i.e. :func:`ppo_clip_loss` with dual clip applied to the regularized advantage
    :math:`\hat A` of :func:`rpg_regularized_advantage` (``urkl``: :math:`A-\beta\log w`,
    ``rkl``: :math:`A-\beta(\log w+1)`, detached). The KL anchor is :math:`\pi_{\text{old}}`
    (RPG's iterative reference). Inside the trust region the gradient weight is
    :math:`w\hat A`, RPG Table 1's URKL / RKL weight.

    Args:
        variant: ``none`` (plain :math:`A`), ``urkl`` or ``rkl``; ``fkl`` / ``ufkl`` also mean
            :math:`\hat A = A` (App. G.2) and then require ``beta == 0``: add their KL with the
            regularizer ``rpg_fkl`` / ``rpg_ufkl`` instead.
        beta: KL coefficient ``>= 0`` (RPG paper: 1e-4).
        eps_low, eps_high: :math:`\epsilon_1, \epsilon_2` (RPG: 0.2, 0.28).
        c: dual-clip constant ``> 1`` (verl default 3; ``None``: off).
    """

    variant: str = "none"
    beta: float = 0.0
    eps_low: float = 0.2
    eps_high: float = 0.28
    c: float | None = 3.0
    name: ClassVar[str] = "rpg_clip"

    def __post_init__(self) -> None:
        _check_variant("rpg_clip", self.variant, ("none", *RPG_VARIANTS))
        _check_beta("rpg_clip", self.beta)
        if self.variant in ("none", "fkl", "ufkl") and self.beta != 0:
            raise ValueError(
                f"rpg_clip: beta has no effect with variant {self.variant!r} (A_hat = A, RPG "
                "App. G.2); set beta=0 and add the KL with a regularizer (e.g. 'rpg_ufkl' with "
                "coef=beta), or use variant 'urkl' / 'rkl'"
            )
        _check_eps("rpg_clip", self.eps_low, self.eps_high)
        _check_dual("rpg_clip", "c", self.c)

    def __call__(
        self, *, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        _, log_ratio, adv, m = prepare_inputs(logp, old_logp, advantages, mask)
        a_hat = rpg_regularized_advantage(adv, log_ratio, self.variant, self.beta)
        low, high = _eps_bounds(self.eps_low, self.eps_high)
        return masked_clip_loss(torch.exp(log_ratio), a_hat, m, low, high, self.c)


@SURROGATES.register("rpg_reinforce")
@dataclass(frozen=True)
class RPGReinforceSurrogate:
    r"""RPG-REINFORCE with RPG-Style Clip (arXiv 2505.17508 Algorithm 2 and Table 2;
    docs/methods.md, section "RPG"), token level; see :func:`rpg_reinforce_loss` for the five
    branches.

    The REINFORCE weight is :math:`\mathrm{SG}(wA + C_{KL})` with :math:`C_{KL}` of
    :func:`rpg_kl_component` computed from the clipped ratio :math:`\bar w`; the KL anchor is
    :math:`\pi_{\text{old}}` (``old_logp``), RPG's iterative reference. Active-region gradient:
    :math:`-(wA + C_{KL})\nabla\log\pi_\theta`. Implemented from the paper: the authors'
    repository defines but never calls ``compute_policy_loss_reinforce`` (docs/methods.md, "Choices"
    item 12). The loss value is a REINFORCE surrogate (weight times :math:`-\log\pi`), not an
    objective estimate.

    Args:
        variant: ``fkl``, ``rkl``, ``ufkl`` or ``urkl`` (required).
        beta: KL coefficient ``>= 0`` (RPG paper: 1e-4).
        eps_low, eps_high: :math:`\epsilon_1, \epsilon_2` (RPG: 0.2, 0.28).
        c: dual-clip constant ``> 1`` for :math:`A' < 0` (RPG REINFORCE scripts: 10;
            ``None``: off).
    """

    variant: str
    beta: float = 1e-4
    eps_low: float = 0.2
    eps_high: float = 0.28
    c: float | None = 10.0
    name: ClassVar[str] = "rpg_reinforce"

    def __post_init__(self) -> None:
        _check_variant("rpg_reinforce", self.variant, RPG_VARIANTS)
        _check_beta("rpg_reinforce", self.beta)
        _check_eps("rpg_reinforce", self.eps_low, self.eps_high)
        _check_dual("rpg_reinforce", "c", self.c)

    def __call__(
        self, *, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        lp, log_ratio, adv, m = prepare_inputs(logp, old_logp, advantages, mask)
        ratio = torch.exp(log_ratio)
        low, high = _eps_bounds(self.eps_low, self.eps_high)
        w_bar = ratio.detach().clamp(low, high)
        c_kl = rpg_kl_component(w_bar, self.variant, self.beta)
        c_kl = torch.where(m, c_kl, torch.zeros_like(c_kl))
        loss, hit_low, hit_high, hit_dual = rpg_reinforce_loss(
            lp, ratio, adv, c_kl, low, high, self.c
        )
        loss = torch.where(m, loss, torch.zeros_like(loss))
        dual = hit_dual if self.c is not None else None
        return loss, clip_diagnostics(ratio, m, hit_low, hit_high, dual)
