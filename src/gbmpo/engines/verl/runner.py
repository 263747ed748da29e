r"""``gbmpo train --engine verl``: verl's ``main_ppo`` (Ray, FSDP, vLLM) from a gbmpo config.

What the config becomes (:mod:`gbmpo.engines.verl.args`: ``overrides``, Hydra overrides of
verl's ``ppo_trainer.yaml``):

* ``objective`` -> the gbmpo verl plugin (``gbmpo.integrations.verl``): the spec as JSON in
  ``policy_loss.gbmpo_objective``, built by the plugin once per process into the own engine's
  ``BuiltObjective`` (so verl's own clip fields add nothing), the surrogate as
  ``policy_loss.loss_mode=gbmpo_<name>``, the regularizer as the actor KL loss
  ``kl_loss_type=gbmpo_<name>`` with ``kl_loss_coef`` = coef, the aggregation as ``loss_agg_mode``
  (:data:`gbmpo.config.hosts.verl.VERL_LOSS_AGG_MODES`; ``dr_grpo`` with
  ``loss_scale_factor`` = the completion length), the advantage as ``algorithm.adv_estimator``
  / ``norm_adv_by_std_in_grpo``;
* ``task`` -> ``data/train.parquet`` and ``data/test.parquet`` in the run directory
  (``write_data``): each prompt rendered exactly as the own trainer renders it, passed
  through verl's chat templating unchanged (a pass-through ``custom_chat_template``), and the
  reward's columns in ``extra_info``; the task's reward -> verl's
  ``reward.custom_reward_function`` (:mod:`gbmpo.engines.verl.reward`, which calls the task's
  reward: math-verify, the code sandbox, a user's ``module:function``);
* ``rollout`` / ``optim`` / ``lora`` / ``run`` -> rollout ``n``, lengths, sampling, learning
  rate and schedule, ``ppo_mini_batch_size`` (prompts), micro-batches, ``ppo_epochs`` = ``mu``,
  LoRA rank, ``trainer.n_gpus_per_node`` = ``run.num_processes``, ``trainer.nnodes`` =
  ``run.num_nodes``, steps, checkpoints, validation (``validation_freq``: the last step
  is the final evaluation), seeds, precision (``precision_overrides``).

In verl's trainer process gbmpo's driver hooks (:mod:`gbmpo.engines.verl.driver`) add the
monitored divergences ``reg/<name>``, the entropy's token mean, the reward failures and the RL
clock to each step's metrics, and end the run after the step that spends
``run.time_budget_seconds``; with ``eval.drift`` the final checkpoint is merged into ``model/``
(verl's model merger) and its drift measured as on the other engines.

Every key is honoured or refused (:data:`gbmpo.config.hosts.verl.VERL`): :func:`run` and
:func:`dry_run` call :func:`check_engine_support` before anything is written. After the run
:mod:`gbmpo.engines.verl.metrics` turns verl's file log into ``metrics.jsonl`` (the schema of
:mod:`gbmpo.io.metrics`, verl's own names under ``verl/``) and ``summary.json``.

verl lives in its own environment (it pins transformers < 5.11): :func:`verl_python` finds it
(``$GBMPO_VERL_PYTHON``, else ``.venv-verl/bin/python`` of this checkout or the working
directory, else this interpreter when it can import verl). ``--dry-run`` composes verl's
config with the overrides there and runs verl's own validation (:mod:`gbmpo.engines.verl.check`);
a run launches ``python -m verl.trainer.main_ppo`` there, after checking for GPUs.

``gbmpo train --resume DIR`` (:func:`resume`) continues a verl run from the newest checkpoint
verl recorded in the directory :data:`LAUNCH_FILE` names, with the launch's overrides plus
verl's ``trainer.resume_mode=resume_path`` (:func:`resume_overrides`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from gbmpo.config import ConfigError, dump_yaml, validate
from gbmpo.config.support import check_support
from gbmpo.engines.checks import (
    DryRunReport,
    EngineUnavailable,
    common_checks,
    memory_check,
)
from gbmpo.engines.verl import cpu as verl_cpu
from gbmpo.engines.verl import driver as verl_driver
from gbmpo.engines.verl.args import overrides, with_mirror_file, write_data
from gbmpo.engines.verl.cpu import VerlCPUError, check_version
from gbmpo.engines.verl.metrics import (
    VERL_EARLIER_METRICS_FILE,
    VERL_METRICS_FILE,
    read_verl_log,
    summarize_run,
)
from gbmpo.engines.verl.objective import hydra_value as _value
from gbmpo.eval.drift import final_drift, fmt_drift
from gbmpo.io import RunStopped, resume_command, write_atomic, write_json_atomic
from gbmpo.io.stop import handling
from gbmpo.lifecycle import (
    CONFIG_FILE,
    MODEL_DIR,
    RunLifecycle,
    default_run_dir,
    refuse_nonempty,
    resume_config,
)
from gbmpo.models import load_model_and_tokenizer, resolve_model_path
from gbmpo.train.setup import build_task, eval_limit, load_splits, load_tokenizer

__all__ = [
    "LAUNCH_FILE",
    "check_engine_support",
    "dry_run",
    "resume",
    "resume_dry_run",
    "resume_overrides",
    "run",
    "verl_python",
]


def verl_python() -> str | None:
    """The interpreter of verl's environment, or ``None`` (see the module doc):
    ``GBMPO_VERL_PYTHON`` (:class:`EngineUnavailable` where it names no file, rather than falling
    back to another python), else ``.venv-verl`` of this checkout or of the current directory
    (``make verl`` builds it), else this python where it has verl."""
    env = os.environ.get("GBMPO_VERL_PYTHON")
    if env:
        if not Path(env).is_file():
            raise EngineUnavailable(f"GBMPO_VERL_PYTHON={env!r} is not a file: point it at the "
                                    "python of an environment with verl, or unset it")  # fmt: skip
        return env
    here = Path(__file__).resolve().parents[4]  # the checkout holding src/gbmpo
    for root in (here, Path.cwd()):
        candidate = root / ".venv-verl" / "bin" / "python"
        if candidate.exists():
            return str(candidate)
    if importlib.util.find_spec("verl") is not None:
        return sys.executable
    return None


def _verl_env(plugins: list[str] | None = None, *, cpu: bool = False) -> dict[str, str]:
    """This process's environment, with this gbmpo first on the path and the plugin loaded
    (after the run's ``run.plugins``, which may register surrogates and regularizers that the
    plugin then registers with verl), and the driver hooks (:mod:`gbmpo.engines.verl.driver`:
    the monitored divergences, the entropy, the reward failures, the time budget); with ``cpu``
    also the CPU platform and rollout
    (:mod:`gbmpo.engines.verl.cpu`, never on a GPU run)."""
    src = str(Path(__file__).resolve().parents[3])  # the src/ holding gbmpo
    path = os.environ.get("PYTHONPATH")
    extra = [verl_cpu.PLUGIN] if cpu else []
    modules = ",".join([*extra, *(plugins or []), "gbmpo.integrations.verl", verl_driver.MODULE])
    env = {**os.environ, "PYTHONPATH": src + (os.pathsep + path if path else ""),
           "VERL_USE_EXTERNAL_MODULES": modules, verl_driver.DRIVER_ENV: "1"}  # fmt: skip
    if cpu:
        env.update(verl_cpu.ENV)
    return env


def check_engine_support(cfg: Any) -> list[str]:
    """:func:`gbmpo.config.support.check_support` for engine verl: ``ConfigError`` (exit 2,
    nothing written) for a value verl cannot honour; returns the no-effect notices (``gbmpo
    train`` prints them once)."""
    return check_support(cfg, "verl")


def dry_run(cfg: Any) -> DryRunReport:
    """Engine-independent checks, the overrides, and verl's own validation of the composed
    ``ppo_trainer.yaml`` in verl's environment (:mod:`gbmpo.engines.verl.check`)."""
    report = DryRunReport("verl")
    notices = check_engine_support(cfg)
    if notices:
        report.info["notices"] = notices
    common_checks(cfg, report)
    memory_check(cfg, report)  # the plan per GPU (FSDP shards, vLLM's reserve, activations)
    run_dir = Path(cfg.run.output_dir or "runs/verl-dry-run")
    with tempfile.TemporaryDirectory() as tmp:
        # a mirror map not written yet (by ES, or the run's default map): a stand-in file
        probe = with_mirror_file(cfg, Path(tmp) / "mirror.json")
        ov = overrides(probe, run_dir, model_path=report.info.get("model"))
        report.ok("overrides", f"{len(ov)} Hydra overrides of verl.trainer.main_ppo")
        report.info["overrides"] = ov
        python = verl_python()
        if python is None:
            report.skip("verl config", "no verl environment here (GBMPO_VERL_PYTHON, .venv-verl)")
            return report
        plugins = list(cfg.run.plugins)
        proc = _verl_check(python, ov, Path(tmp), plugins, cpu=cfg.model.device == "cpu")
        if proc.returncode != 0 and "vllm version" in proc.stderr and cfg.lora.enabled:
            # verl checks the installed vLLM for LoRA rollouts: validate the rest without LoRA
            report.skip("verl LoRA", "verl validates LoRA against an installed vLLM (GPU only)")
            proc = _verl_check(python, [o for o in ov if ".lora_" not in o
                                        and ".target_modules=" not in o], Path(tmp),
                               plugins, cpu=cfg.model.device == "cpu")  # fmt: skip
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ConfigError(f"verl rejects the composed config: {tail}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    report.ok("verl config", f"verl {result['verl']}: ppo_trainer.yaml + overrides validated; "
              f"actor loss {result['surrogate']} + {result['regularizer']}")  # fmt: skip
    return report


