"""TRL's table (``engine: trl``, :mod:`gbmpo.engines.trl`): every config key -> its
:class:`~gbmpo.config.matrix.Support` on TRL, whose ``sets`` are the ``GRPOConfig`` fields the key
decides. From this one table come TRL's column of the support matrix (:mod:`gbmpo.config.support`,
rendered into the docs), the refusals ``gbmpo train --engine trl`` applies before writing anything,
and the ``GBMPOConfig`` keyword arguments :func:`gbmpo.engines.trl.args.grpo_args` builds
(:func:`grpo_kwargs`: the table's fields plus :data:`FIXED`). The batch layout
(:func:`batch_layout`) is here too: it decides the batch fields and the refusals of uneven splits.

A new key's TRL mapping is one row: ``"section.key": H("field_name", probe=..., sets={"field_name":
same})`` (``same`` passes the value on; any ``(value, cfg, layout) -> value`` transforms it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gbmpo.config.hosts.own import SPEED, SUM_PROBE
from gbmpo.config.matrix import H, N, R, Support, default_of, host_values, never_default, same
from gbmpo.config.schema import ConfigError

__all__ = ["FIXED", "TRL", "TRL_LOSS_TYPES", "TRL_SCALE_REWARDS", "BatchLayout", "batch_layout",
           "grpo_kwargs", "static_decode", "uneven_split"]  # fmt: skip

#: gbmpo aggregation -> TRL ``loss_type`` (``bnpo`` is TRL's local token mean; TRL's ``dapo``,
#: the global token mean, is also ``bnpo`` in gbmpo); ``GBMPOConfig`` sets it from the objective
TRL_LOSS_TYPES: dict[str, str] = {
    "grpo": "grpo",
    "bnpo": "bnpo",
    "dr_grpo": "dr_grpo",
    "seq_mean_token_sum": "luspo",
}
#: gbmpo advantage -> TRL ``scale_rewards`` (TRL always subtracts the group mean).
TRL_SCALE_REWARDS: dict[str, str] = {
    "grpo": "group",
    "batch": "batch",
    "dr_grpo": "none",
    "rpg": "none",
}


@dataclass(frozen=True)
class BatchLayout:
    """TRL's batch settings for one RL step of a gbmpo config."""

    #: completions per process per forward/backward (TRL ``per_device_train_batch_size``)
    per_device: int
    #: micro-batches per optimizer step on each process
    grad_accum: int
    #: micro-steps per generation batch (TRL ``steps_per_generation``)
    steps_per_generation: int
    #: optimizer steps per RL step (``mu`` passes of ``batch / mini`` steps)
    optimizer_steps: int


def _mini_and_micro(cfg: Any, world: int) -> tuple[int, int]:
    """The mini-batch :math:`M` (default the whole batch) and the micro-batch asked for
    (default, and at most, the per-process share :math:`M/W`; 0 where :math:`W` does not divide
    :math:`M`)."""
    n = cfg.rollout.prompts_per_step * cfg.rollout.num_generations
    mini = int(cfg.optim.mini_batch_size or n)
    share = mini // world if mini % world == 0 else 0
    return mini, min(cfg.optim.micro_batch_size or share, share)


