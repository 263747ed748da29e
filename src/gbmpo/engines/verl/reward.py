"""verl's reward function for ``gbmpo train --engine verl``: the gbmpo task's own reward.

verl loads this file (``reward.custom_reward_function.path``, name ``compute_score``) and calls
``compute_score(data_source=..., solution_str=..., ground_truth=..., extra_info=...)`` per
response, with ``reward_kwargs`` merged in: here ``gbmpo_config``, the run's ``config.yaml``. The
task is built once per process from that config (its ``run.plugins`` imported first) and its
reward (math-verify for math tasks, the hardened sandbox for code, a user's
``module:function``) scores the response on the example's columns, which the data files carry in
``extra_info["columns"]``. Failures (``None``, NaN, an exception) score 0, as in the own
trainer (:func:`gbmpo.rewards.scoring.score_completions`).

The result is ``{"score": reward, "acc": correct}`` (training rows add ``gbmpo_reward_failed``,
1.0 for a failure, which the driver hooks count per step: :mod:`gbmpo.engines.verl.driver`):
verl trains on ``score`` and reports the
mean of ``acc`` over the validation set as ``val-core/<data_source>/acc/mean@1``. On the
held-out rows (``extra_info["split"] == "test"``) both come from the own evaluation's grading
(:func:`gbmpo.eval.evaluation.score_samples`: the task's ``grade`` where it has one), so that
mean is the own engine's ``accuracy`` (``pass@1`` for code tasks) and ``score`` its reward; on
the training rows ``acc`` is ``reward >= 1``.
"""

from __future__ import annotations

import json
import math
import threading
from functools import lru_cache
from typing import Any

from gbmpo.engines.verl.driver import FAILED_KEY
from gbmpo.eval.evaluation import score_samples
from gbmpo.registry import add_plugin_modules
from gbmpo.rewards.scoring import RewardError, score_completions
from gbmpo.sandbox import require_sandbox

__all__ = ["compute_score"]


#: verl's reward workers call ``compute_score`` from a thread pool: the task is built once
_TASK_LOCK = threading.Lock()


def _task(config_path: str) -> Any:
    with _TASK_LOCK:
        return _build_task(config_path)


@lru_cache(maxsize=4)
def _build_task(config_path: str) -> Any:
    # deferred: gbmpo.config, gbmpo.train import torch; verl loads this file without them
    from gbmpo.config import load_config
    from gbmpo.train.setup import build_task

    cfg = load_config(config_path)
    add_plugin_modules(list(cfg.run.plugins))
    cfg.task.template = "base"  # the reward does not depend on how prompts are rendered
    task = build_task(cfg, None)
    if task.kind == "code":
        require_sandbox(cfg.run.allow_unsandboxed_code)
    return task


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
    gbmpo_config: str | None = None,
    **kwargs: Any,
) -> dict[str, float]:
    """``{"score": reward, "acc": correct}`` of ``solution_str`` under the gbmpo task of
    ``gbmpo_config`` (see the module doc); verl's custom reward-function signature."""
    if gbmpo_config is None:
        raise ValueError(
            "gbmpo's verl reward needs reward_kwargs.gbmpo_config (the run's config.yaml); "
            "gbmpo train --engine verl sets it"
        )
    info = extra_info or {}
    columns = json.loads(info.get("columns") or "{}")
    prompt = info.get("prompt", "")
    task = _task(str(gbmpo_config))
    if info.get("split") == "test":  # held-out: the own evaluation's grading
        graded = score_samples(task, [solution_str], [{**columns, "prompt": prompt}])[0]
        reward = graded.get("reward")
        return {"score": float(reward) if _finite(reward) else 0.0,
                "acc": float(bool(graded.get("correct")))}  # fmt: skip
    try:
        scored = score_completions(
            task.reward, [prompt], [solution_str], {k: [v] for k, v in columns.items()}
        )
    except RewardError:  # verl scores one completion at a time: a failure of this one; a step
        # whose every completion fails stops the run in the driver (gbmpo.engines.verl.driver)
        return {"score": 0.0, "acc": 0.0, FAILED_KEY: 1.0}
    reward = float(scored.rewards[0])
    return {"score": reward, "acc": float(reward >= 1.0), FAILED_KEY: float(scored.failures)}


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(float(x))
