"""The training configuration: one typed dataclass tree <-> YAML <-> command-line overrides.

Resolution order: the dataclass defaults (the embedded default run: the tiny model on the
``arithmetic`` task with Dr. GRPO + ProbL2), then a YAML file (``--config FILE``), then
command-line overrides (``--optim.lr 1e-4`` or an alias such as ``--lr 1e-4``). Every step
checks keys and types and names the offending key by its dotted path::

    ConfigError: unknown key 'optim.learning_rate'; valid keys under 'optim': lr, warmup_steps, ...
    ConfigError: 'rollout.num_generations' must be int, got str 'eight'

:func:`validate` then checks values and names against the registries (advantages, surrogates,
regularizers, aggregations, tasks), building each objective once so that a wrong parameter is
reported before any run directory is created or any model is loaded.

Why one module of ~780 lines: the dataclass tree, its YAML and override parsing and
:func:`validate` are one schema, so each key's type, default, alias and check are read in one
place (``docs/cli-and-config.md`` lists exactly these keys, and a test checks that it does).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import yaml

from gbmpo.objectives.spec import (
    ObjectiveSpec,
    SpecError,
    did_you_mean,
)

__all__ = [
    "ALIASES",
    "ConfigError",
    "EvalConfig",
    "LoraSettings",
    "ModelConfig",
    "OptimConfig",
    "REPORTERS",
    "RolloutConfig",
    "RunConfig",
    "TRAIN_ENGINES",
    "TaskConfig",
    "TrainConfig",
    "apply_overrides",
    "config_from_dict",
    "config_to_dict",
    "leaf_keys",
    "dump_yaml",
    "load_config",
    "validate",
]


class ConfigError(SpecError):
    """A bad configuration: unknown key, wrong type or invalid value (the message names it)."""


# --------------------------------------------------------------------------------- the tree


@dataclass
class ModelConfig:
    """Which causal LM to train."""

    #: ``"tiny"`` (the embedded tiny Qwen3), a local ``save_pretrained`` directory or a hub id
    path: str = "tiny"
    #: weights dtype: float32 | bfloat16 | float16
    dtype: str = "float32"
    #: torch device, e.g. "cpu" or "cuda"
    device: str = "cpu"
    trust_remote_code: bool = False


@dataclass
class TaskConfig:
    """The task (prompts + verifiable reward) from the ``TASKS`` registry."""

    name: str = "arithmetic"
    #: keyword arguments of the task factory
    params: dict[str, Any] = field(default_factory=dict)
    #: split the training prompts come from (``None``: the task's ``train_split``)
    train_split: str | None = None
    #: prompt template for tasks that have several: auto (chat if the tokenizer has a chat
    #: template) | base | chat; the same task object is used for evaluation
    template: str = "auto"


@dataclass
class RolloutConfig:
    """Sampling of the G completions per prompt, and the log-prob forwards over them."""

    prompts_per_step: int = 8
    #: completions per prompt, G
    num_generations: int = 8
    max_new_tokens: int = 40
    temperature: float = 1.0
    top_p: float = 1.0
    #: 0 disables top-k
    top_k: int = 0
    #: prompts per ``generate`` call (``None``: all prompts of the step at once)
    batch_size: int | None = None
    #: "gbmpo": prefill each prompt once, expand its KV cache to the G rows, plain decode loop;
    #: "hf": transformers' ``generate`` (same distribution, other random stream)
    engine: str = "gbmpo"
    #: with engine "gbmpo": decode Llama-shaped models (Qwen3, Qwen2, Llama) with
    #: ``gbmpo.rollout.LeanDecoder`` (same logits, no per-call transformers overhead); false: the
    #: model's own forward (other models always use it)
    lean_decoder: bool = True
    #: log-prob forwards (policy, old, reference) run each distinct prompt once and the G
    #: completions on its KV cache; exact up to float rounding (false: one forward per row)
    share_prompts: bool = True
    #: log-prob forwards and their backward for Llama-shaped models (Qwen3, Qwen2, Llama) through
    #: ``gbmpo.rollout.LeanForward``: plain tensor functions on the model's own parameters (same
    #: values and gradients up to float rounding, no per-op transformers overhead); false: the
    #: model's own forward (adapters, dropout, gradient checkpointing, other models always use it)
    lean_forward: bool = True
    #: engine trl with ``engine: vllm``: ``colocate`` (vLLM inside the training processes) |
    #: ``server`` (a running ``trl vllm-serve`` at vllm_server_host:vllm_server_port)
    vllm_mode: str = "colocate"
    #: engine trl, vllm_mode colocate: fraction of each GPU's memory vLLM reserves
    vllm_gpu_memory_utilization: float = 0.3
    #: engine trl, vllm_mode colocate: GPUs one vLLM engine spans (tensor parallelism)
    vllm_tensor_parallel_size: int = 1
    #: engine trl, vllm_mode server: host of the vLLM server
    vllm_server_host: str = "0.0.0.0"
    #: engine trl, vllm_mode server: port of the vLLM server
    vllm_server_port: int = 8000


@dataclass
class OptimConfig:
    """AdamW, learning-rate schedule, clipping, mini/micro-batching and inner epochs."""

    lr: float = 5e-5
    warmup_steps: int = 0
    #: constant | cosine: decays to min_lr_ratio * lr at the end of the run, i.e. after
    #: run.steps or run.time_budget_seconds of RL, whichever comes first (the decay is what
    #: keeps the final policy of the embedded default from oscillating)
    schedule: str = "cosine"
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.99)
    eps: float = 1e-8
    #: max global grad norm (``None``: no clipping; the norm is still logged)
    grad_clip: float | None = 1.0
    #: inner epochs over each rollout batch (mu); mu > 1 computes old log-probs
    mu: int = 1
    #: sequences per optimizer step (``None``: the whole rollout batch); must divide
    #: ``prompts_per_step * num_generations``. The default, four AdamW steps per rollout batch
    #: of 64 (mini-batches of 16 = 2 groups), learned fastest per second on the embedded model
    mini_batch_size: int | None = 16
    #: sequences per forward/backward (gradient accumulation; ``None``: the mini-batch)
    micro_batch_size: int | None = None


@dataclass
class LoraSettings:
    """LoRA adapters through peft (the reference is the model with adapters disabled)."""

    enabled: bool = False
    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"]
    )


@dataclass
class EvalConfig:
    """Greedy held-out evaluation before, during (every ``every`` steps) and after training."""

    #: steps between evaluations during training (0: only before and after)
    every: int = 50
    #: split to evaluate (``None``: the task's ``eval_split``)
    split: str | None = None
    #: evaluate only the first ``limit`` examples (``None``: all)
    limit: int | None = None
    #: with ``limit`` unset, a split longer than this is evaluated on its first ``auto_limit``
    #: examples (before, during and after training alike; ``None``: always all), so a large test
    #: split (GSM8K's 1,319) does not hold up the start of a run
    auto_limit: int | None = 500
    max_new_tokens: int = 40
    #: prompts per ``generate`` call
    batch_size: int = 100
    before: bool = True
    after: bool = True
    #: with ``after``: at the end of training, measure the final policy's drift from the
    #: reference (exact full-vocabulary KL both ways, ProbL2, total variation and entropy along
    #: samples on the evaluated held-out prompts; ``summary.json`` key ``drift``, see
    #: ``gbmpo.eval.drift``)
    drift: bool = True


@dataclass
class RunConfig:
    """Length, seed, outputs."""

    #: maximum number of RL steps
    steps: int = 1000
    #: stop after this many seconds of RL steps (evaluation and checkpoints excluded); ``None``:
    #: no time limit (runs are then reproducible step for step)
    time_budget_seconds: float | None = 240.0
    seed: int = 0
    #: run directory (``None``: ``runs/<timestamp>-<regularizer>``)
    output_dir: str | None = None
    #: steps between checkpoints (0: only the final one)
    checkpoint_every: int = 50
    #: how many step checkpoints to keep (the newest)
    keep_checkpoints: int = 1
    #: extra loggers: tensorboard | trackio | wandb
    report_to: list[str] = field(default_factory=list)
    #: torch intra-op threads (``None``: torch's default, one per core). 1 is as fast for the
    #: tiny model and avoids the large slowdown of oversubscribed cores on a shared machine;
    #: raise it (or set null) for larger models on CPU
    num_threads: int | None = 1
    #: keep freed tensor memory in the process (glibc ``mallopt``: mmap and trim thresholds
    #: raised to 1 GiB) instead of returning it to the OS after every op, which page-faults on
    #: new activation tensors (2-5% of a benchmark step, more on a loaded machine); process-wide,
    #: not undone. false: glibc's defaults. See ``gbmpo.train.allocator``
    keep_freed_memory: bool = True
    #: show a progress bar
    progress: bool = True
    #: Python modules imported before the run is built (they register tasks, rewards and
    #: regularizers; ``gbmpo --import MODULE`` records its modules here, so a resume finds them)
    plugins: list[str] = field(default_factory=list)
    #: run model-written code (code tasks) even where the sandbox lacks an isolation layer
    #: (bubblewrap, seccomp, uid 65534...); off by default: the sandbox then refuses and names
    #: what to install. Same as ``GBMPO_ALLOW_UNSANDBOXED_CODE=1``
    allow_unsandboxed_code: bool = False
    #: engines trl and verl: processes (GPUs) per node; trl launches them through accelerate
    num_processes: int = 1
    #: engine verl: nodes of the Ray cluster
    num_nodes: int = 1


@dataclass
class TrainConfig:
    """The whole configuration of one training run."""

    #: the trainer that runs this config: gbmpo (the own trainer: one process, CPU or one
    #: GPU) | trl (TRL's GRPOTrainer with gbmpo's loss: accelerate, DeepSpeed, vLLM) | verl
    #: (verl's main_ppo with the gbmpo plugin: Ray, FSDP, vLLM); see docs/engines.md
    engine: str = "gbmpo"
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    objective: ObjectiveSpec = field(default_factory=ObjectiveSpec)
    optim: OptimConfig = field(default_factory=OptimConfig)
    lora: LoraSettings = field(default_factory=LoraSettings)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run: RunConfig = field(default_factory=RunConfig)


#: short command-line spellings -> dotted config keys
ALIASES: dict[str, str] = {
    "engine": "engine",
    "model": "model.path",
    "task": "task.name",
    "lr": "optim.lr",
    "steps": "run.steps",
    "seed": "run.seed",
    "output-dir": "run.output_dir",
    "time-budget": "run.time_budget_seconds",
    "report-to": "run.report_to",
    "threads": "run.num_threads",
    "advantage": "objective.advantage",
    "surrogate": "objective.surrogate.name",
    "regularizer": "objective.regularizer.name",
    "coef": "objective.regularizer.coef",
    "anchor": "objective.regularizer.anchor",
    "mirror": "objective.regularizer.params.mirror",
    "aggregation": "objective.aggregation",
    "mu": "optim.mu",
    "lora": "lora.enabled",
    "num-generations": "rollout.num_generations",
    "prompts-per-step": "rollout.prompts_per_step",
    "max-new-tokens": "rollout.max_new_tokens",
    "temperature": "rollout.temperature",
    "eval-every": "eval.every",
    "num-processes": "run.num_processes",
}

#: values of the top-level ``engine`` key (``gbmpo train --engine NAME``)
TRAIN_ENGINES: tuple[str, ...] = ("gbmpo", "trl", "verl")

#: names accepted by ``run.report_to``, with the package each needs
REPORTERS: dict[str, str] = {"tensorboard": "tensorboard", "trackio": "trackio", "wandb": "wandb"}


# --------------------------------------------------------------------- dict <-> dataclasses


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(tp))
        return f"{origin.__name__}[{args}]"
    if tp is type(None):
        return "None"
    if tp is Any:
        return "any"
    return getattr(tp, "__name__", str(tp))


def _fields(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _describe(value: Any, limit: int = 200) -> str:
    """``type value`` for messages; a long value is cut (``...`` and its length)."""
    try:
        text = repr(value)
    except ValueError:  # an int with more digits than Python prints
        text = f"<{value.bit_length()}-bit int>" if isinstance(value, int) else "<unprintable>"
    if len(text) > limit:
        text = f"{text[:limit]}... ({len(text)} characters)"
    return f"{type(value).__name__} {text}"


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against the annotation ``tp`` (converting where lossless) or raise."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"{path!r} must be {_type_name(tp)}, got None")
        errors = []
        for arg in args:
            # a section or a list of sections (objective.regularizer): the arm of the value's
            # shape reports its own errors (an unknown key inside a term, say)
            if dataclasses.is_dataclass(arg) and isinstance(value, Mapping):
                return _coerce(value, arg, path)
            if typing.get_origin(arg) is list and isinstance(value, (list, tuple)):
                return _coerce(value, arg, path)
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, path)
            except ConfigError as err:
                errors.append(err)
        raise ConfigError(f"{path!r} must be {_type_name(tp)}, got {_describe(value)}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path!r} must be a mapping (section), got {_describe(value)}")
        return _build(tp, value, path)
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path!r} must be a mapping, got {_describe(value)}")
        for k in value:
            if not isinstance(k, str):
                raise ConfigError(f"{path!r} keys must be strings, got {k!r}")
        return dict(value)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, str) or not isinstance(value, Sequence):
            raise ConfigError(f"{path!r} must be {_type_name(tp)}, got {_describe(value)}")
        return [_coerce(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        item_tps = typing.get_args(tp)
        if isinstance(value, str) or not isinstance(value, Sequence) or len(value) != len(item_tps):
            raise ConfigError(
                f"{path!r} must be a list of {len(item_tps)} values ({_type_name(tp)}), got "
                f"{_describe(value)}"
            )
        return tuple(
            _coerce(v, t, f"{path}[{i}]")
            for i, (v, t) in enumerate(zip(value, item_tps, strict=True))
        )
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path!r} must be bool (true/false), got {_describe(value)}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{path!r} must be int, got {_describe(value)}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:  # an int beyond float range
                raise ConfigError(f"{path!r} must be float, got {_describe(value)} (out of "
                                  "float range)") from None
        # PyYAML reads exponent notation without a dot ("5e-5") as a string
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{path!r} must be float, got {_describe(value)}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{path!r} must be str, got {_describe(value)}")
    raise TypeError(f"unsupported config annotation {tp!r} at {path!r}")  # pragma: no cover


def _build(cls: type, data: Mapping[str, Any], path: str) -> Any:
    fields = _fields(cls)
    kwargs = {}
    for key, value in data.items():
        full = f"{path}.{key}" if path else str(key)
        if key not in fields:
            where = f" under {path!r}" if path else ""
            hint = did_you_mean(str(key), list(fields), prefix=f"{path}." if path else "")
            raise ConfigError(
                f"unknown key {full!r}; valid keys{where}: {', '.join(fields)}{hint}"
            )
        kwargs[key] = _coerce(value, fields[key], full)
    return cls(**kwargs)


def config_from_dict(data: Mapping[str, Any]) -> TrainConfig:
    """Build a :class:`TrainConfig` from a nested mapping (missing keys keep their defaults)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"the configuration must be a mapping, got {_describe(data)}")
    return typing.cast(TrainConfig, _build(TrainConfig, data, ""))


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """A plain nested dict (tuples become lists) that :func:`config_from_dict` reads back."""

    def plain(x: Any) -> Any:
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            return {f.name: plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        return x

    return typing.cast(dict[str, Any], plain(cfg))


def dump_yaml(cfg: TrainConfig, path: str | Path | None = None) -> str:
    """The resolved configuration as YAML (written to ``path`` if given)."""
    text = yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=False)
    if path is not None:
        Path(path).write_text(text)
    return text


