#!/usr/bin/env bash
# The project's GPU checks in one call, for a lent one-GPU machine with no network: the cost of
# the objective on the GPU (eager, and compiled with torch.compile) against the TRL-style loss,
# the own sampler's decode steps (the static step as a CUDA graph against the lean decoder, with
# and without LoRA) and the scale rehearsal at Qwen3-1.7B's shape on the own engine and on TRL. Each step has its
# own time limit, so that one failing step does not lose the others; every result goes to $OUT
# (default ./gpu_out): log.txt and one JSON per step.
#
#   bash benchmarks/gpu_checks.sh                  # gbmpo installed with its [trl] extra
#   WHEELS=.whl bash benchmarks/gpu_checks.sh      # offline: first install the wheels in .whl
#                                                  # (transformers, trl, datasets, ...) to /tmp
#   SMOKE=1 PYTHON=.venv/bin/python bash benchmarks/gpu_checks.sh   # the same steps on the
#                                                  # CPU, tiny (a test of this script)
set -u
PY=${PYTHON:-python3}
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "${WHEELS:-}" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/gbmpo_site "$WHEELS"/*.whl >>"$LOG" 2>&1 || echo "wheel install failed" | tee -a "$LOG"
  export PYTHONPATH="$PYTHONPATH:/tmp/gbmpo_site"
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  nproc; } 2>&1 | tee -a "$LOG"

# step NAME SECONDS ARGS...: python3 ARGS under a time limit, its output appended to the log; the
# lines that matter (ratios, summaries, errors) echoed
step() {
  local name=$1 limit=$2
  shift 2
  echo "== $name ($(date -u +%T))" | tee -a "$LOG"
  local t0=$SECONDS
  timeout "$limit" "$PY" "$@" >"$OUT/$name.out" 2>&1
  local rc=$?
  grep -v -E '^(W|V|I)[0-9]{4} ' "$OUT/$name.out" >>"$LOG"
  grep -E '^(TRL-style|the same|clip |scale_rehearsal|decode_step|\| [0-9]|Traceback|[A-Za-z]*Error)|eager, compile' \
    "$OUT/$name.out" | head -n 30
  rm -f "$OUT/$name.out"
  echo "== $name rc=$rc in $((SECONDS - t0)) s" | tee -a "$LOG"
}

DEV=cuda SIZE=full SHAPE=64,1024 LARGE=256,4096
DECODE="--shape qwen3-1.7b --rows 8,64 --new-tokens 256 --lora 0,64 --reps 2"
if [ -n "${SMOKE:-}" ]; then
  DEV=cpu SIZE=tiny SHAPE=8,64 LARGE=16,128
  DECODE="--shape tiny --rows 8 --new-tokens 8 --lora 0,8 --reps 1"
fi
SUBSET_S=clip,gspo,cispo,dc:k1,rpg_reinforce,vespo
SUBSET_R=none,kl_k3,kl_k3_is,prob_l2,rpg_rkl,neural_mirror
# 1. every pair, eager, at the CPU benchmark's shape (64 x 1,024 tokens: launch-bound on a GPU)
step objective_cost_cuda 180 benchmarks/objective_cost.py --device $DEV --shape $SHAPE \
  --reps 7 --out "$OUT/objective_cost_cuda.json"
# 2. compiled_policy_loss against the compiled and the eager TRL-style loss
step objective_cost_cuda_compile 170 benchmarks/objective_cost.py --device $DEV --compile \
  --shape $SHAPE --reps 11 --surrogates clip --regularizers "$SUBSET_R" --out "$OUT/objective_cost_cuda_compile.json"
# 3. the scale rehearsal, own engine
step scale_rehearsal_gbmpo 150 benchmarks/scale_rehearsal.py --engines gbmpo --size $SIZE --device $DEV \
  --out "$OUT/scale_rehearsal_gbmpo.json"
# 3b. the decode steps at Qwen3-1.7B's shape (bf16): the static step (a CUDA graph) and the lean
# decoder at 8 and 64 rows x 256 tokens, and the static step with LoRA r 64 (merged), against
# the weights-only bound (measured copy bandwidth)
step decode_step 150 benchmarks/decode_step.py --device $DEV $DECODE --steps static,lean \
  --out "$OUT/decode_step.json"
# 4. more compiled pairs: each surrogate with k3
step objective_cost_cuda_compile2 110 benchmarks/objective_cost.py --device $DEV --compile \
  --shape $SHAPE --reps 11 --surrogates gspo,cispo,dc:k1,rpg_reinforce,vespo --regularizers kl_k3 \
  --out "$OUT/objective_cost_cuda_compile2.json"
# 5. a bandwidth-bound shape (256 x 4,096 tokens), eager
step objective_cost_cuda_large 60 benchmarks/objective_cost.py --device $DEV --reps 7 \
  --shape $LARGE --surrogates "$SUBSET_S" --regularizers "$SUBSET_R" \
  --out "$OUT/objective_cost_cuda_large.json"
# 6. the scale rehearsal on TRL
step scale_rehearsal_trl 150 benchmarks/scale_rehearsal.py --engines trl --size $SIZE --device $DEV \
  --out "$OUT/scale_rehearsal_trl.json"
echo "done $(date -u +%T)" | tee -a "$LOG"
