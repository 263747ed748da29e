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
:class:`gbmpo.config.ConfigError` for a refused value and returns the notices for
no-effect keys set to non-default values. :func:`gbmpo.config.validate` calls it, so every
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

from gbmpo.config.schema import TRAIN_ENGINES, ConfigError, TrainConfig

__all__ = [
    "ENGINES",
    "HONOURED",
    "NO_EFFECT",
    "REFUSED",
    "SUPPORT",
    "REQUIRED",
    "VERL_REQUIRED",
    "Support",
    "Together",
    "check_support",
    "config_keys",
    "probe_settings",
    "render_markdown",
]

HONOURED, REFUSED, NO_EFFECT = "honoured", "refused", "no_effect"
#: the engines, in the matrix's column order: the config's ``engine`` values (one tuple, also
#: the names of the engine registry :data:`gbmpo.engines.ENGINES`)
ENGINES: tuple[str, ...] = TRAIN_ENGINES


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


@dataclass(frozen=True)
class Together:
    """A probe that needs other keys set with it (``settings``: ``(key, value)`` pairs, the
    entry's own key among them), e.g. ``eval.after: false`` refused only with an ``eval.every``
    that misses the last step."""

    settings: tuple[tuple[str, Any], ...]


def probe_settings(key: str, probe: Any) -> list[tuple[str, Any]]:
    """The config settings of ``key``'s ``probe`` (:class:`Together`: its settings)."""
    return list(probe.settings) if isinstance(probe, Together) else [(key, probe)]


def H(how: str = "", probe: Any = None) -> Support:  # noqa: N802 - table shorthand
    return Support(HONOURED, how, probe=probe)


def R(why: str, refuse: Callable[[Any, Any], bool] | None = None, probe: Any = None) -> Support:  # noqa: N802
    return Support(REFUSED, why, refuse, probe)


def N(what: str) -> Support:  # noqa: N802
    return Support(NO_EFFECT, what)


#: a sum of two regularizers (ProbL2 + k3, the GBMPO authors' ``prob_l2kl``): the probe of the
#: list form of ``objective.regularizer``
_SUM_PROBE: list[dict[str, Any]] = [
    {"name": "prob_l2", "coef": 0.05},
    {"name": "kl_k3", "coef": 0.01},
]


def _any_full(value: Any) -> bool:
    """``estimator: full`` on the term, or on any term of a list."""
    return "full" in (value if isinstance(value, list) else [value])


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
    "rollout.generator": R("the own trainer samples with its own decoder or transformers' "
                           "generate (gbmpo | hf); vllm is engines trl's and verl's",
                           lambda v, c: v == "vllm", probe="vllm"),
    "rollout.lean_decoder": N(_SPEED),
    "rollout.decode_step": N(_SPEED),
    "rollout.share_prompts": N(_SPEED),
    "rollout.lean_forward": N(_SPEED),
    **{key: R("the own trainer has no vLLM (engine trl maps it to TRL's vLLM generation)",
              _never_default(key), probe=probe)
       for key, probe in (("rollout.vllm_mode", "server"),
                          ("rollout.vllm_gpu_memory_utilization", 0.5),
                          ("rollout.vllm_tensor_parallel_size", 2),
                          ("rollout.vllm_server_host", "10.0.0.2"),
                          ("rollout.vllm_server_port", 8001))},  # fmt: skip
    "objective.advantage": H(),
    "objective.surrogate.name": H(),
    "objective.surrogate.params": H(),
    "objective.regularizer": H("one term, or a list of terms whose divergences add up"),
    "objective.regularizer.name": H(),
    "objective.regularizer.coef": H(),
    "objective.regularizer.control": H(
        "coef moves after each step: coef *= 1 + clip(m / target - 1, -0.2, 0.2) / horizon, "
        "within [min, max] (Ziegler et al. 2019), m the step's reg/kl_k3 (measure kl) or "
        "reg/<name> (measure term) of the rollout; logged as drift_coef/<name> and "
        "drift_measure/<name>, saved in checkpoints"),
    "objective.regularizer.anchor": H(),
    "objective.regularizer.params": H(),
    "objective.regularizer.placement": H("reward: coef * sum_t D(pi_old || pi_ref) off each "
                                         "sequence's reward before the advantages; advantage: "
                                         "coef * sum_{s >= t} D_s(pi_old || pi_ref) off each "
                                         "token's advantage after the normalisation (FRPO)"),
    "objective.regularizer.estimator": H("full: the exact divergence over the vocabulary from "
                                         "the policy's and the reference's logits of each "
                                         "micro-batch (KL family, prob_l2, neural_mirror)"),
    "objective.aggregation": H(),
    "objective.monitor_regularizers": H("reg/<name> for every registered regularizer"),
    "objective.rollout_correction.mode": H(
        "weights from the trainer's old log-probs vs the sampler's (gbmpo | hf sampler, "
        "temperature / top-k / top-p applied): 1 up to float rounding unless top_p < 1, "
        "top_k > 0 or bf16 (gbmpo.train.correction)"),
    "objective.rollout_correction.level": H(),
    "objective.rollout_correction.low": H(),
    "objective.rollout_correction.high": H(),
    "objective.rollout_correction.off_policy_mask_threshold": H(
        "against the sampler's log-probs, per micro-batch with the current log-probs"),
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
    "eval.samples": H("N > 1: N samples per problem at rollout.temperature / top_p; pass@k "
                      "for k = 1, 2, 4, ..., N, distinct_answers, token_entropy"),
    "eval.batch_size": N(_SPEED),
    "eval.before": H(),
    "eval.after": H(),
    "eval.drift": H("summary.json drift, with eval.after (gbmpo.eval.drift)"),
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

