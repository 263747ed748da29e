"""The surrogates' shared parts: the :class:`Surrogate` call signature, the registry
:data:`SURROGATES`, the ratio-clip formula (:func:`ppo_clip_loss`) and the plumbing every
surrogate uses (input checks, masking, diagnostics, parameter checks). The surrogates
themselves are in the sibling modules; gradients come from autograd."""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
from torch import Tensor

from gbmpo.objectives.tensors import check_mask, compute_dtype
from gbmpo.registry import Registry

__all__ = [
    "SURROGATES",
    "Surrogate",
    "ppo_clip_loss",
    "sequence_log_ratio",
]


class Surrogate(Protocol):
    """``surrogate(logp=, old_logp=, advantages=, mask=) -> (per-token loss [B, T],
    diagnostics)``, keyword arguments only."""

    def __call__(
        self, *, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]: ...


#: Registry of surrogate classes; instantiate through :func:`get_surrogate`.
SURROGATES: Registry[type] = Registry("surrogate")


_LOG_RATIO_CLAMP = 20.0


def ppo_clip_loss(
    ratio: Tensor,
    adv: Tensor,
    low: float | Tensor,
    high: float | Tensor,
    dual_clip_c: float | None = None,
    ratio_cap: float | None = None,
) -> Tensor:
    r"""Clipped surrogate loss per token (PPO, Schulman et al. 2017; DAPO clip-higher).

    .. math::
        \ell = -\min\big(\tilde w A,\ \mathrm{clip}(w, l, h) A\big),\qquad
        \tilde w = \min(w, \rho_{\text{cap}})\ \text{(``ratio_cap``, TRL's ``delta``, if given)},

    and with dual clip (Ye et al. 2020, as in verl and RPG): for :math:`A < 0`,
    :math:`\ell \leftarrow \min(\ell, -cA)`. With :math:`l = 1-\varepsilon_{\text{low}}`,
    :math:`h = 1+\varepsilon_{\text{high}}` this is docs/methods.md, section "Clipped surrogate".
    Gradient: :math:`-A\,w\,\nabla\log\pi_\theta` inside the trust region, 0 where the clip binds in
    the direction the advantage pushes, and 0 where the dual cap binds.
    """
    unclipped = ratio if ratio_cap is None else ratio.clamp(max=ratio_cap)
    clipped = ratio.clamp(low, high)
    loss = -torch.minimum(unclipped * adv, clipped * adv)
    if dual_clip_c is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -dual_clip_c * adv), loss)
    return loss


