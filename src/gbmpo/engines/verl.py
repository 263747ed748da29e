r"""``gbmpo train --engine verl``: verl's ``main_ppo`` (Ray, FSDP, vLLM) from a gbmpo config.

What the config becomes (:func:`overrides`, Hydra overrides of verl's ``ppo_trainer.yaml``):

* ``objective`` -> the gbmpo verl plugin (``gbmpo.integrations.verl``): the surrogate as
  ``policy_loss.loss_mode=gbmpo_<name>`` with *every* parameter spelled out in
  ``policy_loss.gbmpo_surrogate`` (so verl's own clip fields add nothing), the regularizer as
  the actor KL loss ``kl_loss_type=gbmpo_<name>`` with ``kl_loss_coef`` = coef and its
  parameters in ``policy_loss.gbmpo_kl``, the aggregation as ``loss_agg_mode``
  (:data:`gbmpo.integrations.common.VERL_LOSS_AGG_MODES`; ``dr_grpo`` with
  ``loss_scale_factor`` = the completion length), the advantage as ``algorithm.adv_estimator``
  / ``norm_adv_by_std_in_grpo``;
* ``task`` -> ``data/train.parquet`` and ``data/test.parquet`` in the run directory
  (:func:`write_data`): each prompt rendered exactly as the own trainer renders it, passed
  through verl's chat templating unchanged (a pass-through ``custom_chat_template``), and the
  reward's columns in ``extra_info``; the task's reward -> verl's
  ``reward.custom_reward_function`` (:mod:`gbmpo.engines.verl_reward`, which calls the task's
  reward: math-verify, the code sandbox, a user's ``module:function``);
* ``rollout`` / ``optim`` / ``lora`` / ``run`` -> rollout ``n``, lengths, sampling, learning
  rate and schedule, ``ppo_mini_batch_size`` (prompts), micro-batches, ``ppo_epochs`` = ``mu``,
  LoRA rank, ``trainer.n_gpus_per_node`` = ``run.num_processes``, ``trainer.nnodes`` =
  ``run.num_nodes``, steps, checkpoints, validation (:func:`validation_freq`: the last step
  is the final evaluation), seeds, precision (:func:`precision_overrides`).

Every key is honoured or refused (:data:`gbmpo.train.support.VERL`): :func:`run` and
:func:`dry_run` call :func:`check_engine_support` before anything is written. After the run
:func:`summarize_run` turns verl's file log into ``metrics.jsonl`` (the schema of
:mod:`gbmpo.io.metrics`, verl's own names under ``verl/``) and ``summary.json``.

verl lives in its own environment (it pins transformers < 5.11): :func:`verl_python` finds it
(``$GBMPO_VERL_PYTHON``, else ``.venv-verl/bin/python`` of this checkout or the working
directory, else this interpreter when it can import verl). ``--dry-run`` composes verl's
config with the overrides there and runs verl's own validation (:mod:`gbmpo.engines.verl_check`);
a run launches ``python -m verl.trainer.main_ppo`` there, after checking for GPUs.

``gbmpo train --resume DIR`` (:func:`resume`) continues a verl run from the newest checkpoint
verl recorded in the directory :data:`LAUNCH_FILE` names, with the launch's overrides plus
verl's ``trainer.resume_mode=resume_path`` (:func:`resume_overrides`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gbmpo.engines.checks import (
    DryRunReport,
    EngineUnavailable,
    common_checks,
    run_identity,
    write_summary,
)
from gbmpo.integrations.common import hydra_value as _value

__all__ = [
    "SHARED_METRICS",
    "VERL_METRICS_FILE",
    "check_engine_support",
    "convert_row",
    "data_source",
    "dry_run",
    "eval_metrics",
    "overrides",
    "precision_overrides",
    "read_verl_log",
    "resume",
    "resume_dry_run",
    "resume_overrides",
    "run",
    "summarize_run",
    "validation_freq",
    "verl_python",
    "with_mirror_file",
    "write_data",
]

#: verl's chat templating turned into a pass-through: the prompt is gbmpo's rendered text
PASSTHROUGH_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def overrides(
    cfg: Any,
    run_dir: str | Path,
    *,
    model_path: str | None = None,
    max_prompt_length: int | None = None,
) -> list[str]:
    """The Hydra overrides of ``verl.trainer.main_ppo`` that run ``cfg`` (see the module doc);
    ``max_prompt_length``: the longest tokenized prompt of the data (verl's default otherwise).

    ``ConfigError`` names a setting verl cannot express (the ``batch`` advantage, an ``old``
    anchor on a regularizer without an ``anchor`` parameter, uneven batch sizes, ``eval.after:
    false`` where verl would validate at the last step: :func:`validation_freq`); the values
    :data:`gbmpo.train.support.VERL` refuses are checked by :func:`check_engine_support`."""
    from gbmpo.integrations.common import verl_objective_overrides
    from gbmpo.train.config import ConfigError

    run_dir = Path(run_dir).resolve()
    o, ro, opt, run = cfg.objective, cfg.rollout, cfg.optim, cfg.run
    G = ro.num_generations
    n = ro.prompts_per_step * G
    mini = opt.mini_batch_size or n
    if mini % G:
        raise ConfigError(
            f"'optim.mini_batch_size'={mini} must be a multiple of rollout.num_generations={G} "
            "(verl's ppo_mini_batch_size counts prompts)"
        )
    validation_freq(cfg)  # eval.after that verl cannot express
    a = "actor_rollout_ref.actor"
    out = [
        f"data.train_files={_value(str(run_dir / 'data' / 'train.parquet'))}",
        f"data.val_files={_value(str(run_dir / 'data' / 'test.parquet'))}",
        f"data.train_batch_size={ro.prompts_per_step}",
        f"data.max_response_length={ro.max_new_tokens}",
        *([f"data.max_prompt_length={max_prompt_length}"] if max_prompt_length else []),
        "data.filter_overlong_prompts=true",
        f"data.trust_remote_code={_value(cfg.model.trust_remote_code)}",
        # run.seed: the data order, the mini-batch order, vLLM's sampling, FSDP's seeding
        f"data.seed={run.seed}",
        f"{a}.data_loader_seed={run.seed}",
        f"actor_rollout_ref.rollout.seed={run.seed}",
        f"{a}.fsdp_config.seed={run.seed}",
        f"actor_rollout_ref.ref.fsdp_config.seed={run.seed}",
        f"actor_rollout_ref.model.path={_value(model_path or cfg.model.path)}",
        f"actor_rollout_ref.model.trust_remote_code={_value(cfg.model.trust_remote_code)}",
        f"actor_rollout_ref.model.custom_chat_template={_value(PASSTHROUGH_TEMPLATE)}",
        f"{a}.optim.lr={opt.lr!r}",
        f"{a}.optim.weight_decay={opt.weight_decay!r}",
        f"{a}.optim.betas={_value(list(opt.betas))}",
        f"{a}.optim.override_optimizer_config={{eps:{opt.eps!r}}}",
        f"{a}.optim.lr_warmup_steps={opt.warmup_steps}",
        f"{a}.optim.lr_scheduler_type={opt.schedule}",
        f"{a}.optim.min_lr_ratio={opt.min_lr_ratio!r}",
        f"{a}.optim.clip_grad={opt.grad_clip if opt.grad_clip is not None else 1e9!r}",
        f"{a}.ppo_mini_batch_size={mini // G}",
        f"{a}.ppo_epochs={opt.mu}",
        f"{a}.shuffle=true",  # a seeded shuffle of the rows into mini-batches, as the own engine
        f"{a}.entropy_coeff=0",
        *precision_overrides(cfg.model.dtype),
    ]
    try:  # the objective: the gbmpo verl plugin's overrides for the spec
        out += verl_objective_overrides(o, max_response_length=ro.max_new_tokens)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if opt.micro_batch_size:
        out.append(f"{a}.ppo_micro_batch_size_per_gpu={opt.micro_batch_size}")
        for who in ("rollout", "ref"):
            out.append(
                f"actor_rollout_ref.{who}.log_prob_micro_batch_size_per_gpu={opt.micro_batch_size}"
            )
    else:
        out.append(f"{a}.use_dynamic_bsz=true")
        for who in ("rollout", "ref"):
            out.append(f"actor_rollout_ref.{who}.log_prob_use_dynamic_bsz=true")
    if cfg.lora.enabled:
        modules = _value(list(cfg.lora.target_modules))
        out += [f"actor_rollout_ref.model.lora_rank={cfg.lora.r}",
                f"actor_rollout_ref.model.lora_alpha={cfg.lora.alpha}",
                f"actor_rollout_ref.model.target_modules={modules}"]  # fmt: skip
    out += [
        "actor_rollout_ref.rollout.name=vllm",
        f"actor_rollout_ref.rollout.n={G}",
        f"actor_rollout_ref.rollout.temperature={ro.temperature!r}",
        f"actor_rollout_ref.rollout.top_p={ro.top_p!r}",
        f"actor_rollout_ref.rollout.top_k={ro.top_k if ro.top_k else -1}",
        f"actor_rollout_ref.rollout.response_length={ro.max_new_tokens}",
        # validation: greedy, one completion per prompt (the own engine's evaluation)
        "actor_rollout_ref.rollout.val_kwargs.do_sample=false",
        "actor_rollout_ref.rollout.val_kwargs.temperature=0",
        "actor_rollout_ref.rollout.val_kwargs.n=1",
        # the reward: the task's own (gbmpo.engines.verl_reward)
        f"reward.custom_reward_function.path={_value(reward_module_path())}",
        "reward.custom_reward_function.name=compute_score",
        "+reward.custom_reward_function.reward_kwargs.gbmpo_config="
        + _value(str(run_dir / "config.yaml")),
        # the run
        f"trainer.n_gpus_per_node={run.num_processes}",
        f"trainer.nnodes={run.num_nodes}",
        f"trainer.total_training_steps={run.steps}",
        "trainer.total_epochs=1000000",
        f"trainer.save_freq={run.checkpoint_every or run.steps}",
        f"trainer.max_actor_ckpt_to_keep={run.keep_checkpoints}",
        f"trainer.test_freq={validation_freq(cfg)}",
        f"trainer.val_before_train={_value(cfg.eval.before)}",
        f"trainer.default_local_dir={_value(str(run_dir / 'checkpoints'))}",
        "trainer.project_name=gbmpo",
        f"trainer.experiment_name={_value(run_dir.name)}",
        f"trainer.logger={_value(['console', 'file', *run.report_to])}",
    ]
    return out


def validation_freq(cfg: Any) -> int:
    """verl's ``trainer.test_freq`` for ``cfg.eval``.

    verl validates at step ``s`` when ``test_freq > 0`` and (``s % test_freq == 0`` or ``s`` is
    the last step): ``eval.every`` gives the periodic evaluations and the last step is the
    final one (``eval.after``); with ``eval.every: 0`` only the final step validates
    (``test_freq = run.steps``), with ``eval.after: false`` as well none (``-1``).
    ``ConfigError`` for ``eval.after: false`` with an ``eval.every`` that does not divide
    ``run.steps``: verl would validate at the last step anyway."""
    from gbmpo.train.config import ConfigError

    ev, steps = cfg.eval, cfg.run.steps
    if ev.every:
        if not ev.after and steps % ev.every:
            raise ConfigError(
                f"'eval.after'=False with eval.every={ev.every} and run.steps={steps} is not "
                "supported by engine 'verl': verl validates at the last step whenever it "
                "validates periodically (make eval.every divide run.steps, or eval.after true)"
            )
        return ev.every
    return steps if ev.after else -1


def precision_overrides(dtype: str) -> list[str]:
    """``model.dtype`` on verl's FSDP workers and vLLM.

    ``bfloat16``: verl's default mixed precision, fp32 master weights (``model_dtype=fp32``) with
    bf16 compute (FSDP ``param_dtype=bf16``, gradients reduced in fp32) and a bf16 vLLM, which is
    what the own engine's bfloat16 does (bf16 weights trained through fp32 master weights);
    ``float32``: fp32 weights, compute and rollout. ``float16`` is refused
    (:mod:`gbmpo.train.support`)."""
    p = {"float32": "fp32", "bfloat16": "bf16"}[dtype]
    mixed = f"{{param_dtype:{p},reduce_dtype:fp32,buffer_dtype:fp32}}"
    out = []
    for who in ("actor", "ref"):
        out += [f"actor_rollout_ref.{who}.fsdp_config.model_dtype=fp32",
                f"+actor_rollout_ref.{who}.fsdp_config.mixed_precision={mixed}"]  # fmt: skip
    out.append(f"actor_rollout_ref.rollout.dtype={dtype}")
    return out


def with_mirror_file(cfg: Any, path: Path) -> Any:
    """``cfg``, or a copy whose ``neural_mirror`` regularizer reads ``path`` where it names no
    existing map file; writes there the map gbmpo uses by default (``NeuralMirrorMap.random(
    0.01, 42)``, the NM-GRPO initialisation), unless a file is already there. verl's workers
    read the map from a file, so it must exist."""
    import copy

    reg = cfg.objective.regularizer
    if isinstance(reg, list):  # a sum of regularizers: refused on verl (the support matrix)
        return cfg
    mirror = reg.params.get("mirror")
    if reg.name != "neural_mirror" or (
        isinstance(mirror, str) and Path(mirror).expanduser().exists()
    ):
        return cfg
    from gbmpo.objectives.mirror import NeuralMirrorMap

    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        NeuralMirrorMap.random(0.01, 42).save(path)
    out = copy.deepcopy(cfg)
    out.objective.regularizer.params = {**reg.params, "mirror": str(path.resolve())}
    return out


def reward_module_path() -> str:
    """The file verl loads the reward function from."""
    return str(Path(__file__).with_name("verl_reward.py"))


def write_data(cfg: Any, task: Any, data_dir: Path, tokenizer: Any = None) -> dict[str, int]:
    """``train.parquet`` / ``test.parquet`` in verl's row layout (prompt, data_source, ability,
    reward_model.ground_truth, extra_info with the rendered prompt and the reward's columns);
    the test file holds the examples the own engine evaluates (``eval.limit``, else
    ``eval.auto_limit``: :func:`gbmpo.train.setup.eval_limit`). Returns the row counts and,
    with ``tokenizer``, ``max_prompt_tokens``."""
    import pandas as pd

    from gbmpo.train.setup import eval_limit, load_splits

    train, _, (train_split, eval_split) = load_splits(cfg, task, count_eval=True)
    test = task.split(eval_split)
    limit = eval_limit(cfg, len(test))  # the held-out subset the own engine evaluates
    splits = {"train": train, "test": test if limit is None else test[:limit]}
    data_dir.mkdir(parents=True, exist_ok=True)
    counts = {}
    for name, examples in splits.items():
        rows = []
        for i, ex in enumerate(examples):
            columns = {k: v for k, v in ex.items() if k != "prompt"}
            rows.append({
                "data_source": data_source(cfg),
                "prompt": [{"role": "user", "content": ex["prompt"]}],
                "ability": task.kind,
                "reward_model": {"style": "rule", "ground_truth": str(ex.get("answer", ""))},
                "extra_info": {"split": name, "index": i, "prompt": ex["prompt"],
                               "columns": json.dumps(columns, default=str)},
            })  # fmt: skip
        pd.DataFrame(rows).to_parquet(data_dir / f"{name}.parquet")
        counts[name] = len(rows)
        if tokenizer is not None and examples:
            longest = max(len(tokenizer(ex["prompt"])["input_ids"]) for ex in examples)
            counts["max_prompt_tokens"] = max(counts.get("max_prompt_tokens", 0), longest)
    return counts


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
    here = Path(__file__).resolve().parents[3]  # the checkout holding src/gbmpo
    for root in (here, Path.cwd()):
        candidate = root / ".venv-verl" / "bin" / "python"
        if candidate.exists():
            return str(candidate)
    if importlib.util.find_spec("verl") is not None:
        return sys.executable
    return None


def _verl_env(plugins: list[str] | None = None) -> dict[str, str]:
    """This process's environment, with this gbmpo first on the path and the plugin loaded
    (after the run's ``run.plugins``, which may register surrogates and regularizers that the
    plugin then registers with verl)."""
    src = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH")
    modules = ",".join([*(plugins or []), "gbmpo.integrations.verl"])
    return {**os.environ, "PYTHONPATH": src + (os.pathsep + path if path else ""),
            "VERL_USE_EXTERNAL_MODULES": modules}  # fmt: skip


def check_engine_support(cfg: Any) -> list[str]:
    """:func:`gbmpo.train.support.check_support` for engine verl: ``ConfigError`` (exit 2,
    nothing written) for a value verl cannot honour; returns the no-effect notices (``gbmpo
    train`` prints them once)."""
    from gbmpo.train.support import check_support

    return check_support(cfg, "verl")


def dry_run(cfg: Any) -> DryRunReport:
    """Engine-independent checks, the overrides, and verl's own validation of the composed
    ``ppo_trainer.yaml`` in verl's environment (:mod:`gbmpo.engines.verl_check`)."""
    import tempfile

    report = DryRunReport("verl")
    notices = check_engine_support(cfg)
    if notices:
        report.info["notices"] = notices
    common_checks(cfg, report)
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
        proc = _verl_check(python, ov, Path(tmp), plugins)
        if proc.returncode != 0 and "vllm version" in proc.stderr and cfg.lora.enabled:
            # verl checks the installed vLLM for LoRA rollouts: validate the rest without LoRA
            report.skip("verl LoRA", "verl validates LoRA against an installed vLLM (GPU only)")
            proc = _verl_check(python, [o for o in ov if ".lora_" not in o
                                        and ".target_modules=" not in o], Path(tmp),
                               plugins)  # fmt: skip
    if proc.returncode != 0:
        from gbmpo.train.config import ConfigError

        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ConfigError(f"verl rejects the composed config: {tail}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    report.ok("verl config", f"verl {result['verl']}: ppo_trainer.yaml + overrides validated; "
              f"actor loss {result['surrogate']} + {result['regularizer']}")  # fmt: skip
    return report


def _verl_check(
    python: str, ov: list[str], tmp: Path, plugins: list[str] | None = None
) -> subprocess.CompletedProcess[str]:
    ov_file = tmp / "overrides.json"
    ov_file.write_text(json.dumps(ov))
    return subprocess.run(
        [python, "-m", "gbmpo.engines.verl_check", str(ov_file)],
        env=_verl_env(plugins), capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def run(cfg: Any) -> dict[str, Any]:
    """Write the run directory (config, data, overrides, :data:`LAUNCH_FILE`) and launch
    ``verl.trainer.main_ppo``; :class:`EngineUnavailable` (nothing written) where verl or GPUs
    are missing."""
    from gbmpo.io import is_nonempty, write_atomic, write_json_atomic
    from gbmpo.models import resolve_model_path
    from gbmpo.train.config import ConfigError, dump_yaml, validate
    from gbmpo.train.run import default_run_dir
    from gbmpo.train.setup import build_task, load_tokenizer

    validate(cfg)
    check_engine_support(cfg)  # a value verl cannot honour stops here, before anything else
    python = _gpu_python(cfg)
    run_dir = Path(cfg.run.output_dir) if cfg.run.output_dir else default_run_dir(cfg)
    if is_nonempty(run_dir):
        raise ConfigError(f"output directory {str(run_dir)!r} already exists and is not empty")
    cfg.run.output_dir = str(run_dir)
    model_path = resolve_model_path(cfg.model.path)
    tokenizer = load_tokenizer(cfg)
    task = build_task(cfg, tokenizer)
    overrides(cfg, run_dir, model_path=model_path)  # what verl cannot express, before writing
    run_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(run_dir / "config.yaml", dump_yaml(cfg))
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
    return _launch(cfg, run_dir, python, ov, kind=task.kind, n_eval=counts["test"])


def _gpu_python(cfg: Any) -> str:
    """verl's interpreter where it sees ``run.num_processes`` GPUs; else
    :class:`EngineUnavailable` naming what is missing."""
    python = verl_python()
    if python is None:
        raise EngineUnavailable(
            "engine verl needs verl, in an environment of its own (verl needs transformers<5.11): "
            "in a clone of gbmpo `make verl` builds .venv-verl (2-4 min, 2.1 GB); elsewhere "
            "pip install 'gbmpo[verl]' into a new environment and point GBMPO_VERL_PYTHON at its "
            "python"
        )
    probe = subprocess.run(
        [python, "-c", "import torch; print(torch.cuda.device_count())"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    gpus = int(probe.stdout.strip() or 0) if probe.returncode == 0 else 0
    if gpus < cfg.run.num_processes:
        raise EngineUnavailable(
            f"engine verl needs {cfg.run.num_processes} NVIDIA GPU(s) per node "
            f"(run.num_processes), found {gpus} in verl's environment ({python}); "
            "`gbmpo train --engine verl --dry-run` checks the config without them"
        )
    return python


def _launch(cfg: Any, run_dir: Path, python: str, ov: list[str], *, kind: str,
            n_eval: int | None) -> dict[str, Any]:  # fmt: skip
    """Run ``verl.trainer.main_ppo`` with ``ov`` (also written to verl_overrides.txt), then
    write metrics.jsonl and summary.json."""
    from gbmpo.io import write_atomic

    write_atomic(run_dir / "verl_overrides.txt", "\n".join(ov) + "\n")
    env = {**_verl_env(list(cfg.run.plugins)),
           "VERL_FILE_LOGGER_PATH": str(run_dir.resolve() / VERL_METRICS_FILE)}  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run([python, "-m", "verl.trainer.main_ppo", *ov], env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"verl.trainer.main_ppo failed (exit {proc.returncode}); see above")
    summary = summarize_run(cfg, run_dir, kind=kind, wall_seconds=wall, n_eval=n_eval)
    write_summary(run_dir, summary)
    return summary


#: written at launch: where verl's checkpoints are (``verl_checkpoints``) and what a resume
#: needs to rebuild the launch's overrides (model path, longest prompt, evaluation size)
LAUNCH_FILE = "verl_launch.json"

#: verl's log rows of the parts before a resume (verl's file logger starts its file afresh):
#: the rows up to the checkpoint each resume continues from
VERL_EARLIER_METRICS_FILE = "verl_metrics_before_resume.jsonl"


def _resume_point(run_dir: Path) -> tuple[dict[str, Any], Path | None, int]:
    """The launch record, the checkpoint directory verl resumes from (``None``: none yet) and
    its step (0 without one)."""
    from gbmpo.train.config import ConfigError

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
    from gbmpo.train.config import validate
    from gbmpo.train.run import resume_config

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
    from gbmpo.io import RunLock, write_atomic
    from gbmpo.train.config import dump_yaml

    cfg, path = _resume_config(run_dir, extra)
    python = _gpu_python(cfg)
    ov, step = resume_overrides(cfg, path)
    launch = json.loads((path / LAUNCH_FILE).read_text())
    lock = RunLock(path).acquire()
    try:
        earlier = read_verl_log(path / VERL_EARLIER_METRICS_FILE)
        rows = [r for r in earlier + read_verl_log(path / VERL_METRICS_FILE)
                if step > 0 and int(r["step"]) <= step]  # fmt: skip
        write_atomic(path / VERL_EARLIER_METRICS_FILE,
                     "".join(json.dumps(r) + "\n" for r in rows))  # fmt: skip
        (path / VERL_METRICS_FILE).unlink(missing_ok=True)
        write_atomic(path / "config.yaml", dump_yaml(cfg))
        return _launch(cfg, path, python, ov, kind=launch["kind"], n_eval=launch["n_eval"])
    finally:
        lock.release()


#: verl's file logger output in the run directory (``VERL_FILE_LOGGER_PATH``): one JSON object
#: ``{"step": N, "data": {metric: value}}`` per ``Tracking.log`` call
VERL_METRICS_FILE = "verl_metrics.jsonl"

#: verl metric -> metrics.jsonl schema name (:mod:`gbmpo.io.metrics`), where verl's definition is
#: the schema's. Kept only under ``verl/``: ``actor/lr`` (read after the step's scheduler step:
#: the next step's rate), ``response_length/clip_ratio`` (length equal to the limit, which also
#: counts an EOS in the last position), ``actor/pg_clipfrac*`` / ``actor/gbmpo/*`` (means of
#: per-micro-batch fractions, not fractions of the step's tokens), ``actor/loss``.
SHARED_METRICS: dict[str, str] = {
    "actor/pg_loss": "pg_loss",
    "actor/grad_norm": "grad_norm",
    "critic/score/mean": "reward_mean",
    "response_length/mean": "response_length_mean",
    "response_length/max": "response_length_max",
    "timing_s/step": "step_seconds",
}


def data_source(cfg: Any) -> str:
    """The ``data_source`` of the run's data rows (verl groups validation metrics by it)."""
    return f"gbmpo/{cfg.task.name}"


def eval_metrics(cfg: Any, data: dict[str, Any], kind: str, n_eval: int | None = None
                 ) -> dict[str, Any] | None:  # fmt: skip
    """The own engine's evaluation metrics from one verl log row's validation metrics, or
    ``None`` when the row holds none.

    verl validates greedily (``val_kwargs``: ``do_sample=false``, ``n=1``) on data/test.parquet
    and reports ``val-core/<data_source>/acc/mean@1``, the mean over the examples of the reward
    function's ``acc`` (:func:`gbmpo.engines.verl_reward.compute_score`: the own evaluation's
    ``correct``), i.e. ``accuracy`` (``pass@1`` for code tasks), and
    ``val-aux/<data_source>/reward/mean@1``, the mean reward (``mean_reward``)."""
    ds = data_source(cfg)
    acc = data.get(f"val-core/{ds}/acc/mean@1")
    reward = data.get(f"val-aux/{ds}/reward/mean@1")
    if acc is None and reward is None:
        return None
    out: dict[str, Any] = {}
    if acc is not None:
        out["pass@1" if kind == "code" else "accuracy"] = float(acc)
    if reward is not None:
        out["mean_reward"] = float(reward)
    if n_eval is not None:
        out["n"] = n_eval
    out["samples"] = 1
    return out


def convert_row(cfg: Any, row: dict[str, Any], kind: str, n_eval: int | None = None
                ) -> dict[str, Any]:  # fmt: skip
    """One verl file-logger row -> one metrics.jsonl row: the schema names of
    :data:`SHARED_METRICS` (``entropy`` from ``actor/entropy`` with the token-mean aggregation
    ``bnpo``, the only one where verl's aggregate is the per-token mean), ``eval/<metric>``
    (:func:`eval_metrics`), and every verl metric under ``verl/<name>``."""
    from gbmpo.io.metrics import host_name

    data = row["data"]
    out: dict[str, Any] = {"step": int(row["step"])}
    for key, value in data.items():
        out[host_name("verl", key)] = value
        if key in SHARED_METRICS:
            out[SHARED_METRICS[key]] = value
        elif key == "actor/entropy" and cfg.objective.aggregation == "bnpo":
            out["entropy"] = value
    reward_placed = [t for t in cfg.objective.terms if t.placement == "reward" and t.coef != 0]
    if reward_placed and "critic/score/mean" in data and "critic/rewards/mean" in data:
        # in-reward KL: score = task reward, rewards = score - kl_coef * sum_t D (per sequence)
        score, shaped = data["critic/score/mean"], data["critic/rewards/mean"]
        out["reward_penalty"] = float(score) - float(shaped)
    ev = eval_metrics(cfg, data, kind, n_eval)
    if ev is not None:
        out.update({f"eval/{k}": v for k, v in ev.items()})
    return out


def read_verl_log(path: Path) -> list[dict[str, Any]]:
    """The rows of verl's file logger (:data:`VERL_METRICS_FILE`); ``[]`` when absent."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize_run(
    cfg: Any,
    run_dir: Path,
    *,
    kind: str,
    wall_seconds: float,
    n_eval: int | None = None,
) -> dict[str, Any]:
    """Write metrics.jsonl (:func:`convert_row`) from verl's log and return the summary (every
    key of :data:`gbmpo.io.metrics.SUMMARY_KEYS`).

    verl logs the evaluation before training as the row of step 0 and each later one in the
    row of its training step. ``eval_before``: step 0's evaluation (with ``eval.before``);
    ``eval_after``: the evaluation in the row of the last training step (with ``eval.after``;
    :func:`validation_freq` makes verl validate there), ``None`` where there is none."""
    from gbmpo.io import write_atomic

    # the parts before a resume (up to its checkpoint), then the last part
    rows = read_verl_log(run_dir / VERL_EARLIER_METRICS_FILE)
    rows += read_verl_log(run_dir / VERL_METRICS_FILE)
    converted = [convert_row(cfg, r, kind, n_eval) for r in rows]
    write_atomic(run_dir / "metrics.jsonl",
                 "".join(json.dumps(r, default=str) + "\n" for r in converted))  # fmt: skip
    steps = max((int(r["step"]) for r in rows if "training/global_step" in r["data"]),
                default=0)  # fmt: skip

    def eval_at(step: int) -> dict[str, Any] | None:
        found = None
        for r in rows:
            if int(r["step"]) == step:
                found = eval_metrics(cfg, r["data"], kind, n_eval) or found
        return found

    return {
        "status": "finished",
        "engine": "verl",
        "steps": steps,
        "stop_reason": "steps",
        "wall_seconds": wall_seconds,
        "eval_before": eval_at(0) if cfg.eval.before else None,
        "eval_after": eval_at(steps) if cfg.eval.after and steps > 0 else None,
        **run_identity(cfg),
        "device": "cuda",
        "gpus": cfg.run.num_processes * cfg.run.num_nodes,
        "dtype": cfg.model.dtype,
        "fp32_master_weights": cfg.model.dtype == "bfloat16",
        "run_dir": str(run_dir),
        "final_model": str(run_dir / "checkpoints" / f"global_step_{steps}" / "actor"),
    }
