"""The support matrix: every config key x every engine -> honoured, refused or no effect.

One config is one experiment on every engine, so each key has one answer per engine:

* ``honoured``: the engine does what the key says, with the own engine's meaning (``how``
  names the host setting it becomes);
* ``refused``: some (or all) values cannot be expressed on that engine; such a value stops the
  run with exit 2 before anything is written, naming the key, its value and the engine
  (``refuse`` says which values, ``how`` says why);
* ``no_effect``: a speed or display key that does not change results on that engine (printed
  once at the start when set to a non-default value).

:func:`check_support` applies the matrix to a config: it raises
:class:`gbmpo.train.config.ConfigError` for a refused value and returns the notices for
no-effect keys set to non-default values. :func:`gbmpo.train.config.validate` calls it, so every
engine refuses before anything is written; ``gbmpo train`` prints the notices once.
``docs/cli-and-config.md`` holds the rendered table (:func:`render_markdown`), and a test fails
for a config key without an entry for every engine.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ENGINES",
    "HONOURED",
    "NO_EFFECT",
    "REFUSED",
    "SUPPORT",
    "Support",
    "check_support",
    "config_keys",
    "render_markdown",
]

HONOURED, REFUSED, NO_EFFECT = "honoured", "refused", "no_effect"
ENGINES: tuple[str, ...] = ("gbmpo", "trl", "verl")


@dataclass(frozen=True)
class Support:
    """One key on one engine.

    ``refuse(value, cfg)`` returns ``True`` for the values the engine cannot honour (for
    ``status == REFUSED``; ``None`` refuses every value but the default); ``how`` is the host
    setting (honoured), the reason (refused) or what the key changes (no effect); ``probe`` is
    a second valid value whose effect on the host's configuration a test checks (honoured keys
    of the ``trl`` and ``verl`` engines)."""

    status: str
    how: str = ""
    refuse: Callable[[Any, Any], bool] | None = None
    probe: Any = None


def H(how: str = "", probe: Any = None) -> Support:  # noqa: N802 - table shorthand
    return Support(HONOURED, how, probe=probe)


def R(why: str, refuse: Callable[[Any, Any], bool] | None = None, probe: Any = None) -> Support:  # noqa: N802
    return Support(REFUSED, why, refuse, probe)


def N(what: str) -> Support:  # noqa: N802
    return Support(NO_EFFECT, what)


def _never_default(key: str) -> Callable[[Any, Any], bool]:
    return lambda value, cfg: value != _default_of(key)


# ------------------------------------------------------------------- the own engine


_SPEED = "speed only: same results up to float rounding"

GBMPO: dict[str, Support] = {
    "engine": H("the own trainer"),
    "model.path": H(),
    "model.dtype": R("float16 training is refused (no loss scaling; bf16 trains through fp32 "
                     "master weights)", lambda v, c: v == "float16", probe="float16"),
    "model.device": H(),
    "model.trust_remote_code": H(),
    "task.name": H(),
    "task.params": H(),
    "task.train_split": H(),
    "task.template": H(),
    "rollout.prompts_per_step": H(),
    "rollout.num_generations": H(),
    "rollout.max_new_tokens": H(),
    "rollout.temperature": H(),
    "rollout.top_p": H(),
    "rollout.top_k": H(),
    "rollout.batch_size": N(_SPEED),
    "rollout.engine": H("gbmpo | hf sampler (vllm: engines trl and verl)"),
    "rollout.lean_decoder": N(_SPEED),
    "rollout.share_prompts": N(_SPEED),
    "rollout.lean_forward": N(_SPEED),
    "objective.advantage": H(),
    "objective.surrogate.name": H(),
    "objective.surrogate.params": H(),
    "objective.regularizer.name": H(),
    "objective.regularizer.coef": H(),
    "objective.regularizer.anchor": H(),
    "objective.regularizer.params": H(),
    "objective.aggregation": H(),
    "objective.monitor_regularizers": H("reg/<name> for every registered regularizer"),
    "optim.lr": H(),
    "optim.warmup_steps": H(),
    "optim.schedule": H(),
    "optim.min_lr_ratio": H(),
    "optim.weight_decay": H(),
    "optim.betas": H(),
    "optim.eps": H(),
    "optim.grad_clip": H(),
    "optim.mu": H(),
    "optim.mini_batch_size": H(),
    "optim.micro_batch_size": N("gradient accumulation: same gradient up to float rounding"),
    "lora.enabled": H(),
    "lora.r": H(),
    "lora.alpha": H(),
    "lora.dropout": H(),
    "lora.target_modules": H(),
    "eval.every": H(),
    "eval.split": H(),
    "eval.limit": H(),
    "eval.auto_limit": H(),
    "eval.max_new_tokens": H(),
    "eval.batch_size": N(_SPEED),
    "eval.before": H(),
    "eval.after": H(),
    "run.steps": H(),
    "run.time_budget_seconds": H(),
    "run.seed": H(),
    "run.output_dir": H(),
    "run.checkpoint_every": H(),
    "run.keep_checkpoints": H(),
    "run.report_to": H(),
    "run.num_threads": N(_SPEED),
    "run.keep_freed_memory": N(_SPEED),
    "run.progress": H("the progress display"),
    "run.plugins": H(),
    "run.allow_unsandboxed_code": H(),
    "run.num_processes": R("the own trainer runs one process; engines trl and verl run "
                           "several", _never_default("run.num_processes"), probe=2),
    "run.num_nodes": R("the own trainer runs on one machine; engine verl runs on several",
                       _never_default("run.num_nodes"), probe=2),
}

# ------------------------------------------------------------------- TRL (gbmpo.engines.trl)

TRL: dict[str, Support] = dict(GBMPO)  # filled in by the TRL engine's owner: see below
TRL.update({
    "engine": H("TRL's GRPOTrainer with GBMPOTrainer's loss"),
    "run.num_processes": H("accelerate launch --num_processes", probe=2),
})

# ------------------------------------------------------------------- verl (gbmpo.engines.verl)

VERL: dict[str, Support] = dict(GBMPO)  # filled in by the verl engine's owner: see below
VERL.update({
    "engine": H("verl's main_ppo with the gbmpo plugin"),
    "run.num_processes": H("trainer.n_gpus_per_node", probe=2),
    "run.num_nodes": H("trainer.nnodes", probe=2),
})

#: engine -> key -> :class:`Support`
SUPPORT: dict[str, dict[str, Support]] = {"gbmpo": GBMPO, "trl": TRL, "verl": VERL}


# ------------------------------------------------------------------- applying the matrix


def config_keys() -> list[str]:
    """Every dotted key of :class:`gbmpo.train.config.TrainConfig` (free ``params`` dicts are
    one key each)."""
    from gbmpo.train.config import TrainConfig

    def walk(cls: type, prefix: str) -> Iterator[str]:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            key = f"{prefix}{f.name}"
            if dataclasses.is_dataclass(tp):
                yield from walk(typing.cast(type, tp), key + ".")
            else:
                yield key

    return list(walk(TrainConfig, ""))


def _value_at(cfg: Any, key: str) -> Any:
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _default_of(key: str) -> Any:
    from gbmpo.train.config import TrainConfig

    return _value_at(TrainConfig(), key)


def check_support(cfg: Any, engine: str | None = None) -> list[str]:
    """Refuse (``ConfigError``, exit 2) a value ``engine`` (default ``cfg.engine``) cannot honour;
    return one notice per no-effect key set to a non-default value."""
    from gbmpo.train.config import ConfigError

    engine = engine or cfg.engine
    table = SUPPORT[engine]
    notices = []
    for key in config_keys():
        entry = table.get(key)
        if entry is None:
            raise ConfigError(f"{key!r} has no entry for engine {engine!r} in the support matrix")
        value = _value_at(cfg, key)
        if entry.status == REFUSED:
            refused = (entry.refuse or _never_default(key))(value, cfg)
            if refused:
                raise ConfigError(
                    f"{key!r}={value!r} is not supported by engine {engine!r}: {entry.how}"
                )
        elif entry.status == NO_EFFECT and value != _default_of(key):
            notices.append(f"{key}={value!r} has no effect on results with engine {engine!r} "
                           f"({entry.how})")  # fmt: skip
    return notices


def render_markdown() -> str:
    """The matrix as a Markdown table (one row per key, one column per engine)."""
    label = {HONOURED: "honoured", REFUSED: "refused", NO_EFFECT: "no effect"}
    lines = ["| key | " + " | ".join(ENGINES) + " |", "|---|" + "---|" * len(ENGINES)]
    for key in config_keys():
        cells = []
        for engine in ENGINES:
            e = SUPPORT[engine][key]
            cell = label[e.status] + (f": {e.how}" if e.how else "")
            cells.append(cell.replace("|", "\\|"))
        lines.append(f"| `{key}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
