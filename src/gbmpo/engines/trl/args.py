r"""What a gbmpo config becomes on TRL (``gbmpo train --engine trl``): the ``GBMPOConfig``
(a ``GRPOConfig``, :func:`grpo_args`) with its batch layout (:func:`batch_layout`), the learning
rate of every RL step (:func:`lr_at`), the PEFT config, the dataset and reward function, the
``accelerate launch`` command, and the checks that refuse a config before anything is written
(:func:`check_engine`). The run itself is :mod:`gbmpo.engines.trl.runner`.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gbmpo.config import ConfigError
from gbmpo.config.hosts.trl import BatchLayout, batch_layout, grpo_kwargs
from gbmpo.config.support import check_support
from gbmpo.rewards.scoring import score_completions
from gbmpo.train import schedule
from gbmpo.train.setup import eval_limit

__all__ = ["BatchLayout", "batch_layout", "check_engine", "eval_limit_of", "grpo_args",
           "host_settings", "launch_command", "lora_config", "lr_at", "reward_function",
           "static_cache_length", "train_dataset", "vllm_missing"]  # fmt: skip


def grpo_args(cfg: Any, output_dir: str | Path, *, world: int = 1) -> Any:
    """The ``GBMPOConfig`` (a ``GRPOConfig``) that runs ``cfg`` on ``world`` processes: the
    fields of TRL's table (:func:`gbmpo.config.hosts.trl.grpo_kwargs`).

    The learning rate of each RL step is set by gbmpo's own schedule (per RL step, decaying over
    what actually runs, a callback), so TRL's scheduler is ``constant`` there."""
    # deferred: trl is optional (the trl extra)
    from gbmpo.engines.trl.config import GBMPOConfig

    kw = {"output_dir": str(output_dir), **grpo_kwargs(cfg, world)}
    try:
        return GBMPOConfig(**kw)
    except ValueError as err:  # TRL's own checks (batch divisibility, vLLM, precision, ...)
        raise ConfigError(f"TRL's GRPOConfig rejects this configuration: {err}") from err


def static_cache_length(prompts: Sequence[str], tokenizer: Any, max_new_tokens: int) -> int:
    """The length of TRL's static KV cache for a run: the longest prompt in tokens (TRL
    tokenizes a text prompt with the tokenizer's defaults) plus ``max_new_tokens``. Passed as
    ``generation_kwargs`` ``max_cache_len``, one cache length serves every generation batch,
    so transformers compiles the decode step once (a longer batch would recompile it)."""
    lengths = tokenizer(list(prompts))["input_ids"] if prompts else [[]]
    return max(len(ids) for ids in lengths) + max_new_tokens


def lr_at(cfg: Any, rl_step: int, rl_seconds: float) -> float:
    """The learning rate of RL step ``rl_step`` (0-based) after ``rl_seconds`` of RL: the own
    engine's schedule itself (:func:`gbmpo.train.schedule.lr_at`: warm-up, then constant or
    cosine decay whose progress is the larger of the step and time-budget fractions), so a run
    stopped by ``run.time_budget_seconds`` decays to ``min_lr_ratio * lr`` on both engines."""
    return schedule.lr_at(cfg.optim, cfg.run, rl_step, rl_seconds)


def lora_config(cfg: Any) -> Any:
    """The PEFT ``LoraConfig`` of ``cfg.lora`` (``None`` when LoRA is off)."""
    if not cfg.lora.enabled:
        return None
    # deferred: peft is optional (the trl extra)
    from peft import LoraConfig

    return LoraConfig(
        r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
        target_modules=list(cfg.lora.target_modules), task_type="CAUSAL_LM",
    )  # fmt: skip


def host_settings(cfg: Any, output_dir: str | Path = "unused") -> dict[str, Any]:
    """What ``cfg`` becomes on TRL, in one dict (for the support-matrix tests): the
    ``GRPOConfig`` fields, the PEFT config, the engine's own callbacks' settings (evaluation
    schedule, limit, time budget) and the learning rate at a few (RL step, seconds) points."""
    args = grpo_args(cfg, output_dir, world=1).to_dict()
    args.pop("output_dir", None)
    lora = lora_config(cfg)
    ev = cfg.eval
    return {
        "grpo": args,
        "lora": None if lora is None else lora.to_dict(),
        "eval": {
            "every": ev.every,
            "before": ev.before,
            "after": ev.after,
            "drift": ev.drift,
            "split": ev.split,
            "max_new_tokens": ev.max_new_tokens,
            "samples": ev.samples,
            "limit": eval_limit_of(cfg, 10_000),
        },
        "time_budget_seconds": cfg.run.time_budget_seconds,
        "lr": [lr_at(cfg, s, t) for s, t in ((0, 0.0), (1, 1.0), (5, 30.0), (50, 100.0))],
        "model": {"path": cfg.model.path, "trust_remote_code": cfg.model.trust_remote_code},
        "task": {
            "name": cfg.task.name,
            "params": cfg.task.params,
            "train_split": cfg.task.train_split,
            "template": cfg.task.template,
        },
        "run": {
            "output_dir": cfg.run.output_dir,
            "plugins": cfg.run.plugins,
            "allow_unsandboxed_code": cfg.run.allow_unsandboxed_code,
        },
        "launch": launch_command(cfg, Path("RUN_DIR")),
    }


