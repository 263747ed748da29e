"""The run directory and the run's lifecycle (:func:`run`).

A run writes ``config.yaml``, ``status.json`` (running / failed / interrupted / finished),
``metrics.jsonl``, ``checkpoints/``, the final ``model/`` and, last, ``summary.json`` (only for a
finished run). One process per run directory (a lock, removed when the run ends); a resumed run
continues from its last intact checkpoint with the metrics rows that checkpoint counted.

SIGTERM / SIGINT (:mod:`gbmpo.io.stop`): the step under way finishes, a checkpoint is written,
``status.json`` says ``preempted`` / ``interrupted`` with the step and the checkpoint, and
:class:`gbmpo.io.RunStopped` is raised (its message: the checkpoint and the resume command); a
second signal stops at once (the last complete checkpoint is kept).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gbmpo.config import (
    ConfigError,
    TrainConfig,
    apply_overrides,
    config_from_dict,
    config_to_dict,
    dump_yaml,
)
from gbmpo.io import (
    CheckpointError,
    RunLock,
    RunStopped,
    StopSignals,
    is_nonempty,
    resume_command,
    write_atomic,
    write_json_atomic,
)
from gbmpo.train.checkpoint import (
    latest_checkpoint,
    latest_valid_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from gbmpo.train.console import Console, fmt_eval, main_metric
from gbmpo.train.device import device_memory_bytes, peak_memory_bytes
from gbmpo.train.logging import MetricsWriter, Reporters
from gbmpo.train.precision import MasterWeightOptimizer

if TYPE_CHECKING:
    from gbmpo.train.trainer import Trainer

__all__ = [
    "CONFIG_FILE",
    "MODEL_DIR",
    "RESUMABLE_OVERRIDES",
    "STATUS_FILE",
    "SUMMARY_FILE",
    "default_run_dir",
    "final_drift",
    "fmt_drift",
    "no_checkpoint_error",
    "refuse_nonempty",
    "resume_config",
    "run",
    "write_status",
]

CONFIG_FILE = "config.yaml"

STATUS_FILE = "status.json"

SUMMARY_FILE = "summary.json"

MODEL_DIR = "model"

RESUMABLE_OVERRIDES = (
    "run.steps",
    "run.time_budget_seconds",
    "run.checkpoint_every",
    "run.keep_checkpoints",
    "run.report_to",
    "run.num_threads",
    "run.keep_freed_memory",
    "run.progress",
    "run.allow_unsandboxed_code",
)



def default_run_dir(cfg: TrainConfig, root: str | Path = "runs") -> Path:
    """``runs/<YYYYmmdd-HHMMSS>-<regularizer>`` (suffixed if it already exists)."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path(root) / f"{stamp}-{cfg.objective.regularizer_label}"
    path, k = base, 1
    while path.exists():
        path, k = Path(f"{base}-{k}"), k + 1
    return path



def refuse_nonempty(path: Path) -> None:
    """:class:`ConfigError` when ``path`` holds anything (a new run needs an empty directory)."""
    if is_nonempty(path):
        raise ConfigError(
            f"output directory {str(path)!r} already exists and is not empty; "
            "resume it with `gbmpo train --resume DIR` or choose another --output-dir"
        )


def resume_config(
    run_dir: str | Path, overrides: list[tuple[str, Any]] | None = None
) -> tuple[TrainConfig, Path]:
    """The configuration of the unfinished run ``run_dir`` (its config.yaml; only the keys in
    :data:`RESUMABLE_OVERRIDES` may be overridden) and its path."""
    import yaml

    from gbmpo.config import canonical_key

    path = Path(run_dir)
    if not (path / CONFIG_FILE).is_file():
        raise ConfigError(f"cannot resume {str(run_dir)!r}: no {CONFIG_FILE} in it")
    if (path / SUMMARY_FILE).is_file():
        raise ConfigError(f"cannot resume {str(run_dir)!r}: the run already finished")
    data = yaml.safe_load((path / CONFIG_FILE).read_text())
    for key, _ in overrides or []:
        if canonical_key(key) not in RESUMABLE_OVERRIDES:
            raise ConfigError(
                f"cannot change {canonical_key(key)!r} when resuming; only "
                f"{', '.join(RESUMABLE_OVERRIDES)} may change"
            )
    apply_overrides(data, overrides or [])
    cfg = config_from_dict(data)
    cfg.run.output_dir = str(path)
    return cfg, path


