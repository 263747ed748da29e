"""``optim.schedule`` / ``warmup_steps`` on verl: verl's own LR scheduler
(``verl.utils.torch_functional.get_cosine_schedule_with_warmup``, built from the overrides as
verl's FSDP engine builds it) gives the own engine's rate (``gbmpo.train.schedule.lr_at``) at
every step."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("verl")

import torch  # noqa: E402

from gbmpo.config import load_config  # noqa: E402
from gbmpo.engines.verl.args import schedule_overrides  # noqa: E402
from gbmpo.train.schedule import lr_at  # noqa: E402


def _verl_rates(ov: list[str], lr: float, steps: int) -> list[float]:
    from verl.utils.torch_functional import get_cosine_schedule_with_warmup

    kv = {o.split("=", 1)[0].rsplit(".", 1)[1]: o.split("=", 1)[1] for o in ov}
    assert kv["lr_scheduler_type"] == "cosine"
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = get_cosine_schedule_with_warmup(
        optimizer=opt, num_warmup_steps=int(kv["lr_warmup_steps"]), num_training_steps=steps,
        min_lr_ratio=float(kv["min_lr_ratio"]),
        zero_indexed_step=kv["zero_indexed_step"] == "true",
    )  # fmt: skip
    rates = []
    for _ in range(steps):  # verl steps its scheduler once per RL step, after the update
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return rates


def _own_rates(cfg: Any) -> list[float]:
    return [lr_at(cfg.optim, cfg.run, s, 0.0) for s in range(cfg.run.steps)]


@pytest.mark.parametrize(
    ("schedule", "warmup", "min_ratio"),
    [("constant", 10, 0.0), ("constant", 3, 0.5), ("constant", 0, 0.0), ("cosine", 0, 0.0),
     ("cosine", 0, 0.1)],
)  # fmt: skip
def test_verl_schedule_is_the_own_engines(schedule: str, warmup: int, min_ratio: float) -> None:
    cfg = load_config(None, [("optim.schedule", schedule), ("optim.warmup_steps", warmup),
                             ("optim.min_lr_ratio", min_ratio), ("run.steps", 20),
                             ("run.time_budget_seconds", None), ("optim.lr", 1e-3)])  # fmt: skip
    own = _own_rates(cfg)
    got = _verl_rates(schedule_overrides(cfg), cfg.optim.lr, cfg.run.steps)
    assert got == pytest.approx(own, rel=1e-12, abs=1e-15)
    if warmup:
        assert got[0] == pytest.approx(cfg.optim.lr / warmup)  # (s+1)/w: not 0 at the first step
