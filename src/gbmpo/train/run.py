"""The own trainer's run (:func:`run`): its training loop, checkpoints, final model and summary.

The lifecycle around it (the lock, ``status.json``, SIGTERM / SIGINT, ``summary.json``) is every
engine's :class:`gbmpo.lifecycle.RunLifecycle`. A resumed run continues from its last intact
checkpoint with the metrics rows that checkpoint counted.

SIGTERM / SIGINT (:mod:`gbmpo.io.stop`): the step under way finishes, a checkpoint is written,
``status.json`` says ``preempted`` / ``interrupted`` with the step and the checkpoint, and
:class:`gbmpo.io.RunStopped` is raised (its message: the checkpoint and the resume command); a
second signal stops at once (the last complete checkpoint is kept).

The run-directory names and helpers that lived here (``CONFIG_FILE``, ``STATUS_FILE``,
``SUMMARY_FILE``, ``MODEL_DIR``, ``RESUMABLE_OVERRIDES``, ``default_run_dir``,
``refuse_nonempty``, ``resume_config``, ``no_checkpoint_error``, ``write_status``) are
:mod:`gbmpo.lifecycle`'s, and ``final_drift`` / ``fmt_drift`` are
:mod:`gbmpo.eval.drift`'s; they are re-exported here.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gbmpo.config import config_to_dict, dump_yaml
from gbmpo.eval.drift import INITIAL as INITIAL
from gbmpo.eval.drift import final_drift as final_drift
from gbmpo.eval.drift import fmt_drift as fmt_drift
from gbmpo.io import write_atomic
from gbmpo.lifecycle import CONFIG_FILE as CONFIG_FILE
from gbmpo.lifecycle import MODEL_DIR as MODEL_DIR
from gbmpo.lifecycle import RESUMABLE_OVERRIDES as RESUMABLE_OVERRIDES
from gbmpo.lifecycle import STATUS_FILE as STATUS_FILE
from gbmpo.lifecycle import SUMMARY_FILE as SUMMARY_FILE
from gbmpo.lifecycle import RunLifecycle
from gbmpo.lifecycle import default_run_dir as default_run_dir
from gbmpo.lifecycle import no_checkpoint_error as no_checkpoint_error
from gbmpo.lifecycle import refuse_nonempty as refuse_nonempty
from gbmpo.lifecycle import resume_config as resume_config
from gbmpo.lifecycle import write_status as write_status
from gbmpo.lifecycle.console import Console, fmt_eval, main_metric
from gbmpo.lifecycle.logging import MetricsWriter, Reporters
from gbmpo.train.checkpoint import (
    latest_checkpoint,
    latest_valid_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from gbmpo.train.device import device_memory_bytes, peak_memory_bytes
from gbmpo.train.drift import drift_state, restore_drift
from gbmpo.train.precision import MasterWeightOptimizer

if TYPE_CHECKING:
    from gbmpo.train.trainer import Trainer

__all__ = ["checkpoint", "placement", "run"]


def _gib(n: int | None) -> float | None:
    return None if n is None else n / 2**30


def run(tr: Trainer) -> dict[str, Any]:
    """Run (or resume) the whole training in the run's :class:`gbmpo.lifecycle.RunLifecycle`
    (lock, status, signals); returns the summary written to summary.json."""
    cfg = tr.config
    tr._t0 = time.perf_counter()
    if tr.run_dir is None:
        tr.run_dir = default_run_dir(cfg)
        cfg.run.output_dir = str(tr.run_dir)
    run_dir = tr.run_dir
    # one process per run directory; the empty / finished checks again under the lock, which
    # another process may have taken (and used) since __init__
    life = RunLifecycle(
        run_dir, "gbmpo", resuming=tr._resume_dir is not None, signals=True,
        step=lambda: tr.step, checkpoint=lambda: latest_checkpoint(run_dir),
    )  # fmt: skip
    with life:
        tr._life = life
        try:
            return _train_locked(tr, run_dir, life)
        finally:
            tr._life = None


def _train_locked(tr: Trainer, run_dir: Path, life: RunLifecycle) -> dict[str, Any]:
    cfg = tr.config
    resumed_from = latest_valid_checkpoint(run_dir) if tr._resume_dir else None
    if tr._resume_dir is not None and resumed_from is None and not tr._restart:
        raise no_checkpoint_error(run_dir)
    if resumed_from is not None:
        _restore(tr, resumed_from)
        print(f"gbmpo: resuming {str(run_dir)!r} from {resumed_from.name} (step {tr.step} of "
              f"{cfg.run.steps})", file=sys.stderr, flush=True)  # fmt: skip
    elif tr._resume_dir is not None:
        print(f"gbmpo: restarting {str(run_dir)!r} from step 0 (--restart)", file=sys.stderr,
              flush=True)  # fmt: skip
    write_atomic(run_dir / CONFIG_FILE, dump_yaml(cfg))
    life.running(tr.step, resumed_from=resumed_from)
    # on resume, drop what was logged after the checkpoint (everything if there is none):
    # the rows it counted, e.g. not the final evaluation's row logged after the last periodic
    # checkpoint at the same step (older checkpoints: the rows up to its step)
    keep = (tr.step if resumed_from is not None else -1) if tr._resume_dir else None
    rows = tr._resume_rows if resumed_from is not None else None
    writer = tr._writer = MetricsWriter(run_dir, keep_up_to_step=keep, keep_rows=rows)
    reporters: Reporters | None = None
    try:
        reporters = Reporters(
            cfg.run.report_to, run_dir, config_to_dict(cfg), run_name=run_dir.name
        )
        return _loop(tr, writer, reporters, life)
    finally:
        writer.close()
        if reporters is not None:
            reporters.close()


def _loop(tr: Trainer, writer: MetricsWriter, reporters: Reporters,
          life: RunLifecycle) -> dict[str, Any]:  # fmt: skip
    cfg = tr.config
    assert tr.run_dir is not None
    budget = cfg.run.time_budget_seconds
    console = Console(cfg.run.progress)
    console.print(placement(tr))
    if tr.eval_limit is not None and tr.eval_limit < tr.n_eval:
        console.print(
            f"evaluating the first {tr.eval_limit} of {tr.n_eval} {tr.eval_split!r} "
            "examples (eval.limit / eval.auto_limit)"
        )

    if cfg.eval.before and tr.eval_before is None:
        record = _eval_record(tr, 0)
        tr.eval_before = tr.last_eval[1] if tr.last_eval else None
        _log(writer, reporters, {"step": 0, **record})
        console.print(f"held-out {fmt_eval(tr.eval_before)} before training")

    stop_reason = "steps"
    with console.progress(cfg.run.steps, budget, tr.step, tr.rl_seconds) as bar:
        while tr.step < cfg.run.steps:
            _stop_if_asked(tr, life)
            if budget is not None and tr.rl_seconds >= budget:
                stop_reason = "time_budget"
                break
            record = tr.train_step()
            if cfg.eval.every and tr.step % cfg.eval.every == 0:
                record.update(_eval_record(tr, tr.step))
            _log(writer, reporters, record)
            every = cfg.run.checkpoint_every
            checkpointed = bool(every and tr.step % every == 0)
            if checkpointed:
                tr._checkpoint()  # via the trainer: subclasses extend it
            bar.update(tr.step, tr.rl_seconds, record, tr.last_eval)
            _stop_if_asked(tr, life, checkpointed=checkpointed)
            life.running(tr.step)  # the step, for whoever watches the run

    eval_after = None
    if cfg.eval.after:
        if tr.last_eval is not None and tr.last_eval[0] == tr.step and tr.step > 0:
            eval_after = tr.last_eval[1]
        else:
            record = _eval_record(tr, tr.step)
            eval_after = tr.last_eval[1] if tr.last_eval else None
            _log(writer, reporters, {"step": tr.step, **record})
        console.print(f"held-out {fmt_eval(eval_after)} after {tr.step} steps")
    drift, drift_seconds = final_drift(
        cfg, tr.model, tr.tokenizer, tr.task, tr.eval_split, tr.eval_limit,
        reference=_drift_reference(tr),
    )  # fmt: skip
    if drift is not None:
        console.print(fmt_drift(drift, drift_seconds))

    peak = peak_memory_bytes(tr.device)
    if peak is not None:
        console.print(f"peak {tr.device} memory {peak / 2**30:.2f} GiB")
    tr._checkpoint()  # via the trainer: subclasses extend it
    _export_model(tr)
    summary = _summary(tr, eval_after, stop_reason)
    summary["drift"] = drift
    summary["drift_seconds"] = drift_seconds if drift is not None else None
    return life.finished(summary)  # summary.json last: the run is finished


def _stop_if_asked(tr: Trainer, life: RunLifecycle, *, checkpointed: bool = False) -> None:
    """After a step (or before the first): on a requested stop, checkpoint this step (unless
    just done), record the stop (:meth:`RunLifecycle.stopped`) and raise it."""
    stop = life.stop
    signame = stop.poll() if stop is not None else None
    if signame is None:
        return
    assert tr.run_dir is not None
    stop.immediate_second = True
    if not checkpointed:
        tr._checkpoint()
    raise life.stopped(signame, tr.step, latest_checkpoint(tr.run_dir))


def _drift_reference(tr: Trainer) -> Any:
    """The reference the own engine holds: its frozen copy, the copy of the initial weights kept
    for drift when a model object was passed in, else :data:`INITIAL`."""
    if tr.ref_model is not None:
        return tr.ref_model
    kept = getattr(tr, "initial_model", None)
    return kept if kept is not None else INITIAL


def _eval_record(tr: Trainer, step: int) -> dict[str, Any]:
    t = time.perf_counter()
    metrics = tr.evaluate()
    tr.last_eval = (step, metrics)
    record = {f"eval/{k}": v for k, v in metrics.items()}
    record["time/eval_seconds"] = time.perf_counter() - t
    return record


def _log(writer: MetricsWriter, reporters: Reporters, record: dict[str, Any]) -> None:
    writer.write(record)
    reporters.log(record, record["step"])


def _state(tr: Trainer) -> dict[str, Any]:
    return {
        "sampler_position": tr.sampler.position,
        "rl_seconds": tr.rl_seconds,
        "wall_seconds": tr.wall_seconds_before + (time.perf_counter() - tr._t0),
        "reward_failures_total": tr.reward_failures_total,
        "eval_before": tr.eval_before,
        "last_eval": list(tr.last_eval) if tr.last_eval else None,
        # metrics.jsonl rows written so far: a resume keeps exactly these
        "metrics_rows": tr._writer.rows if tr._writer is not None else None,
        "drift_coefs": drift_state(tr),  # the controlled coefficients of the next step
    }


def _restore(tr: Trainer, path: Path) -> None:
    state = load_checkpoint(path, model=tr.model, optimizer=tr.optimizer)
    tr.step = int(state["step"])
    tr.sampler.position = int(state["sampler_position"])
    tr.rl_seconds = float(state["rl_seconds"])
    tr.wall_seconds_before = float(state["wall_seconds"])
    tr.reward_failures_total = int(state["reward_failures_total"])
    tr.eval_before = state["eval_before"]
    tr.last_eval = tuple(state["last_eval"]) if state["last_eval"] else None  # type: ignore[assignment]
    tr._resume_rows = state.get("metrics_rows")
    restore_drift(tr, state.get("drift_coefs"))


def checkpoint(tr: Trainer) -> None:
    assert tr.run_dir is not None
    save_checkpoint(
        tr.run_dir,
        tr.step,
        model=tr.model,
        optimizer=tr.optimizer,
        state=_state(tr),
        keep=tr.config.run.keep_checkpoints,
    )


def _export_model(tr: Trainer) -> None:
    assert tr.run_dir is not None
    out = tr.run_dir / MODEL_DIR
    tr.model.save_pretrained(out)
    tr.tokenizer.save_pretrained(out)


def _summary(tr: Trainer, eval_after: dict[str, Any] | None, stop_reason: str) -> dict[str, Any]:
    cfg = tr.config
    summary: dict[str, Any] = {
        "status": "finished",
        "engine": "gbmpo",
        "steps": tr.step,
        "stop_reason": stop_reason,
        "wall_seconds": tr.wall_seconds_before + (time.perf_counter() - tr._t0),
        "rl_seconds": tr.rl_seconds,
        "eval_before": tr.eval_before,
        "eval_after": eval_after,
        "reward_failures": tr.reward_failures_total,
        "model": cfg.model.path,
        "task": cfg.task.name,
        "advantage": cfg.objective.advantage,
        "surrogate": cfg.objective.surrogate.name,
        "regularizer": cfg.objective.regularizer_label,
        "coef": cfg.objective.coef_label,
        "aggregation": cfg.objective.aggregation,
        "seed": cfg.run.seed,
        "device": str(tr.device),
        "dtype": str(tr.params[0].dtype).removeprefix("torch."),
        "fp32_master_weights": isinstance(tr.optimizer, MasterWeightOptimizer),
        "peak_memory_gib": _gib(peak_memory_bytes(tr.device)),
        "run_dir": str(tr.run_dir),
        "final_model": str(tr.run_dir / MODEL_DIR) if tr.run_dir else None,
    }
    if tr.objective.controlled:  # each controlled coefficient: its setting and final value
        summary["drift_control"] = {
            t.name: {**t.control.to_dict(), "final_coef": t.coef}
            for t in tr.objective.controlled if t.control is not None
        }
    key = main_metric(tr.eval_before or eval_after or {})
    if key and tr.eval_before and eval_after:
        summary["gain"] = {key: eval_after[key] - tr.eval_before[key]}
    return summary


def placement(tr: Trainer) -> str:
    """One line: device, weights dtype, master weights, device memory."""
    dtype = str(tr.params[0].dtype).removeprefix("torch.")
    line = f"device {tr.device}, trainable weights {dtype}"
    if isinstance(tr.optimizer, MasterWeightOptimizer):
        line += " (fp32 master weights)"
    total = device_memory_bytes(str(tr.device))
    if total is not None and tr.device.type != "cpu":
        line += f", {total / 2**30:.1f} GiB device memory"
    return line