def no_checkpoint_error(run_dir: str | Path) -> CheckpointError:
    """What ``gbmpo train --resume DIR`` says (exit 1, nothing changed) about a run that has no
    checkpoint to continue from."""
    return CheckpointError(
        f"cannot resume {str(run_dir)!r}: it has no checkpoint (it stopped before its first); "
        f"start it over in the same directory with `{resume_command(run_dir)} --restart`"
    )


def _gib(n: int | None) -> float | None:
    return None if n is None else n / 2**30


def run(tr: Trainer) -> dict[str, Any]:
    """Run (or resume) the whole training; returns the summary written to summary.json."""
    cfg = tr.config
    tr._t0 = time.perf_counter()
    if tr.run_dir is None:
        tr.run_dir = default_run_dir(cfg)
        cfg.run.output_dir = str(tr.run_dir)
    run_dir = tr.run_dir
    # one process per run directory; checked again under the lock, which the other process
    # may have taken (and used) since __init__
    lock = RunLock(run_dir).acquire()
    try:
        with StopSignals() as tr._stop:
            return _train_locked(tr, run_dir)
    finally:
        tr._stop = None
        lock.release()


def _train_locked(tr: Trainer, run_dir: Path) -> dict[str, Any]:
    cfg = tr.config
    if tr._resume_dir is None:
        refuse_nonempty(run_dir)
    if tr._resume_dir is not None and (run_dir / SUMMARY_FILE).is_file():
        raise ConfigError(f"cannot resume {str(run_dir)!r}: the run already finished")
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
    tr._running = {"resumed_from": str(resumed_from) if resumed_from else None}
    set_status(tr, "running", **tr._running)
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
        summary = _loop(tr, writer, reporters)
    except RunStopped as err:
        if not err.now:  # stopped after a step: status and checkpoint written
            raise
        # a second signal: the newest complete checkpoint is what a resume continues from
        found = latest_checkpoint(run_dir)
        stopped = err.complete(step=tr.step, checkpoint=found, run_dir=run_dir)
        with contextlib.suppress(OSError):
            set_status(tr, stopped.state, signal=err.signame, stopped="at once",
                       checkpoint=None if found is None else str(found))  # fmt: skip
        raise stopped from None
    except BaseException as err:
        kind = "interrupted" if isinstance(err, KeyboardInterrupt) else "failed"
        with contextlib.suppress(OSError):  # e.g. a full disk: report the original error
            set_status(tr, kind, error=f"{type(err).__name__}: {err}")
        raise
    finally:
        writer.close()
        if reporters is not None:
            reporters.close()
    return summary


def _loop(tr: Trainer, writer: MetricsWriter, reporters: Reporters) -> dict[str, Any]:
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
            _stop_if_asked(tr)
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
            _stop_if_asked(tr, checkpointed=checkpointed)
            set_status(tr, "running", **tr._running)  # the step, for whoever watches the run

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
    write_json_atomic(tr.run_dir / SUMMARY_FILE, summary)  # last: the run is finished
    set_status(tr, "finished")
    return summary


