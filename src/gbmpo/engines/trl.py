r"""``gbmpo train --engine trl``: TRL's ``GRPOTrainer`` (with gbmpo's loss) from a gbmpo config.

What the config becomes (every key's answer on this engine is in the support matrix,
:data:`gbmpo.train.support.TRL`, checked by :func:`check_engine` before anything is written):

* ``objective`` -> ``GBMPOConfig(objective=...)`` (the spec itself; TRL's ``loss_type`` and
  ``scale_rewards`` follow from its aggregation and advantage);
* ``model`` -> the policy, loaded as the own trainer loads it (fp32 weights under bf16 autocast
  for ``bfloat16``); ``lora`` -> a PEFT config (:func:`lora_config`);
* ``task`` -> a ``datasets.Dataset`` of the task's prompts (rendered exactly as the own trainer
  renders them) and its other columns; the task's reward -> a TRL reward function
  (:func:`reward_function`: failures count as 0, as in the own trainer);
* ``rollout`` / ``optim`` -> ``GRPOConfig`` (:func:`batch_layout` for the batch sizes:
  one RL step = one generation batch of ``prompts_per_step * num_generations`` completions,
  ``mu`` passes over it in optimizer steps of ``mini_batch_size`` sequences, each the sum of
  micro-batches of ``micro_batch_size`` per process); ``rollout.engine: vllm`` -> TRL's vLLM
  generation (``rollout.vllm_*`` -> ``vllm_mode``, ``vllm_gpu_memory_utilization``, ...);
  the learning rate of every RL step is the own engine's schedule (:func:`lr_at`);
* ``run.num_processes`` > 1 -> ``accelerate launch`` of this module (gloo on CPU).

The run directory is the own engine's: ``config.yaml``, ``metrics.jsonl`` (one row per RL step
under the schema's names, :mod:`gbmpo.io.metrics`, with TRL's other metrics as ``trl/<name>``;
the ``eval/*`` metrics before, every ``eval.every`` steps and after), ``summary.json``
(``eval_before`` / ``eval_after`` from :func:`gbmpo.eval.evaluate`), ``model/``; TRL's own
checkpoints go to ``checkpoints/checkpoint-<optimizer step>/``, each completed by gbmpo's
:data:`STATE_FILE` (written last, atomically: the RL state TRL does not keep and the size and
sha256 of every file), so that ``gbmpo train --resume DIR`` (:func:`resume`) continues the run
from its newest intact checkpoint with TRL's ``resume_from_checkpoint``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import os
import re
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

__all__ = ["STATE_FILE", "BatchLayout", "batch_layout", "check_engine", "checkpoints",
           "dry_run", "grpo_args", "host_settings", "latest_valid_checkpoint", "launch_command",
           "lora_config", "lr_at", "resume", "reward_function", "run", "schema_record",
           "train_dataset", "verify_checkpoint"]  # fmt: skip


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
    """The ``GBMPOConfig`` (a ``GRPOConfig``) that runs ``cfg`` on ``world`` processes.

    The learning rate of each RL step is set by :class:`_Schedule` (gbmpo's own schedule, per
    RL step, decaying over what actually runs), so TRL's scheduler is ``constant`` here."""
    from gbmpo.integrations.trl import GBMPOConfig

    ro, opt, run = cfg.rollout, cfg.optim, cfg.run
    lay = batch_layout(cfg, world)
    k = lay.optimizer_steps
    on_cpu = cfg.model.device == "cpu"
    kw: dict[str, Any] = {
        "output_dir": str(output_dir),
        "objective": cfg.objective.to_dict(),
        # the reference model's log-probs for reg/<name> = D(pi_old || pi_ref), as the own
        # engine computes them whenever it monitors regularizers
        "monitor_reference": bool(cfg.objective.monitor_regularizers),
        # generation
        "num_generations": ro.num_generations,
        "max_completion_length": ro.max_new_tokens,
        "temperature": ro.temperature,
        "top_p": ro.top_p,
        "top_k": ro.top_k,
        "use_vllm": ro.engine == "vllm",
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


def lr_at(cfg: Any, rl_step: int, rl_seconds: float) -> float:
    """The learning rate of RL step ``rl_step`` (0-based) after ``rl_seconds`` of RL: the own
    engine's schedule itself (:meth:`gbmpo.train.Trainer.lr_at`: warm-up, then constant or
    cosine decay whose progress is the larger of the step and time-budget fractions), so a run
    stopped by ``run.time_budget_seconds`` decays to ``min_lr_ratio * lr`` on both engines."""
    from types import SimpleNamespace

    from gbmpo.train.trainer import Trainer

    return Trainer.lr_at(SimpleNamespace(config=cfg, step=rl_step, rl_seconds=rl_seconds))  # type: ignore[arg-type]


def lora_config(cfg: Any) -> Any:
    """The PEFT ``LoraConfig`` of ``cfg.lora`` (``None`` when LoRA is off)."""
    if not cfg.lora.enabled:
        return None
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
    from gbmpo.train.setup import eval_limit

    return eval_limit(cfg, n_eval)


def _check_vllm(cfg: Any) -> None:
    """``ConfigError`` for a bad vLLM setting (values TRL would take and fail on later)."""
    from gbmpo.train.config import ConfigError

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


def _vllm_missing(cfg: Any) -> str | None:
    """Why ``rollout.engine: vllm`` cannot run here (``None`` when it can, or is not asked)."""
    import importlib.util

    if cfg.rollout.engine != "vllm" or importlib.util.find_spec("vllm") is not None:
        return None
    return ("rollout.engine 'vllm' on engine 'trl' needs the vllm package, which is not "
            "installed here (pip install vllm; GPU machines only)")  # fmt: skip


def check_engine(cfg: Any) -> list[str]:
    """Everything refused before a TRL run writes anything: the support matrix
    (:func:`gbmpo.train.support.check_support`), the vLLM settings and the batch layout;
    returns the support matrix's no-effect notices."""
    from gbmpo.train.support import check_support

    notices = check_support(cfg, "trl")
    _check_vllm(cfg)
    batch_layout(cfg, cfg.run.num_processes)
    return notices


def train_dataset(examples: Sequence[dict[str, Any]]) -> Any:
    """The task's examples as a ``datasets.Dataset`` (``prompt`` plus the reward's columns)."""
    from datasets import Dataset

    return Dataset.from_list([dict(ex) for ex in examples])


def reward_function(task: Any, columns: Sequence[str]) -> Callable[..., list[float]]:
    """A TRL reward function computing ``task.reward`` on the completions, with the dataset's
    ``columns``; per-sample failures (``None``, NaN, an exception) score 0 as in the own
    trainer (:func:`gbmpo.rewards.scoring.score_completions`); the function's ``failures``
    attribute counts them (this process's)."""
    from gbmpo.rewards.scoring import score_completions

    def gbmpo_reward(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
        cols = {c: list(kwargs[c]) for c in columns if c in kwargs}
        scored = score_completions(task.reward, list(prompts), list(completions), cols)
        gbmpo_reward.failures += scored.failures  # type: ignore[attr-defined]
        return scored.rewards

    gbmpo_reward.failures = 0  # type: ignore[attr-defined]
    gbmpo_reward.__name__ = f"{getattr(task, 'name', 'task')}_reward"
    return gbmpo_reward


# ------------------------------------------------------------------------------ dry run


def dry_run(cfg: Any) -> DryRunReport:
    """Engine-independent checks plus the ``GRPOConfig`` this config becomes (and vLLM when
    ``rollout.engine: vllm``); GPU-only parts are reported as skipped. A value the engine
    refuses (support matrix) raises ``ConfigError`` as the real run would."""
    import importlib.util
    import tempfile

    report = DryRunReport("trl")
    notices = check_engine(cfg)
    for line in notices:  # one check per no-effect key set
        report.ok(line.split("=", 1)[0], "no effect: " + line)
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
        report.skip("GRPOConfig on cuda", "bf16 / CUDA settings need a GPU here")
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
        ro = cfg.rollout
        how = f"use_vllm=True, vllm_mode={ro.vllm_mode}" + (
            f", vllm_gpu_memory_utilization={ro.vllm_gpu_memory_utilization}, "
            f"vllm_tensor_parallel_size={ro.vllm_tensor_parallel_size}"
            if ro.vllm_mode == "colocate"
            else f", server {ro.vllm_server_host}:{ro.vllm_server_port}"
        )
        missing = _vllm_missing(cfg)
        if missing is not None:
            report.skip("vllm", f"{how}: {missing}; a real run here stops with exit 2")
        else:
            report.ok("vllm", how)
    if world > 1:
        report.ok("launch", " ".join(launch_command(cfg, Path("RUN_DIR"))))
    return report


# ------------------------------------------------------------------------------ the run


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
    cmd += ["--module", "gbmpo.engines.trl", "--run-dir", str(run_dir)]
    if resuming:
        cmd += ["--resume-from", str(resume_from) if resume_from is not None else ""]
    return cmd


def run(cfg: Any) -> dict[str, Any]:
    """Train ``cfg`` with TRL; returns the summary (also written to ``summary.json``).

    Everything the engine refuses (support matrix, vLLM missing, batch layout, TRL's own
    ``GRPOConfig`` checks) stops the run before anything is written. One process: in this
    process. Several: ``accelerate launch`` of :func:`main` on the run directory's
    ``config.yaml`` (this process waits and reads back the summary)."""
    import importlib.util
    import tempfile

    from gbmpo.io import is_nonempty, write_atomic
    from gbmpo.train.config import ConfigError, dump_yaml, validate
    from gbmpo.train.run import default_run_dir

    if importlib.util.find_spec("trl") is None:
        raise EngineUnavailable("engine trl needs TRL: pip install 'gbmpo[trl]'")
    validate(cfg)
    check_engine(cfg)  # (gbmpo train prints the no-effect notices once)
    missing = _vllm_missing(cfg)
    if missing is not None:
        raise EngineUnavailable(missing)
    with tempfile.TemporaryDirectory() as tmp:  # TRL's own checks, before anything is written
        grpo_args(without_missing_mirror(cfg), tmp, world=1)
    run_dir = Path(cfg.run.output_dir) if cfg.run.output_dir else default_run_dir(cfg)
    if is_nonempty(run_dir):
        raise ConfigError(
            f"output directory {str(run_dir)!r} already exists and is not empty; choose another "
            "--output-dir"
        )
    cfg.run.output_dir = str(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(run_dir / "config.yaml", dump_yaml(cfg))
    return _train(cfg, run_dir)


def _train(cfg: Any, run_dir: Path, *, resume_from: Path | None = None,
           resuming: bool = False) -> dict[str, Any]:  # fmt: skip
    """Train in this process (one process) or through ``accelerate launch`` (several)."""
    if cfg.run.num_processes == 1:
        return train_in_process(cfg, run_dir, resume_from=resume_from, resuming=resuming)
    env = {**os.environ, "ACCELERATE_USE_CPU": "true"} if cfg.model.device == "cpu" else None
    cmd = launch_command(cfg, run_dir, resume_from=resume_from, resuming=resuming)
    proc = subprocess.run(cmd, env=env, preexec_fn=_die_with_parent())
    if proc.returncode != 0:
        raise RuntimeError(f"the TRL workers failed (exit {proc.returncode}); see above")
    import json

    return dict(json.loads((run_dir / "summary.json").read_text()))


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` (Linux; ``None`` elsewhere) after which the process gets SIGKILL when
    its parent exits. torch's launcher starts each worker in a session of its own, so a kill of
    ``gbmpo train`` (or of its process group) would otherwise leave the launcher or the workers
    training, and writing the run directory, next to the resume."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    import signal

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, not in the forked child

    def preexec() -> None:
        prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG

    return preexec


# ------------------------------------------------------------------------------ resume

#: gbmpo's file in each TRL checkpoint, written last (atomically) once TRL's files are complete:
#: what TRL does not keep (RL step and seconds, metrics.jsonl rows, evaluations, reward
#: failures, wall seconds) and the size and sha256 of every other file of the checkpoint
STATE_FILE = "gbmpo_state.json"
_CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")


def checkpoints(run_dir: str | Path, *, complete: bool = True) -> list[tuple[int, Path]]:
    """The run's TRL checkpoints as ``(optimizer step, path)``, oldest first: those gbmpo
    completed (with :data:`STATE_FILE`), or with ``complete=False`` every ``checkpoint-<N>``
    directory (a killed save leaves one without the file)."""
    root = Path(run_dir) / "checkpoints"
    out = []
    if root.is_dir():
        for child in root.iterdir():
            m = _CHECKPOINT_DIR.match(child.name)
            if m and child.is_dir() and (not complete or (child / STATE_FILE).is_file()):
                out.append((int(m.group(1)), child))
    return sorted(out)


def _files(directory: Path) -> dict[str, dict[str, Any]]:
    """Size and sha256 of every file under ``directory`` but :data:`STATE_FILE`, by relative
    path."""
    from gbmpo.io import file_sha256

    return {
        str(p.relative_to(directory)): {"size": p.stat().st_size, "sha256": file_sha256(p)}
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != STATE_FILE
    }


def verify_checkpoint(path: str | Path) -> str | None:
    """``None`` when the TRL checkpoint ``path`` is complete and its files match the sizes and
    sha256 in its :data:`STATE_FILE`, else what is wrong."""
    import json

    from gbmpo.io import file_sha256

    p = Path(path)
    try:
        files = json.loads((p / STATE_FILE).read_text())["files"]
    except FileNotFoundError:
        return f"{STATE_FILE} is missing (the save did not complete)"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{STATE_FILE} is unreadable ({err})"
    for name, meta in files.items():
        f = p / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != meta["size"]:
            return f"{name} has {f.stat().st_size} bytes, {STATE_FILE} says {meta['size']}"
        if file_sha256(f) != meta["sha256"]:
            return f"{name} does not match its sha256 in {STATE_FILE}"
    return None


def latest_valid_checkpoint(run_dir: str | Path,
                            log: Callable[[str], None] | None = None) -> Path | None:  # fmt: skip
    """The newest intact TRL checkpoint of the run (``None`` when it completed none): damaged
    ones are skipped with a message to ``log`` (default stderr); ``CheckpointError`` names them
    when every completed checkpoint is damaged (starting over would silently redo the run)."""
    from gbmpo.io import newest_intact

    return newest_intact(checkpoints(run_dir), verify_checkpoint,
                         Path(run_dir) / "checkpoints", log)  # fmt: skip


def _complete_checkpoint(path: Path, state: dict[str, Any], keep: int) -> None:
    """Write ``path``'s :data:`STATE_FILE` (last, atomically), then keep the newest ``keep``
    completed checkpoints: an older one goes only once a newer one is complete, its state file
    first (a kill while deleting leaves an incomplete checkpoint, never a complete-looking
    damaged one)."""
    from gbmpo.io import write_json_atomic

    write_json_atomic(path / STATE_FILE, {**state, "files": _files(path)})
    for _, old in checkpoints(path.parent.parent)[:-keep] if keep > 0 else []:
        (old / STATE_FILE).unlink(missing_ok=True)
        shutil.rmtree(old, ignore_errors=True)


def _prepare_resume(run_dir: Path) -> Path | None:
    """The checkpoint a resume continues from (:func:`latest_valid_checkpoint`); the
    checkpoint directories past it (incomplete or damaged saves of the killed run) are removed,
    saying so, since TRL writes the steps after it again."""
    start = latest_valid_checkpoint(run_dir)
    step = int(_CHECKPOINT_DIR.match(start.name).group(1)) if start else -1  # type: ignore[union-attr]
    for n, path in checkpoints(run_dir, complete=False):
        if n > step:
            print(f"gbmpo: removing {path.name} (past the checkpoint the run continues from)",
                  file=sys.stderr, flush=True)  # fmt: skip
            shutil.rmtree(path, ignore_errors=True)
    return start


def resume(run_dir: str | Path, overrides: list[tuple[str, Any]] | None = None,
           *, dry: bool = False) -> dict[str, Any]:  # fmt: skip
    """``gbmpo train --resume DIR`` for a TRL run: its config.yaml (only the keys of
    :data:`gbmpo.train.run.RESUMABLE_OVERRIDES` may change; a finished run is refused), TRL's
    ``resume_from_checkpoint`` on the newest intact checkpoint (weights, optimizer, scheduler,
    data position, every process's RNG states) and gbmpo's :data:`STATE_FILE` (RL seconds and
    step for the learning rate and the time budget, the evaluation before training, the
    metrics.jsonl rows to keep: the ones logged after the checkpoint are dropped). Without an
    intact checkpoint the run starts over in the same directory. ``dry``: only the plan
    (``{"resume_from": ...}``), nothing written. Returns the summary."""
    import importlib.util

    from gbmpo.io import RunLock, write_atomic
    from gbmpo.train.config import dump_yaml, validate
    from gbmpo.train.run import resume_config

    cfg, path = resume_config(run_dir, overrides)
    if importlib.util.find_spec("trl") is None:
        raise EngineUnavailable("engine trl needs TRL: pip install 'gbmpo[trl]'")
    validate(cfg)
    check_engine(cfg)
    missing = _vllm_missing(cfg)
    if missing is not None:
        raise EngineUnavailable(missing)
    if dry:
        found = latest_valid_checkpoint(path)
        return {"resume_from": None if found is None else str(found)}
    lock = RunLock(path).acquire()  # one process per run directory
    try:
        start = _prepare_resume(path)
        where = f"from {start.name}" if start else "from the start (no intact checkpoint)"
        print(f"gbmpo: resuming {str(path)!r} {where}", file=sys.stderr, flush=True)
        write_atomic(path / "config.yaml", dump_yaml(cfg))
        return _train(cfg, path, resume_from=start, resuming=True)
    finally:
        lock.release()


#: TRL / GBMPOTrainer metric names -> the schema's (gbmpo.io.metrics); the rest -> trl/<name>
_SCHEMA_NAMES = {
    "loss": "loss",
    "loss/surrogate": "pg_loss",
    "loss/regularizer": "reg_loss",
    "clip_ratio/low_mean": "clip_frac_low",
    "clip_ratio/high_mean": "clip_frac_high",
    "clip_ratio/dual_mean": "clip_frac_dual",
    "ratio/mean": "ratio_mean",
    "ratio/min": "ratio_min",
    "ratio/max": "ratio_max",
    "entropy": "entropy",
    "completions/mean_length": "response_length_mean",
    "completions/max_length": "response_length_max",
    "completions/clipped_ratio": "truncated_frac",
    "reward": "reward_mean",
    "frac_reward_zero_std": "frac_reward_zero_std",
    "gbmpo/accuracy": "accuracy",
    "gbmpo/reward_std": "reward_std",
}


def schema_record(logs: dict[str, Any], regularizer: str) -> dict[str, Any]:
    """One TRL log row under the schema's names (:mod:`gbmpo.io.metrics`): shared quantities
    renamed (``regularizer/<active>`` -> ``reg_value``, ``reference/<name>`` ->
    ``reg/<name>``; for a sum ``regularizer`` is ``a+b``, its terms' ``regularizer/<term>`` ->
    ``reg_value/<term>`` and ``loss/regularizer/<term>`` -> ``reg_loss/<term>``), TRL's other
    metrics kept as ``trl/<name>``."""
    from gbmpo.io.metrics import host_name

    record: dict[str, Any] = {}
    for key, value in logs.items():
        if key in _SCHEMA_NAMES:
            record[_SCHEMA_NAMES[key]] = value
        elif key == f"regularizer/{regularizer}":
            record["reg_value"] = value
        elif "+" in regularizer and key.split("/", 1)[-1] in regularizer.split("+") \
                and key.startswith("regularizer/"):  # fmt: skip
            record["reg_value/" + key.split("/", 1)[1]] = value  # a term of a sum
        elif key.startswith("loss/regularizer/"):  # a sum of regularizers: each term's part
            record["reg_loss/" + key.split("/", 2)[2]] = value
        elif key.startswith("reference/"):
            record["reg/" + key.split("/", 1)[1]] = value
        else:
            record[host_name("trl", key)] = value
    return record


class _RLProgress:
    """The run's RL-step state, shared by the TRL callback and the trainer: RL seconds
    (generation and updates; evaluation and checkpoints excluded, as on the own engine), the
    learning rate of each RL step, the gradient norms of its optimizer steps, evaluations, the
    stop reason."""

    def __init__(self, cfg: Any, k: int) -> None:
        self.cfg, self.k = cfg, k
        self.rl_seconds = 0.0
        self.step_start: float | None = None
        self.step_seconds = 0.0
        self.lrs: dict[int, float] = {}
        self.grad_norms: list[float] = []
        self.stop_reason = "steps"
        self.last_eval: tuple[int, dict[str, Any]] | None = None
        self.pending_eval: dict[str, Any] | None = None

    def lr(self, rl_step: int) -> float:
        """The rate of RL step ``rl_step``, fixed when the step starts (every optimizer step
        of an RL step uses it, as on the own engine)."""
        if rl_step not in self.lrs:
            self.lrs[rl_step] = lr_at(self.cfg, rl_step, self.rl_seconds)
        return self.lrs[rl_step]


def _all_reduce(value: float, op: str = "max") -> float:
    """``value``'s maximum (``op="max"``) or sum (``"sum"``) over the processes (itself with
    one process)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return value
    on_gpu = dist.get_backend() == "nccl"  # NCCL reduces CUDA tensors only
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else None
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return float(t.item())


class _RunDirCallback:
    """The run's TRL callback: gbmpo's learning rate per RL step, RL time, evaluation every
    ``eval.every`` RL steps, the time budget, metrics.jsonl rows (main process) and the
    console's progress bar."""

    def __init__(self, cfg: Any, progress: _RLProgress, writer: Any, evaluate: Any,
                 bar: Any) -> None:  # fmt: skip
        self.cfg, self.p, self.writer = cfg, progress, writer
        self.evaluate, self.bar = evaluate, bar

    def as_trainer_callback(self) -> Any:
        from transformers import TrainerCallback

        outer = self
        p = self.p

        class Callback(TrainerCallback):  # type: ignore[misc]
            def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                if state.global_step % p.k == 0:
                    p.step_start = time.perf_counter()
                lr = p.lr(state.global_step // p.k)
                optimizer = kw.get("optimizer")
                if optimizer is not None:
                    for group in optimizer.param_groups:
                        group["lr"] = lr

            def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                if state.global_step % p.k or p.step_start is None:
                    return
                p.step_seconds = time.perf_counter() - p.step_start
                # every process agrees on the RL time: the rate and the stop depend on it
                p.rl_seconds = _all_reduce(p.rl_seconds + p.step_seconds)
                p.step_start = None
                step = state.global_step // p.k
                every = outer.cfg.eval.every
                if every and step % every == 0:
                    outer.evaluate_now(step, kw.get("model"))
                budget = outer.cfg.run.time_budget_seconds
                if budget is not None and p.rl_seconds >= budget and step < outer.cfg.run.steps:
                    p.stop_reason = "time_budget"
                    control.should_training_stop = True

            def on_log(self, args: Any, state: Any, control: Any, logs: Any = None,
                       **kw: Any) -> None:  # fmt: skip
                if logs is None or "loss" not in logs:
                    return
                outer.write_row(state.global_step // p.k, logs)

        return Callback()

    def evaluate_now(self, step: int, model: Any) -> None:
        """gbmpo's evaluation on the main process (the others wait), outside the RL time."""
        from accelerate import PartialState

        state = PartialState()
        if state.is_main_process and model is not None:
            t = time.perf_counter()
            was_training = model.training
            model.eval()
            metrics = self.evaluate(model)
            model.train(was_training)
            self.p.last_eval = (step, metrics)
            self.p.pending_eval = {**{f"eval/{k}": v for k, v in metrics.items()},
                                   "time/eval_seconds": time.perf_counter() - t}  # fmt: skip
        state.wait_for_everyone()

    def write_row(self, step: int, logs: dict[str, Any]) -> None:
        p = self.p
        record: dict[str, Any] = {"step": step}
        record.update(schema_record(logs, self.cfg.objective.regularizer_label))
        record.pop("trl/learning_rate", None)  # the scheduler's base rate; "lr" is the used one
        record["lr"] = p.lr(step - 1)
        if p.grad_norms:  # the schema's mean over the step's optimizer steps (TRL: the last)
            record.pop("trl/grad_norm", None)
            record["grad_norm"] = sum(p.grad_norms) / len(p.grad_norms)
            record["grad_norm_max"] = max(p.grad_norms)
            p.grad_norms.clear()
        record["step_seconds"] = p.step_seconds
        record["time/rl_seconds"] = p.rl_seconds
        if p.pending_eval is not None:
            record.update(p.pending_eval)
            p.pending_eval = None
        if self.writer is not None:
            self.writer.write(record)
        if self.bar is not None:
            self.bar.update(step, p.rl_seconds, record, p.last_eval)


def _evaluate(cfg: Any, model: Any, tokenizer: Any, task: Any, split: str,
              limit: int | None) -> dict[str, Any]:  # fmt: skip
    from gbmpo.eval import evaluate

    ev = cfg.eval
    result = evaluate(
        model, tokenizer, task, split=split, limit=limit, samples=1, temperature=0.0,
        max_new_tokens=ev.max_new_tokens, batch_size=ev.batch_size,
        engine="gbmpo" if cfg.rollout.engine == "vllm" else cfg.rollout.engine,
    )  # fmt: skip
    metrics = result["metrics"].items()
    return {
        k: v
        for k, v in metrics
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "seconds"
    }


def _engine_trainer_class() -> type:
    """:class:`gbmpo.integrations.trl.GBMPOTrainer` with the engine's additions: the schema's
    reward metrics (``accuracy`` = fraction of rewards >= 1, the population ``reward_std``),
    weight decay on every parameter (the own engine's AdamW; transformers exempts biases and
    norms) and the gradient norm of every optimizer step."""
    from gbmpo.integrations.trl import GBMPOTrainer

    class EngineTrainer(GBMPOTrainer):
        progress: _RLProgress | None = None
        #: called on every process with each saved checkpoint's directory (gbmpo's state)
        on_checkpoint: Callable[[Path], None] | None = None

        def _save_checkpoint(self, model: Any, trial: Any) -> None:
            # TRL's files first, without its rotation: on_checkpoint completes the checkpoint
            # and only then removes older ones (a kill in between keeps a complete one)
            limit = self.args.save_total_limit
            self.args.save_total_limit = None
            try:
                super()._save_checkpoint(model, trial)
            finally:
                self.args.save_total_limit = limit
            if self.on_checkpoint is not None:
                out = Path(self._get_output_dir(trial=trial))
                self.on_checkpoint(out / f"checkpoint-{self.state.global_step}")

        def _generate_and_score_completions(self, inputs: Any) -> Any:
            out = super()._generate_and_score_completions(inputs)
            if self.model.training:
                rewards = [r for values in self._logs["rewards"].values() for r in values]
                if rewards:
                    import statistics

                    self._metrics["train"]["gbmpo/accuracy"].append(
                        sum(r >= 1.0 for r in rewards) / len(rewards)
                    )
                    self._metrics["train"]["gbmpo/reward_std"].append(statistics.pstdev(rewards))
            return out

        def get_decay_parameter_names(self, model: Any) -> list[str]:
            return [n for n, _ in model.named_parameters()]

        def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
            norm = super()._get_grad_norm(model, grad_norm=grad_norm)
            if self.progress is not None and norm is not None:
                self.progress.grad_norms.append(float(norm))
            return norm

    return EngineTrainer


def train_in_process(cfg: Any, run_dir: Path, *, resume_from: Path | None = None,
                     resuming: bool = False) -> dict[str, Any]:  # fmt: skip
    """The TRL run of ``cfg`` in this process (one of ``run.num_processes`` under
    ``accelerate launch``); the main process writes the run directory. ``resuming``: continue
    from the checkpoint ``resume_from`` (its :data:`STATE_FILE` restores what TRL does not;
    ``None``: start over, dropping the rows logged so far)."""
    import torch
    from accelerate import PartialState

    from gbmpo.models import load_model_and_tokenizer
    from gbmpo.train.console import Console, fmt_eval
    from gbmpo.train.device import peak_memory_bytes
    from gbmpo.train.logging import MetricsWriter
    from gbmpo.train.run import final_drift, fmt_drift
    from gbmpo.train.setup import build_task, load_splits, load_tokenizer

    t0 = time.perf_counter()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # weight loading/saving bars (the CLI's, in workers too)
    if cfg.run.num_threads is not None:
        torch.set_num_threads(cfg.run.num_threads)
    state = PartialState(cpu=cfg.model.device == "cpu")
    main = state.is_main_process
    console = Console(cfg.run.progress and main)
    task = build_task(cfg, load_tokenizer(cfg))
    if task.kind == "code":
        from gbmpo.sandbox import require_sandbox

        require_sandbox(cfg.run.allow_unsandboxed_code)
    train, n_eval, (_, eval_split) = load_splits(cfg, task)
    limit = eval_limit_of(cfg, n_eval)
    dtype = cfg.model.dtype
    if not cfg.lora.enabled and dtype != "float32":
        # full fine-tuning: fp32 weights (the optimizer's master copy), bf16 compute through
        # autocast (GRPOConfig bf16), so that small updates are not rounded away
        dtype = "float32"
    model, tokenizer = load_model_and_tokenizer(
        cfg.model.path, dtype=getattr(torch, dtype), device=str(state.device),
        trust_remote_code=cfg.model.trust_remote_code,
    )  # fmt: skip
    if limit is not None and limit < n_eval:
        console.print(f"evaluating the first {limit} of {n_eval} {eval_split!r} examples "
                      "(eval.limit / eval.auto_limit)")  # fmt: skip

    def evaluate(policy: Any) -> dict[str, Any]:
        return _evaluate(cfg, policy, tokenizer, task, eval_split, limit)

    import json

    saved: dict[str, Any] | None = None
    if resume_from is not None:
        saved = json.loads((resume_from / STATE_FILE).read_text())
    writer = None
    if main:  # on resume: the rows the checkpoint counted (none when starting over)
        keep = {"keep_rows": saved["metrics_rows"]} if saved else {"keep_up_to_step": -1}
        writer = MetricsWriter(run_dir, **(keep if resuming else {}))
    eval_before = saved["eval_before"] if saved else None
    if cfg.eval.before and main and saved is None:
        t = time.perf_counter()
        eval_before = evaluate(model)
        writer.write({"step": 0, **{f"eval/{k}": v for k, v in eval_before.items()},  # type: ignore[union-attr]
                      "time/eval_seconds": time.perf_counter() - t})  # fmt: skip
        console.print(f"held-out {fmt_eval(eval_before)} before training")
    state.wait_for_everyone()

    dataset = train_dataset(train)
    columns = [c for c in dataset.column_names if c != "prompt"]
    args = grpo_args(cfg, run_dir / "checkpoints", world=state.num_processes)
    lay = batch_layout(cfg, state.num_processes)
    progress = _RLProgress(cfg, lay.optimizer_steps)
    wall_before = 0.0
    if saved is not None:
        progress.rl_seconds = float(saved["rl_seconds"])
        progress.last_eval = tuple(saved["last_eval"]) if saved["last_eval"] else None  # type: ignore[assignment]
        wall_before = float(saved["wall_seconds"])
    trainer_cls = _engine_trainer_class()
    with console.progress(cfg.run.steps, cfg.run.time_budget_seconds, 0, 0.0) as bar:
        callback = _RunDirCallback(cfg, progress, writer, evaluate, bar if main else None)
        reward = reward_function(task, columns)
        trainer = trainer_cls(
            model=model,
            reward_funcs=[reward],
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=lora_config(cfg),
            callbacks=[callback.as_trainer_callback()],
        )
        trainer.progress = progress
        if main and saved is not None:  # the failures counted before (the sum over processes)
            reward.failures = int(saved["reward_failures"])  # type: ignore[attr-defined]

        def on_checkpoint(path: Path) -> None:
            # every process: the failures summed and every process's files (RNG states) written
            failed = int(_all_reduce(float(reward.failures), "sum"))  # type: ignore[attr-defined]
            state.wait_for_everyone()
            if main:
                assert writer is not None
                _complete_checkpoint(path, {
                    "global_step": trainer.state.global_step,
                    "rl_step": trainer.state.global_step // lay.optimizer_steps,
                    "rl_seconds": progress.rl_seconds,
                    "wall_seconds": wall_before + time.perf_counter() - t0,
                    "metrics_rows": writer.rows,
                    "eval_before": eval_before,
                    "last_eval": list(progress.last_eval) if progress.last_eval else None,
                    "reward_failures": failed,
                    "world_size": state.num_processes,
                }, cfg.run.keep_checkpoints)  # fmt: skip
            state.wait_for_everyone()

        trainer.on_checkpoint = on_checkpoint
        from transformers import PrinterCallback

        trainer.remove_callback(PrinterCallback)  # TRL's log dicts; gbmpo's bar shows RL steps
        policy = trainer.accelerator.unwrap_model(trainer.model)
        params = [p for p in policy.parameters() if p.requires_grad]
        line = f"device {params[0].device}, trainable weights "
        line += str(params[0].dtype).removeprefix("torch.")
        if args.bf16:
            line += " (bf16 autocast: fp32 master weights)"
        console.print(line)
        budget = cfg.run.time_budget_seconds
        if saved is not None:
            console.print(f"resuming from {resume_from.name} (RL step "  # type: ignore[union-attr]
                          f"{saved['rl_step']} of {cfg.run.steps})")  # fmt: skip
        if (saved is not None and budget is not None and progress.rl_seconds >= budget
                and saved["rl_step"] < cfg.run.steps):  # fmt: skip
            # killed after the step that used up the time budget: the run stops there, with
            # that checkpoint's weights, as the uninterrupted run did
            trainer._load_from_checkpoint(str(resume_from))
            trainer.state.global_step = int(saved["global_step"])
            progress.stop_reason = "time_budget"
        else:
            trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    steps = math.ceil(trainer.state.global_step / lay.optimizer_steps)
    failures = int(_all_reduce(float(reward.failures), "sum"))  # type: ignore[attr-defined]

    summary: dict[str, Any] = {}
    if main:
        assert writer is not None
        policy = trainer.accelerator.unwrap_model(trainer.model)
        policy.eval()
        eval_after = None
        if cfg.eval.after:
            if progress.last_eval is not None and progress.last_eval[0] == steps and steps > 0:
                eval_after = progress.last_eval[1]
            else:
                t = time.perf_counter()
                eval_after = evaluate(policy)
                writer.write({"step": steps, **{f"eval/{k}": v for k, v in eval_after.items()},
                              "time/eval_seconds": time.perf_counter() - t})  # fmt: skip
            console.print(f"held-out {fmt_eval(eval_after)} after {steps} steps")
        drift, drift_seconds = final_drift(cfg, policy, tokenizer, task, eval_split, limit)
        if drift is not None:
            console.print(fmt_drift(drift, drift_seconds))
        writer.close()
        out = run_dir / "model"
        policy.save_pretrained(out)
        tokenizer.save_pretrained(out)
        params = [p for p in policy.parameters() if p.requires_grad]
        summary = _summary(cfg, run_dir, steps, progress, eval_before, eval_after, t0)
        summary["wall_seconds"] += wall_before  # the parts before a resume too
        summary["device"] = str(params[0].device)
        summary["dtype"] = str(params[0].dtype).removeprefix("torch.")
        summary["mixed_precision"] = "bf16" if args.bf16 else "no"
        # HF's Trainer steps the fp32 weights it computes with under bf16 autocast
        summary["fp32_master_weights"] = bool(args.bf16) and not cfg.lora.enabled
        peak = peak_memory_bytes(params[0].device)
        summary["peak_memory_gib"] = None if peak is None else peak / 2**30
        summary["reward_failures"] = failures
        summary["world_size"] = state.num_processes  # processes that trained (accelerate)
        summary["drift"] = drift  # gbmpo.eval.drift.DRIFT_KEYS, or None
        summary["drift_seconds"] = drift_seconds if drift is not None else None
        write_summary(run_dir, summary)
    state.wait_for_everyone()
    if main and not cfg.run.checkpoint_every:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return summary


def _summary(cfg: Any, run_dir: Path, steps: int, progress: _RLProgress,
             before: dict[str, Any] | None, after: dict[str, Any] | None,
             t0: float) -> dict[str, Any]:  # fmt: skip
    summary: dict[str, Any] = {
        "status": "finished",
        "engine": "trl",
        "steps": steps,
        "stop_reason": progress.stop_reason,
        "wall_seconds": time.perf_counter() - t0,
        "rl_seconds": progress.rl_seconds,
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
    parser.add_argument(
        "--resume-from",
        default=None,
        help="continue from this checkpoint ('': resume from the start)",
    )
    ns = parser.parse_args(argv)
    from gbmpo.train.config import load_config

    run_dir = Path(ns.run_dir)
    cfg = load_config(run_dir / "config.yaml")
    from gbmpo.registry import add_plugin_modules

    add_plugin_modules(list(cfg.run.plugins))
    on_exit = _die_with_parent()  # the launcher killed: this worker too
    if on_exit is not None:
        on_exit()
        if os.getppid() == 1:  # the launcher had already gone
            return 1
    resuming = ns.resume_from is not None
    start = Path(ns.resume_from) if ns.resume_from else None
    train_in_process(cfg, run_dir, resume_from=start, resuming=resuming)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
