"""The training configuration's values checked before any run directory is written or any model
loaded: :func:`validate` (the objective through its spec's own check, the support matrix of
the engine).
"""

from __future__ import annotations

import importlib.util
import math

from gbmpo.config.schema import REPORTERS, TRAIN_ENGINES, ConfigError, TrainConfig
from gbmpo.config.support import check_support
from gbmpo.objectives.spec import SpecError
from gbmpo.registry import PluginError, UnknownNameError, add_plugin_modules
from gbmpo.rollout.sampling import DECODE_BUFFERS, DECODE_STEPS, GENERATORS
from gbmpo.tasks import TASKS
from gbmpo.tasks.reasoning_gym import list_datasets

__all__ = ["validate"]


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _positive_int(
    value: int | None, key: str, *, allow_none: bool = False, zero: bool = False
) -> None:
    if value is None and allow_none:
        return
    low = 0 if zero else 1
    _require(
        isinstance(value, int) and value >= low, f"{key!r} must be an int >= {low}, got {value!r}"
    )


def validate(cfg: TrainConfig) -> TrainConfig:
    """Check values and registry names (objectives are built once to check their parameters).

    Raises :class:`ConfigError` (or :class:`gbmpo.registry.UnknownNameError`, which lists the
    valid names) naming the key, also for a value ``cfg.engine`` cannot honour (the support
    matrix, :func:`gbmpo.config.support.check_support`). Does not touch the filesystem or load a
    model. The sections are checked in this order (the first bad value is the one reported).
    """
    _check_plugins(cfg)  # first: plugins may register the names checked below
    _check_engine_and_model(cfg)
    _check_rollout(cfg)
    _check_task(cfg)
    _check_objective(cfg)
    _check_optim(cfg)
    _check_lora(cfg)
    _check_eval(cfg)
    _check_run(cfg)
    # the support matrix: a value this engine cannot honour is refused here, before any write
    check_support(cfg)
    return cfg


def _check_plugins(cfg: TrainConfig) -> None:
    try:
        add_plugin_modules(list(cfg.run.plugins))
    except PluginError as err:
        raise ConfigError(f"run.plugins: {err}") from None


def _check_engine_and_model(cfg: TrainConfig) -> None:
    run = cfg.run
    _require(
        cfg.engine in TRAIN_ENGINES,
        f"'engine': unknown engine {cfg.engine!r}; valid: {', '.join(TRAIN_ENGINES)}",
    )
    _positive_int(run.num_processes, "run.num_processes")
    _positive_int(run.num_nodes, "run.num_nodes")
    _require(
        cfg.model.dtype in ("float32", "bfloat16", "float16"),
        f"'model.dtype' must be float32, bfloat16 or float16, got {cfg.model.dtype!r}",
    )
    _require(bool(cfg.model.path.strip()), "'model.path' is empty")


def _check_rollout(cfg: TrainConfig) -> None:
    r = cfg.rollout
    _positive_int(r.prompts_per_step, "rollout.prompts_per_step")
    _positive_int(r.num_generations, "rollout.num_generations")
    _require(
        r.num_generations >= 2,
        f"'rollout.num_generations' must be >= 2, got {r.num_generations}: every advantage "
        "estimator subtracts the group mean, so a group of one has advantage 0 and the run "
        "would train nothing",
    )
    _positive_int(r.max_new_tokens, "rollout.max_new_tokens")
    _positive_int(r.batch_size, "rollout.batch_size", allow_none=True)
    _require(
        math.isfinite(r.temperature) and r.temperature > 0,
        f"'rollout.temperature' must be > 0, got {r.temperature}",
    )
    _require(0 < r.top_p <= 1, f"'rollout.top_p' must be in (0, 1], got {r.top_p}")
    _require(r.top_k >= 0, f"'rollout.top_k' must be >= 0 (0 = off), got {r.top_k}")
    generators = (*GENERATORS, "vllm")  # vllm: engines trl and verl (the support matrix)
    _require(
        r.generator in generators,
        f"'rollout.generator': unknown generator {r.generator!r}; valid: {', '.join(generators)}",
    )
    _require(
        r.decode_step in DECODE_STEPS,
        f"'rollout.decode_step': unknown decode step {r.decode_step!r}; valid: "
        f"{', '.join(DECODE_STEPS)}",
    )
    _require(
        r.decode_buffers in DECODE_BUFFERS,
        f"'rollout.decode_buffers': unknown choice {r.decode_buffers!r}; valid: "
        f"{', '.join(DECODE_BUFFERS)}",
    )


def _check_task(cfg: TrainConfig) -> None:
    if cfg.task.name not in TASKS:
        try:
            gym = list_datasets()
        except ImportError:
            gym = []
        if cfg.task.name not in gym:
            raise UnknownNameError(
                f"task.name: unknown name {cfg.task.name!r}; valid names: "
                f"{', '.join(TASKS.names())} (or a reasoning-gym data set name)"
            )
    _require(
        cfg.task.template in ("auto", "base", "chat"),
        f"'task.template' must be auto, base or chat, got {cfg.task.template!r}",
    )