def _yaml_problem(err: yaml.YAMLError) -> str:
    """PyYAML's error in one line: the problem and where (``line L, column C``)."""
    problem = getattr(err, "problem", None)
    mark = getattr(err, "problem_mark", None)
    if not problem:
        return " ".join(str(err).split())
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    context = getattr(err, "context", None)
    return f"{context + ': ' if context else ''}{problem}{where}"


def _read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        found = p.is_file()
    except OSError as err:  # a name longer than the file system allows, ...
        text = str(path)
        shown = text if len(text) <= 200 else f"{text[:200]}... ({len(text)} characters)"
        raise ConfigError(f"config file {shown!r} cannot be read: {err.strerror}") from None
    if not found:
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8-sig"))
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {_yaml_problem(err)}"
                          ) from err
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text: {err}") from err
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping, got {_describe(data)}")
    return data


# ------------------------------------------------------------------------------- overrides


def annotation_at(path: Sequence[str]) -> Any:
    """The annotation of the dotted ``path`` (``Any`` inside a free ``params`` dict)."""
    tp: Any = TrainConfig
    for i, part in enumerate(path):
        prefix = ".".join(path[:i])
        if typing.get_origin(tp) in (Union, types.UnionType):
            # a section that may also be a list of sections (objective.regularizer): its keys
            # are the section's
            sections = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
            tp = sections[0] if sections else tp
        if dataclasses.is_dataclass(tp):
            fields = _fields(tp)
            if part not in fields:
                where = f" under {prefix!r}" if prefix else ""
                raise ConfigError(
                    f"unknown key {'.'.join(path[: i + 1])!r}; valid keys{where}: "
                    f"{', '.join(fields)}{_override_hint(part, prefix, fields)}"
                )
            tp = fields[part]
        elif typing.get_origin(tp) is dict:
            tp = Any
        else:
            raise ConfigError(f"{prefix!r} is a {_type_name(tp)}, it has no key {part!r}")
    return tp