def uneven_split(cfg: Any, world: int) -> str | None:
    """The key whose batch split TRL cannot run on ``world`` processes: ``optim.mini_batch_size``
    when :math:`W` does not divide :math:`M`, ``optim.micro_batch_size`` when the micro-batch
    does not divide :math:`M/W`; ``None`` when the split is even."""
    mini, micro = _mini_and_micro(cfg, world)
    if mini % world:
        return "optim.mini_batch_size"
    return "optim.micro_batch_size" if (mini // world) % micro else None


def batch_layout(cfg: Any, world: int) -> BatchLayout:
    r"""The layout of one RL step on ``world`` processes.

    With :math:`N = PG` sequences per RL step, mini-batch :math:`M` (default :math:`N`) and
    micro-batch :math:`m` (default :math:`M/W`): each process runs :math:`M/(Wm)` micro-batches
    of :math:`m` per optimizer step, TRL generates :math:`N` completions every
    :math:`N/(Wm)` micro-steps, and an RL step has :math:`\mu N/M` optimizer steps.
    ``ConfigError`` names the setting when :math:`M` is not a multiple of :math:`W m`."""
    n = cfg.rollout.prompts_per_step * cfg.rollout.num_generations
    mini, micro = _mini_and_micro(cfg, world)
    uneven = uneven_split(cfg, world)
    if uneven == "optim.mini_batch_size":
        raise ConfigError(
            f"'optim.mini_batch_size'={mini} must be a multiple of run.num_processes={world} "
            "(each process takes an equal share of every optimizer step)"
        )
    share = mini // world
    if uneven == "optim.micro_batch_size":
        raise ConfigError(
            f"'optim.micro_batch_size'={micro} must divide the per-process mini-batch "
            f"{share} (optim.mini_batch_size / run.num_processes)"
        )
    return BatchLayout(
        per_device=micro,
        grad_accum=share // micro,
        steps_per_generation=n // (micro * world),
        optimizer_steps=(n // mini) * cfg.optim.mu,
    )


def _device_index(value: Any, cfg: Any) -> bool:
    """A CUDA device index other than 0 (``cuda:1``)."""
    head, _, index = str(value).partition(":")
    return head == "cuda" and index not in ("", "0")


def _uneven_mini(value: Any, cfg: Any) -> bool:
    """A process count that cannot share the mini-batch equally."""
    return uneven_split(cfg, max(int(value), 1)) == "optim.mini_batch_size"


def _uneven_micro(value: Any, cfg: Any) -> bool:
    """A micro-batch that does not divide the per-process share of the mini-batch."""
    return uneven_split(cfg, max(int(cfg.run.num_processes), 1)) == "optim.micro_batch_size"


def _without_vllm(key: str) -> Callable[[Any, Any], bool]:
    """A value other than the default while the generator is not vLLM (no effect there)."""
    return lambda value, cfg: cfg.rollout.generator != "vllm" and value != default_of(key)


def static_decode(cfg: Any) -> bool:
    """Whether TRL generates with transformers' static KV cache and compiled decode step
    (``rollout.decode_step`` static, or auto on CUDA; never with vLLM generation)."""
    step = cfg.rollout.decode_step
    on_cuda = str(cfg.model.device).startswith("cuda")
    return cfg.rollout.generator != "vllm" and (step == "static" or (step == "auto" and on_cuda))


def _field(name: str) -> dict[str, Callable[..., Any]]:
    """``sets`` of a key that is one ``GRPOConfig`` field, its value unchanged."""
    return {name: same}


_TRL_PROMPTS = "the generation batch (prompts_per_step * num_generations = steps_per_generation"
_TRL_EVAL = "gbmpo.eval on the main process, as the own engine"
TRL: dict[str, Support] = {
    "engine": H("TRL's GRPOTrainer with GBMPOTrainer's loss"),
    "model.path": H("the policy, loaded as the own engine loads it (GRPOTrainer model=)",
                    probe="tiny-other"),
    "model.dtype": R("float16 training is refused (no loss scaling); bfloat16 trains fp32 "
                     "weights (the optimizer's masters) under bf16 autocast (GRPOConfig bf16)",
                     lambda v, c: v == "float16", probe="float16",
                     sets={"bf16": lambda v, c, lay: v == "bfloat16"}),
    "model.device": R("cpu -> GRPOConfig use_cpu, cuda -> one GPU per process (accelerate); a "
                      "device index other than 0 is refused: select the GPU with "
                      "CUDA_VISIBLE_DEVICES and use model.device cuda", _device_index,
                      probe="cuda:1", sets={"use_cpu": lambda v, c, lay: v == "cpu"}),
    "model.trust_remote_code": H("load_model_and_tokenizer(trust_remote_code=) for the policy, "
                                 "GRPOConfig trust_remote_code for TRL's reference model",
                                 probe=True,
                                 sets={"trust_remote_code": lambda v, c, lay: bool(v)}),
    "task.name": H("train_dataset (prompts rendered as the own engine) + the reward function",
                   probe="gsm8k"),
    "task.params": H("the task factory's keyword arguments", probe={"num_train": 100}),
    "task.train_split": H("the split train_dataset is built from", probe="test"),
    "task.template": H("the prompts' template", probe="base"),
    "rollout.prompts_per_step": H(f"{_TRL_PROMPTS} x micro-batch)", probe=4,
                                  sets={"steps_per_generation":
                                        lambda v, c, lay: lay.steps_per_generation}),
    "rollout.num_generations": H("num_generations", probe=4,
                                 sets=_field("num_generations")),
    "rollout.max_new_tokens": H("max_completion_length", probe=16,
                                sets=_field("max_completion_length")),
    "rollout.temperature": H("temperature", probe=0.7, sets=_field("temperature")),
    "rollout.top_p": H("top_p", probe=0.9, sets=_field("top_p")),
    "rollout.top_k": H("top_k", probe=5, sets=_field("top_k")),
    "rollout.batch_size": N("TRL generates each process's share of the batch at once"),
    "rollout.generator": H("gbmpo | hf -> TRL's transformers generation; vllm -> use_vllm",
                           probe="vllm", sets={"use_vllm": lambda v, c, lay: v == "vllm"}),
    "rollout.lean_decoder": N("the own engine's decoder; TRL generates with transformers"),
    "rollout.decode_step": H(
        "transformers' generate (without vLLM): static -> cache_implementation 'static' with "
        "compile_generation (transformers compiles the decode step with torch.compile's "
        "reduce-overhead mode, CUDA graphs, on CUDA only; TRL alone would disable it; LoRA "
        "adapters stay unmerged in the compiled step); lean -> TRL's default dynamic cache, "
        "uncompiled; auto -> static on CUDA, lean on the CPU (where nothing is compiled and the "
        "static cache was no faster); the same tokens for the same seed up to float rounding; "
        "no effect with rollout.generator vllm",
        probe="static", sets={"cache_implementation": lambda v, c, lay:
                              "static" if static_decode(c) else None,
                              "compile_generation": lambda v, c, lay: static_decode(c)}),
    "rollout.decode_buffers": N("the own engine's decoder; TRL generates with transformers"),
    "rollout.share_prompts": N("the own engine's forward; TRL runs its own"),
    "rollout.lean_forward": N("the own engine's forward; TRL runs its own"),
    **{key: R(f"{key.removeprefix('rollout.')} with rollout.generator vllm; without vLLM "
              "generation a value other than the default is refused (it would change nothing)",
              _without_vllm(key), probe=probe,
              sets=_field(key.removeprefix("rollout.")))
       for key, probe in (("rollout.vllm_mode", "server"),
                          ("rollout.vllm_gpu_memory_utilization", 0.5),
                          ("rollout.vllm_tensor_parallel_size", 2),
                          ("rollout.vllm_server_host", "10.0.0.2"),
                          ("rollout.vllm_server_port", 8001))},  # fmt: skip
    "objective.advantage": H("GBMPOConfig objective (TRL scale_rewards); TRL adds 1e-4 to the "
                             "reward std (the own engine and verl 1e-6)", probe="grpo"),
    "objective.surrogate.name": H("GBMPOConfig objective", probe="gspo"),
    "objective.surrogate.params": H("GBMPOConfig objective", probe={"eps_low": 0.1}),
    "objective.regularizer": H("GBMPOConfig objective: a list of terms is summed in "
                               "GBMPOTrainer's loss", probe=SUM_PROBE),
    "objective.regularizer.name": H("GBMPOConfig objective", probe="kl_k3"),
    "objective.regularizer.coef": H("GBMPOConfig objective (TRL beta)", probe=0.2),
    "objective.regularizer.control": H(
        "GBMPOConfig objective: GBMPOTrainer moves coef after each generation batch (the RL "
        "step) from the batch's measure over every process; saved in each checkpoint "
        "(gbmpo_drift_state.json)", probe={"target": 0.02}),
    "objective.regularizer.anchor": H("GBMPOConfig objective", probe="old"),
    "objective.regularizer.params": H("GBMPOConfig objective", probe={"clamp": 10.0}),
    "objective.regularizer.placement": R(
        "reward: GBMPOTrainer subtracts coef * sum_t D(pi_old || pi_ref) (detached, from TRL's "
        "rollout and reference log-probs) from the summed reward before TRL's advantages; "
        "'advantage' is refused: TRL's advantages are per sequence and computed inside "
        "GRPOTrainer._generate_and_score_completions (engine gbmpo takes it)",
        lambda v, c: "advantage" in (v if isinstance(v, list) else [v]), probe="advantage"),
    "objective.regularizer.estimator": H(
        "full: the exact divergence over the vocabulary from the policy's logits of each "
        "micro-batch and a no-grad reference forward (the reference model, or the adapter "
        "switched off under LoRA), chunked as on the own engine", probe="full"),
    "objective.aggregation": H("GBMPOConfig objective (TRL loss_type); bnpo: the token mean of "
                               "each optimizer step over every process, as the own engine's "
                               "mini-batch", probe="grpo"),
    "objective.monitor_regularizers": H("reg/<name> = D(pi_old || pi_ref) for every registered "
                                        "regularizer (GBMPOConfig monitor_regularizers, the "
                                        "same name; GBMPOTrainer logs reg/<name>)",
                                        probe=False),
    "objective.rollout_correction.mode": R(
        "TRL returns the sampler's log-probs only from vLLM: a mode other than 'none' needs "
        "rollout.generator vllm (then vllm_importance_sampling_correction with "
        "vllm_importance_sampling_mode token|sequence_truncate (tis) or _mask (mis, icepop)); "
        "'none' sets vllm_importance_sampling_correction=false, TRL's default being on",
        lambda v, c: v != "none" and c.rollout.generator != "vllm", probe="tis"),
    "objective.rollout_correction.level": H("vllm_importance_sampling_mode token_* | "
                                            "sequence_*", probe="sequence"),
    "objective.rollout_correction.low": H("vllm_importance_sampling_clip_min", probe=0.5),
    "objective.rollout_correction.high": H("vllm_importance_sampling_clip_max", probe=3.0),
    "objective.rollout_correction.off_policy_mask_threshold": H(
        "off_policy_mask_threshold (against vLLM's log-probs with rollout.generator vllm, else "
        "TRL's old log-probs)", probe=0.5),
    "optim.lr": H("the rate of each RL step from gbmpo's schedule (GRPOConfig learning_rate)",
                  probe=1e-4, sets=_field("learning_rate")),
    "optim.warmup_steps": H("gbmpo's schedule, per RL step", probe=3),
    "optim.schedule": H("gbmpo's schedule, per RL step", probe="constant"),
    "optim.min_lr_ratio": H("gbmpo's schedule, per RL step", probe=0.1),
    "optim.weight_decay": H("weight_decay, on every parameter as the own engine (no bias / norm "
                            "exemption)", probe=0.01, sets=_field("weight_decay")),
    "optim.betas": H("adam_beta1, adam_beta2", probe=[0.8, 0.95],
                     sets={"adam_beta1": lambda v, c, lay: v[0],
                           "adam_beta2": lambda v, c, lay: v[1]}),
    "optim.eps": H("adam_epsilon", probe=1e-6, sets=_field("adam_epsilon")),
    "optim.grad_clip": H("max_grad_norm", probe=0.5,  # None: no clipping
                         sets={"max_grad_norm": lambda v, c, lay: v if v is not None else 0.0}),
    "optim.mu": H("num_iterations", probe=2, sets=_field("num_iterations")),
    "optim.mini_batch_size": H("per_device_train_batch_size x gradient_accumulation_steps x "
                               "processes", probe=8,
                               sets={"per_device_train_batch_size":
                                     lambda v, c, lay: lay.per_device,
                                     "gradient_accumulation_steps":
                                     lambda v, c, lay: lay.grad_accum}),
    "optim.micro_batch_size": R("gradient accumulation (same gradient up to float rounding): a "
                                "micro-batch that does not divide the per-process mini-batch "
                                "(optim.mini_batch_size / run.num_processes) is refused",
                                _uneven_micro, probe=3),
    "lora.enabled": H("peft_config (LoraConfig)", probe=True),
    "lora.r": H("LoraConfig r (with lora.enabled)", probe=4),
    "lora.alpha": H("LoraConfig lora_alpha (with lora.enabled)", probe=8),
    "lora.dropout": H("LoraConfig lora_dropout (with lora.enabled)", probe=0.1),
    "lora.target_modules": H("LoraConfig target_modules (with lora.enabled)", probe=["q_proj"]),
    "eval.every": H(f"{_TRL_EVAL}, every N RL steps (a TrainerCallback)", probe=2),
    "eval.split": H(_TRL_EVAL, probe="train"),
    "eval.limit": H(_TRL_EVAL, probe=8),
    "eval.auto_limit": H(f"{_TRL_EVAL} (the same held-out subset)", probe=100),
    "eval.max_new_tokens": H(_TRL_EVAL, probe=16),
    "eval.samples": H(f"{_TRL_EVAL} (pass@k curve, distinct_answers, token_entropy)", probe=4),
    "eval.batch_size": N(SPEED),
    "eval.before": H(_TRL_EVAL, probe=False),
    "eval.after": H(_TRL_EVAL, probe=False),
    "eval.drift": H("summary.json drift, with eval.after: measured as the own engine from the "
                    "final policy on the main process (gbmpo.eval.drift)", probe=False),
    "run.steps": H("max_steps = steps x optimizer steps per RL step", probe=3,
                   sets={"max_steps": lambda v, c, lay: v * lay.optimizer_steps}),
    "run.time_budget_seconds": H("a TrainerCallback stops after that much RL time; the "
                                 "schedule decays over it", probe=60.0),
    "run.seed": H("seed", probe=1, sets=_field("seed")),
    "run.output_dir": H("the run directory; TRL's output_dir is its checkpoints/",
                        probe="runs/probe"),
    "run.checkpoint_every": H("save_steps (TRL's checkpoints, which --resume continues from; "
                              "0: the final one only, as a stop by the time budget saves one)",
                              probe=5, sets={"save_steps": lambda v, c, lay:
                                             (v or c.run.steps) * lay.optimizer_steps}),
    "run.keep_checkpoints": H("save_total_limit", probe=2, sets=_field("save_total_limit")),
    "run.report_to": H("report_to", probe=["tensorboard"],
                        sets={"report_to": lambda v, c, lay: list(v) or "none"}),
    "run.num_threads": N(SPEED),
    "run.keep_freed_memory": N("the own engine's allocator setting; not applied by TRL"),
    "run.progress": N("display only"),
    "run.plugins": H("imported in every process", probe=["json"]),
    "run.allow_unsandboxed_code": H("the code sandbox of the reward function", probe=True),
    "run.num_processes": R("accelerate launch --num_processes; a count that does not divide "
                           "the mini-batch (optim.mini_batch_size, default the whole batch) is "
                           "refused: each process takes an equal share of every optimizer step",
                           _uneven_mini, probe=3),
    "run.num_nodes": R("engine trl runs on one machine (a multi-node accelerate configuration is "
                       "out of scope; engine verl runs on several)",
                       never_default("run.num_nodes"), probe=2),
}


#: the ``GRPOConfig`` fields no single key decides: the objective section itself
#: (``GBMPOConfig`` builds the spec once), one log row per RL step, and settings gbmpo fixes:
#: TRL's scheduler constant (gbmpo's schedule sets each RL step's rate, a callback), no fp16
#: (refused; ``model.dtype`` bfloat16 is ``bf16``), activation checkpointing under the name
#: transformers 5 reads (TRL's default: memory, no effect on results), checkpoints every
#: ``save_steps``, no progress bar, the dataset shuffled
FIXED: dict[str, Callable[..., Any]] = {
    "objective": lambda cfg, lay: cfg.objective,
    "logging_steps": lambda cfg, lay: lay.optimizer_steps,
    "lr_scheduler_type": lambda cfg, lay: "constant",
    "fp16": lambda cfg, lay: False,
    "activation_checkpointing": lambda cfg, lay: True,
    "disable_tqdm": lambda cfg, lay: True,
    "save_strategy": lambda cfg, lay: "steps",
    "shuffle_dataset": lambda cfg, lay: True,
}


def grpo_kwargs(cfg: Any, world: int) -> dict[str, Any]:
    """The ``GBMPOConfig`` keyword arguments of ``cfg`` on ``world`` processes (all but
    ``output_dir``): the fields of :data:`TRL`'s rows, then :data:`FIXED`. ``ConfigError`` for
    a batch TRL cannot split (:func:`batch_layout`)."""
    lay = batch_layout(cfg, world)
    return {**host_values(TRL, cfg, lay), **{name: f(cfg, lay) for name, f in FIXED.items()}}
