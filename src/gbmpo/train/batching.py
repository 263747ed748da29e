"""How a step's data is drawn and split: the seeded prompt order, derived seeds, the row order
of mini-batches, micro-batch chunks, and the accumulators that combine micro-batch results."""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

__all__ = ["BatchSizes", "DataError", "PromptSampler", "derive_seed", "row_order"]


class DataError(ValueError):
    """The task's data cannot be used (e.g. an empty split)."""


class PromptSampler:
    """Endless prompt indices: a fresh seeded permutation of ``range(n)`` per epoch.

    The whole state is ``position`` (prompts drawn so far), so resuming is exact.
    """

    def __init__(self, n: int, seed: int, position: int = 0) -> None:
        if n < 1:
            raise DataError("cannot sample prompts from an empty split")
        self.n, self.seed, self.position = n, seed, position
        self._epoch, self._perm = -1, torch.empty(0, dtype=torch.long)

    def _permutation(self, epoch: int) -> Tensor:
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(derive_seed(self.seed, "prompts", epoch))
            self._epoch, self._perm = epoch, torch.randperm(self.n, generator=gen)
        return self._perm

    def take(self, k: int) -> list[int]:
        out = []
        for _ in range(k):
            epoch, i = divmod(self.position, self.n)
            out.append(int(self._permutation(epoch)[i]))
            self.position += 1
        return out


def derive_seed(seed: int, *parts: int | str) -> int:
    """A 63-bit seed derived from the run seed and a purpose (stable across processes)."""
    words = [int(seed) & 0xFFFFFFFF]
    for p in parts:
        words.append(zlib.crc32(p.encode()) if isinstance(p, str) else int(p) & 0xFFFFFFFF)
    state = np.random.SeedSequence(words).generate_state(2, dtype=np.uint32)
    return int(state[0]) << 31 | int(state[1]) >> 1



class BatchSizes(NamedTuple):
    """Rows per part of a step's update (``optim.mini_batch_size`` / ``micro_batch_size``, or
    their defaults and the memory plan's)."""

    #: rows per optimizer step
    mini: int
    #: rows per forward and backward (gradient accumulation over a mini-batch)
    micro: int
    #: rows per no-grad log-prob pass (at least ``micro``: no backward is pending)
    inference: int


def row_order(
    n: int, mini_batch: int, seed: int, step: int, epoch: int, device: torch.device
) -> Tensor:
    """Rows in order for a single mini-batch; a seeded shuffle when there are several."""
    if mini_batch >= n:
        return torch.arange(n, device=device)
    gen = torch.Generator().manual_seed(derive_seed(seed, "rows", step, epoch))
    # drawn on the CPU (the same order on every device), then moved
    return torch.randperm(n, generator=gen).to(device)


def _chunks(n: int, size: int) -> Iterator[list[int]]:
    for s in range(0, n, size):
        yield list(range(s, min(n, s + size)))


@dataclass
class _Accumulator:
    """Combines per-micro-batch diagnostics: token-weighted means, max of ``*_max``, min of
    ``*_min``."""

    sums: dict[str, float]
    weights: dict[str, float]

    @classmethod
    def empty(cls) -> _Accumulator:
        return cls({}, {})

    def add(self, values: dict[str, float], weight: float) -> None:
        for k, v in values.items():
            if k.endswith("_max"):
                self.sums[k] = max(self.sums.get(k, -math.inf), v)
                self.weights[k] = 1.0
            elif k.endswith("_min"):
                self.sums[k] = min(self.sums.get(k, math.inf), v)
                self.weights[k] = 1.0
            else:
                self.sums[k] = self.sums.get(k, 0.0) + v * weight
                self.weights[k] = self.weights.get(k, 0.0) + weight

    def result(self) -> dict[str, float]:
        return {k: self.sums[k] / self.weights[k] if self.weights[k] else 0.0 for k in self.sums}


@dataclass
class _MiniBatchStats:
    """What :func:`gbmpo.train.step.accumulate_gradients` reports for one mini-batch."""

    logp: Tensor
    loss: float = 0.0
    pg_loss: float = 0.0
    entropy_sum: float = 0.0
