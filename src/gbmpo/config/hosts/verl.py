"""verl's table (``engine: verl``, :mod:`gbmpo.engines.verl`): every config key -> its
:class:`~gbmpo.config.matrix.Support` on verl, whose ``sets`` are the Hydra overrides of
``verl.trainer.main_ppo`` the key decides (override name -> its text). From this one table come
verl's column of the support matrix, the refusals ``gbmpo train --engine verl`` applies before
writing anything, and those overrides (:func:`override_values`;
:func:`gbmpo.engines.verl.args.overrides` adds the ones no single key decides: the data files,
the schedule, precision, the objective, LoRA, the evaluation schedule, the CPU run). The verl
names of the aggregation and the advantage (:data:`VERL_LOSS_AGG_MODES`,
:data:`VERL_ADV_ESTIMATORS`) are here too.
"""

from __future__ import annotations

from typing import Any

from gbmpo.config.hosts.own import GBMPO
from gbmpo.config.matrix import H, N, R, Support, Together, any_full, host_values, never_default

__all__ = ["VERL", "VERL_ADV_ESTIMATORS", "VERL_LOSS_AGG_MODES", "VERL_REQUIRED", "hydra_value",
           "mini_batch", "override_values", "uneven_mini"]

#: gbmpo aggregation -> verl ``actor.loss_agg_mode`` (``dr_grpo`` is verl's
#: ``seq-mean-token-sum-norm`` with ``loss_scale_factor`` = the maximal completion length).
VERL_LOSS_AGG_MODES: dict[str, str] = {
    "grpo": "seq-mean-token-mean",
    "bnpo": "token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
    "seq_mean_token_sum": "seq-mean-token-sum",
}
#: gbmpo advantage -> verl ``(algorithm.adv_estimator, algorithm.norm_adv_by_std_in_grpo)``;
#: ``batch`` (group mean, batch std) has no verl counterpart.
VERL_ADV_ESTIMATORS: dict[str, tuple[str, bool]] = {
    "grpo": ("grpo", True),
    "dr_grpo": ("grpo", False),
    "rpg": ("grpo", False),
}

#: the values verl needs where the own engine's defaults are refused on verl: none, the default
#: config runs on verl as it is (on GPUs; ``model.device: cpu`` on a machine without one)
VERL_REQUIRED: dict[str, Any] = {}