# ------------------------------------------------------------ TRL (gbmpo.engines.trl_runner)

def _device_index(value: Any, cfg: Any) -> bool:
    """A CUDA device index other than 0 (``cuda:1``)."""
    head, _, index = str(value).partition(":")
    return head == "cuda" and index not in ("", "0")


def _trl_mini(cfg: Any) -> int:
    ro = cfg.rollout
    return int(cfg.optim.mini_batch_size or ro.prompts_per_step * ro.num_generations)


def _uneven_mini(value: Any, cfg: Any) -> bool:
    """A process count that cannot share the mini-batch equally."""
    return _trl_mini(cfg) % max(int(value), 1) != 0


def _uneven_micro(value: Any, cfg: Any) -> bool:
    """A micro-batch that does not divide the per-process share of the mini-batch."""
    world = max(int(cfg.run.num_processes), 1)
    if _trl_mini(cfg) % world:
        return False  # refused by optim.mini_batch_size
    share = _trl_mini(cfg) // world
    return share % min(value or share, share) != 0


def _without_vllm(key: str) -> Callable[[Any, Any], bool]:
    """A value other than the default while the generator is not vLLM (no effect there)."""
    return lambda value, cfg: cfg.rollout.generator != "vllm" and value != _default_of(key)


_TRL_PROMPTS = "the generation batch (prompts_per_step * num_generations = steps_per_generation"
_TRL_EVAL = "gbmpo.eval on the main process, as the own engine"
TRL: dict[str, Support] = {
    "engine": H("TRL's GRPOTrainer with GBMPOTrainer's loss"),
    "model.path": H("the policy, loaded as the own engine loads it (GRPOTrainer model=)",
                    probe="tiny-other"),
    "model.dtype": R("float16 training is refused (no loss scaling); bfloat16 trains fp32 "
                     "weights (the optimizer's masters) under bf16 autocast (GRPOConfig bf16)",
                     lambda v, c: v == "float16", probe="float16"),
    "model.device": R("cpu -> GRPOConfig use_cpu, cuda -> one GPU per process (accelerate); a "
                      "device index other than 0 is refused: select the GPU with "
                      "CUDA_VISIBLE_DEVICES and use model.device cuda", _device_index,
                      probe="cuda:1"),
    "model.trust_remote_code": H("load_model_and_tokenizer(trust_remote_code=) for the policy, "
                                 "GRPOConfig trust_remote_code for TRL's reference model",
                                 probe=True),
    "task.name": H("train_dataset (prompts rendered as the own engine) + the reward function",
                   probe="gsm8k"),
    "task.params": H("the task factory's keyword arguments", probe={"num_train": 100}),
    "task.train_split": H("the split train_dataset is built from", probe="test"),
    "task.template": H("the prompts' template", probe="base"),
    "rollout.prompts_per_step": H(f"{_TRL_PROMPTS} x micro-batch)", probe=4),
    "rollout.num_generations": H("num_generations", probe=4),
    "rollout.max_new_tokens": H("max_completion_length", probe=16),
    "rollout.temperature": H("temperature", probe=0.7),
    "rollout.top_p": H("top_p", probe=0.9),
    "rollout.top_k": H("top_k", probe=5),
    "rollout.batch_size": N("TRL generates each process's share of the batch at once"),
    "rollout.generator": H("gbmpo | hf -> TRL's transformers generation; vllm -> use_vllm",
                           probe="vllm"),
    "rollout.lean_decoder": N("the own engine's decoder; TRL generates with transformers"),
    "rollout.decode_step": N("the own engine's decoder; TRL generates with transformers"),
    "rollout.share_prompts": N("the own engine's forward; TRL runs its own"),
    "rollout.lean_forward": N("the own engine's forward; TRL runs its own"),
    **{key: R(f"{key.removeprefix('rollout.')} with rollout.generator vllm; without vLLM "
              "generation a value other than the default is refused (it would change nothing)",
              _without_vllm(key), probe=probe)
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
                               "GBMPOTrainer's loss", probe=_SUM_PROBE),
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
                  probe=1e-4),
    "optim.warmup_steps": H("gbmpo's schedule, per RL step", probe=3),
    "optim.schedule": H("gbmpo's schedule, per RL step", probe="constant"),
    "optim.min_lr_ratio": H("gbmpo's schedule, per RL step", probe=0.1),
    "optim.weight_decay": H("weight_decay, on every parameter as the own engine (no bias / norm "
                            "exemption)", probe=0.01),
    "optim.betas": H("adam_beta1, adam_beta2", probe=[0.8, 0.95]),
    "optim.eps": H("adam_epsilon", probe=1e-6),
    "optim.grad_clip": H("max_grad_norm", probe=0.5),
    "optim.mu": H("num_iterations", probe=2),
    "optim.mini_batch_size": H("per_device_train_batch_size x gradient_accumulation_steps x "
                               "processes", probe=8),
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
    "eval.batch_size": N(_SPEED),
    "eval.before": H(_TRL_EVAL, probe=False),
    "eval.after": H(_TRL_EVAL, probe=False),
    "eval.drift": H("summary.json drift, with eval.after: measured as the own engine from the "
                    "final policy on the main process (gbmpo.eval.drift)", probe=False),
    "run.steps": H("max_steps = steps x optimizer steps per RL step", probe=3),
    "run.time_budget_seconds": H("a TrainerCallback stops after that much RL time; the "
                                 "schedule decays over it", probe=60.0),
    "run.seed": H("seed", probe=1),
    "run.output_dir": H("the run directory; TRL's output_dir is its checkpoints/",
                        probe="runs/probe"),
    "run.checkpoint_every": H("save_steps (TRL's checkpoints, which --resume continues from; "
                              "0: the final one only, as a stop by the time budget saves one)",
                              probe=5),
    "run.keep_checkpoints": H("save_total_limit", probe=2),
    "run.report_to": H("report_to", probe=["tensorboard"]),
    "run.num_threads": N(_SPEED),
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
                       _never_default("run.num_nodes"), probe=2),
}