def eval_limit_of(cfg: Any, n_eval: int) -> int | None:
    """Examples per evaluation: the own engine's rule (:func:`gbmpo.train.setup.eval_limit`)."""
    return eval_limit(cfg, n_eval)


def check_vllm(cfg: Any) -> None:
    """``ConfigError`` for a bad vLLM setting (values TRL would take and fail on later)."""
    ro = cfg.rollout
    if ro.vllm_mode not in ("colocate", "server"):
        raise ConfigError(f"'rollout.vllm_mode' must be colocate or server, got {ro.vllm_mode!r}")
    if not 0 < ro.vllm_gpu_memory_utilization <= 1:
        raise ConfigError(
            "'rollout.vllm_gpu_memory_utilization' must be in (0, 1], got "
            f"{ro.vllm_gpu_memory_utilization}"
        )
    if ro.vllm_tensor_parallel_size < 1:
        raise ConfigError(
            f"'rollout.vllm_tensor_parallel_size' must be >= 1, got {ro.vllm_tensor_parallel_size}"
        )
    if not 0 < ro.vllm_server_port < 65536:
        raise ConfigError(
            f"'rollout.vllm_server_port' must be a TCP port, got {ro.vllm_server_port}"
        )


def vllm_missing(cfg: Any) -> str | None:
    """Why ``rollout.generator: vllm`` cannot run here (``None`` when it can, or is not asked)."""
    if cfg.rollout.generator != "vllm" or importlib.util.find_spec("vllm") is not None:
        return None
    return ("rollout.generator 'vllm' on engine 'trl' needs the vllm package, which is not "
            "installed here (pip install vllm; GPU machines only)")  # fmt: skip


def check_engine(cfg: Any) -> list[str]:
    """Everything refused before a TRL run writes anything: the support matrix
    (:func:`gbmpo.config.support.check_support`), the vLLM settings and the batch layout;
    returns the support matrix's no-effect notices."""
    notices = check_support(cfg, "trl")
    check_vllm(cfg)
    batch_layout(cfg, cfg.run.num_processes)
    return notices


def train_dataset(examples: Sequence[dict[str, Any]]) -> Any:
    """The task's examples as a ``datasets.Dataset`` (``prompt`` plus the reward's columns)."""
    # deferred: datasets is optional (the trl extra)
    from datasets import Dataset

    return Dataset.from_list([dict(ex) for ex in examples])


def reward_function(task: Any, columns: Sequence[str]) -> Callable[..., list[float]]:
    """A TRL reward function computing ``task.reward`` on the completions, with the dataset's
    ``columns``; per-sample failures (``None``, NaN, an exception) score 0 as in the own
    trainer (:func:`gbmpo.rewards.scoring.score_completions`); the function's ``failures``
    attribute counts them (this process's)."""
    def gbmpo_reward(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
        cols = {c: list(kwargs[c]) for c in columns if c in kwargs}
        scored = score_completions(task.reward, list(prompts), list(completions), cols)
        gbmpo_reward.failures += scored.failures  # type: ignore[attr-defined]
        return scored.rewards

    gbmpo_reward.failures = 0  # type: ignore[attr-defined]
    gbmpo_reward.__name__ = f"{getattr(task, 'name', 'task')}_reward"
    return gbmpo_reward



def launch_command(cfg: Any, run_dir: Path, *, resume_from: Path | None = None,
                   resuming: bool = False) -> list[str]:  # fmt: skip
    """The ``accelerate launch`` command running this module's worker on
    ``run.num_processes`` processes (gloo on CPU, one GPU each otherwise); ``resuming``: the
    worker continues the run from the checkpoint ``resume_from`` (``None``: from the start)."""
    n = cfg.run.num_processes
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(n),
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]  # fmt: skip
    if n > 1:
        cmd.append("--multi_gpu")  # accelerate's multi-process flag; CPU comes from use_cpu
    if cfg.model.device == "cpu":
        cmd += ["--num_cpu_threads_per_process", str(cfg.run.num_threads or 1)]
    cmd += ["--module", "gbmpo.engines.trl.runner", "--run-dir", str(run_dir)]
    if resuming:
        cmd += ["--resume-from", str(resume_from) if resume_from is not None else ""]
    return cmd
