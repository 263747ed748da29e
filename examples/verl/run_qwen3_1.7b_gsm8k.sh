#!/usr/bin/env bash
# GSM8K with Qwen3-1.7B on verl (Ray + FSDP + vLLM), gbmpo's objectives through the verl plugin
# (gbmpo.integrations.verl). Two variants:
#   nm_grpo   NM-GRPO (GBMPO, arXiv 2602.04380): Dr. GRPO loss and advantages, the neural-mirror
#             Bregman divergence to the reference as the actor's KL loss (coefficient 1e-4, the
#             authors' code default), mirror map read from $MIRROR (created as the authors'
#             random init U[0, 0.01), seed 42, if missing; or a map from `gbmpo es`)
#   atr_grpo  ATR-GRPO (UCF, arXiv 2602.05494): GRPO with the KL3 trust region
#             w - 1 - log w <= delta as the ratio clip (delta 0.02; the paper's value was not
#             recovered, docs/methods.md suggests sweeping 0.01-0.03), verl's k3 KL loss
# Usage (in the verl environment, e.g. .venv-verl on a GPU machine with vLLM):
#   bash examples/verl/run_qwen3_1.7b_gsm8k.sh nm_grpo [more hydra overrides]
#   bash examples/verl/run_qwen3_1.7b_gsm8k.sh atr_grpo trainer.n_gpus_per_node=4
#   bash examples/verl/run_qwen3_1.7b_gsm8k.sh atr_grpo --print-overrides   # print, don't run
# Environment: DATA_DIR (default ~/data/gsm8k; written by prepare_gsm8k.py if missing), MODEL,
# MIRROR, N_GPUS, PYTHON. tests_verl/test_example.py composes verl's Hydra config from exactly
# these overrides (via --print-overrides). Batch sizes follow verl's GRPO GSM8K example scaled to
# a 1.7B model on one 8-GPU node; they are starting points, not tuned values.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VARIANT=${1:?usage: run_qwen3_1.7b_gsm8k.sh nm_grpo|atr_grpo [--print-overrides | hydra overrides]}
shift
PYTHON=${PYTHON:-python3}
DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k}
MODEL=${MODEL:-Qwen/Qwen3-1.7B}
MIRROR=${MIRROR:-$DATA_DIR/mirror_random_0.01_seed42.json}
N_GPUS=${N_GPUS:-8}

COMMON=(
  algorithm.adv_estimator=grpo
  algorithm.use_kl_in_reward=False
  "data.train_files=$DATA_DIR/train.parquet"
  "data.val_files=$DATA_DIR/test.parquet"
  data.train_batch_size=512
  data.max_prompt_length=512
  data.max_response_length=1024
  data.filter_overlong_prompts=True
  data.truncation=error
  +data.apply_chat_template_kwargs.enable_thinking=False
  "actor_rollout_ref.model.path=$MODEL"
  actor_rollout_ref.model.use_remove_padding=True
  actor_rollout_ref.model.enable_gradient_checkpointing=True
  actor_rollout_ref.actor.optim.lr=1e-6
  actor_rollout_ref.actor.ppo_mini_batch_size=128
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16
  actor_rollout_ref.actor.entropy_coeff=0
  actor_rollout_ref.rollout.name=vllm
  actor_rollout_ref.rollout.n=5
  actor_rollout_ref.rollout.tensor_model_parallel_size=1
  actor_rollout_ref.rollout.gpu_memory_utilization=0.6
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32
  # gbmpo: the config class carrying gbmpo's hyperparameters (Hydra imports the plugin with it)
  actor_rollout_ref.actor.policy_loss._target_=gbmpo.integrations.verl.GBMPOPolicyLossConfig
  trainer.logger=[console]
  trainer.project_name=gbmpo_verl_gsm8k
  "trainer.n_gpus_per_node=$N_GPUS"
  trainer.nnodes=1
  trainer.save_freq=50
  trainer.test_freq=10
  trainer.total_epochs=15
)
case "$VARIANT" in
  nm_grpo)
    VARIANT_OVERRIDES=(
      trainer.experiment_name=qwen3_1.7b_nm_grpo
      # Dr. GRPO: advantages not divided by the group std; loss summed over tokens / (B * L_max)
      algorithm.norm_adv_by_std_in_grpo=False
      actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm
      actor_rollout_ref.actor.loss_scale_factor=1024
      actor_rollout_ref.actor.policy_loss.loss_mode=gbmpo_clip
      actor_rollout_ref.actor.use_kl_loss=True
      actor_rollout_ref.actor.kl_loss_coef=1e-4
      actor_rollout_ref.actor.kl_loss_type=gbmpo_neural_mirror
      "+actor_rollout_ref.actor.policy_loss.gbmpo_kl.mirror=$MIRROR"
    )
    ;;
  atr_grpo)
    VARIANT_OVERRIDES=(
      trainer.experiment_name=qwen3_1.7b_atr_grpo
      actor_rollout_ref.actor.loss_agg_mode=token-mean
      actor_rollout_ref.actor.policy_loss.loss_mode=gbmpo_atr
      +actor_rollout_ref.actor.policy_loss.gbmpo_surrogate.delta=0.02
      actor_rollout_ref.actor.use_kl_loss=True
      actor_rollout_ref.actor.kl_loss_coef=0.001
      actor_rollout_ref.actor.kl_loss_type=low_var_kl
    )
    ;;
  *)
    echo "unknown variant '$VARIANT'; valid: nm_grpo, atr_grpo" >&2
    exit 2
    ;;
esac
OVERRIDES=()
for o in "${COMMON[@]}" "${VARIANT_OVERRIDES[@]}"; do
  OVERRIDES+=("$o")
done

if [ "${1:-}" = --print-overrides ]; then
  printf '%s\n' "${OVERRIDES[@]}"
  exit 0
fi

if [ ! -f "$DATA_DIR/train.parquet" ]; then
  "$PYTHON" "$HERE/prepare_gsm8k.py" --out "$DATA_DIR"
fi
if [ "$VARIANT" = nm_grpo ] && [ ! -f "$MIRROR" ]; then
  "$PYTHON" -c 'import sys; from gbmpo.objectives import NeuralMirrorMap
NeuralMirrorMap.random(0.01, 42).save(sys.argv[1])' "$MIRROR"
fi
# VERL_USE_EXTERNAL_MODULES: verl imports the plugin in every process and, unlike the entry
# point, does not hide an import error
export VERL_USE_EXTERNAL_MODULES=gbmpo.integrations.verl
exec "$PYTHON" -m verl.trainer.main_ppo "${OVERRIDES[@]}" "$@"