def _check_objective(cfg: TrainConfig) -> None:
    o = cfg.objective
    try:  # the spec's own check: names (UnknownNameError), parameters (each built once), coef
        o.check("objective")
    except ConfigError:
        raise
    except SpecError as err:
        raise ConfigError(str(err)) from None
    except OSError as err:  # e.g. a mirror-map file that is not there
        raise ConfigError(f"objective.regularizer ({o.regularizer_label!r}): {err}") from None


def _check_optim(cfg: TrainConfig) -> None:
    r, opt = cfg.rollout, cfg.optim
    _require(math.isfinite(opt.lr) and opt.lr >= 0, f"'optim.lr' must be >= 0, got {opt.lr}")
    _positive_int(opt.warmup_steps, "optim.warmup_steps", zero=True)
    _require(
        opt.schedule in ("constant", "cosine"),
        f"'optim.schedule' must be 'constant' or 'cosine', got {opt.schedule!r}",
    )
    _require(
        0 <= opt.min_lr_ratio <= 1,
        f"'optim.min_lr_ratio' must be in [0, 1], got {opt.min_lr_ratio}",
    )
    _require(opt.weight_decay >= 0, f"'optim.weight_decay' must be >= 0, got {opt.weight_decay}")
    _require(
        all(0 <= b < 1 for b in opt.betas), f"'optim.betas' must be in [0, 1), got {opt.betas}"
    )
    _require(opt.eps > 0, f"'optim.eps' must be > 0, got {opt.eps}")
    _require(
        opt.grad_clip is None or opt.grad_clip > 0,
        f"'optim.grad_clip' must be > 0 or null, got {opt.grad_clip}",
    )
    _positive_int(opt.mu, "optim.mu")
    _positive_int(opt.mini_batch_size, "optim.mini_batch_size", allow_none=True)
    _positive_int(opt.micro_batch_size, "optim.micro_batch_size", allow_none=True)
    batch = r.prompts_per_step * r.num_generations
    mini = opt.mini_batch_size or batch
    _require(
        batch % mini == 0,
        f"'optim.mini_batch_size'={mini} must divide the rollout batch "
        f"(prompts_per_step * num_generations = {batch}); set optim.mini_batch_size "
        "(null = the whole batch)",
    )
    micro = opt.micro_batch_size or mini
    _require(
        mini % micro == 0,
        f"'optim.micro_batch_size'={micro} must divide the mini-batch size {mini}",
    )


def _check_lora(cfg: TrainConfig) -> None:
    if not cfg.lora.enabled:
        return
    _positive_int(cfg.lora.r, "lora.r")
    _require(cfg.lora.alpha > 0, f"'lora.alpha' must be > 0, got {cfg.lora.alpha}")
    _require(
        0 <= cfg.lora.dropout < 1, f"'lora.dropout' must be in [0, 1), got {cfg.lora.dropout}"
    )
    _require(bool(cfg.lora.target_modules), "'lora.target_modules' is empty")
    _require(
        importlib.util.find_spec("peft") is not None,
        "'lora.enabled' needs the peft package: pip install peft",
    )


def _check_eval(cfg: TrainConfig) -> None:
    ev = cfg.eval
    _positive_int(ev.every, "eval.every", zero=True)
    _positive_int(ev.limit, "eval.limit", allow_none=True)
    _positive_int(ev.auto_limit, "eval.auto_limit", allow_none=True)
    _positive_int(ev.max_new_tokens, "eval.max_new_tokens")
    _positive_int(ev.samples, "eval.samples")
    if ev.samples > 1 and cfg.rollout.temperature <= 0:
        raise ConfigError("'eval.samples' > 1 samples at rollout.temperature, which must be > 0")
    _positive_int(ev.batch_size, "eval.batch_size")


def _check_run(cfg: TrainConfig) -> None:
    run = cfg.run
    _positive_int(run.steps, "run.steps")
    _require(
        run.time_budget_seconds is None or run.time_budget_seconds > 0,
        f"'run.time_budget_seconds' must be > 0 or null, got {run.time_budget_seconds}",
    )
    _positive_int(run.checkpoint_every, "run.checkpoint_every", zero=True)
    _positive_int(run.keep_checkpoints, "run.keep_checkpoints")
    _positive_int(run.num_threads, "run.num_threads", allow_none=True)
    for name in run.report_to:
        if name not in REPORTERS:
            raise ConfigError(
                f"'run.report_to': unknown logger {name!r}; valid: {', '.join(REPORTERS)}"
            )
        package = REPORTERS[name]
        if importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"'run.report_to' {name!r} needs the {package} package, which is not installed "
                f"(pip install {package})"
            )
