"""The own engine's column of the support matrix (``engine: gbmpo``, :mod:`gbmpo.train`): every
config key -> :class:`gbmpo.config.matrix.Support`."""

from __future__ import annotations

from typing import Any

from gbmpo.config.matrix import H, N, R, Support, never_default

__all__ = ["GBMPO", "SPEED", "SUM_PROBE"]

#: a sum of two regularizers (ProbL2 + k3, the GBMPO authors' ``prob_l2kl``): the probe of the
#: list form of ``objective.regularizer``
SUM_PROBE: list[dict[str, Any]] = [
    {"name": "prob_l2", "coef": 0.05},
    {"name": "kl_k3", "coef": 0.01},
]



SPEED = "speed only: same results up to float rounding"

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
    "rollout.batch_size": N(SPEED),
    "rollout.generator": R("the own trainer samples with its own decoder or transformers' "
                           "generate (gbmpo | hf); vllm is engines trl's and verl's",
                           lambda v, c: v == "vllm", probe="vllm"),
    "rollout.lean_decoder": N(SPEED),
    "rollout.decode_step": N(SPEED),
    "rollout.decode_buffers": N("memory and speed only: the same tokens"),
    "rollout.share_prompts": N(SPEED),
    "rollout.lean_forward": N(SPEED),
    **{key: R("the own trainer has no vLLM (engine trl maps it to TRL's vLLM generation)",
              never_default(key), probe=probe)
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
    "eval.batch_size": N(SPEED),
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
    "run.num_threads": N(SPEED),
    "run.keep_freed_memory": N(SPEED),
    "run.progress": H("the progress display"),
    "run.plugins": H(),
    "run.allow_unsandboxed_code": H(),
    "run.num_processes": R("the own trainer runs one process; engines trl and verl run "
                           "several", never_default("run.num_processes"), probe=2),
    "run.num_nodes": R("the own trainer runs on one machine; engine verl runs on several",
                       never_default("run.num_nodes"), probe=2),
}

