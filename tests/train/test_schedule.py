"""The learning-rate schedule (:func:`gbmpo.train.schedule.lr_at`) is the trainer's schedule as it
was a method of :class:`gbmpo.train.Trainer`: the table below is that method's output, written
down before it became a function of the settings, the step and the RL seconds, and is compared
bit for bit (the same float operations in the same order give the same doubles)."""

from __future__ import annotations

import pytest

from gbmpo.config import load_config
from gbmpo.train.schedule import lr_at

#: (step, RL seconds) at which each schedule is read
POINTS = [(0, 0.0), (1, 0.5), (3, 2.0), (4, 10.0), (7, 37.5), (9, 50.0), (13, 99.0),
          (14, 120.0), (900, 1.0)]

CASES = {
    "constant after a warm-up of 4": (
        [("optim.lr", "1e-3"), ("optim.warmup_steps", "4"), ("run.steps", "14"),
         ("optim.schedule", "constant"), ("run.time_budget_seconds", "null")],
        [0.00025, 0.0005, 0.001, 0.001, 0.001, 0.001, 0.001, 0.001, 0.001],
    ),
    "cosine over 14 steps to 0.1 lr": (
        [("optim.lr", "1e-3"), ("optim.warmup_steps", "4"), ("run.steps", "14"),
         ("optim.schedule", "cosine"), ("optim.min_lr_ratio", "0.1"),
         ("run.time_budget_seconds", "null")],
        [0.00025, 0.0005, 0.001, 0.001, 0.000814503363531613, 0.00055, 0.00012202456766718093,
         0.0001, 0.0001],
    ),
    "cosine ended by a 100 s budget": (
        [("optim.lr", "3e-6"), ("optim.warmup_steps", "2"), ("run.steps", "1000"),
         ("optim.schedule", "cosine"), ("run.time_budget_seconds", "100"),
         ("optim.min_lr_ratio", "0.05")],
        [1.5e-06, 3e-06, 2.997188088010287e-06, 2.930255535720594e-06, 2.120323891120253e-06,
         1.5750000000000002e-06, 1.5070315147883248e-07, 1.5000000000000002e-07,
         2.2002196689218914e-07],
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_schedule_gives_the_former_method_s_rates(name: str) -> None:
    overrides, expected = CASES[name]
    cfg = load_config(overrides=overrides)
    got = [lr_at(cfg.optim, cfg.run, step, seconds) for step, seconds in POINTS]
    assert got == expected


def test_the_budget_ends_the_decay_when_it_comes_first() -> None:
    """Step 900 of 1000 with 1 s used reads the steps (u = 0.9); at step 10 with 150 s of a
    100 s budget the decay is over (u clipped to 1: min_lr_ratio * lr)."""
    cfg = load_config(overrides=[("optim.lr", "1e-3"), ("optim.schedule", "cosine"),
                                 ("run.steps", "1000"), ("run.time_budget_seconds", "100")])
    assert lr_at(cfg.optim, cfg.run, 10, 150.0) == 0.0
    assert lr_at(cfg.optim, cfg.run, 10, 50.0) == pytest.approx(5e-4, rel=1e-12)
    assert lr_at(cfg.optim, cfg.run, 900, 1.0) > lr_at(cfg.optim, cfg.run, 900, 95.0)
