"""Closed-form fitness functions for testing and benchmarking the ES machinery.

They are picklable (plain dataclasses), so they run on every backend, including spawned worker
processes and Ray tasks. None of them trains a model; ``gbmpo.meta.fitness`` does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

__all__ = ["BusyFitness", "LinearFitness", "QuadraticFitness"]


@dataclass(frozen=True)
class QuadraticFitness:
    """f(theta) = offset - scale * ||theta - target||^2, maximised at ``target``."""

    target: np.ndarray
    scale: float = 1.0
    offset: float = 0.0

    def __call__(self, theta: np.ndarray) -> float:
        d = np.asarray(theta, dtype=np.float64) - self.target
        return float(self.offset - self.scale * np.dot(d, d))


@dataclass(frozen=True)
class LinearFitness:
    """f(theta) = offset + c . theta; its gradient is ``c`` everywhere."""

    c: np.ndarray
    offset: float = 0.0

    def __call__(self, theta: np.ndarray) -> float:
        return float(self.offset + np.dot(self.c, np.asarray(theta, dtype=np.float64)))


@dataclass(frozen=True)
class BusyFitness:
    """A CPU-bound stand-in for a training run: about ``seconds`` of torch matrix products.

    The work is a fixed number of ``size x size`` float64 products, calibrated once in the
    constructor (one thread, on this machine) unless ``repeats`` is given, so every member does
    the same amount of work whatever the load; the returned fitness is a quadratic in theta.
    """

    seconds: float = 1.0
    size: int = 96
    target: np.ndarray = field(default_factory=lambda: np.zeros(1))
    repeats: int = 0

    def __post_init__(self) -> None:
        if self.repeats <= 0:
            object.__setattr__(self, "repeats", self._calibrate())

    def _work(self, n: int) -> float:
        # deferred: torch is heavy; ES's workers import gbmpo.meta without it (pin threads first)
        import torch

        a = torch.full((self.size, self.size), 1.0 / self.size, dtype=torch.float64)
        x = torch.eye(self.size, dtype=torch.float64)
        for _ in range(n):
            x = a @ x
        return float(x[0, 0])

    def _fastest(self, n: int, trials: int = 3) -> float:
        best = float("inf")
        for _ in range(trials):
            t0 = time.perf_counter()
            self._work(n)
            best = min(best, time.perf_counter() - t0)
        return best

    def _calibrate(self) -> int:
        """Repeats for ``seconds`` on one thread: the fastest of 3 timings (the least disturbed
        by other load), since workers run members on one thread each."""
        # deferred: torch is heavy; ES's workers import gbmpo.meta without it
        import torch

        previous = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            n, elapsed = 8, 0.0
            while elapsed < 0.1:
                n *= 2
                elapsed = self._fastest(n)
        finally:
            torch.set_num_threads(previous)
        return max(1, int(n * self.seconds / elapsed))

    def __call__(self, theta: np.ndarray) -> float:
        self._work(self.repeats)
        t = np.asarray(theta, dtype=np.float64)
        d = t[: self.target.size] - self.target
        return float(-np.dot(d, d))
