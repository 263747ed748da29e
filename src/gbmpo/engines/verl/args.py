"""What a gbmpo config becomes on verl (``gbmpo train --engine verl``): Hydra overrides of verl's
``ppo_trainer.yaml`` (:func:`overrides`, with :func:`validation_freq` and
:func:`precision_overrides`) and the run's data files (:func:`write_data`). The run itself is
:mod:`gbmpo.engines.verl.runner`; verl's log back into the metrics schema is
:mod:`gbmpo.engines.verl.metrics`.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from gbmpo.config import ConfigError
from gbmpo.config.hosts.verl import hydra_value as _value
from gbmpo.config.hosts.verl import mini_batch, override_values, uneven_mini
from gbmpo.engines.verl.objective import verl_objective_overrides
from gbmpo.objectives.mirror import NeuralMirrorMap
from gbmpo.train.setup import eval_limit, load_splits

__all__ = [
    "PASSTHROUGH_TEMPLATE",
    "cpu_overrides",
    "data_source",
    "overrides",
    "precision_overrides",
    "reward_module_path",
    "schedule_overrides",
    "validation_freq",
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
    :data:`gbmpo.config.hosts.verl.VERL` refuses are checked by :func:`check_engine_support`."""
    run_dir = Path(run_dir).resolve()
    o, ro, opt = cfg.objective, cfg.rollout, cfg.optim
    G = ro.num_generations
    if uneven_mini(opt.mini_batch_size, cfg):  # the table's refusal, for callers that skip it
        raise ConfigError(
            f"'optim.mini_batch_size'={mini_batch(cfg)} must be a multiple of "
            f"rollout.num_generations={G} (verl's ppo_mini_batch_size counts prompts)"
        )
    validation_freq(cfg)  # eval.after that verl cannot express
    a = "actor_rollout_ref.actor"
    out = [
        f"data.train_files={_value(str(run_dir / 'data' / 'train.parquet'))}",
        f"data.val_files={_value(str(run_dir / 'data' / 'test.parquet'))}",
        # every key whose override(s) verl's table names (gbmpo.config.hosts.verl.VERL)
        *override_values(cfg),
        *([f"data.max_prompt_length={max_prompt_length}"] if max_prompt_length else []),
        "data.filter_overlong_prompts=true",
        f"actor_rollout_ref.model.path={_value(model_path or cfg.model.path)}",
        f"actor_rollout_ref.model.custom_chat_template={_value(PASSTHROUGH_TEMPLATE)}",
        *schedule_overrides(cfg),
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
    cpu = cfg.model.device == "cpu"
    out += [
        f"actor_rollout_ref.rollout.name={'hf' if cpu else 'vllm'}",
        # validation: greedy, one completion per prompt (the own engine's evaluation)
        "actor_rollout_ref.rollout.val_kwargs.do_sample=false",
        "actor_rollout_ref.rollout.val_kwargs.temperature=0",
        "actor_rollout_ref.rollout.val_kwargs.n=1",
        # the reward: the task's own (gbmpo.engines.verl.reward)
        f"reward.custom_reward_function.path={_value(reward_module_path())}",
        "reward.custom_reward_function.name=compute_score",
        "+reward.custom_reward_function.reward_kwargs.gbmpo_config="
        + _value(str(run_dir / "config.yaml")),
        # the run: verl's legacy trainer (main_ppo_v0; the v1 default needs TransferQueue's
        # storage actors, 8 CPUs by default): one trainer on GPUs and on the CPU
        "trainer.use_v1=false",
        "trainer.total_epochs=1000000",
        f"trainer.test_freq={validation_freq(cfg)}",
        f"trainer.default_local_dir={_value(str(run_dir / 'checkpoints'))}",
        "trainer.project_name=gbmpo",
        f"trainer.experiment_name={_value(run_dir.name)}",
        *cpu_overrides(cfg),
    ]
    return out


def cpu_overrides(cfg: Any) -> list[str]:
    """The overrides of a CPU run (``model.device: cpu``; none otherwise), with the platform
    and rollout of :mod:`gbmpo.engines.verl.cpu` loaded in verl's processes: Ray with one
    logical GPU (verl's placement groups count GPU bundles; no CUDA is used) and a few logical
    CPUs for verl's actors, the device, the ``hf`` rollout (one server, no tensor
    parallelism), SDPA attention (no flash-attn), no torch.compile, FSDP2 (whose CPU offload
    policy the reference model uses), no gradient checkpointing, and the data loaded in the
    trainer's process, one agent-loop and one reward worker."""
    if cfg.model.device != "cpu":
        return []
    a = "actor_rollout_ref"
    return [
        "+ray_kwargs.ray_init.num_gpus=1",
        "ray_kwargs.ray_init.num_cpus=8",
        "trainer.device=cpu",
        f"{a}.rollout.tensor_model_parallel_size=1",
        f"+{a}.model.override_config.attn_implementation=sdpa",
        f"{a}.model.enable_gradient_checkpointing=false",
        f"{a}.model.use_remove_padding=false",
        f"{a}.actor.use_torch_compile=false",
        f"{a}.actor.strategy=fsdp2",
        f"{a}.ref.strategy=fsdp2",
        "data.dataloader_num_workers=0",
        # one agent-loop and one reward-loop worker (8 each by default: a Ray process apiece)
        f"{a}.rollout.agent.num_workers=1",
        "reward.num_workers=1",
    ]


def schedule_overrides(cfg: Any) -> list[str]:
    """``optim.schedule`` / ``warmup_steps`` / ``min_lr_ratio`` as verl's LR scheduler
    (``verl.utils.torch_functional``), the own engine's rate at every step
    (:func:`gbmpo.train.schedule.lr_at`: warm-up :math:`(s+1)/w` for :math:`s < w`, then
    constant or cosine with progress :math:`(s-w)/(S-w)`).

    verl's ``constant`` warms up as :math:`s/w` (the first step at rate 0), so ``constant``
    becomes verl's ``cosine`` with ``min_lr_ratio=1`` (a flat cosine) and
    ``zero_indexed_step=false`` (its warm-up is then :math:`(s+1)/w`). ``cosine`` keeps verl's
    zero-indexed steps (the same progress); with a warm-up verl's cosine cannot give both the
    own warm-up and the own progress, so that is refused (the support matrix)."""
    opt = cfg.optim
    a = "actor_rollout_ref.actor.optim"
    out = [f"{a}.lr_warmup_steps={opt.warmup_steps}", f"{a}.lr_scheduler_type=cosine"]
    if opt.schedule == "constant":
        return [*out, f"{a}.min_lr_ratio=1.0", f"{a}.zero_indexed_step=false"]
    return [*out, f"{a}.min_lr_ratio={opt.min_lr_ratio!r}", f"{a}.zero_indexed_step=true"]


def validation_freq(cfg: Any) -> int:
    """verl's ``trainer.test_freq`` for ``cfg.eval``.

    verl validates at step ``s`` when ``test_freq > 0`` and (``s % test_freq == 0`` or ``s`` is
    the last step): ``eval.every`` gives the periodic evaluations and the last step is the
    final one (``eval.after``); with ``eval.every: 0`` only the final step validates
    (``test_freq = run.steps``), with ``eval.after: false`` as well none (``-1``).
    ``ConfigError`` for ``eval.after: false`` with an ``eval.every`` that does not divide
    ``run.steps``: verl would validate at the last step anyway."""
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
    (:mod:`gbmpo.config.support`)."""
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
    reg = cfg.objective.regularizer
    terms = reg if isinstance(reg, list) else [reg]
    missing = []
    for i, term in enumerate(terms):
        mirror = term.params.get("mirror")
        if term.name == "neural_mirror" and not (
            isinstance(mirror, str) and Path(mirror).expanduser().exists()
        ):
            missing.append(i)
    if not missing:
        return cfg

    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        NeuralMirrorMap.random(0.01, 42).save(path)
    out = copy.deepcopy(cfg)
    new = out.objective.regularizer
    for i in missing:
        term = new[i] if isinstance(new, list) else new
        term.params = {**term.params, "mirror": str(path.resolve())}
    return out


def reward_module_path() -> str:
    """The file verl loads the reward function from."""
    return str(Path(__file__).with_name("reward.py"))


def write_data(cfg: Any, task: Any, data_dir: Path, tokenizer: Any = None) -> dict[str, int]:
    """``train.parquet`` / ``test.parquet`` in verl's row layout (prompt, data_source, ability,
    reward_model.ground_truth, extra_info with the rendered prompt and the reward's columns);
    the test file holds the examples the own engine evaluates (``eval.limit``, else
    ``eval.auto_limit``: :func:`gbmpo.train.setup.eval_limit`). Returns the row counts and,
    with ``tokenizer``, ``max_prompt_tokens``."""
    # deferred: pandas is optional (it comes with the verl and trl extras)
    import pandas as pd

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


def data_source(cfg: Any) -> str:
    """The ``data_source`` of the run's data rows (verl groups validation metrics by it)."""
    return f"gbmpo/{cfg.task.name}"
