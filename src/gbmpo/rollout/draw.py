r"""Drawing a token from a row of logits: the sampling distribution (temperature, top-k, top-p),
inverse-CDF draws from given uniform numbers, and the log-prob of the drawn token.

Apart from :mod:`gbmpo.rollout.sampling` so that both decode loops (the lean one there and the
static-shape step of :mod:`gbmpo.rollout.static_decoder`) use the same functions without an
import circle. Every function here has static shapes (no host reads), so it can run inside a
captured CUDA graph.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["filter_logits", "sample_from_logits", "sampled_logprobs"]


def filter_logits(logits: Tensor, *, temperature: float = 1.0, top_k: int = 0,
                  top_p: float = 1.0) -> Tensor:
    r"""The logits of the sampling distribution, in float32: temperature, then top-k, then top-p.

    :math:`z \leftarrow z / T`; top-k keeps the ``k`` largest logits (ties at the k-th value
    kept; 0 = off); top-p (nucleus, 1 = off) removes the tokens whose cumulative probability,
    summed from the least likely upwards, is at most :math:`1-p`, so the kept set is the
    smallest most-likely set with mass :math:`\ge p` (the most likely token is always kept).
    Removed tokens get :math:`-\infty`. This is the order and the semantics of Hugging Face's
    ``TemperatureLogitsWarper``, ``TopKLogitsWarper`` and ``TopPLogitsWarper`` (Holtzman et al.
    2020 for nucleus sampling).
    """
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    vocab = z.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(z, top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, -math.inf)
    if top_p < 1.0:
        sorted_z, order = torch.sort(z, dim=-1, descending=False)
        cum = sorted_z.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cum <= 1 - top_p
        remove_sorted[..., -1:] = False
        remove = remove_sorted.scatter(-1, order, remove_sorted)
        z = z.masked_fill(remove, -math.inf)
    return z


def sample_from_logits(z: Tensor, uniform: Tensor) -> Tensor:
    r"""Inverse-CDF sampling: token :math:`i` with :math:`F_{i-1} \le u\,F_V < F_i`, where
    :math:`F_i=\sum_{v\le i}\operatorname{softmax}(z)_v` (accumulated in float64) and ``uniform``
    holds one :math:`u\sim U[0,1)` per row, so :math:`P(i)=\operatorname{softmax}(z)_i` and a
    token of probability 0 (logit :math:`-\infty`) is never drawn. ``z`` ``[N, V]``, returns
    ``[N]`` long."""
    cdf = torch.softmax(z.float(), dim=-1).double().cumsum_(dim=-1)
    total = cdf[:, -1:]
    # u * F < F, also after rounding, so the draw lands on a token of positive probability
    u = torch.minimum(uniform.to(cdf.dtype).reshape(-1, 1) * total,
                      torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_max(z.shape[-1] - 1)


def sampled_logprobs(z: Tensor, tokens: Tensor) -> Tensor:
    r""":math:`\log\mu(o) = z'_o - \operatorname{logsumexp}_v z'_v` in float32: the log-prob of
    each drawn token under the distribution it was drawn from, ``z`` ``[N, V]`` the filtered
    logits (:func:`filter_logits`: temperature, top-k, top-p; removed tokens at
    :math:`-\infty`), ``tokens`` ``[N]``. These are the sampler's log-probs that
    :mod:`gbmpo.objectives.rollout_correction` compares with the trainer's."""
    z = z.float()
    return z.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)