# ----------------------------------------------------------- verl (gbmpo.engines.verl_runner)

#: the values verl needs where the own engine's defaults are refused on verl: none, the default
#: config runs on verl as it is (on GPUs; ``model.device: cpu`` on a machine without one)
VERL_REQUIRED: dict[str, Any] = {}

VERL: dict[str, Support] = dict(GBMPO)  # every key is set below (engines/verl_args.py)
_A = "actor_rollout_ref.actor"


def _verl_refuses_control(value: Any, cfg: Any) -> bool:
    """A controlled coefficient anywhere but on one in-reward term."""
    terms = cfg.objective.terms
    if not any(t.control is not None for t in terms):
        return False
    return len(terms) > 1 or terms[0].placement != "reward"


def _verl_refuses_terms(value: Any, cfg: Any) -> bool:
    """A list with an active in-reward term, or one in-reward term with parameters (verl's
    driver computes the in-reward KL and receives no gbmpo_kl parameters)."""
    if isinstance(value, list):
        return any(t.placement == "reward" and t.coef != 0 and t.name != "none" for t in value)
    return bool(value.placement == "reward" and value.coef != 0 and value.params)


def _verl_refuses_correction(value: Any, cfg: Any) -> bool:
    """verl's TIS is a cap only; its masked IS ("low_high") needs both bounds."""
    low = cfg.objective.rollout_correction.low
    return (value == "tis" and low is not None) or (value == "mis" and low is None)


