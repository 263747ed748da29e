"""An example gbmpo plugin: a task, a reward and a regularizer (see ../../README.md)."""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any

import torch

from gbmpo.objectives import Regularizer
from gbmpo.tasks import Example, Task

__all__ = ["CountdownTask", "last_integer_reward", "log_huber", "make_log_huber"]


def last_integer_reward(
    prompts: Sequence[Any], completions: Sequence[str], answer: Sequence[Any], **_: Any
) -> list[float | None]:
    """TRL-style reward: 1.0 when the last integer in the completion equals ``answer``."""
    out: list[float | None] = []
    for completion, gold in zip(completions, answer, strict=True):
        found = re.findall(r"-?\d+", completion)
        out.append(1.0 if found and int(found[-1]) == int(gold) else 0.0)
    return out


class CountdownTask(Task):
    """Subtraction problems in the built-in task's format (``Q: ...\\nA:``, answer ``#### N``)."""

    name = "countdown"
    kind = "math"

    def __init__(self, num_train: int = 2000, num_test: int = 100, seed: int = 0) -> None:
        rng = random.Random(seed)
        problems = set()
        while len(problems) < num_train + num_test:
            a = rng.randrange(10, 100)
            problems.add((a, rng.randrange(1, a)))
        ordered = sorted(problems)
        rng.shuffle(ordered)
        self._splits = {"test": ordered[:num_test], "train": ordered[num_test:]}

    def split(self, name: str) -> list[Example]:
        if name not in self._splits:
            raise ValueError(f"countdown has no split {name!r}; valid splits: test, train")
        return [{"prompt": f"Q: Sam has {a} coins and spends {b}. How many coins are left?\nA:",
                 "answer": str(a - b)} for a, b in self._splits[name]]

    def reward(self, prompts: Sequence[str], completions: Sequence[str], **columns: Any
               ) -> list[float | None]:
        return last_integer_reward(prompts, completions, columns["answer"])


def log_huber(logp: torch.Tensor, anchor_logp: torch.Tensor, delta: float) -> torch.Tensor:
    """Huber(l - r): ½(l−r)² for |l−r| ≤ δ, δ(|l−r| − ½δ) beyond (a robust ``kl_k2``)."""
    return torch.nn.functional.huber_loss(logp, anchor_logp, reduction="none", delta=delta)


def make_log_huber(delta: float = 1.0) -> Regularizer:
    """Factory the ``gbmpo.regularizers`` entry point names: returns a :class:`Regularizer`."""
    if not delta > 0:
        raise ValueError(f"log_huber: delta must be > 0, got {delta}")
    return Regularizer("log_huber", lambda l, r, o: log_huber(l, r, delta),
                       params={"delta": delta})
