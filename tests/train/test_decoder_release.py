"""When the trainer frees the static decoder's buffers (gbmpo.train.step.release_decoder_buffers):
per rollout by its prompt width's plan, and after an evaluation by the latest rollout's."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from gbmpo.config import TrainConfig
from gbmpo.train import step


def _batch(width: int) -> Any:
    return SimpleNamespace(prompt_ids=torch.zeros(2, width, dtype=torch.long))


def test_an_evaluation_follows_the_latest_rollouts_choice(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    freed: list[str] = []
    asked: list[int] = []

    def plan(cfg: Any, model_config: Any, width: int, device: Any, *, needs_ref: bool) -> bool:
        asked.append(width)
        return width > 64  # the wide prompts do not fit with the buffers kept

    monkeypatch.setattr(step, "releases_decoder_buffers", plan)
    monkeypatch.setattr(step, "release_static_decoder", lambda model: freed.append("x") or True)
    cfg, model, cpu = TrainConfig(), SimpleNamespace(config=None), torch.device("cpu")
    plans: dict[int, bool] = {}

    def after(batch: Any) -> bool:
        return step.release_decoder_buffers(cfg, model, batch, cpu, plans, needs_ref=False)

    assert after(_batch(100)) is True          # width 128: released
    assert after(_batch(30)) is False          # width 64: kept
    assert after(None) is False                # the evaluation follows width 64, the latest
    assert after(_batch(120)) is True          # width 128 again: from the memo
    assert after(None) is True                 # now the latest is width 128
    assert asked == [128, 64] and len(freed) == 3
