"""verl's reward function for ``gbmpo train --engine verl``: the gbmpo task's own reward.

verl loads this file (``reward.custom_reward_function.path``, name ``compute_score``) and calls
``compute_score(data_source=..., solution_str=..., ground_truth=..., extra_info=...)`` per
response, with ``reward_kwargs`` merged in: here ``gbmpo_config``, the run's ``config.yaml``. The
task is built once per process from that config (its ``run.plugins`` imported first) and its
reward (math-verify for math tasks, the hardened sandbox for code, a user's
``module:function``) scores the response on the example's columns, which the data files carry in
``extra_info["columns"]``. Failures (``None``, NaN, an exception) score 0, as in the own
trainer (:func:`gbmpo.train.rewards.score_completions`).
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

__all__ = ["compute_score"]


@lru_cache(maxsize=4)
def _task(config_path: str) -> Any:
    from gbmpo.registry import add_plugin_modules
    from gbmpo.train.config import load_config
    from gbmpo.train.trainer import build_task

    cfg = load_config(config_path)
    add_plugin_modules(list(cfg.run.plugins))
    cfg.task.template = "base"  # the reward does not depend on how prompts are rendered
    task = build_task(cfg, None)
    if task.kind == "code":
        from gbmpo.rewards.sandbox import require_sandbox

        require_sandbox(cfg.run.allow_unsandboxed_code)
    return task


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
    gbmpo_config: str | None = None,
    **kwargs: Any,
) -> float:
    """The reward of ``solution_str`` under the gbmpo task of ``gbmpo_config`` (see the module
    doc); verl's custom reward-function signature."""
    from gbmpo.train.rewards import score_completions

    if gbmpo_config is None:
        raise ValueError(
            "gbmpo's verl reward needs reward_kwargs.gbmpo_config (the run's config.yaml); "
            "gbmpo train --engine verl sets it"
        )
    info = extra_info or {}
    columns = json.loads(info.get("columns") or "{}")
    prompt = info.get("prompt", "")
    scored = score_completions(
        _task(str(gbmpo_config)).reward, [prompt], [solution_str],
        {k: [v] for k, v in columns.items()},
    )  # fmt: skip
    return float(scored.rewards[0])