def _verl_refuses_old_anchor(value: Any, cfg: Any) -> bool:
    """An active term anchored at 'old' whose regularizer is not an rpg_* one."""
    return any(t.anchor == "old" and t.coef != 0 and t.name != "none"
               and not t.name.startswith("rpg_") for t in cfg.objective.terms)  # fmt: skip


def _verl_refuses_device(value: Any, cfg: Any) -> bool:
    """Anything but 'cuda' and 'cpu'; 'cpu' with LoRA or more than one process or node."""
    if value == "cpu":
        return bool(cfg.lora.enabled or cfg.run.num_processes != 1 or cfg.run.num_nodes != 1)
    return value != "cuda"


_VERL_SAMPLER = ("verl samples with vLLM (on the CPU with gbmpo's hf rollout) whatever the "
                 "value (the same sampling distribution)")
VERL.update({
    "engine": H("verl's main_ppo with the gbmpo plugin"),
    "model.path": H("actor_rollout_ref.model.path", probe="some/other-model"),
    "model.dtype": R("float16 training is refused (no loss scaling); float32: FSDP "
                     "mixed_precision fp32 and vLLM float32; bfloat16: fp32 master weights "
                     "(FSDP model_dtype fp32) with bf16 compute and bf16 vLLM",
                     lambda v, c: v == "float16", probe="float16"),
    "model.device": R("'cuda': verl places its workers on every GPU of each node through Ray "
                      "(run.num_processes per node; choose the GPUs with CUDA_VISIBLE_DEVICES); "
                      "'cpu': one process, verl's trainer with gbmpo's CPU platform and "
                      "transformers rollout (gbmpo.integrations.verl_cpu, verl 0.9.1 only), "
                      "refused with lora.enabled (the CPU rollout takes full weights) and with "
                      "run.num_processes or run.num_nodes above 1; other devices are refused",
                      _verl_refuses_device, probe="cuda:1"),
    "model.trust_remote_code": H("actor_rollout_ref.model.trust_remote_code, "
                                 "data.trust_remote_code", probe=True),
    "task.name": H("data/train.parquet, data/test.parquet and the reward function"),
    "task.params": H("data files and reward function"),
    "task.train_split": H("data/train.parquet"),
    "task.template": H("prompts rendered by gbmpo, verl's chat template a pass-through"),
    "rollout.prompts_per_step": H("data.train_batch_size", probe=4),
    "rollout.num_generations": H("actor_rollout_ref.rollout.n", probe=4),
    "rollout.max_new_tokens": H("data.max_response_length, rollout.response_length", probe=64),
    "rollout.temperature": H("actor_rollout_ref.rollout.temperature", probe=0.7),
    "rollout.top_p": H("actor_rollout_ref.rollout.top_p", probe=0.9),
    "rollout.top_k": H("actor_rollout_ref.rollout.top_k (0 -> -1)", probe=20),
    "rollout.batch_size": N("vLLM batches the requests itself (the CPU rollout samples one "
                            "completion at a time)"),
    "rollout.generator": N(_VERL_SAMPLER),
    "rollout.lean_decoder": N("the own engine's decoder; " + _VERL_SAMPLER),
    "rollout.decode_step": N("the own engine's decoder; " + _VERL_SAMPLER),
    "rollout.share_prompts": N("the own engine's log-prob forwards; verl has its own"),
    "rollout.lean_forward": N("the own engine's log-prob forwards; verl has its own"),
    "objective.advantage": R("verl's grpo estimator has no batch-std scaling: 'batch' is "
                             "refused", lambda v, c: v == "batch", probe="batch"),
    "objective.surrogate.name": H(f"{_A}.policy_loss.loss_mode=gbmpo_<name>", probe="gspo"),
    "objective.surrogate.params": H(f"{_A}.policy_loss.gbmpo_objective (the spec, built "
                                    "by the plugin into the own engine's objective)",
                                    probe={"eps_low": 0.1}),
    "objective.regularizer": R(
        f"a list of terms: one KL loss {_A}.kl_loss_type=gbmpo_sum (kl_loss_coef 1) summing "
        "coef * D per term of the built objective with its own anchor and params; with "
        "placement reward verl's driver "
        "computes its one in-reward KL and receives no gbmpo_kl parameters, so a term with "
        "params, or any in-reward term in a list, is refused",
        _verl_refuses_terms,
        probe=[{"name": "prob_l2", "coef": 0.05},
               {"name": "kl_k3", "coef": 0.01, "placement": "reward"}]),
    "objective.regularizer.name": H(f"{_A}.kl_loss_type=gbmpo_<name> (placement reward: "
                                    "algorithm.kl_penalty=gbmpo_<name>)", probe="kl_k3"),
    "objective.regularizer.coef": H(f"{_A}.kl_loss_coef (placement reward: "
                                    "algorithm.kl_ctrl.kl_coef, kl_ctrl.type fixed)", probe=0.5),
    "objective.regularizer.control": R(
        "honoured for one term with placement: reward: gbmpo's driver hooks put the controller "
        "in place of verl's kl_ctrl_in_reward (the same measure, update and bounds as the other "
        "engines; verl's adaptive controller tracks a mean of per-sequence means without bounds), "
        "and keep its value beside verl's checkpoints (gbmpo_drift_state.json); refused for a "
        "term in the loss (verl's kl_loss_coef is fixed in the actor workers) and in a list",
        _verl_refuses_control, probe={"target": 0.02}),
    "objective.regularizer.anchor": R(
        "verl's KL loss is anchored at the reference model; anchor 'old' is offered there for "
        "the rpg_* regularizers only",
        _verl_refuses_old_anchor, probe="old"),
    "objective.regularizer.params": H(f"{_A}.policy_loss.gbmpo_objective (the spec)"),
    "objective.regularizer.placement": R(
        "reward: algorithm.use_kl_in_reward=true with algorithm.kl_penalty=gbmpo_<name> and a "
        f"fixed kl_ctrl ({_A}.use_kl_loss=false); 'advantage' is refused: verl's driver "
        "computes the advantages and has no hook for a per-token penalty after the "
        "normalisation (engine gbmpo takes it)",
        lambda v, c: "advantage" in (v if isinstance(v, list) else [v]), probe="advantage"),
    "objective.regularizer.estimator": R(
        "verl's KL loss and in-reward KL are computed from per-token log-probs (its reference "
        "worker returns log-probs, not logits), and the exact divergence needs the reference's "
        "logits inside the actor's loss; with LoRA the reference is the actor with its adapter "
        "off, which verl's loss function does not reach (not wired in gbmpo's plugin): 'full' "
        "is refused (engine gbmpo takes it)",
        lambda v, c: _any_full(v), probe="full"),
    "objective.aggregation": H(f"{_A}.loss_agg_mode (dr_grpo: loss_scale_factor)",
                               probe="bnpo"),
    "objective.monitor_regularizers": H(
        "reg/<name> = D(pi_old || pi_ref) for every registered regularizer (false: the "
        "optimised ones), the token mean over the step's batch from the old and reference "
        "log-probs verl's driver holds (gbmpo.integrations.verl_driver); with no active term "
        f"a KL loss of coefficient 0 ({_A}.use_kl_loss, kl_loss_coef 0) makes verl compute the "
        "reference's log-probs", probe=False),
    "objective.rollout_correction.mode": R(
        "algorithm.rollout_correction.rollout_is (null for 'none'), rollout_is_threshold: "
        "verl's truncated IS has no lower bound ('tis' with low is refused) and its masked IS "
        "needs both bounds ('mis' without low is refused)", _verl_refuses_correction,
        probe="mis"),
    "objective.rollout_correction.level": H("algorithm.rollout_correction.rollout_is",
                                            probe="sequence"),
    "objective.rollout_correction.low": H("algorithm.rollout_correction.rollout_is_threshold "
                                          "'low_high' (mis, icepop)", probe=0.25),
    "objective.rollout_correction.high": H("algorithm.rollout_correction.rollout_is_threshold",
                                           probe=3.0),
    "objective.rollout_correction.off_policy_mask_threshold": R(
        "verl 0.9.1 has no advantage-conditioned off-policy sequence mask (its rollout_rs "
        "rejects sequences whatever their advantage): engines gbmpo and trl take it",
        lambda v, c: v is not None, probe=0.5),
    "optim.lr": H(f"{_A}.optim.lr", probe=1e-4),
    "optim.warmup_steps": R(f"{_A}.optim.lr_warmup_steps, the own engine's (s+1)/w warm-up "
                            "(constant: verl's cosine with min_lr_ratio 1 and zero_indexed_step "
                            "false); with schedule cosine refused: verl's cosine gives either "
                            "the own warm-up or the own decay, not both",
                            lambda v, c: bool(v) and c.optim.schedule == "cosine",
                            probe=Together((("optim.schedule", "cosine"),
                                            ("optim.warmup_steps", 5)))),
    "optim.schedule": H(f"{_A}.optim.lr_scheduler_type=cosine (constant: min_lr_ratio 1)",
                        probe="constant"),
    "optim.min_lr_ratio": H(f"{_A}.optim.min_lr_ratio (schedule cosine)", probe=0.1),
    "optim.weight_decay": H(f"{_A}.optim.weight_decay", probe=0.1),
    "optim.betas": H(f"{_A}.optim.betas", probe=(0.9, 0.999)),
    "optim.eps": H(f"{_A}.optim.override_optimizer_config.eps", probe=1e-6),
    "optim.grad_clip": H(f"{_A}.optim.clip_grad (null: 1e9)", probe=0.5),
    "optim.mu": H(f"{_A}.ppo_epochs", probe=2),
    "optim.mini_batch_size": R(f"{_A}.ppo_mini_batch_size (in prompts), rows shuffled "
                               f"({_A}.shuffle); verl counts mini-batches in prompts, so a "
                               "mini-batch (null: the whole batch) that is not a multiple of "
                               "rollout.num_generations is refused. The metric entropy is the "
                               "token mean at pi_old over the whole batch, whatever the "
                               "aggregation (the own engine and TRL: over the first epoch's "
                               "mini-batches as the policy updates, the same value with one "
                               "mini-batch)",
                               lambda v, c: bool((v or c.rollout.prompts_per_step
                                                  * c.rollout.num_generations)
                                                 % c.rollout.num_generations),
                               probe=Together((("rollout.num_generations", 8),
                                               ("optim.mini_batch_size", 12)))),
    "optim.micro_batch_size": H(f"{_A}.ppo_micro_batch_size_per_gpu (null: dynamic batch "
                                "sizes); the same gradient up to float rounding", probe=4),
    "lora.enabled": H("actor_rollout_ref.model.lora_rank > 0", probe=True),
    "lora.r": H("actor_rollout_ref.model.lora_rank"),
    "lora.alpha": H("actor_rollout_ref.model.lora_alpha"),
    "lora.dropout": R("verl's FSDP LoRA (peft) has no dropout setting: only 0.0",
                      lambda v, c: v != 0.0, probe=0.05),
    "lora.target_modules": H("actor_rollout_ref.model.target_modules"),
    "eval.every": H("trainer.test_freq (verl also validates at the last step)", probe=10),
    "eval.split": H("data/test.parquet"),
    "eval.limit": H("data/test.parquet holds the first eval.limit examples"),
    "eval.auto_limit": H("data/test.parquet holds the examples the own engine evaluates"),
    "eval.max_new_tokens": R("verl validates with the rollout length: eval.max_new_tokens must "
                             "equal rollout.max_new_tokens",
                             lambda v, c: v != c.rollout.max_new_tokens, probe=41),
    "eval.samples": R("verl validates one greedy sample per problem: eval.samples must be 1 "
                      "(measure pass@k of the merged model with gbmpo eval --samples N)",
                      lambda v, c: v != 1, probe=4),
    "eval.batch_size": N("verl sends the whole validation set to vLLM at once"),
    "eval.before": H("trainer.val_before_train", probe=False),
    "eval.after": R("trainer.test_freq includes the last step (eval.every 0: test_freq = "
                    "run.steps); verl validates at the last step whenever it validates "
                    "periodically, so eval.after false is refused where eval.every does not "
                    "divide run.steps",
                    lambda v, c: bool(not v and c.eval.every and c.run.steps % c.eval.every),
                    probe=Together((("eval.every", 7), ("run.steps", 30),
                                    ("eval.after", False)))),
    "eval.drift": H("summary.json drift, with eval.after: verl's final checkpoint merged into a "
                    "Hugging Face model in model/ (verl.model_merger, then summary.json "
                    "final_model), measured as on the own engine (gbmpo.eval.drift)"),
    "run.steps": H("trainer.total_training_steps", probe=7),
    "run.time_budget_seconds": H(
        "gbmpo's driver hooks (gbmpo.integrations.verl_driver) make the step in which the RL "
        "time (verl's step timer, validation excluded) reaches the budget verl's last: its "
        "final checkpoint and validation (with eval.every > 0 that step validates even with "
        "eval.after false), summary.json stop_reason time_budget. verl's LR "
        "schedule is fixed when it starts and spans run.steps: with optim.schedule cosine a run "
        "the budget stops ends before the decay does (the own engine and TRL decay over "
        "whichever limit comes first)"),
    "run.seed": H("data.seed, actor data_loader_seed, rollout.seed, fsdp_config.seed",
                  probe=1),
    "run.output_dir": H("the run directory: data, trainer.default_local_dir, metrics"),
    "run.checkpoint_every": H("trainer.save_freq (0: run.steps, the final one only)", probe=5),
    "run.keep_checkpoints": H("trainer.max_actor_ckpt_to_keep", probe=3),
    "run.report_to": H("trainer.logger", probe=["tensorboard"]),
    "run.num_threads": N("the own engine's torch threads; verl's workers set their own"),
    "run.keep_freed_memory": N("the own engine's allocator setting"),
    "run.progress": N("display only"),
    "run.plugins": H("imported in verl's processes (VERL_USE_EXTERNAL_MODULES)"),
    "run.allow_unsandboxed_code": H("the reward function's sandbox check"),
    "run.num_processes": H("trainer.n_gpus_per_node", probe=2),
    "run.num_nodes": H("trainer.nnodes", probe=2),
    # placeholders until the verl engine's owner maps them (verl's rollout settings)
    **{key: R("not mapped to verl's vLLM rollout yet", _never_default(key), probe=probe)
       for key, probe in (("rollout.vllm_mode", "server"),
                          ("rollout.vllm_gpu_memory_utilization", 0.5),
                          ("rollout.vllm_tensor_parallel_size", 2),
                          ("rollout.vllm_server_host", "10.0.0.2"),
                          ("rollout.vllm_server_port", 8001))},  # fmt: skip
})