def leaf_keys(cls: type | None = None, prefix: str = "") -> list[str]:
    """Every dotted key of the configuration down to its values (``optim.lr``, ...; a free
    ``params`` dict is one key)."""
    out: list[str] = []
    for name, tp in _fields(TrainConfig if cls is None else cls).items():
        key = f"{prefix}{name}"
        sections = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        if sections:  # a section or a list of sections (objective.regularizer): the whole
            out.append(key)  # value is a key of its own, and so is each key of the section
            out += leaf_keys(sections[0], f"{key}.")
        elif dataclasses.is_dataclass(tp):
            out += leaf_keys(tp, f"{key}.")
        else:
            out.append(key)
    return out


def _override_hint(part: str, prefix: str, fields: Mapping[str, Any]) -> str:
    """The "did you mean" of an unknown override key: a field of the same section; at the top
    level also an alias (``--regulariser`` -> ``regularizer``) or the dotted key a bare field
    name belongs to (``--grad_clip`` -> ``optim.grad_clip``)."""
    if prefix:
        return did_you_mean(part, list(fields), prefix=f"{prefix}.")
    table = {name: name for name in fields}
    for alias in ALIASES:
        table.setdefault(alias, alias)
    for key in leaf_keys():
        table.setdefault(key.rsplit(".", 1)[-1], key)
    return did_you_mean(part, table)


