r"""``gbmpo train --engine trl``: TRL's ``GRPOTrainer`` (with gbmpo's loss) from a gbmpo config.

What the config becomes is :mod:`gbmpo.engines.trl.args` (every key's answer on this engine is
in the support matrix, :data:`gbmpo.config.hosts.trl.TRL`, checked by ``check_engine`` before
anything is written):

* ``objective`` -> ``GBMPOConfig(objective=...)`` (the spec itself; TRL's ``loss_type`` and
  ``scale_rewards`` follow from its aggregation and advantage);
* ``model`` -> the policy, loaded as the own trainer loads it (fp32 weights under bf16 autocast
  for ``bfloat16``); ``lora`` -> a PEFT config (``lora_config``);
* ``task`` -> a ``datasets.Dataset`` of the task's prompts (rendered exactly as the own trainer
  renders them) and its other columns; the task's reward -> a TRL reward function
  (``reward_function``: failures count as 0, as in the own trainer);
* ``rollout`` / ``optim`` -> ``GRPOConfig`` (``batch_layout`` for the batch sizes:
  one RL step = one generation batch of ``prompts_per_step * num_generations`` completions,
  ``mu`` passes over it in optimizer steps of ``mini_batch_size`` sequences, each the sum of
  micro-batches of ``micro_batch_size`` per process); ``rollout.generator: vllm`` -> TRL's vLLM
  generation (``rollout.vllm_*`` -> ``vllm_mode``, ``vllm_gpu_memory_utilization``, ...);
  the learning rate of every RL step is the own engine's schedule (``lr_at``);
* ``run.num_processes`` > 1 -> ``accelerate launch`` of this module (gloo on CPU).

The run directory is the own engine's: ``config.yaml``, ``metrics.jsonl`` (one row per RL step
under the schema's names, :mod:`gbmpo.io.metrics`, with TRL's other metrics as ``trl/<name>``;
written by :mod:`gbmpo.engines.trl.callbacks`; the ``eval/*`` metrics before, every
``eval.every`` steps and after), ``summary.json`` (``eval_before`` / ``eval_after`` from
:func:`gbmpo.eval.evaluate`), ``model/``; TRL's own checkpoints go to
``checkpoints/checkpoint-<optimizer step>/``, each completed by gbmpo's state file
(:mod:`gbmpo.engines.trl.checkpoints`: written last, atomically, the RL state TRL does not keep
and the size and sha256 of every file), so that ``gbmpo train --resume DIR`` (:func:`resume`)
continues the run from its newest intact checkpoint with TRL's ``resume_from_checkpoint``.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import datetime as _dt
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gbmpo.config import dump_yaml, load_config, validate
from gbmpo.engines.checks import (
    DryRunReport,
    EngineUnavailable,
    common_checks,
    memory_check,
    run_identity,
    without_missing_mirror,
)
from gbmpo.engines.trl.args import (
    batch_layout,
    check_engine,
    eval_limit_of,
    grpo_args,
    launch_command,
    lora_config,
    reward_function,
    static_cache_length,
    train_dataset,
    vllm_missing,
)
from gbmpo.engines.trl.callbacks import (
    RLProgress,
    RunDirCallback,
    all_reduce,
    engine_trainer_class,
)
from gbmpo.engines.trl.checkpoints import (
    STATE_FILE,
    complete_checkpoint,
    latest_valid_checkpoint,
    prepare_resume,
)
from gbmpo.engines.trl.stop import StopCallback
from gbmpo.eval import evaluate
from gbmpo.eval.drift import final_drift, fmt_drift
from gbmpo.io import RunStopped, write_atomic
from gbmpo.io.stop import forwarding, stop_file
from gbmpo.lifecycle import (
    CONFIG_FILE,
    MODEL_DIR,
    RunLifecycle,
    check_not_in_use,
    default_run_dir,
    no_checkpoint_error,
    read_status,
    resume_config,
)
from gbmpo.lifecycle.console import Console, fmt_eval, main_metric
from gbmpo.lifecycle.logging import MetricsWriter
from gbmpo.models import load_model_and_tokenizer
from gbmpo.registry import add_plugin_modules
from gbmpo.sandbox import require_sandbox
from gbmpo.train.device import peak_memory_bytes
from gbmpo.train.setup import build_task, load_splits, load_tokenizer

__all__ = ["dry_run", "main", "resume", "run", "train_in_process"]


# ------------------------------------------------------------------------------ dry run


def dry_run(cfg: Any) -> DryRunReport:
    """Engine-independent checks plus the ``GRPOConfig`` this config becomes (and vLLM when
    ``rollout.generator: vllm``); GPU-only parts are reported as skipped. A value the engine
    refuses (support matrix) raises ``ConfigError`` as the real run would."""
    report = DryRunReport("trl")
    notices = check_engine(cfg)
    for line in notices:  # one check per no-effect key set
        report.ok(line.split("=", 1)[0], "no effect: " + line)
    common_checks(cfg, report)
    memory_check(cfg, report)  # the plan per GPU (weights ... activations, KV cache or vLLM)
    if importlib.util.find_spec("trl") is None:
        raise EngineUnavailable("engine trl needs TRL: pip install 'gbmpo[trl]'")
    world = cfg.run.num_processes
    lay = batch_layout(cfg, world)
    probe = without_missing_mirror(cfg)
    on_gpu = cfg.model.device.startswith("cuda")
    if on_gpu and not torch.cuda.is_available():
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
    if cfg.rollout.generator == "vllm":
        ro = cfg.rollout
        how = f"use_vllm=True, vllm_mode={ro.vllm_mode}" + (
            f", vllm_gpu_memory_utilization={ro.vllm_gpu_memory_utilization}, "
            f"vllm_tensor_parallel_size={ro.vllm_tensor_parallel_size}"
            if ro.vllm_mode == "colocate"
            else f", server {ro.vllm_server_host}:{ro.vllm_server_port}"
        )
        missing = vllm_missing(cfg)
        if missing is not None:
            report.skip("vllm", f"{how}: {missing}; a real run here stops with exit 2")
        else:
            report.ok("vllm", how)
    if world > 1:
        report.ok("launch", " ".join(launch_command(cfg, Path("RUN_DIR"))))
    return report


# ------------------------------------------------------------------------------ the run


def run(cfg: Any) -> dict[str, Any]:
    """Train ``cfg`` with TRL; returns the summary (also written to ``summary.json``).

    Everything the engine refuses (support matrix, vLLM missing, batch layout, TRL's own
    ``GRPOConfig`` checks) stops the run before anything is written. One process: in this
    process. Several: ``accelerate launch`` of :func:`main` on the run directory's
    ``config.yaml`` (this process waits and reads back the summary)."""
    if importlib.util.find_spec("trl") is None:
        raise EngineUnavailable("engine trl needs TRL: pip install 'gbmpo[trl]'")
    validate(cfg)
    check_engine(cfg)  # (gbmpo train prints the no-effect notices once)
    missing = vllm_missing(cfg)
    if missing is not None:
        raise EngineUnavailable(missing)
    run_dir = Path(cfg.run.output_dir) if cfg.run.output_dir else default_run_dir(cfg)
    check_not_in_use(run_dir)  # a directory in use: refused before TRL is imported
    with tempfile.TemporaryDirectory() as tmp:  # TRL's own checks, before anything is written
        grpo_args(without_missing_mirror(cfg), tmp, world=1)
    cfg.run.output_dir = str(run_dir)
    # the lock (a second run on this directory is refused) and the empty-directory check
    with RunLifecycle(run_dir, "trl", checkpoint=lambda: _newest(run_dir)):
        write_atomic(run_dir / CONFIG_FILE, dump_yaml(cfg))
        return _train(cfg, run_dir)


def _newest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint (the lifecycle's hook when a run stops at once)."""
    return latest_valid_checkpoint(run_dir, log=lambda _: None)