#: engine -> key -> :class:`Support` (the tables in the order of :data:`ENGINES`)
SUPPORT: dict[str, dict[str, Support]] = dict(zip(ENGINES, (GBMPO, TRL, VERL), strict=True))

#: engine -> the values it needs where the own engine's defaults are refused (a config for that
#: engine starts from these; tests check every other key from there)
REQUIRED: dict[str, dict[str, Any]] = {"gbmpo": {}, "trl": {}, "verl": VERL_REQUIRED}


# ------------------------------------------------------------------- applying the matrix


def config_keys() -> list[str]:
    """Every dotted key of :class:`gbmpo.config.TrainConfig` (free ``params`` dicts are
    one key each)."""
    def walk(cls: type, prefix: str) -> Iterator[str]:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            key = f"{prefix}{f.name}"
            sections = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
            if sections:  # a section or a list of sections (objective.regularizer): the list
                yield key  # form is a key of its own, then the section's keys
                yield from walk(typing.cast(type, sections[0]), key + ".")
            elif dataclasses.is_dataclass(tp):
                yield from walk(typing.cast(type, tp), key + ".")
            else:
                yield key

    return list(walk(TrainConfig, ""))


def _value_at(cfg: Any, key: str) -> Any:
    """The value at ``key``; below a list of sections (regularizer terms), the list of the
    terms' values."""
    node = cfg
    for part in key.split("."):
        if isinstance(node, list):
            node = [getattr(item, part) for item in node]
        else:
            node = getattr(node, part)
    return node