def _parse_text(text: str, tp: Any, key: str) -> Any:
    """Turn a command-line string into a value of annotation ``tp``."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp) if origin in (Union, types.UnionType) else (tp,)
    if type(None) in args and text.strip().lower() in ("none", "null", "~"):
        return None
    concrete = [a for a in args if a is not type(None)]
    if len(concrete) == 1:
        base = concrete[0]
        if base is str:
            return text
        if base is bool:
            low = text.strip().lower()
            if low in ("true", "yes", "1", "on"):
                return True
            if low in ("false", "no", "0", "off"):
                return False
            raise ConfigError(f"{key!r} must be bool (true/false), got {text!r}")
        if base is int:
            try:
                return int(text)
            except ValueError:
                raise ConfigError(f"{key!r} must be int, got {text!r}") from None
        if base is float:
            try:
                return float(text)
            except ValueError:
                raise ConfigError(f"{key!r} must be float, got {text!r}") from None
        if typing.get_origin(base) is list and typing.get_args(base) == (str,):
            stripped = text.strip()
            if not stripped.startswith("["):
                return [s.strip() for s in stripped.split(",") if s.strip()]
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as err:
        if tp is Any:  # free params: text YAML cannot read is a string (e.g. "a: {x}: b")
            return text
        raise ConfigError(f"cannot parse the value {text!r} of {key!r}: {err}") from err
    if tp is Any and _reads_as_text(text, value):
        return text
    return value


_LEADING_ZERO = re.compile(r"[-+]?0[0-9_]+")


def _reads_as_text(text: str, value: Any) -> bool:
    """Whether a free-params value that YAML read as a mapping or list was meant as text: a
    template such as ``"Q: {question}\nA:"`` or ``"{prompt}"`` (block syntax not opened by
    ``{``/``[``, or a flow mapping with an empty value); also a number YAML 1.1 read in base 60
    (``1:2:3``) or in octal (``010``), and text YAML reads as a comment (``# {prompt}``)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and (
        ":" in text or _LEADING_ZERO.fullmatch(text.strip())
    ):
        return True  # YAML 1.1 base 60 ("1:2:3" = 3723) or octal ("010" = 8): not what was typed
    if value is None and text.strip() not in ("", "~", "null", "Null", "NULL"):
        return True  # a YAML comment: "# Question: {prompt}"
    if not isinstance(value, (dict, list)):
        return False
    if not text.lstrip().startswith(("{", "[")):
        return True
    return isinstance(value, dict) and any(v is None for v in value.values())


def _set_path(data: dict[str, Any], path: Sequence[str], value: Any) -> None:
    node = data
    for i, part in enumerate(path[:-1]):
        nxt = node.get(part)
        if isinstance(nxt, list):
            where = ".".join(path[: i + 1])
            raise ConfigError(
                f"{'.'.join(path)!r}: {where!r} is a list of {len(nxt)} terms here (from the "
                f"config file), so a key of one term cannot be overridden on the command line; "
                f"edit the list in the file or set the whole list, e.g. --{where} "
                "'[{name: prob_l2, coef: 0.05}, {name: kl_k3, coef: 0.01}]'"
            )
        if not isinstance(nxt, dict):
            nxt = {}
            node[part] = nxt
        node = nxt
    node[path[-1]] = value


def canonical_key(key: str) -> str:
    """``--optim.grad-clip`` / ``optim.grad_clip`` / an alias -> the dotted config key."""
    k = key.lstrip("-")
    if k in ALIASES:
        return ALIASES[k]
    if k.replace("_", "-") in ALIASES:
        return ALIASES[k.replace("_", "-")]
    parts = k.split(".")
    # params dicts keep their keys verbatim; section and field names use underscores
    out = []
    in_params = False
    for part in parts:
        out.append(part if in_params else part.replace("-", "_"))
        in_params = in_params or part == "params"
    return ".".join(out)


def apply_overrides(data: dict[str, Any], overrides: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """Apply ``(dotted key or alias, value)`` pairs to a nested dict; string values are parsed
    according to the field's annotation. Unknown keys raise :class:`ConfigError`."""
    for raw_key, raw_value in overrides:
        key = canonical_key(raw_key)
        path = key.split(".")
        tp = annotation_at(path)
        value = _parse_text(raw_value, tp, key) if isinstance(raw_value, str) else raw_value
        if dataclasses.is_dataclass(tp):
            raise ConfigError(f"{key!r} is a section; set one of its keys instead")
        _set_path(data, path, value)
    return data


def load_config(
    path: str | Path | None = None, overrides: Sequence[tuple[str, Any]] = ()
) -> TrainConfig:
    """Defaults <- YAML file ``path`` <- ``overrides``; keys and types are checked (values are
    checked by :func:`validate`)."""
    data = config_to_dict(TrainConfig())
    if path is not None:
        _deep_merge(data, _read_yaml(path), "")
    apply_overrides(data, overrides)
    return config_from_dict(data)


def _deep_merge(base: dict[str, Any], new: Mapping[str, Any], path: str) -> None:
    for key, value in new.items():
        full = f"{path}.{key}" if path else str(key)
        if key not in base:
            # let the typed builder produce the "unknown key" message
            base[key] = value
            continue
        if (
            isinstance(base[key], dict)
            and isinstance(value, Mapping)
            and not full.endswith("params")
        ):
            _deep_merge(base[key], value, full)
        else:
            base[key] = value


# ------------------------------------------------------------------------------ validation


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
    matrix, :func:`gbmpo.train.support.check_support`). Does not touch the filesystem or load a
    model.
    """
    from gbmpo.registry import PluginError, UnknownNameError, add_plugin_modules
    from gbmpo.tasks import TASKS

    try:  # plugins first: they may register the names checked below
        add_plugin_modules(list(cfg.run.plugins))
    except PluginError as err:
        raise ConfigError(f"run.plugins: {err}") from None
    r, o, opt, ev, run = cfg.rollout, cfg.objective, cfg.optim, cfg.eval, cfg.run
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
    from gbmpo.rollout.sampling import ENGINES

    engines = (*ENGINES, "vllm") if cfg.engine != "gbmpo" else ENGINES  # TRL / verl: vLLM
    _require(
        r.engine in engines,
        f"'rollout.engine': unknown engine {r.engine!r}; valid: {', '.join(engines)}",
    )

    if cfg.task.name not in TASKS:
        try:
            from gbmpo.tasks.reasoning_gym import list_datasets

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
    try:  # the spec's own check: names, parameters (each built once), coef, anchor
        o.check("objective")
    except UnknownNameError:
        raise
    except ConfigError:
        raise
    except SpecError as err:
        raise ConfigError(str(err)) from None
    except OSError as err:  # e.g. a mirror-map file that is not there
        raise ConfigError(f"objective.regularizer ({o.regularizer_label!r}): {err}") from None

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

    if cfg.lora.enabled:
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

    _positive_int(ev.every, "eval.every", zero=True)
    _positive_int(ev.limit, "eval.limit", allow_none=True)
    _positive_int(ev.auto_limit, "eval.auto_limit", allow_none=True)
    _positive_int(ev.max_new_tokens, "eval.max_new_tokens")
    _positive_int(ev.batch_size, "eval.batch_size")

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
    # the support matrix: a value this engine cannot honour is refused here, before any write
    from gbmpo.train.support import check_support

    check_support(cfg)
    return cfg
