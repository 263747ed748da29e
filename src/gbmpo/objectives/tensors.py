"""Shared tensor plumbing of the objectives: the compute dtype, mask checks, masking and the
masked mean.

Surrogates, regularizers and the loss all take a ``[B, T]`` {0, 1} completion mask; the
helpers here check it once (:func:`float_mask`), zero padded positions whatever they hold
(:func:`masked`) and average over valid tokens (:func:`masked_mean`).
"""

from __future__ import annotations

import math
import weakref

import torch
from torch import Tensor

__all__ = [
    "check_mask",
    "compute_dtype",
    "float_mask",
    "masked",
    "masked_mean",
    "sync_free",
]


def compute_dtype(*tensors: Tensor | None) -> torch.dtype:
    """The dtype the objectives compute in: float64 if any of ``tensors`` is float64, else
    float32 (bf16 / fp16 inputs are upcast, so a loss, a divergence or an advantage is never
    accumulated in half precision). ``None`` entries are skipped. The one place this rule lives:
    the surrogates, regularizers, aggregation, advantages, rollout correction, the
    full-vocabulary divergences and the log-prob kernels all ask it."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64
                                for t in tensors) else torch.float32  # fmt: skip


def sync_free(x: Tensor) -> bool:
    """Whether the objectives avoid reading a value of ``x`` back to the host: when ``x`` is
    off the CPU (each read stalls the device's queue until every launched kernel has run) or
    inside ``torch.compile`` (a data-dependent branch breaks the graph). Their CPU-tuned forms,
    a multiply checked by one finite sum instead of a ``where``, then take the ``where`` form
    directly: the same values (a masked entry may be +0 instead of -0)."""
    return x.device.type != "cpu" or torch.compiler.is_compiling()


def check_mask(mask: Tensor, shape: torch.Size) -> Tensor:
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"mask shape {tuple(mask.shape)} != logp shape {tuple(shape)}")
    if mask.dtype != torch.bool:
        if not torch.compiler.is_compiling() and not is_checked_mask(mask) \
                and not ((mask == 0) | (mask == 1)).all():  # fmt: skip
            raise ValueError("mask must contain only 0 and 1")
        mask = mask != 0
    return mask


def float_mask(mask: Tensor, shape: torch.Size, dtype: torch.dtype) -> Tensor:
    """``mask`` as a {0, 1} tensor of ``dtype`` after checking its shape and values. Float
    arithmetic on such a mask is several times faster on CPU than ``torch.where`` on a bool one.
    A float mask is checked as ``sum |m - m * m| == 0`` (true only for 0 and 1; NaN fails)."""
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"mask shape {tuple(mask.shape)} != logp shape {tuple(shape)}")
    if mask.dtype == torch.bool:
        return mask.to(dtype)
    mf = mask.to(dtype)
    if torch.compiler.is_compiling():  # checked outside the graph (compiled_policy_loss)
        return mf
    if not is_checked_mask(mf):
        if float((mf - mf * mf).abs().sum()) != 0.0:
            raise ValueError("mask must contain only 0 and 1")
        _remember_checked(mf)
    return mf


#: the float mask checked last, with its version counter: the policy loss checks its mask once and
#: hands the same tensor to the surrogate, the regularizers and the aggregation, which then skip
#: the four passes of the {0, 1} check (an in-place change of the mask bumps its version)
_CHECKED: tuple[weakref.ref[Tensor], int] | None = None


def _remember_checked(mf: Tensor) -> None:
    global _CHECKED
    _CHECKED = (weakref.ref(mf), mf._version)


def is_checked_mask(m: Tensor) -> bool:
    """Whether ``m`` is the float mask :func:`float_mask` checked last, unchanged since (same
    object, same version counter): its {0, 1} check need not run again."""
    c = _CHECKED
    return c is not None and c[0]() is m and c[1] == m._version


def masked(x: Tensor, mf: Tensor) -> Tensor:
    """``torch.where(mf != 0, x, 0)``: ``x`` at valid tokens (NaN and inf included, so a bad
    value is not hidden), 0 where masked whatever ``x`` holds there. Computed as ``x * mf``
    (a multiply instead of a ``where``, ~10x cheaper on CPU) when that is finite, which it is
    unless some entry of ``x`` is NaN or infinite."""
    if sync_free(x):
        return torch.where(mf != 0, x, torch.zeros((), dtype=x.dtype, device=x.device))
    y = x * mf
    if math.isfinite(float(y.detach().sum())):  # a finite sum has only finite terms
        return y
    return torch.where(mf != 0, x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    r"""Mean of ``x`` over the valid tokens, :math:`\sum_t m_t x_t / \max(1, \sum_t m_t)`, as a
    detached float32 0-dim tensor (0 on an empty mask); padded positions may hold anything,
    NaN and inf included (:func:`masked`)."""
    mf = mask.to(torch.float32)
    return masked(x.detach().to(torch.float32), mf).sum() / mf.sum().clamp_min(1.0)