def hydra_value(v: Any) -> str:
    """A Python value as a Hydra command-line override value (strings quoted)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(hydra_value(x) for x in v) + "]"
    text = str(v)
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _text(value: Any, cfg: Any) -> str:
    return str(value)


def _repr(value: Any, cfg: Any) -> str:
    return repr(value)


def _hydra(value: Any, cfg: Any) -> str:
    return hydra_value(value)


def mini_batch(cfg: Any) -> int:
    """The mini-batch in sequences (``optim.mini_batch_size``; null: the whole batch)."""
    ro = cfg.rollout
    return int(cfg.optim.mini_batch_size or ro.prompts_per_step * ro.num_generations)


def uneven_mini(value: Any, cfg: Any) -> bool:
    """A mini-batch that is not a whole number of prompts' groups (verl's
    ``ppo_mini_batch_size`` counts prompts)."""
    return mini_batch(cfg) % cfg.rollout.num_generations != 0


def _mini_in_prompts(value: Any, cfg: Any) -> str:
    """verl's ``ppo_mini_batch_size``: the mini-batch over ``rollout.num_generations``."""
    return str(mini_batch(cfg) // cfg.rollout.num_generations)



VERL: dict[str, Support] = dict(GBMPO)  # every key is set below (engines/verl/args.py)
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
                      "transformers rollout (gbmpo.engines.verl.cpu, verl 0.9.1 only), "
                      "refused with lora.enabled (the CPU rollout takes full weights) and with "
                      "run.num_processes or run.num_nodes above 1; other devices are refused",
                      _verl_refuses_device, probe="cuda:1"),
    "model.trust_remote_code": H("actor_rollout_ref.model.trust_remote_code, "
                                 "data.trust_remote_code", probe=True,
                                 sets={"data.trust_remote_code": _hydra,
                                       "actor_rollout_ref.model.trust_remote_code": _hydra}),
    "task.name": H("data/train.parquet, data/test.parquet and the reward function"),
    "task.params": H("data files and reward function"),
    "task.train_split": H("data/train.parquet"),
    "task.template": H("prompts rendered by gbmpo, verl's chat template a pass-through"),
    "rollout.prompts_per_step": H("data.train_batch_size", probe=4,
                                  sets={"data.train_batch_size": _text}),
    "rollout.num_generations": H("actor_rollout_ref.rollout.n", probe=4,
                                 sets={"actor_rollout_ref.rollout.n": _text}),
    "rollout.max_new_tokens": H("data.max_response_length, rollout.response_length", probe=64,
                                sets={"data.max_response_length": _text,
                                      "actor_rollout_ref.rollout.response_length": _text}),
    "rollout.temperature": H("actor_rollout_ref.rollout.temperature", probe=0.7,
                             sets={"actor_rollout_ref.rollout.temperature": _repr}),
    "rollout.top_p": H("actor_rollout_ref.rollout.top_p", probe=0.9,
                       sets={"actor_rollout_ref.rollout.top_p": _repr}),
    "rollout.top_k": H("actor_rollout_ref.rollout.top_k (0 -> -1)", probe=20,
                       sets={"actor_rollout_ref.rollout.top_k": lambda v, c: str(v if v else -1)}),
    "rollout.batch_size": N("vLLM batches the requests itself (the CPU rollout samples one "
                            "completion at a time)"),
    "rollout.generator": N(_VERL_SAMPLER),
    "rollout.lean_decoder": N("the own engine's decoder; " + _VERL_SAMPLER),
    "rollout.decode_step": N("the own engine's decoder; " + _VERL_SAMPLER),
    "rollout.decode_buffers": N("the own engine's decoder; " + _VERL_SAMPLER),
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
        lambda v, c: any_full(v), probe="full"),
    "objective.aggregation": H(f"{_A}.loss_agg_mode (dr_grpo: loss_scale_factor)",
                               probe="bnpo"),
    "objective.monitor_regularizers": H(
        "reg/<name> = D(pi_old || pi_ref) for every registered regularizer (false: the "
        "optimised ones), the token mean over the step's batch from the old and reference "
        "log-probs verl's driver holds (gbmpo.engines.verl.driver); with no active term "
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
    "optim.lr": H(f"{_A}.optim.lr", probe=1e-4, sets={f"{_A}.optim.lr": _repr}),
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
    "optim.weight_decay": H(f"{_A}.optim.weight_decay", probe=0.1,
                            sets={f"{_A}.optim.weight_decay": _repr}),
    "optim.betas": H(f"{_A}.optim.betas", probe=(0.9, 0.999),
                     sets={f"{_A}.optim.betas": lambda v, c: hydra_value(list(v))}),
    "optim.eps": H(f"{_A}.optim.override_optimizer_config.eps", probe=1e-6,
                   sets={f"{_A}.optim.override_optimizer_config": lambda v, c: f"{{eps:{v!r}}}"}),
    "optim.grad_clip": H(f"{_A}.optim.clip_grad (null: 1e9)", probe=0.5,
                         sets={f"{_A}.optim.clip_grad":
                               lambda v, c: repr(v if v is not None else 1e9)}),
    "optim.mu": H(f"{_A}.ppo_epochs", probe=2, sets={f"{_A}.ppo_epochs": _text}),
    "optim.mini_batch_size": R(f"{_A}.ppo_mini_batch_size (in prompts), rows shuffled "
                               f"({_A}.shuffle); verl counts mini-batches in prompts, so a "
                               "mini-batch (null: the whole batch) that is not a multiple of "
                               "rollout.num_generations is refused. The metric entropy is the "
                               "token mean at pi_old over the whole batch, whatever the "
                               "aggregation (the own engine and TRL: over the first epoch's "
                               "mini-batches as the policy updates, the same value with one "
                               "mini-batch)",
                               uneven_mini,
                               probe=Together((("rollout.num_generations", 8),
                                               ("optim.mini_batch_size", 12))),
                               sets={f"{_A}.ppo_mini_batch_size": _mini_in_prompts}),
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
    "eval.before": H("trainer.val_before_train", probe=False,
                       sets={"trainer.val_before_train": _hydra}),
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
    "run.steps": H("trainer.total_training_steps", probe=7,
                    sets={"trainer.total_training_steps": _text}),
    "run.time_budget_seconds": H(
        "gbmpo's driver hooks (gbmpo.engines.verl.driver) make the step in which the RL "
        "time (verl's step timer, validation excluded) reaches the budget verl's last: its "
        "final checkpoint and validation (with eval.every > 0 that step validates even with "
        "eval.after false), summary.json stop_reason time_budget. verl's LR "
        "schedule is fixed when it starts and spans run.steps: with optim.schedule cosine a run "
        "the budget stops ends before the decay does (the own engine and TRL decay over "
        "whichever limit comes first)"),
    "run.seed": H("data.seed, actor data_loader_seed, rollout.seed, fsdp_config.seed",
                  probe=1,  # the data order, the mini-batch order, vLLM's sampling, FSDP's seeding
                  sets=dict.fromkeys(("data.seed", f"{_A}.data_loader_seed",
                                      "actor_rollout_ref.rollout.seed", f"{_A}.fsdp_config.seed",
                                      "actor_rollout_ref.ref.fsdp_config.seed"), _text)),
    "run.output_dir": H("the run directory: data, trainer.default_local_dir, metrics"),
    "run.checkpoint_every": H("trainer.save_freq (0: run.steps, the final one only)", probe=5,
                              sets={"trainer.save_freq": lambda v, c: str(v or c.run.steps)}),
    "run.keep_checkpoints": H("trainer.max_actor_ckpt_to_keep", probe=3,
                              sets={"trainer.max_actor_ckpt_to_keep": _text}),
    "run.report_to": H("trainer.logger", probe=["tensorboard"],
                       sets={"trainer.logger":
                             lambda v, c: hydra_value(["console", "file", *v])}),
    "run.num_threads": N("the own engine's torch threads; verl's workers set their own"),
    "run.keep_freed_memory": N("the own engine's allocator setting"),
    "run.progress": N("display only"),
    "run.plugins": H("imported in verl's processes (VERL_USE_EXTERNAL_MODULES)"),
    "run.allow_unsandboxed_code": H("the reward function's sandbox check"),
    "run.num_processes": H("trainer.n_gpus_per_node", probe=2,
                           sets={"trainer.n_gpus_per_node": _text}),
    "run.num_nodes": H("trainer.nnodes", probe=2, sets={"trainer.nnodes": _text}),
    # placeholders until the verl engine's owner maps them (verl's rollout settings)
    **{key: R("not mapped to verl's vLLM rollout yet", never_default(key), probe=probe)
       for key, probe in (("rollout.vllm_mode", "server"),
                          ("rollout.vllm_gpu_memory_utilization", 0.5),
                          ("rollout.vllm_tensor_parallel_size", 2),
                          ("rollout.vllm_server_host", "10.0.0.2"),
                          ("rollout.vllm_server_port", 8001))},  # fmt: skip
})


def override_values(cfg: Any) -> list[str]:
    """The Hydra overrides :data:`VERL`'s rows set for ``cfg`` (``name=value``, the table's
    order); :func:`gbmpo.engines.verl.args.overrides` adds those no single key decides."""
    return [f"{name}={text}" for name, text in host_values(VERL, cfg).items()]
