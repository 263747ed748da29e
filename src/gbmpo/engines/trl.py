r"""``gbmpo train --engine trl``: TRL's ``GRPOTrainer`` (with gbmpo's loss) from a gbmpo config.

What the config becomes:

* ``objective`` -> ``GBMPOConfig(objective=...)`` (the spec itself; TRL's ``loss_type`` and
  ``scale_rewards`` follow from its aggregation and advantage);
* ``model`` -> the policy, loaded as the own trainer loads it; ``lora`` -> a PEFT config;
* ``task`` -> a ``datasets.Dataset`` of the task's prompts (rendered exactly as the own trainer
  renders them) and its other columns; the task's reward -> a TRL reward function
  (:func:`reward_function`: failures count as 0, as in the own trainer);
* ``rollout`` / ``optim`` -> ``GRPOConfig`` (:func:`batch_layout` for the batch sizes:
  one RL step = one generation batch of ``prompts_per_step * num_generations`` completions,
  ``mu`` passes over it in optimizer steps of ``mini_batch_size`` sequences, each the sum of
  micro-batches of ``micro_batch_size`` per process); ``rollout.engine: vllm`` -> TRL's vLLM
  generation (``vllm_mode="colocate"``);
* ``run.num_processes`` > 1 -> ``accelerate launch`` of this module (gloo on CPU).

The run directory is the own engine's: ``config.yaml``, ``metrics.jsonl`` (one row per RL step:
``loss``, ``reward_mean``, ``reg/<name>``, ``lr``, ... and the ``eval/*`` rows),
``summary.json`` (``eval_before`` / ``eval_after`` from :func:`gbmpo.eval.evaluate`), ``model/``;
TRL's own checkpoints go to ``checkpoints/``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gbmpo.engines.checks import (
    DryRunReport,
    EngineUnavailable,
    common_checks,
    run_identity,
    without_missing_mirror,
    write_summary,
)

__all__ = ["BatchLayout", "batch_layout", "dry_run", "grpo_args", "launch_command",
           "reward_function", "run", "train_dataset"]  # fmt: skip

#: TRL metric names -> the own engine's metrics.jsonl names
_RENAMES = {"reward": "reward_mean", "reward_std": "reward_std", "learning_rate": "lr",
            "completions/mean_length": "response_length_mean",
            "completions/max_length": "response_length_max"}  # fmt: skip


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
    from gbmpo.train.config import ConfigError

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
    """The ``GBMPOConfig`` (a ``GRPOConfig``) that runs ``cfg`` on ``world`` processes."""
    from gbmpo.integrations.trl import GBMPOConfig

    ro, opt, run = cfg.rollout, cfg.optim, cfg.run
    lay = batch_layout(cfg, world)
    k = lay.optimizer_steps
    if opt.schedule == "cosine":
        scheduler, sched_kw = "cosine_with_min_lr", {"min_lr_rate": opt.min_lr_ratio}
    else:
        scheduler, sched_kw = ("constant_with_warmup" if opt.warmup_steps else "constant"), {}
    on_cpu = cfg.model.device == "cpu"
    kw: dict[str, Any] = {
        "output_dir": str(output_dir),
        "objective": cfg.objective.to_dict(),
        # generation
        "num_generations": ro.num_generations,
        "max_completion_length": ro.max_new_tokens,
        "temperature": ro.temperature,
        "top_p": ro.top_p,
        "top_k": ro.top_k,
        "use_vllm": ro.engine == "vllm",
        "vllm_mode": "colocate",
        # batches (batch_layout)
        "per_device_train_batch_size": lay.per_device,
        "gradient_accumulation_steps": lay.grad_accum,
        "steps_per_generation": lay.steps_per_generation,
        "num_iterations": opt.mu,
        # optimisation (steps are optimizer steps: k per RL step)
        "learning_rate": opt.lr,
        "lr_scheduler_type": scheduler,
        "lr_scheduler_kwargs": sched_kw,
        "warmup_steps": opt.warmup_steps * k,
        "weight_decay": opt.weight_decay,
        "adam_beta1": opt.betas[0],
        "adam_beta2": opt.betas[1],
        "adam_epsilon": opt.eps,
        "max_grad_norm": opt.grad_clip if opt.grad_clip is not None else 0.0,
        "max_steps": run.steps * k,
        "seed": run.seed,
        # precision and device
        "bf16": cfg.model.dtype == "bfloat16" and not on_cpu,
        "fp16": cfg.model.dtype == "float16" and not on_cpu,
        "use_cpu": on_cpu,
        # logging and checkpoints: one log row per RL step
        "logging_steps": k,
        "report_to": list(run.report_to) or "none",
        "disable_tqdm": not run.progress,
        "save_strategy": "steps" if run.checkpoint_every else "no",
        "save_steps": max(run.checkpoint_every, 1) * k,
        "save_total_limit": run.keep_checkpoints,
        "shuffle_dataset": True,
    }
    try:
        return GBMPOConfig(**kw)
    except ValueError as err:  # TRL's own checks (batch divisibility, vLLM, precision, ...)
        from gbmpo.train.config import ConfigError

        raise ConfigError(f"TRL's GRPOConfig rejects this configuration: {err}") from err


def train_dataset(examples: Sequence[dict[str, Any]]) -> Any:
    """The task's examples as a ``datasets.Dataset`` (``prompt`` plus the reward's columns)."""
    from datasets import Dataset

    return Dataset.from_list([dict(ex) for ex in examples])


def reward_function(task: Any, columns: Sequence[str]) -> Callable[..., list[float]]:
    """A TRL reward function computing ``task.reward`` on the completions, with the dataset's
    ``columns``; per-sample failures (``None``, NaN, an exception) score 0 as in the own
    trainer (:func:`gbmpo.train.rewards.score_completions`)."""
    from gbmpo.train.rewards import score_completions

    def gbmpo_reward(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
        cols = {c: list(kwargs[c]) for c in columns if c in kwargs}
        return score_completions(task.reward, list(prompts), list(completions), cols).rewards

    gbmpo_reward.__name__ = f"{getattr(task, 'name', 'task')}_reward"
    return gbmpo_reward


# ------------------------------------------------------------------------------ dry run


def dry_run(cfg: Any) -> DryRunReport:
    """Engine-independent checks plus the ``GRPOConfig`` this config becomes (and vLLM when
    ``rollout.engine: vllm``); GPU-only parts are reported as skipped."""
    import importlib.util
    import tempfile

    report = DryRunReport("trl")
    common_checks(cfg, report)
    if importlib.util.find_spec("trl") is None:
        raise EngineUnavailable("engine trl needs TRL: pip install 'gbmpo[trl]'")
    world = cfg.run.num_processes
    lay = batch_layout(cfg, world)
    probe = without_missing_mirror(cfg)
    on_gpu = cfg.model.device.startswith("cuda")
    import torch

    if on_gpu and not torch.cuda.is_available():
        import copy

        probe = copy.deepcopy(probe)
        probe.model.device = "cpu"  # the GRPOConfig itself, without the GPU-only settings
        report.skip("GRPOConfig on cuda", "bf16 / fp16 / CUDA settings need a GPU here")
    with tempfile.TemporaryDirectory() as tmp:
        # TRL sizes the generation batch with the processes that build the config: here one, so
        # the GRPOConfig is checked with the 1-process layout and the N-process layout above
        args = grpo_args(probe, tmp, world=1)
    report.ok(
        "GRPOConfig",
        f"loss_type {args.loss_type}, scale_rewards {args.scale_rewards}, "
        f"{lay.per_device} x {lay.grad_accum} x {world} per optimizer step, "
        f"{lay.optimizer_steps} optimizer steps per RL step, max_steps {args.max_steps}",
    )
    if cfg.rollout.engine == "vllm":
        if importlib.util.find_spec("vllm") is None:
            report.skip("vllm", "use_vllm=True, vllm_mode=colocate: vllm is not installed here")
        else:
            report.ok("vllm", "use_vllm=True, vllm_mode=colocate")
    if world > 1:
        report.ok("launch", " ".join(launch_command(cfg, Path("RUN_DIR"))))
    return report


# ------------------------------------------------------------------------------ the run


def launch_command(cfg: Any, run_dir: Path) -> list[str]:
    """The ``accelerate launch`` command running this module's worker on
    ``run.num_processes`` processes (gloo on CPU, one GPU each otherwise)."""
    n = cfg.run.num_processes
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(n),
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]  # fmt: skip
    if n > 1:
        cmd.append("--multi_gpu")  # accelerate's multi-process flag; CPU comes from use_cpu
    if cfg.model.device == "cpu":
        cmd += ["--num_cpu_threads_per_process", str(cfg.run.num_threads or 1)]
    cmd += ["--module", "gbmpo.engines.trl", "--run-dir", str(run_dir)]
    return cmd


def run(cfg: Any) -> dict[str, Any]:
    """Train ``cfg`` with TRL; returns the summary (also written to ``summary.json``).

    One process: in this process. Several: ``accelerate launch`` of :func:`main` on the run
    directory's ``config.yaml`` (this process waits and reads back the summary)."""
    import importlib.util

    from gbmpo.io import is_nonempty, write_atomic
    from gbmpo.train.config import ConfigError, dump_yaml, validate
    from gbmpo.train.trainer import default_run_dir

    if importlib.util.find_spec("trl") is None:
        raise EngineUnavailable("engine trl needs TRL: pip install 'gbmpo[trl]'")
    validate(cfg)
    batch_layout(cfg, cfg.run.num_processes)  # batch errors before anything is written
    run_dir = Path(cfg.run.output_dir) if cfg.run.output_dir else default_run_dir(cfg)
    if is_nonempty(run_dir):
        raise ConfigError(
            f"output directory {str(run_dir)!r} already exists and is not empty; choose another "
            "--output-dir"
        )
    cfg.run.output_dir = str(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(run_dir / "config.yaml", dump_yaml(cfg))
    if cfg.run.num_processes == 1:
        return train_in_process(cfg, run_dir)
    env = {**os.environ, "ACCELERATE_USE_CPU": "true"} if cfg.model.device == "cpu" else None
    proc = subprocess.run(launch_command(cfg, run_dir), env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"the TRL workers failed (exit {proc.returncode}); see above")
    import json

    return dict(json.loads((run_dir / "summary.json").read_text()))


class _RunDirCallback:
    """Writes TRL's logs as metrics.jsonl rows (main process) and stops at the time budget."""

    def __init__(self, writer: Any, steps_per_rl: int, budget: float | None) -> None:
        self.writer, self.k, self.budget = writer, steps_per_rl, budget
        self.t0 = time.perf_counter()
        self.rl_seconds = 0.0
        self.stop_reason = "steps"

    def as_trainer_callback(self) -> Any:
        from transformers import TrainerCallback

        outer = self

        class Callback(TrainerCallback):  # type: ignore[misc]
            def on_log(self, args: Any, state: Any, control: Any, logs: Any = None,
                       **kw: Any) -> None:  # fmt: skip
                if logs is None or "loss" not in logs or outer.writer is None:
                    return
                record: dict[str, Any] = {"step": math.ceil(state.global_step / outer.k)}
                for key, value in logs.items():
                    name = _RENAMES.get(key, key)
                    if name.startswith("regularizer/"):
                        name = "reg/" + name.split("/", 1)[1]
                    record[name] = value
                record["time/rl_seconds"] = time.perf_counter() - outer.t0
                outer.writer.write(record)

            def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                outer.rl_seconds = time.perf_counter() - outer.t0
                if outer.budget is None or state.global_step % outer.k:
                    return
                stop = outer.rl_seconds >= outer.budget
                import torch.distributed as dist

                if dist.is_available() and dist.is_initialized():  # every process agrees
                    import torch

                    on_gpu = dist.get_backend() == "nccl"  # NCCL reduces CUDA tensors only
                    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else None
                    flag = torch.tensor([float(stop)], device=device)
                    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                    stop = bool(flag.item())
                if stop:
                    outer.stop_reason = "time_budget"
                    control.should_training_stop = True

        return Callback()


def _evaluate(cfg: Any, model: Any, tokenizer: Any, task: Any, split: str) -> dict[str, Any]:
    from gbmpo.eval import evaluate

    ev = cfg.eval
    result = evaluate(
        model, tokenizer, task, split=split, limit=ev.limit, samples=1, temperature=0.0,
        max_new_tokens=ev.max_new_tokens, batch_size=ev.batch_size,
        engine="gbmpo" if cfg.rollout.engine == "vllm" else cfg.rollout.engine,
    )  # fmt: skip
    metrics = result["metrics"].items()
    return {
        k: v
        for k, v in metrics
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "seconds"
    }


def train_in_process(cfg: Any, run_dir: Path) -> dict[str, Any]:
    """The TRL run of ``cfg`` in this process (one of ``run.num_processes`` under
    ``accelerate launch``); the main process writes the run directory."""
    import torch
    from accelerate import PartialState

    from gbmpo.integrations.trl import GBMPOTrainer
    from gbmpo.models import load_model_and_tokenizer
    from gbmpo.train.logging import MetricsWriter
    from gbmpo.train.trainer import build_task, load_splits, load_tokenizer

    t0 = time.perf_counter()
    if cfg.run.num_threads is not None:
        torch.set_num_threads(cfg.run.num_threads)
    state = PartialState(cpu=cfg.model.device == "cpu")
    main = state.is_main_process
    task = build_task(cfg, load_tokenizer(cfg))
    if task.kind == "code":
        from gbmpo.rewards.sandbox import require_sandbox

        require_sandbox(cfg.run.allow_unsandboxed_code)
    train, _, (_, eval_split) = load_splits(cfg, task)
    dtype = cfg.model.dtype
    if not cfg.lora.enabled and dtype != "float32" and state.device.type == "cuda":
        # full fine-tuning: fp32 master weights, bf16 / fp16 compute through TRL's autocast
        # (GRPOConfig bf16 / fp16), so that small updates are not rounded away
        dtype = "float32"
    model, tokenizer = load_model_and_tokenizer(
        cfg.model.path, dtype=getattr(torch, dtype), device=str(state.device),
        trust_remote_code=cfg.model.trust_remote_code,
    )  # fmt: skip
    writer = MetricsWriter(run_dir) if main else None
    eval_before = None
    if cfg.eval.before and main:
        t = time.perf_counter()
        eval_before = _evaluate(cfg, model, tokenizer, task, eval_split)
        writer.write({"step": 0, **{f"eval/{k}": v for k, v in eval_before.items()},  # type: ignore[union-attr]
                      "time/eval_seconds": time.perf_counter() - t})  # fmt: skip
    state.wait_for_everyone()

    dataset = train_dataset(train)
    columns = [c for c in dataset.column_names if c != "prompt"]
    args = grpo_args(cfg, run_dir / "checkpoints", world=state.num_processes)
    peft_config = None
    if cfg.lora.enabled:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
            target_modules=list(cfg.lora.target_modules), task_type="CAUSAL_LM",
        )  # fmt: skip
    lay = batch_layout(cfg, state.num_processes)
    callback = _RunDirCallback(writer, lay.optimizer_steps, cfg.run.time_budget_seconds)
    trainer = GBMPOTrainer(
        model=model,
        reward_funcs=[reward_function(task, columns)],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[callback.as_trainer_callback()],
    )
    trainer.train()
    steps = math.ceil(trainer.state.global_step / lay.optimizer_steps)

    summary: dict[str, Any] = {}
    if main:
        assert writer is not None
        policy = trainer.accelerator.unwrap_model(trainer.model)
        policy.eval()
        eval_after = None
        if cfg.eval.after:
            t = time.perf_counter()
            eval_after = _evaluate(cfg, policy, tokenizer, task, eval_split)
            writer.write({"step": steps, **{f"eval/{k}": v for k, v in eval_after.items()},
                          "time/eval_seconds": time.perf_counter() - t})  # fmt: skip
        writer.close()
        out = run_dir / "model"
        policy.save_pretrained(out)
        tokenizer.save_pretrained(out)
        summary = _summary(cfg, run_dir, steps, callback, eval_before, eval_after, t0)
        summary["world_size"] = state.num_processes  # processes that trained (accelerate)
        write_summary(run_dir, summary)
    state.wait_for_everyone()
    if main and not cfg.run.checkpoint_every:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return summary