def _train(cfg: Any, run_dir: Path, *, resume_from: Path | None = None,
           resuming: bool = False) -> dict[str, Any]:  # fmt: skip
    """Train in this process (one process) or through ``accelerate launch`` (several)."""
    stop_file(run_dir).unlink(missing_ok=True)  # a stop request left by a killed run
    if cfg.run.num_processes == 1:
        return train_in_process(cfg, run_dir, resume_from=resume_from, resuming=resuming)
    env = {**os.environ, "ACCELERATE_USE_CPU": "true"} if cfg.model.device == "cpu" else None
    cmd = launch_command(cfg, run_dir, resume_from=resume_from, resuming=resuming)
    # a session of its own: SIGTERM / SIGINT reach the workers through the stop file only
    proc = subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent(), start_new_session=True)
    with forwarding(run_dir, lambda: os.killpg(proc.pid, signal.SIGKILL)) as stop:
        try:
            returncode = proc.wait()
        except RunStopped:  # a second signal: the launcher and its workers killed; the run's
            proc.wait()  # lifecycle records the step status.json last said and the checkpoint
            raise
    status = read_status(run_dir) or {}
    if stop.requested and status.get("status") in ("preempted", "interrupted"):
        raise RunStopped(status["signal"], step=status["step"], checkpoint=status["checkpoint"],
                         run_dir=run_dir)  # fmt: skip
    if returncode != 0:  # status.json still "running": the lifecycle makes it "failed"
        raise RuntimeError(f"the TRL workers failed (exit {returncode}); see above")
    return dict(json.loads((run_dir / "summary.json").read_text()))


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` (Linux; ``None`` elsewhere) after which the process gets SIGKILL when
    its parent exits. torch's launcher starts each worker in a session of its own, so a kill of
    ``gbmpo train`` (or of its process group) would otherwise leave the launcher or the workers
    training, and writing the run directory, next to the resume."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, not in the forked child

    def preexec() -> None:
        prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG

    return preexec


# ------------------------------------------------------------------------------ resume

def resume(run_dir: str | Path, overrides: list[tuple[str, Any]] | None = None,
           *, dry: bool = False, restart: bool = False) -> dict[str, Any]:  # fmt: skip
    """``gbmpo train --resume DIR`` for a TRL run: its config.yaml (only the keys of
    :data:`gbmpo.lifecycle.RESUMABLE_OVERRIDES` may change; a finished run is refused), TRL's
    ``resume_from_checkpoint`` on the newest intact checkpoint (weights, optimizer, scheduler,
    data position, every process's RNG states) and gbmpo's :data:`STATE_FILE` (RL seconds and
    step for the learning rate and the time budget, the evaluation before training, the
    metrics.jsonl rows to keep: the ones logged after the checkpoint are dropped). Without an
    intact checkpoint :class:`gbmpo.io.CheckpointError` (nothing changed) unless ``restart``:
    the run starts over in the same directory. ``dry``: only the plan
    (``{"resume_from": ...}``), nothing written. Returns the summary."""
    cfg, path = resume_config(run_dir, overrides)
    if importlib.util.find_spec("trl") is None:
        raise EngineUnavailable("engine trl needs TRL: pip install 'gbmpo[trl]'")
    validate(cfg)
    check_engine(cfg)
    missing = vllm_missing(cfg)
    if missing is not None:
        raise EngineUnavailable(missing)
    if dry:
        found = latest_valid_checkpoint(path)
        return {"resume_from": None if found is None else str(found)}
    if not restart and latest_valid_checkpoint(path, log=lambda _: None) is None:
        raise no_checkpoint_error(path)
    with RunLifecycle(path, "trl", resuming=True, checkpoint=lambda: _newest(path)):
        start = prepare_resume(path)
        where = f"from {start.name}" if start else "from step 0 (--restart)"
        print(f"gbmpo: resuming {str(path)!r} {where}", file=sys.stderr, flush=True)
        write_atomic(path / CONFIG_FILE, dump_yaml(cfg))
        return _train(cfg, path, resume_from=start, resuming=True)


def _evaluate(cfg: Any, model: Any, tokenizer: Any, task: Any, split: str,
              limit: int | None) -> dict[str, Any]:  # fmt: skip
    ev = cfg.eval
    result = evaluate(
        model, tokenizer, task, split=split, limit=limit, samples=ev.samples,
        temperature=cfg.rollout.temperature if ev.samples > 1 else 0.0,
        top_p=cfg.rollout.top_p if ev.samples > 1 else 1.0,
        max_new_tokens=ev.max_new_tokens, batch_size=ev.batch_size,
        generator="gbmpo" if cfg.rollout.generator == "vllm" else cfg.rollout.generator,
    )  # fmt: skip
    metrics = result["metrics"].items()
    return {
        k: v
        for k, v in metrics
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "seconds"
    }


def train_in_process(cfg: Any, run_dir: Path, *, resume_from: Path | None = None,
                     resuming: bool = False) -> dict[str, Any]:  # fmt: skip
    """The TRL run of ``cfg`` in this process (one of ``run.num_processes`` under
    ``accelerate launch``); the main process writes the run directory. ``resuming``: continue
    from the checkpoint ``resume_from`` (its :data:`STATE_FILE` restores what TRL does not;
    ``None``: start over, dropping the rows logged so far). Its status, stop and end go through
    the run's :class:`gbmpo.lifecycle.RunLifecycle` (the lock is the launching process's; the
    main process writes ``status.json``): a run that ends on an exception says so (``failed``,
    with the error), as the own engine's does."""
    life = RunLifecycle(run_dir, "trl", resuming=resuming, lock=False, stop_file=True,
                        main=os.environ.get("RANK", "0") == "0",  # accelerate sets RANK
                        checkpoint=lambda: _newest(run_dir))  # fmt: skip
    with life:
        return _train_in_process(cfg, run_dir, life, resume_from=resume_from, resuming=resuming)


def _train_in_process(cfg: Any, run_dir: Path, life: RunLifecycle, *,
                      resume_from: Path | None, resuming: bool) -> dict[str, Any]:  # fmt: skip
    # deferred: accelerate is optional (the trl extra)
    from accelerate import PartialState

    t0 = time.perf_counter()
    # deferred: transformers is heavy; loaded only when TRL trains
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # weight loading/saving bars (the CLI's, in workers too)
    if cfg.run.num_threads is not None:
        torch.set_num_threads(cfg.run.num_threads)
    state = PartialState(cpu=cfg.model.device == "cpu")
    main = state.is_main_process
    console = Console(cfg.run.progress and main)
    task = build_task(cfg, load_tokenizer(cfg))
    if task.kind == "code":
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

    saved: dict[str, Any] | None = None
    if resume_from is not None:
        saved = json.loads((resume_from / STATE_FILE).read_text())
    # running from the evaluation before training on (a failure from here on: "failed")
    life.running(int(saved["rl_step"]) if saved else 0, resumed_from=resume_from)
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
    if args.compile_generation:  # rollout.decode_step static: one cache length for the run
        args.generation_kwargs = {"max_cache_len": static_cache_length(
            dataset["prompt"], tokenizer, cfg.rollout.max_new_tokens)}
    lay = batch_layout(cfg, state.num_processes)
    progress = RLProgress(cfg, lay.optimizer_steps)
    wall_before = 0.0
    if saved is not None:
        progress.rl_seconds = float(saved["rl_seconds"])
        progress.last_eval = tuple(saved["last_eval"]) if saved["last_eval"] else None  # type: ignore[assignment]
        wall_before = float(saved["wall_seconds"])
    trainer_cls = engine_trainer_class()
    with console.progress(cfg.run.steps, cfg.run.time_budget_seconds, 0, 0.0) as bar, \
            life.catching():  # fmt: skip
        callback = RunDirCallback(cfg, progress, writer, evaluate, bar if main else None)
        stopper = StopCallback(life, lay.optimizer_steps)
        reward = reward_function(task, columns)
        trainer = trainer_cls(
            model=model,
            reward_funcs=[reward],
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=lora_config(cfg),
            callbacks=[callback.as_trainer_callback(), stopper.as_trainer_callback()],
        )
        trainer.progress = progress
        life.step = lambda: trainer.state.global_step // lay.optimizer_steps  # a second signal
        if main and saved is not None:  # the failures counted before (the sum over processes)
            reward.failures = int(saved["reward_failures"])  # type: ignore[attr-defined]

        def on_checkpoint(path: Path) -> None:
            # every process: the failures summed and every process's files (RNG states) written
            failed = int(all_reduce(float(reward.failures), "sum"))  # type: ignore[attr-defined]
            state.wait_for_everyone()
            if main:
                assert writer is not None
                complete_checkpoint(path, {
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
        # deferred: transformers is heavy; loaded only when TRL trains
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
            try:
                trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
            except RunStopped:  # a second signal: the lifecycle records it
                if writer is not None:
                    writer.close()
                raise
    steps = math.ceil(trainer.state.global_step / lay.optimizer_steps)
    if stopper.signame is not None:  # stopped on a signal, with a checkpoint of this step
        if writer is not None:
            writer.close()
        state.wait_for_everyone()
        raise life.stopped(stopper.signame, steps, _newest(run_dir))
    failures = int(all_reduce(float(reward.failures), "sum"))  # type: ignore[attr-defined]

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
        out = run_dir / MODEL_DIR
        policy.save_pretrained(out)
        tokenizer.save_pretrained(out)
        params = [p for p in policy.parameters() if p.requires_grad]
        summary = _summary(cfg, run_dir, steps, progress, eval_before, eval_after, t0)
        summary["wall_seconds"] += wall_before  # the parts before a resume too
        summary["device"] = str(params[0].device)
        summary["dtype"] = str(params[0].dtype).removeprefix("torch.")
        summary["trl/mixed_precision"] = "bf16" if args.bf16 else "no"
        # HF's Trainer steps the fp32 weights it computes with under bf16 autocast
        summary["fp32_master_weights"] = bool(args.bf16) and not cfg.lora.enabled
        peak = peak_memory_bytes(params[0].device)
        summary["peak_memory_gib"] = None if peak is None else peak / 2**30
        summary["reward_failures"] = failures
        summary["trl/world_size"] = state.num_processes  # processes that trained (accelerate)
        summary["drift"] = drift  # gbmpo.eval.drift.DRIFT_KEYS, or None
        summary["drift_seconds"] = drift_seconds if drift is not None else None
        life.finished(summary)  # summary.json, then status.json "finished"
    state.wait_for_everyone()
    return summary


def _summary(cfg: Any, run_dir: Path, steps: int, progress: RLProgress,
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
        # host-only values under the host's prefix: the other keys are the own engine's
        "trl/num_processes": cfg.run.num_processes,
        "trl/finished": _dt.datetime.now().isoformat(timespec="seconds"),
        "run_dir": str(run_dir),
        "final_model": str(run_dir / MODEL_DIR),
    }
    key = main_metric(before or {})
    if key and before and after:
        summary["gain"] = {key: after[key] - before[key]}
    return summary


def main(argv: list[str] | None = None) -> int:
    """Worker entry (``accelerate launch --module gbmpo.engines.trl.runner --run-dir DIR``):
    train the run directory's ``config.yaml``."""
    parser = argparse.ArgumentParser(description="gbmpo TRL engine worker")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument(
        "--resume-from",
        default=None,
        help="continue from this checkpoint ('': resume from the start)",
    )
    ns = parser.parse_args(argv)
    run_dir = Path(ns.run_dir)
    cfg = load_config(run_dir / CONFIG_FILE)
    add_plugin_modules(list(cfg.run.plugins))
    on_exit = _die_with_parent()  # the launcher killed: this worker too
    if on_exit is not None:
        on_exit()
        if os.getppid() == 1:  # the launcher had already gone
            return 1
    resuming = ns.resume_from is not None
    start = Path(ns.resume_from) if ns.resume_from else None
    try:
        train_in_process(cfg, run_dir, resume_from=start, resuming=resuming)
    except RunStopped:  # status.json says so; `gbmpo train` prints the line and the exit code
        return 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