def _stop_if_asked(tr: Trainer, *, checkpointed: bool = False) -> None:
    """After a step (or before the first): on a requested stop, checkpoint this step (unless
    just done), write the stopped state to status.json and raise :class:`RunStopped`."""
    stop = tr._stop
    signame = stop.poll() if stop is not None else None
    if signame is None:
        return
    assert tr.run_dir is not None
    stop.immediate_second = True
    if not checkpointed:
        tr._checkpoint()
    found = latest_checkpoint(tr.run_dir)
    stopped = RunStopped(signame, step=tr.step, checkpoint=found, run_dir=tr.run_dir)
    set_status(tr, stopped.state, signal=signame, checkpoint=str(found),
               resume=resume_command(tr.run_dir))  # fmt: skip
    raise stopped


#: ``final_drift``'s default reference: the initial weights (LoRA: the adapters disabled)
INITIAL = "initial"


def final_drift(
    cfg: TrainConfig,
    policy: Any,
    tokenizer: Any,
    task: Any,
    split: str,
    limit: int | None,
    *,
    reference: Any = INITIAL,
) -> tuple[dict[str, Any] | None, float]:
    """``(drift, seconds)`` of the final policy from the reference (``summary.json`` ``drift``,
    the keys of :data:`gbmpo.eval.drift.DRIFT_KEYS`), or ``(None, 0.0)`` unless ``eval.drift``
    and ``eval.after`` are set: :func:`gbmpo.eval.drift.measure_drift` on the prompts the final
    evaluation uses (``split``, ``limit``), ``eval.max_new_tokens`` tokens, seed ``run.seed``.

    ``reference``: a model, ``None`` (the policy with its LoRA adapters disabled) or
    :data:`INITIAL`: with LoRA the adapters disabled, otherwise ``model.path`` loaded again on
    the policy's device in the policy's dtype (and freed afterwards). Every engine that measures
    drift calls this function.
    """
    if not (cfg.eval.drift and cfg.eval.after):
        return None, 0.0
    from gbmpo.eval.drift import measure_drift

    t = time.perf_counter()
    if isinstance(reference, str) and reference == INITIAL:
        if cfg.lora.enabled:
            reference = None
        else:
            from gbmpo.models import load_model_and_tokenizer

            weight = next(policy.parameters())
            reference, _ = load_model_and_tokenizer(
                cfg.model.path, dtype=weight.dtype, device=str(weight.device),
                trust_remote_code=cfg.model.trust_remote_code,
            )  # fmt: skip
    drift = measure_drift(
        policy, reference, tokenizer, task, split=split, limit=limit,
        max_new_tokens=cfg.eval.max_new_tokens, batch_size=cfg.eval.batch_size,
        seed=cfg.run.seed,
        generator="gbmpo" if cfg.rollout.generator == "vllm" else cfg.rollout.generator,
        lean=cfg.rollout.lean_forward,
    )  # fmt: skip
    return drift, time.perf_counter() - t


def fmt_drift(drift: dict[str, Any], seconds: float) -> str:
    """One console line for :func:`final_drift`'s result."""
    return (
        f"drift from the reference: KL {drift['kl']:.4g} (reverse {drift['kl_reverse']:.4g}), "
        f"ProbL2 {drift['prob_l2']:.4g}, TV {drift['tv']:.4g} per token over "
        f"{drift['n_tokens']} tokens of {drift['n_prompts']} prompts ({seconds:.1f} s)"
    )


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


def set_status(tr: Trainer, status: str, **extra: Any) -> None:
    assert tr.run_dir is not None
    write_status(tr.run_dir, status, tr.step, **extra)


def write_status(run_dir: str | Path, status: str, step: int, **extra: Any) -> None:
    """``status.json``: ``{"status", "step", "updated", **extra}`` (every engine), written
    atomically. ``status``: running / finished / failed / interrupted (SIGINT) / preempted
    (SIGTERM)."""
    write_json_atomic(
        Path(run_dir) / STATUS_FILE,
        {
            "status": status,
            "step": step,
            "updated": _dt.datetime.now().isoformat(timespec="seconds"),
            **extra,
        },
    )


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
