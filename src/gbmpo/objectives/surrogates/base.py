"""The surrogates' shared parts: the :class:`Surrogate` call signature, the registry
:data:`SURROGATES`, the ratio-clip formula (:func:`ppo_clip_loss`) and the plumbing every
surrogate uses (input checks, masking, the fused value-and-derivative pass, diagnostics,
parameter checks). The surrogates themselves are in the sibling modules."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

from gbmpo.objectives.tensors import attach, check_mask, compute_dtype, float_mask, masked
from gbmpo.registry import Registry

__all__ = [
    "SURROGATES",
    "KnownGradient",
    "KnownGradientSurrogate",
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


class KnownGradient(NamedTuple):
    r"""A per-token loss computed without autograd, with its elementwise derivative:
    ``value`` ``[B, T]`` (0 where masked) is a function of ``x`` (the policy log-probs in the
    compute dtype, the tensor the gradient flows to) with
    :math:`\partial\,\mathrm{value}_{i,t} / \partial x_{i,t} = \mathrm{grad}_{i,t}` (0 where
    masked), and the surrogate's diagnostics. :func:`gbmpo.objectives.compute_policy_loss`
    folds it with the regularizers' and the aggregation's derivatives into one backward node."""

    x: Tensor
    value: Tensor
    grad: Tensor | Callable[[Tensor], Tensor]
    diag: dict[str, Tensor]


class KnownGradientSurrogate:
    """Base of the surrogates whose per-token derivative in :math:`\\log\\pi_\theta` is known in
    closed form: they implement :meth:`known_gradient`; calling them attaches that derivative
    to the value (one multiplication in the backward, :func:`gbmpo.objectives.tensors.attach`)."""

    def known_gradient(
        self, *, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor
    ) -> KnownGradient | None:
        """The loss with its derivative (``grad``: per-token values, or a function of the
        incoming gradient that forms autograd's products), or ``None`` where the surrogate
        goes through autograd for these parameters (its ``reference`` form)."""
        raise NotImplementedError

    def __call__(
        self, *, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        k = self.known_gradient(logp=logp, old_logp=old_logp, advantages=advantages, mask=mask)
        if k is None:
            ref = self.reference  # type: ignore[attr-defined]
            out: tuple[Tensor, dict[str, Tensor]] = ref(
                logp=logp, old_logp=old_logp, advantages=advantages, mask=mask
            )
            return out
        return attach(k.x, k.value, k.grad), k.diag


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



def _fcmp(op: Callable[..., Tensor], a: Tensor, b: Tensor | float) -> Tensor:
    """Comparison ``op(a, b)`` as a {0, 1} tensor of ``a``'s dtype, written straight into a
    float buffer (as fast as a multiplication; a bool result plus a cast costs ~10x more)."""
    return op(a, b, out=torch.empty_like(a))


def _prepare(
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


def _prepare_fused(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, need_lp: bool = True
) -> tuple[Tensor, Tensor | None, Tensor, Tensor, Tensor, Tensor]:
    """:func:`_prepare` without autograd, for surrogates with an analytic per-token derivative:
    ``(x, lp, log_ratio, adv, mf, inside)`` with ``x`` = ``logp`` in the compute dtype (the
    tensor the gradient flows to), ``lp`` / ``log_ratio`` / ``adv`` detached, finite and 0 where
    masked, ``mf`` the mask as {0, 1} floats and ``inside`` (float) the tokens whose log-ratio
    is within the +-20 clamp (elsewhere the clamp passes no gradient, as in :func:`_prepare`).
    Masked garbage (NaN, inf) never reaches a value or a gradient (:func:`_masked`). With
    ``need_lp=False`` ``lp`` is not formed (``None``; the log-ratio is the same bits)."""
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, T], got shape {tuple(logp.shape)}")
    if tuple(old_logp.shape) != tuple(logp.shape):
        raise ValueError(
            f"old_logp shape {tuple(old_logp.shape)} != logp shape {tuple(logp.shape)}"
        )
    dt = compute_dtype(logp)
    mf = float_mask(mask, logp.shape, dt)
    x = logp.to(dt)
    b, t = logp.shape
    adv = advantages.detach().to(dt)
    if adv.dim() == 1 and adv.shape[0] == b:
        adv = adv.unsqueeze(-1)
    elif not (adv.dim() == 2 and adv.shape[0] == b and adv.shape[1] in (1, t)):
        raise ValueError(
            f"advantages must be [B]={b} or [B, T]=[{b}, {t}], got shape {tuple(adv.shape)}"
        )
    with torch.no_grad():
        lp = masked(x.detach(), mf) if need_lp else None
        # at a valid token lp is x itself, so lp - old and x - old are the same bits
        raw = masked((x.detach() if lp is None else lp) - old_logp.detach().to(dt), mf)
        log_ratio = raw.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        # |raw| <= 20 exactly where the clamp leaves raw unchanged (NaN: neither)
        inside = _fcmp(torch.eq, log_ratio, raw)
        adv = masked(adv, mf)
    return x, lp, log_ratio, adv, mf, inside


def _fdiag(
    w: Tensor, mf: Tensor, low: Tensor | None, high: Tensor | None, dual: Tensor | None
) -> dict[str, Tensor]:
    """:func:`_diagnostics` from {0, 1} float tensors that are already 0 where masked (``w`` is
    1 there), with float arithmetic only."""
    w = w.to(torch.float32)
    mf = mf.to(torch.float32)
    n = mf.sum()
    denom = n.clamp_min(1.0)
    zero = torch.zeros((), dtype=torch.float32, device=w.device)

    def frac(hit: Tensor | None) -> Tensor:
        return zero if hit is None else hit.to(torch.float32).sum() / denom

    wm = w * mf
    rmin = torch.add(wm, 1.0 - mf, alpha=3e38).amin()  # wm where valid, 3e38 where masked
    return {
        "clip_frac_low": frac(low),
        "clip_frac_high": frac(high),
        "clip_frac_dual": frac(dual),
        "ratio_mean": wm.sum() / denom,
        "ratio_min": torch.where(n > 0, rmin, zero),
        "ratio_max": wm.amax() if w.numel() else zero,
    }


def _diagnostics(
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


def _masked_clip_loss(
    ratio: Tensor,
    adv: Tensor,
    m: Tensor,
    low: float | Tensor,
    high: float | Tensor,
    dual_clip_c: float | None,
    ratio_cap: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`ppo_clip_loss` zeroed at masked positions, with its clip diagnostics, through
    autograd (the reference form of :func:`_fused_clip_loss`); ``low`` / ``high`` may be
    per-token tensors of ``ratio``'s shape."""
    loss = ppo_clip_loss(ratio, adv, low, high, dual_clip_c, ratio_cap)
    loss = torch.where(m, loss, torch.zeros_like(loss))
    r = ratio.detach()
    hit_low = (r < low) & (adv < 0)
    hit_high = (r > high) & (adv > 0)
    dual = None
    if dual_clip_c is not None:
        ru = r if ratio_cap is None else r.clamp(max=ratio_cap)
        dual = (adv < 0) & (ru > dual_clip_c)
    return loss, _diagnostics(r, m, hit_low, hit_high, dual)


def _min_grad(a: Tensor, b: Tensor, da: Tensor, db: Tensor) -> Tensor:
    """Derivative of ``torch.minimum(a, b)`` as autograd takes it: ``da`` where ``a < b``,
    ``db`` where ``b < a``, the mean of the two at a tie."""
    return torch.where(a < b, da, torch.where(b < a, db, 0.5 * (da + db)))


def _fused_clip_loss(
    x: Tensor,
    log_ratio: Tensor,
    adv: Tensor,
    mf: Tensor,
    inside: Tensor,
    low: float | Tensor,
    high: float | Tensor,
    dual_clip_c: float | None,
    ratio_cap: float | None = None,
) -> KnownGradient:
    r""":func:`_masked_clip_loss` with its derivative in :math:`\log\pi_\theta` computed in the
    same elementwise pass, float arithmetic only (inputs from :func:`_prepare_fused`), returned
    as a :class:`KnownGradient` (attached to ``x`` by one multiplication in the backward instead
    of a graph of a dozen nodes).

    Same value, and the gradient as autograd takes it, ties included (the clip passes the
    gradient on its closed interval, ``minimum`` splits it at a tie): with
    :math:`u = wA` and :math:`c = \mathrm{clip}(w, l, h)A`, the derivative of
    :math:`-\min(u, c)` is :math:`-Aw\,[u \le c]` (where :math:`c < u` the ratio is outside
    :math:`[l, h]` and the clip passes nothing; a tie with :math:`A \ne 0` has :math:`w` in
    :math:`[l, h]`, both halves pass). The dual clip :math:`\min(\ell, -cA)` for :math:`A < 0`
    is :math:`\min(\ell, -c\min(A, 0))` (for :math:`A \ge 0`, :math:`\ell \le 0`); the TRL
    cap :math:`\min(w, \rho_{\text{cap}})` takes the general tie rule."""
    # the intermediates are fresh tensors of this call: updated in place where the operation
    # is the same (a new buffer per operation costs more than the operation on CPU)
    with torch.no_grad():
        w = torch.exp(log_ratio)
        a_w = adv * w  # d(w A) / d log pi
        ca = w.clamp(low, high).mul_(adv)
        if ratio_cap is None:
            ua = a_w
            factor = _fcmp(torch.le, ua, ca)
        else:
            unclipped = w.clamp(max=ratio_cap)
            ua = unclipped * adv
            u_pass = _fcmp(torch.le, w, ratio_cap)
            c_pass = _fcmp(torch.ge, w, low) * _fcmp(torch.le, w, high)
            lt, gt = _fcmp(torch.lt, ua, ca), _fcmp(torch.gt, ua, ca)
            factor = lt * u_pass + gt * c_pass + (1.0 - lt - gt) * 0.5 * (u_pass + c_pass)
        loss = torch.minimum(ua, ca).neg_()
        dual = None
        adv_neg = _fcmp(torch.lt, adv, 0.0)  # shared by the dual clip's and the low clip's count
        if dual_clip_c is not None:
            cap = adv.clamp(max=0.0).mul_(-dual_clip_c)
            half = _fcmp(torch.le, loss, cap).add_(_fcmp(torch.lt, loss, cap)).mul_(0.5)
            factor = factor.mul_(half)
            loss = torch.minimum(loss, cap, out=loss)
            unc = w if ratio_cap is None else w.clamp(max=ratio_cap)
            dual = _fcmp(torch.gt, unc, dual_clip_c).mul_(adv_neg)
        # adv and the log-ratio are 0 where masked, so loss and g are 0 there already (signed
        # zeros aside): no multiplication by the mask; a_w (= ua) is not read again
        g = a_w.mul_(factor).neg_().mul_(inside)
        diag = _fdiag(
            w,
            mf,
            _fcmp(torch.lt, w, low).mul_(adv_neg),
            _fcmp(torch.gt, w, high).mul_(_fcmp(torch.gt, adv, 0.0)),
            dual,
        )
    return KnownGradient(x, loss, g, diag)


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