def _listed(value: Any, cfg: Any) -> bool:
    """Whether ``objective.regularizer`` is a list of terms."""
    return isinstance(value, list)


def _default_of(key: str) -> Any:
    return _value_at(TrainConfig(), key)


def check_support(cfg: Any, engine: str | None = None) -> list[str]:
    """Refuse (``ConfigError``, exit 2) a value ``engine`` (default ``cfg.engine``) cannot honour;
    return one notice per no-effect key set to a non-default value."""
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
    notices.extend(placement_notes(cfg))
    return notices


#: advantages divided by a standard deviation (``placement: reward`` is then rescaled)
STD_NORMALISED: tuple[str, ...] = ("grpo", "batch")


def placement_notes(cfg: Any) -> list[str]:
    """One note when a term is placed in the reward and the advantage divides by a standard
    deviation: the penalty then reaches the gradient as beta / sigma_g (each group's std), so
    it is the exact KL-regularised gradient only with ``dr_grpo`` (Dr. GRPO)."""
    placed = [t.name for t in cfg.objective.terms
              if t.placement == "reward" and t.name != "none" and t.coef != 0]  # fmt: skip
    if not placed or cfg.objective.advantage not in STD_NORMALISED:
        return []
    return [
        f"objective.regularizer.placement=reward ({', '.join(placed)}) with objective.advantage="
        f"{cfg.objective.advantage}: the penalty is subtracted before the advantages are divided "
        "by the std, so beta is divided by each group's std (exact only with advantage: "
        "dr_grpo, Dr. GRPO); placement: advantage adds it after the normalisation (FRPO)"
    ]