def sequence_log_ratio(log_ratio: Tensor, mask: Tensor) -> Tensor:
    r"""GSPO sequence log-ratio (Zheng et al. 2025, arXiv 2507.18071; TRL
    ``importance_sampling_level="sequence"``), shape ``[B, 1]``:

    .. math::
        \log s_i = \frac{1}{|o_i|}\sum_t m_{i,t}\,(\log\pi_\theta - \log\pi_{\text{old}})_{i,t}

    with :math:`|o_i| = \max(1, \sum_t m_{i,t})`. Its gradient is
    :math:`\nabla \log s_i = \frac{1}{|o_i|}\sum_t m_{i,t}\nabla\log\pi_\theta(o_{i,t})`.
    """
    m = mask.to(log_ratio.dtype)
    return (log_ratio * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp_min(1.0)



def prepare_inputs(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Validate shapes; return (logp, log_ratio, adv [B, T], mask bool) in the compute dtype.

    Masked positions get log-ratio 0 and advantage 0, so padding garbage never reaches the
    loss or its gradient.
    """
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, T], got shape {tuple(logp.shape)}")
    if tuple(old_logp.shape) != tuple(logp.shape):
        raise ValueError(
            f"old_logp shape {tuple(old_logp.shape)} != logp shape {tuple(logp.shape)}"
        )
    m = check_mask(mask, logp.shape)
    dt = compute_dtype(logp)
    lp = logp.to(dt)
    zero = torch.zeros((), dtype=dt, device=lp.device)
    lp = torch.where(m, lp, zero)
    old = torch.where(m, old_logp.detach().to(dt), zero)
    log_ratio = (lp - old).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    adv = advantages.detach().to(dt)
    b, t = logp.shape
    if adv.dim() == 1 and adv.shape[0] == b:
        adv = adv.unsqueeze(-1).expand(b, t)
    elif adv.dim() == 2 and adv.shape[0] == b and adv.shape[1] in (1, t):
        adv = adv.expand(b, t)
    else:
        raise ValueError(
            f"advantages must be [B]={b} or [B, T]=[{b}, {t}], got shape {tuple(adv.shape)}"
        )
    adv = torch.where(m, adv, zero)
    return lp, log_ratio, adv, m


def clip_diagnostics(
    ratio: Tensor, m: Tensor, low: Tensor, high: Tensor, dual: Tensor | None
) -> dict[str, Tensor]:
    """Masked means of the bool masks ``low`` / ``high`` / ``dual`` and the ratio's masked
    mean / min / max (0 on an empty mask), float32, without autograd or host syncs."""
    with torch.no_grad():
        r = ratio.detach().to(torch.float32)
        mf = m.to(torch.float32)
        n = mf.sum()
        denom = n.clamp_min(1.0)
        zero = torch.zeros((), dtype=torch.float32, device=r.device)

        def frac(hit: Tensor) -> Tensor:
            return torch.count_nonzero(hit & m).to(torch.float32) / denom

        any_valid = n > 0
        rmax = torch.where(any_valid, torch.where(m, r, -math.inf).amax(), zero)
        rmin = torch.where(any_valid, torch.where(m, r, math.inf).amin(), zero)
        return {
            "clip_frac_low": frac(low),
            "clip_frac_high": frac(high),
            "clip_frac_dual": frac(dual) if dual is not None else zero,
            "ratio_mean": (r * mf).sum() / denom,
            "ratio_min": rmin,
            "ratio_max": rmax,
        }


def masked_clip_loss(
    ratio: Tensor,
    adv: Tensor,
    m: Tensor,
    low: float | Tensor,
    high: float | Tensor,
    dual_clip_c: float | None,
    ratio_cap: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`ppo_clip_loss` zeroed at masked positions, with its clip diagnostics; ``low`` /
    ``high`` may be per-token tensors of ``ratio``'s shape."""
    loss = ppo_clip_loss(ratio, adv, low, high, dual_clip_c, ratio_cap)
    loss = torch.where(m, loss, torch.zeros_like(loss))
    r = ratio.detach()
    hit_low = (r < low) & (adv < 0)
    hit_high = (r > high) & (adv > 0)
    dual = None
    if dual_clip_c is not None:
        ru = r if ratio_cap is None else r.clamp(max=ratio_cap)
        dual = (adv < 0) & (ru > dual_clip_c)
    return loss, clip_diagnostics(r, m, hit_low, hit_high, dual)


def _eps_bounds(eps_low: float, eps_high: float | None) -> tuple[float, float]:
    """Ratio clip interval ``(1 - eps_low, 1 + eps_high)`` (``eps_high`` already resolved)."""
    return 1.0 - eps_low, 1.0 + float(eps_high)  # type: ignore[arg-type]


def _finite_number(cls: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{cls}: {name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{cls}: {name} must be finite, got {value!r}")
    return float(value)


def _check_eps(cls: str, eps_low: Any, eps_high: Any) -> None:
    lo = _finite_number(cls, "eps_low", eps_low)
    hi = _finite_number(cls, "eps_high", eps_high)
    if not 0.0 <= lo <= 1.0:
        raise ValueError(f"{cls}: eps_low must be in [0, 1], got {lo}")
    if hi < 0.0:
        raise ValueError(f"{cls}: eps_high must be >= 0, got {hi}")


def _check_dual(cls: str, name: str, c: Any) -> None:
    if c is None:
        return
    if _finite_number(cls, name, c) <= 1.0:
        raise ValueError(f"{cls}: dual-clip constant {name} must be > 1, got {c!r}")


def _check_clip_params(
    cls: str, eps_low: Any, eps_high: Any, dual_clip_c: Any, ratio_cap: Any
) -> None:
    _check_eps(cls, eps_low, eps_high)
    _check_dual(cls, "dual_clip_c", dual_clip_c)
    if ratio_cap is not None:
        d = _finite_number(cls, "ratio_cap", ratio_cap)
        if d < 1.0 + float(eps_high):
            raise ValueError(
                f"{cls}: ratio_cap (cap on the unclipped ratio) must be >= 1 + eps_high = "
                f"{1.0 + float(eps_high):g}, got {d}"
            )


def _check_variant(cls: str, variant: Any, allowed: tuple[str, ...]) -> None:
    if variant not in allowed:
        raise ValueError(f"{cls}: unknown variant {variant!r}; valid: {', '.join(allowed)}")


def _check_beta(cls: str, beta: Any) -> None:
    if _finite_number(cls, "beta", beta) < 0:
        raise ValueError(f"{cls}: beta must be >= 0, got {beta!r}")