def _verl_check(
    python: str, ov: list[str], tmp: Path, plugins: list[str] | None = None, *, cpu: bool = False
) -> subprocess.CompletedProcess[str]:
    ov_file = tmp / "overrides.json"
    ov_file.write_text(json.dumps(ov))
    return subprocess.run(
        [python, "-m", "gbmpo.engines.verl.check", str(ov_file)],
        env=_verl_env(plugins, cpu=cpu), capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def run(cfg: Any) -> dict[str, Any]:
    """Write the run directory (config, data, overrides, :data:`LAUNCH_FILE`) and launch
    ``verl.trainer.main_ppo``; :class:`EngineUnavailable` (nothing written) where verl or GPUs
    are missing."""
    validate(cfg)
    check_engine_support(cfg)  # a value verl cannot honour stops here, before anything else
    python = _gpu_python(cfg)
    run_dir = Path(cfg.run.output_dir) if cfg.run.output_dir else default_run_dir(cfg)
    refuse_nonempty(run_dir)  # before the tokenizer and the task (again under the lock)
    cfg.run.output_dir = str(run_dir)
    model_path = resolve_model_path(cfg.model.path)
    tokenizer = load_tokenizer(cfg)
    task = build_task(cfg, tokenizer)
    overrides(cfg, run_dir, model_path=model_path)  # what verl cannot express, before writing
    # the lock (a second run on this directory is refused) and the empty-directory check
    with RunLifecycle(run_dir, "verl") as life:
        write_atomic(run_dir / CONFIG_FILE, dump_yaml(cfg))
        counts = write_data(cfg, task, run_dir / "data", tokenizer)
        ov = overrides(
            with_mirror_file(cfg, run_dir / "mirror_init.json"), run_dir, model_path=model_path,
            max_prompt_length=counts.get("max_prompt_tokens"),
        )  # fmt: skip
        write_json_atomic(run_dir / LAUNCH_FILE, {
            "verl_checkpoints": str(run_dir.resolve() / "checkpoints"),
            "model_path": model_path,
            "max_prompt_length": counts.get("max_prompt_tokens"),
            "n_eval": counts["test"],
            "kind": task.kind,
        })  # fmt: skip
        return _launch(cfg, run_dir, python, ov, life, kind=task.kind, n_eval=counts["test"])


def _gpu_python(cfg: Any) -> str:
    """verl's interpreter where it can run ``cfg``: on ``model.device: cuda`` where it sees
    ``run.num_processes`` GPUs; on ``cpu`` where its verl is a version the CPU run was tested
    with (:func:`gbmpo.engines.verl.cpu.check_version`). Else :class:`EngineUnavailable`
    naming what is missing."""
    python = verl_python()
    if python is None:
        raise EngineUnavailable(
            "engine verl needs verl, in an environment of its own (verl needs transformers<5.11): "
            "in a clone of gbmpo `make verl` builds .venv-verl (2-4 min, 2.1 GB); elsewhere "
            "pip install 'gbmpo[verl]' into a new environment and point GBMPO_VERL_PYTHON at its "
            "python"
        )
    if cfg.model.device == "cpu":
        probe = subprocess.run(
            [python, "-c", "import importlib.metadata as m; print(m.version('verl'))"],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        try:
            check_version(probe.stdout.strip() if probe.returncode == 0 else None)
        except VerlCPUError as err:
            raise EngineUnavailable(str(err)) from None
        return python
    probe = subprocess.run(
        [python, "-c", "import torch; print(torch.cuda.device_count())"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    gpus = int(probe.stdout.strip() or 0) if probe.returncode == 0 else 0
    if gpus < cfg.run.num_processes:
        raise EngineUnavailable(
            f"engine verl needs {cfg.run.num_processes} NVIDIA GPU(s) per node "
            f"(run.num_processes), found {gpus} in verl's environment ({python}); "
            "model.device: cpu trains on the CPU (one process), and "
            "`gbmpo train --engine verl --dry-run` checks the config without GPUs"
        )
    return python


def _launch(cfg: Any, run_dir: Path, python: str, ov: list[str], life: RunLifecycle, *,
            kind: str, n_eval: int | None) -> dict[str, Any]:  # fmt: skip
    """Run ``verl.trainer.main_ppo`` with ``ov`` (also written to verl_overrides.txt), then
    write metrics.jsonl and summary.json; ``status.json`` through the run's lifecycle
    (``life``): ``running`` from verl's newest checkpoint, then ``finished``, ``failed`` (verl
    exited non-zero: the lifecycle records the error) or the stop on a signal."""
    write_atomic(run_dir / "verl_overrides.txt", "\n".join(ov) + "\n")
    env = {**_verl_env(list(cfg.run.plugins), cpu=cfg.model.device == "cpu"),
           "VERL_FILE_LOGGER_PATH": str(run_dir.resolve() / VERL_METRICS_FILE)}  # fmt: skip
    budget = cfg.run.time_budget_seconds
    if budget is not None:  # the driver hooks end the run after the step that spends it
        env[verl_driver.BUDGET_ENV] = repr(float(budget))
    env[verl_driver.RL_SECONDS_ENV] = repr(_rl_seconds(run_dir))  # the parts before a resume
    t0 = time.perf_counter()
    # Hydra's own output folder (the composed config, the log) inside the run directory, not
    # ./outputs of the working directory
    hydra_dir = f"hydra.run.dir={_value(str(run_dir.resolve() / 'hydra'))}"
    _, start, step = _resume_point(run_dir)
    life.running(step, resumed_from=start)
    with _forwarding_signals() as (received, forward):
        proc = subprocess.Popen([python, "-m", "verl.trainer.main_ppo", *ov, hydra_dir],
                                env=env, start_new_session=True)  # fmt: skip
        forward.append(proc)
        if received:  # a signal between the start and the line above: passed on now
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.Signals[received[0]])
        code = proc.wait()
    wall = time.perf_counter() - t0
    if received:
        raise _stopped(life, received[0])
    if code != 0:
        raise RuntimeError(f"verl.trainer.main_ppo failed (exit {code}); see above")
    summary = summarize_run(cfg, run_dir, kind=kind, wall_seconds=wall, n_eval=n_eval)
    return life.finished(_with_drift(cfg, run_dir, python, summary))


def _with_drift(cfg: Any, run_dir: Path, python: str, summary: dict[str, Any]) -> dict[str, Any]:
    """``summary`` with the drift of the final policy (``eval.drift`` with ``eval.after``): verl's
    last checkpoint merged into a Hugging Face model in ``model/`` (verl's model merger, in
    verl's environment; then ``final_model``), measured by :func:`gbmpo.eval.drift.final_drift`
    against ``model.path`` on the prompts of the final evaluation, as on the other engines."""
    steps = summary["steps"]
    if not (cfg.eval.drift and cfg.eval.after and steps > 0):
        return summary
    t0 = time.perf_counter()
    if not python:
        raise EngineUnavailable("eval.drift on engine verl merges verl's checkpoint with verl's "
                                "model merger, in verl's environment: none here (make verl)")
    actor = Path(summary["final_model"])
    target = run_dir / MODEL_DIR
    merged = subprocess.run(
        [python, "-m", "verl.model_merger", "merge", "--backend", "fsdp",
         "--local_dir", str(actor), "--target_dir", str(target),
         *(["--trust-remote-code"] if cfg.model.trust_remote_code else [])],
        env=_verl_env(list(cfg.run.plugins)), capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    if merged.returncode != 0:
        tail = (merged.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"verl's model merger failed on {actor} (eval.drift): {tail}")
    load = {"dtype": getattr(torch, cfg.model.dtype), "trust_remote_code":
            cfg.model.trust_remote_code, "device": "cpu" if cfg.model.device == "cpu" else "cuda"}
    policy, tokenizer = load_model_and_tokenizer(str(target), **load)
    reference, _ = load_model_and_tokenizer(cfg.model.path, **load)
    task = build_task(cfg, tokenizer)
    _, _, (_, split) = load_splits(cfg, task, count_eval=True)
    limit = eval_limit(cfg, len(task.split(split)))
    drift, seconds = final_drift(cfg, policy, tokenizer, task, split, limit, reference=reference)
    if drift is not None:
        print(fmt_drift(drift, seconds), file=sys.stderr)
    return {**summary, "drift": drift, "drift_seconds": seconds if drift is not None else None,
            "final_model": str(target),
            "wall_seconds": summary["wall_seconds"] + time.perf_counter() - t0}  # fmt: skip


def _rl_seconds(run_dir: Path, step: int | None = None) -> float:
    """The RL seconds verl's log records up to ``step`` (all: ``None``), the earlier parts'
    included (:mod:`gbmpo.engines.verl.driver`'s clock, 0 without a row)."""
    rows = (read_verl_log(run_dir / VERL_EARLIER_METRICS_FILE)
            + read_verl_log(run_dir / VERL_METRICS_FILE))  # fmt: skip
    return max((float(r["data"][verl_driver.RL_SECONDS_METRIC]) for r in rows
                if verl_driver.RL_SECONDS_METRIC in r["data"]
                and (step is None or int(r["step"]) <= step)), default=0.0)  # fmt: skip


@contextlib.contextmanager
def _forwarding_signals() -> Iterator[tuple[list[str], list[subprocess.Popen[bytes]]]]:
    """While verl runs (in a session of its own, so that a terminal's Ctrl-C reaches only
    ``gbmpo train``): SIGTERM / SIGINT are recorded and passed on to verl's whole process group
    (``main_ppo`` and the Ray processes it started), which ends it. Yields the signals received
    and the list to put the launched process in."""
    received: list[str] = []
    procs: list[subprocess.Popen[bytes]] = []

    def handle(signum: int, frame: FrameType | None) -> None:
        received.append(signal.Signals(signum).name)
        for proc in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signum)

    with handling(handle):
        yield received, procs


class VerlStopped(RunStopped):
    """A verl run stopped on SIGTERM / SIGINT. verl's trainer writes no checkpoint when it is
    signalled, so the run goes on from verl's newest checkpoint (``step``; none: it starts
    over)."""

    def message(self) -> str:
        head = f"stopped ({self.state}, {self.signame}); verl writes no checkpoint on a signal"
        if self.checkpoint is None:
            return (f"{head} and had none yet in {self.run_dir}: resuming starts over; "
                    f"resume with: {resume_command(self.run_dir or '')}")  # fmt: skip
        return (f"{head}: its newest is step {self.step} ({self.checkpoint}); resume with: "
                f"{resume_command(self.run_dir or '')}")  # fmt: skip


def _stopped(life: RunLifecycle, signame: str) -> RunStopped:
    """The stop to raise, recorded in ``status.json`` (preempted / interrupted, ``"stopped":
    "at once"``: verl's step under way is lost; verl's newest checkpoint)."""
    _, folder, step = _resume_point(life.run_dir)
    return life.stopped(signame, step, folder, now=True, kind=VerlStopped)


#: written at launch: where verl's checkpoints are (``verl_checkpoints``) and what a resume
#: needs to rebuild the launch's overrides (model path, longest prompt, evaluation size)
LAUNCH_FILE = "verl_launch.json"



def _logged_step(run_dir: Path) -> int:
    """The last training step whose row verl's log holds, the earlier parts' included (0:
    none)."""
    rows = (read_verl_log(run_dir / VERL_EARLIER_METRICS_FILE)
            + read_verl_log(run_dir / VERL_METRICS_FILE))  # fmt: skip
    return max((int(r["step"]) for r in rows if "training/global_step" in r.get("data", {})),
               default=0)  # fmt: skip


def _resume_point(run_dir: Path) -> tuple[dict[str, Any], Path | None, int]:
    """The launch record, the checkpoint directory verl resumes from (``None``: none yet) and
    its step (0 without one): verl's newest checkpoint, or, when verl saved a step's checkpoint
    but was stopped before it logged that step's row (it saves before it logs), the newest
    checkpoint whose step was logged, so that the unlogged step is trained and logged again
    (where no such checkpoint is kept, the newest one, and the row stays missing)."""
    try:
        launch = json.loads((run_dir / LAUNCH_FILE).read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"cannot resume {str(run_dir)!r}: no readable {LAUNCH_FILE} (the record of where "
            f"verl keeps its checkpoints, written when the run starts): {err}"
        ) from None
    ckpts = Path(launch["verl_checkpoints"])
    try:  # verl's own record of its newest complete checkpoint
        step = int((ckpts / "latest_checkpointed_iteration.txt").read_text().strip())
    except (OSError, ValueError):
        return launch, None, 0
    logged = _logged_step(run_dir)
    if 0 < logged < step:
        kept = [j for j in range(logged, 0, -1) if (ckpts / f"global_step_{j}").is_dir()]
        step = kept[0] if kept else step
    folder = ckpts / f"global_step_{step}"
    return (launch, folder, step) if folder.is_dir() else (launch, None, 0)


def resume_overrides(cfg: Any, run_dir: str | Path) -> tuple[list[str], int]:
    """The overrides that continue the verl run ``run_dir`` (``cfg``: its config.yaml with the
    allowed resume overrides) and the step they continue from: the launch's overrides
    (:func:`overrides`: the same run directory, data files and checkpoint directory) plus
    ``trainer.resume_mode=resume_path`` with ``trainer.resume_from_path`` = verl's newest
    checkpoint and ``trainer.val_before_train=false`` (the evaluation before training is the
    first part's); without a checkpoint ``trainer.resume_mode=disable`` (the run starts over)."""
    run_dir = Path(run_dir)
    launch, folder, step = _resume_point(run_dir)
    ov = overrides(with_mirror_file(cfg, run_dir / "mirror_init.json"), run_dir,
                   model_path=launch.get("model_path"),
                   max_prompt_length=launch.get("max_prompt_length"))  # fmt: skip
    if folder is None:
        return [*ov, "trainer.resume_mode=disable"], 0
    ov = [o for o in ov if not o.startswith("trainer.val_before_train=")]
    return [*ov, "trainer.val_before_train=false", "trainer.resume_mode=resume_path",
            f"trainer.resume_from_path={_value(str(folder))}"], step  # fmt: skip


def _resume_config(run_dir: str | Path, extra: list[tuple[str, Any]] | None) -> tuple[Any, Path]:
    cfg, path = resume_config(run_dir, extra)
    validate(cfg)
    check_engine_support(cfg)
    return cfg, path


def resume_dry_run(run_dir: str | Path, extra: list[tuple[str, Any]] | None = None
                   ) -> DryRunReport:  # fmt: skip
    """``gbmpo train --resume DIR --dry-run`` for a verl run: the resume's overrides
    (:func:`resume_overrides`) and the step it continues from; nothing written or launched."""
    cfg, path = _resume_config(run_dir, extra)
    report = DryRunReport("verl")
    ov, step = resume_overrides(cfg, path)
    report.ok("resume", f"from step {step}" if step else "from the start (no checkpoint)")
    report.info["overrides"] = ov
    report.info["resume_step"] = step
    return report


def resume(run_dir: str | Path, extra: list[tuple[str, Any]] | None = None) -> dict[str, Any]:
    """Continue the verl run ``run_dir`` from its newest checkpoint (:func:`resume_overrides`);
    :class:`EngineUnavailable` (nothing written) where verl or its GPUs are missing. verl's log
    rows past that checkpoint are dropped (the rows up to it are kept in
    :data:`VERL_EARLIER_METRICS_FILE`), so that metrics.jsonl has each step once."""
    cfg, path = _resume_config(run_dir, extra)
    ov, step = resume_overrides(cfg, path)
    # a checkpoint of the last step: verl's loop would train one step more (it advances the
    # step before it checks for the end), so nothing is launched and the run is summarised
    budget = cfg.run.time_budget_seconds
    trained = step >= cfg.run.steps or (budget is not None and step > 0
                                        and _rl_seconds(path, step) >= budget)
    python = (verl_python() or "") if trained else _gpu_python(cfg)  # trained: the merge's
    launch = json.loads((path / LAUNCH_FILE).read_text())
    with RunLifecycle(path, "verl", resuming=True) as life:
        earlier = read_verl_log(path / VERL_EARLIER_METRICS_FILE)
        rows = [r for r in earlier + read_verl_log(path / VERL_METRICS_FILE)
                if step > 0 and int(r["step"]) <= step]  # fmt: skip
        write_atomic(path / VERL_EARLIER_METRICS_FILE,
                     "".join(json.dumps(r) + "\n" for r in rows))  # fmt: skip
        (path / VERL_METRICS_FILE).unlink(missing_ok=True)
        write_atomic(path / CONFIG_FILE, dump_yaml(cfg))
        if trained:
            life.running(step, resumed_from=_resume_point(path)[1])
            summary = summarize_run(cfg, path, kind=launch["kind"], wall_seconds=0.0,
                                    n_eval=launch["n_eval"])  # fmt: skip
            return life.finished(_with_drift(cfg, path, python, summary))
        return _launch(cfg, path, python, ov, life, kind=launch["kind"],
                       n_eval=launch["n_eval"])  # fmt: skip