def _summary(cfg: Any, run_dir: Path, steps: int, callback: _RunDirCallback,
             before: dict[str, Any] | None, after: dict[str, Any] | None,
             t0: float) -> dict[str, Any]:  # fmt: skip
    summary: dict[str, Any] = {
        "status": "finished",
        "engine": "trl",
        "steps": steps,
        "stop_reason": callback.stop_reason,
        "wall_seconds": time.perf_counter() - t0,
        "rl_seconds": callback.rl_seconds,
        "eval_before": before,
        "eval_after": after,
        **run_identity(cfg),
        "num_processes": cfg.run.num_processes,
        "finished": _dt.datetime.now().isoformat(timespec="seconds"),
        "run_dir": str(run_dir),
        "final_model": str(run_dir / "model"),
    }
    key = next((k for k in ("accuracy", "pass@1") if before and k in before), None)
    if key and before and after:
        summary["gain"] = {key: after[key] - before[key]}
    return summary


def main(argv: list[str] | None = None) -> int:
    """Worker entry (``accelerate launch --module gbmpo.engines.trl --run-dir DIR``): train the
    run directory's ``config.yaml``."""
    parser = argparse.ArgumentParser(description="gbmpo TRL engine worker")
    parser.add_argument("--run-dir", required=True)
    ns = parser.parse_args(argv)
    from gbmpo.train.config import load_config

    run_dir = Path(ns.run_dir)
    cfg = load_config(run_dir / "config.yaml")
    from gbmpo.registry import add_plugin_modules

    add_plugin_modules(list(cfg.run.plugins))
    train_in_process(cfg, run_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