def _cell_text(text: str) -> str:
    """Table-cell Markdown: ``|`` escaped; outside code spans ``<``/``>`` written as entities
    (so that ``reg/<name>`` is not read as an HTML tag) and ``_``/``*`` escaped (so that
    ``CUDA_VISIBLE_DEVICES`` is not read as emphasis)."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):  # even parts lie outside code spans
        parts[i] = (parts[i].replace("<", "&lt;").replace(">", "&gt;")
                    .replace("_", "\\_").replace("*", "\\*"))
    return "`".join(parts).replace("|", "\\|")


def _label(e: Support) -> str:
    """What happens, in words: a refusal with a ``refuse`` test refuses only some values."""
    if e.status == HONOURED:
        head = "honoured"
    elif e.status == NO_EFFECT:
        head = "no effect"
    elif e.refuse is None:
        head = "**only the default**"
    else:
        head = "honoured, **some values refused**"
    return head + (f": {_cell_text(e.how)}" if e.how else "")


def render_markdown() -> str:
    """The matrix as Markdown: one table per top-level section of the config (its heading
    anchored ``support-SECTION``), one row per key and engine, a key whose three entries are
    alike on one row ("all engines")."""
    sections: dict[str, list[str]] = {}
    for key in config_keys():
        sections.setdefault(key.split(".", 1)[0], []).append(key)
    out: list[str] = []
    for section, keys in sections.items():
        out += [f"### `{section}` {{#support-{section}}}", "",
                "| key | engine | what happens |", "|---|---|---|"]  # fmt: skip
        for key in keys:
            entries = [SUPPORT[engine][key] for engine in ENGINES]
            # a key breaks only after a dot (docs/stylesheets/extra.css: .config-key)
            shown = f'<code class="config-key">{key.replace(".", ".<wbr>")}</code>'
            if all((e.status, e.how) == (entries[0].status, entries[0].how) for e in entries):
                out.append(f"| {shown} | all engines | {_label(entries[0])} |")
                continue
            for engine, e in zip(ENGINES, entries, strict=True):
                out.append(f"| {shown} | {engine} | {_label(e)} |")
                shown = ""
        out.append("")
    return "\n".join(out)
