r"""What a gbmpo config becomes on TRL (``gbmpo train --engine trl``): the ``GBMPOConfig``
(a ``GRPOConfig``, :func:`grpo_args`) with its batch layout (:func:`batch_layout`), the learning
rate of every RL step (:func:`lr_at`), the PEFT config, the dataset and reward function, the
``accelerate launch`` command, and the checks that refuse a config before anything is written
(:func:`check_engine`). The run itself is :mod:`gbmpo.engines.trl_runner`.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gbmpo.config import ConfigError
from gbmpo.config.support import check_support
from gbmpo.rewards.scoring import score_completions
from gbmpo.train import schedule
from gbmpo.train.setup import eval_limit

__all__ = ["BatchLayout", "batch_layout", "check_engine", "eval_limit_of", "grpo_args",
           "host_settings", "launch_command", "lora_config", "lr_at", "reward_function",
           "train_dataset", "vllm_missing"]  # fmt: skip


@dataclass(frozen=True)
class BatchLayout:
    """TRL's batch settings for one RL step of a gbmpo config."""

    #: completions per process per forward/backward (TRL ``per_device_train_batch_size``)
    per_device: int
    #: micro-batches per optimizer step on each process
    grad_accum: int
    #: micro-steps per generation batch (TRL ``steps_per_generation``)
    steps_per_generation: int
    #: optimizer steps per RL step (``mu`` passes of ``batch / mini`` steps)
    optimizer_steps: int


def batch_layout(cfg: Any, world: int) -> BatchLayout:
    r"""The layout of one RL step on ``world`` processes.

    With :math:`N = PG` sequences per RL step, mini-batch :math:`M` (default :math:`N`) and
    micro-batch :math:`m` (default :math:`M/W`): each process runs :math:`M/(Wm)` micro-batches
    of :math:`m` per optimizer step, TRL generates :math:`N` completions every
    :math:`N/(Wm)` micro-steps, and an RL step has :math:`\mu N/M` optimizer steps.
    ``ConfigError`` names the setting when :math:`M` is not a multiple of :math:`W m`."""
    n = cfg.rollout.prompts_per_step * cfg.rollout.num_generations
    mini = cfg.optim.mini_batch_size or n
    if mini % world:
        raise ConfigError(
            f"'optim.mini_batch_size'={mini} must be a multiple of run.num_processes={world} "
            "(each process takes an equal share of every optimizer step)"
        )
    share = mini // world
    micro = min(cfg.optim.micro_batch_size or share, share)
    if share % micro:
        raise ConfigError(
            f"'optim.micro_batch_size'={micro} must divide the per-process mini-batch "
            f"{share} (optim.mini_batch_size / run.num_processes)"
        )
    return BatchLayout(
        per_device=micro,
        grad_accum=share // micro,
        steps_per_generation=n // (micro * world),
        optimizer_steps=(n // mini) * cfg.optim.mu,
    )


def grpo_args(cfg: Any, output_dir: str | Path, *, world: int = 1) -> Any:
    """The ``GBMPOConfig`` (a ``GRPOConfig``) that runs ``cfg`` on ``world`` processes.

    The learning rate of each RL step is set by :class:`_Schedule` (gbmpo's own schedule, per
    RL step, decaying over what actually runs), so TRL's scheduler is ``constant`` here."""
    # deferred: trl is optional (the trl extra)
    from gbmpo.integrations.trl import GBMPOConfig

    ro, opt, run = cfg.rollout, cfg.optim, cfg.run
    lay = batch_layout(cfg, world)
    k = lay.optimizer_steps
    on_cpu = cfg.model.device == "cpu"
    kw: dict[str, Any] = {
        "output_dir": str(output_dir),
        # the spec itself (GBMPOConfig builds it once; its monitor_regularizers decides whether
        # TRL loads the reference for reg/<name>, as on the own engine)
        "objective": cfg.objective,
        # TRL loads its reference model itself, with this flag (the policy comes loaded)
        "trust_remote_code": bool(cfg.model.trust_remote_code),
        # generation
        "num_generations": ro.num_generations,
        "max_completion_length": ro.max_new_tokens,
        "temperature": ro.temperature,
        "top_p": ro.top_p,
        "top_k": ro.top_k,
        "use_vllm": ro.generator == "vllm",
        "vllm_mode": ro.vllm_mode,
        "vllm_gpu_memory_utilization": ro.vllm_gpu_memory_utilization,
        "vllm_tensor_parallel_size": ro.vllm_tensor_parallel_size,
        "vllm_server_host": ro.vllm_server_host,
        "vllm_server_port": ro.vllm_server_port,
        # batches (batch_layout)
        "per_device_train_batch_size": lay.per_device,
        "gradient_accumulation_steps": lay.grad_accum,
        "steps_per_generation": lay.steps_per_generation,
        "num_iterations": opt.mu,
        # optimisation (steps are optimizer steps: k per RL step); the rate of each RL step
        # comes from gbmpo's schedule (_Schedule), over TRL's constant one
        "learning_rate": opt.lr,
        "lr_scheduler_type": "constant",
        "weight_decay": opt.weight_decay,
        "adam_beta1": opt.betas[0],
        "adam_beta2": opt.betas[1],
        "adam_epsilon": opt.eps,
        "max_grad_norm": opt.grad_clip if opt.grad_clip is not None else 0.0,
        "max_steps": run.steps * k,
        "seed": run.seed,
        # precision and device: full fine-tuning keeps fp32 weights (the optimizer's master
        # copy) and computes in bf16 under autocast; float16 is refused (support matrix)
        "bf16": cfg.model.dtype == "bfloat16",
        "fp16": False,
        "use_cpu": on_cpu,
        # TRL's default (memory for large models; no effect on results), spelled with the
        # name transformers 5 reads, so that it does not warn about the old one
        "activation_checkpointing": True,
        # logging and checkpoints: one log row per RL step; gbmpo's console shows RL steps
        "logging_steps": k,
        "report_to": list(run.report_to) or "none",
        "disable_tqdm": True,
        # checkpoint_every 0: the final checkpoint only (TRL saves at max_steps, and the time
        # budget's stop saves its step), as the own engine keeps its last step
        "save_strategy": "steps",
        "save_steps": (run.checkpoint_every or run.steps) * k,
        "save_total_limit": run.keep_checkpoints,
        "shuffle_dataset": True,
    }
    try:
        return GBMPOConfig(**kw)
    except ValueError as err:  # TRL's own checks (batch divisibility, vLLM, precision, ...)
        raise ConfigError(f"TRL's GRPOConfig rejects this configuration: {err}") from err


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
    cmd += ["--module", "gbmpo.engines.trl_runner", "--run-dir", str(run_dir)]
    if resuming:
        cmd += ["--resume-from", str(resume_from) if resume_from is not None else ""]
    return cmd
