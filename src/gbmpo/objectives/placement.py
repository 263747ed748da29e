r"""``placement: advantage``: the divergence penalty added to the advantages after they are
normalised (FRPO, arXiv 2601.10201; docs/methods.md, "Where the divergence goes").

Per token, with the rollout's per-token divergence :math:`D_{i,s} = D(\pi_{old}\,\|\,
\pi_{ref})` on the sampled tokens (detached) and the group advantage :math:`A_i` (normalised or
not, as the objective's ``advantage`` says),

.. math::
    \tilde A_{i,t} = A_i - \sum_k \beta_k \sum_{s \ge t} m_{i,s}\, D^{(k)}_{i,s},

the future penalty from t on: a reward-to-go of the per-token penalty, so each token is charged
only for what it and the later tokens cost (the earlier ones do not depend on it). Because it is
added after :math:`A_i` is divided by the group's standard deviation, :math:`\beta` keeps its
scale under ``advantage: grpo``; ``placement: reward`` subtracts :math:`\beta\sum_t D_t` from
the reward *before* the normalisation, so there :math:`\beta` is divided by each group's
:math:`\sigma_g` (exact only with ``dr_grpo``, Dr. GRPO, arXiv 2503.20783).

With ``kl_k1`` (:math:`D = \log\pi_{old} - \log\pi_{ref}`) and an on-policy surrogate the
expected gradient is exactly :math:`\nabla_\theta(\mathbb E[\text{reward term}] -
\beta\,\mathrm{KL}(\pi_\theta\,\|\,\pi_{\text{ref}}))` over whole sequences (the past-only part
of the full-sequence score-function estimator has expectation 0), checked by enumeration in
``tests/objectives/test_placement.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["advantage_penalty", "future_sum"]


def future_sum(values: Tensor, mask: Tensor) -> Tensor:
    r""":math:`F_{i,t} = \sum_{s \ge t} m_{i,s} v_{i,s}` (``[B, T]``, detached; 0 where masked
    or beyond the end): the reversed cumulative sum of the masked per-token values."""
    with torch.no_grad():
        m = mask.to(torch.bool)
        v = torch.where(m, values.detach(), torch.zeros((), dtype=values.dtype,
                                                       device=values.device))
        out = v.flip(-1).cumsum(-1).flip(-1)
        return torch.where(m, out, torch.zeros((), dtype=out.dtype, device=out.device))


def advantage_penalty(
    advantages: Tensor, penalties: Sequence[tuple[float, Tensor]], mask: Tensor
) -> Tensor:
    r"""Per-token advantages :math:`\tilde A_{i,t} = A_{i(,t)} - \sum_k \beta_k F^{(k)}_{i,t}`
    (module docstring) from ``advantages`` ``[B]`` or ``[B, T]`` and ``penalties``
    ``(beta_k, D^(k) [B, T])`` pairs (per-token divergences of the rollout); ``[B, T]``,
    detached, 0 where masked. Returns the advantages' dtype."""
    b, t = mask.shape
    a = advantages.detach()
    if a.dim() == 1:
        if a.shape[0] != b:
            raise ValueError(f"advantages have shape {tuple(a.shape)}, expected [{b}]")
        a = a[:, None].expand(b, t)
    elif tuple(a.shape) != (b, t):
        raise ValueError(f"advantages have shape {tuple(a.shape)}, expected [{b}] or [{b}, {t}]")
    out = a.clone()
    for beta, values in penalties:
        if tuple(values.shape) != (b, t):
            raise ValueError(f"penalty values have shape {tuple(values.shape)}, expected "
                             f"[{b}, {t}]")  # fmt: skip
        out = out - beta * future_sum(values, mask).to(out.dtype)
    return torch.where(mask.to(torch.bool), out, torch.zeros((), dtype=out.dtype,
                                                               device=out.device))
