"""The training configuration's dataclass tree (:class:`TrainConfig` and its sections), the
command-line aliases, and :class:`ConfigError`. Each key's type, default and comment are here;
``docs/cli-and-config.md`` lists exactly these keys (a test checks that it does).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gbmpo.objectives.spec import (
    ObjectiveSpec,
    SpecError,
)

__all__ = [
    "ALIASES",
    "ConfigError",
    "EvalConfig",
    "LoraSettings",
    "ModelConfig",
    "OptimConfig",
    "RENAMED_KEYS",
    "REPORTERS",
    "RolloutConfig",
    "RunConfig",
    "TRAIN_ENGINES",
    "TaskConfig",
    "TrainConfig",
]


class ConfigError(SpecError):
    """A bad configuration: unknown key, wrong type or invalid value (the message names it)."""


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
    #: what samples the completions: "gbmpo": prefill each prompt once, expand its KV cache to
    #: the G rows, plain decode loop; "hf": transformers' ``generate`` (same distribution, other
    #: random stream); "vllm": vLLM (engines trl and verl). Formerly ``rollout.engine``
    generator: str = "gbmpo"
    #: with generator "gbmpo": decode Llama-shaped models (Qwen3, Qwen2, Llama) with
    #: ``gbmpo.rollout.LeanDecoder`` (same logits, no per-call transformers overhead); false: the
    #: model's own forward (other models always use it)
    lean_decoder: bool = True
    #: with generator "gbmpo" and lean_decoder: the decode step of the rollouts. "static": a
    #: static-shape step (``gbmpo.rollout.StaticDecoder``: buffers for the whole completion,
    #: sampling inside the step, a CUDA graph on a GPU; LoRA adapters merged into a decode copy
    #: of the weights); "lean": ``gbmpo.rollout.LeanDecoder`` (refuses adapters: the model's
    #: own forward then); "auto": static on CUDA, and on the CPU for LoRA models, lean otherwise
    #: (the faster there). The same tokens for the same seed up to float rounding
    decode_step: str = "auto"
    #: the static decode step's buffers (its slots: keys/values for the whole completion, a CUDA
    #: graph and its memory pool; with LoRA the merged decode copy of the weights) between
    #: rollouts and evaluations. "keep": kept through the update (no re-allocation or
    #: re-capture per rollout); "release": freed after each rollout and evaluation, so the
    #: update has their memory; "auto": keep when the memory plan fits the device with them
    #: kept, release otherwise (only on CUDA, where the plan knows the device; keep elsewhere).
    #: The same tokens either way
    decode_buffers: str = "auto"
    #: log-prob forwards (policy, old, reference) run each distinct prompt once and the G
    #: completions on its KV cache; exact up to float rounding (false: one forward per row)
    share_prompts: bool = True
    #: log-prob forwards and their backward for Llama-shaped models (Qwen3, Qwen2, Llama) through
    #: ``gbmpo.rollout.LeanForward``: plain tensor functions on the model's own parameters (same
    #: values and gradients up to float rounding, no per-op transformers overhead); false: the
    #: model's own forward (adapters, dropout, gradient checkpointing, other models always use it)
    lean_forward: bool = True
    #: engine trl with ``generator: vllm``: ``colocate`` (vLLM inside the training processes) |
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
    #: sequences per forward/backward (gradient accumulation; ``None``: on CUDA, own engine, the
    #: largest the memory plan fits with a 10% margin; elsewhere the mini-batch)
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
    """Held-out evaluation before, during (every ``every`` steps) and after training (greedy, or
    ``samples`` per problem)."""

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
    #: completions per problem: 1 decodes greedily (accuracy / pass@1); N > 1 samples N at the
    #: rollout's temperature and top_p and adds the pass@k curve (k = 1, 2, 4, ..., N; unbiased
    #: estimator), the mean number of distinct final answers per problem and the mean token
    #: entropy (``gbmpo.eval``)
    samples: int = 1
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

#: renamed keys: old dotted key -> its new name. The old key is still read, with a
#: ``DeprecationWarning`` (``gbmpo train`` prints it as a note); giving both is a ConfigError.
RENAMED_KEYS: dict[str, str] = {"rollout.engine": "rollout.generator"}

#: values of the top-level ``engine`` key (``gbmpo train --engine NAME``): the one list of the
#: engines, also the support matrix's columns (:data:`gbmpo.config.support.ENGINES`) and the
#: names in the engine registry (:data:`gbmpo.engines.ENGINES`, which sits above this layer)
TRAIN_ENGINES: tuple[str, ...] = ("gbmpo", "trl", "verl")

#: names accepted by ``run.report_to``, with the package each needs
REPORTERS: dict[str, str] = {"tensorboard": "tensorboard", "trackio": "trackio", "wandb": "wandb"}
