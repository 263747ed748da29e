#!/usr/bin/env bash
# The project's GPU checks in one call, for a lent one-GPU machine with no network, within 7
# minutes of limits (the sum below), so that a 15-minute lease keeps time for the machine's
# start and a rerun of a step. At Qwen3-1.7B's shape (a random model, bf16):
#   1. scale_rehearsal_paper: the GBMPO paper config's setting (2 x 4 x 256, LoRA r 64), own
#      engine by phase and TRL (without vLLM) with rollout.decode_step auto (transformers'
#      static cache and compiled decode step; 3 steps, the first, which compiles, untimed);
#      with TRL_LEAN=1 then TRL with decode_step lean (the dynamic cache, uncompiled: TRL's own
#      generation; one step, in the process the other runs warmed) for the lean-vs-auto
#      ratio; the own-vs-TRL seconds per step; builds the random model the other steps reuse;
#   2. scale_rehearsal: the rehearsal's setting (8 x 8 x 256, full fine-tuning, the reference
#      on the card), own engine with the planned micro-batch, by phase: decode against its
#      weights-only bound, MFU per phase, peak memory against the plan;
#   3. decode_step: the static step (a CUDA graph) against the lean decoder, 8 and 64 rows x
#      128 tokens, without LoRA and with r 64 (merged): ms per token against the bound.
# Budget (seconds; each step has its own time limit, so one failing step does not lose the
# others): wheel install 45 + versions 20 + paper 165 + rehearsal 105 + decode 85 = 420.
# TRL_LEAN=1 adds TRL with decode_step lean to step 1 (one step in the same process, +30 s of
# limit; 450 in all): the before-figure, measured by itself before (TRL's own generation).
# Left out to fit: TRL in the rehearsal's setting, the micro-batch of 8 beside the planned one,
# 512 new tokens (run scale_rehearsal.py with --engines, --micro, --new-tokens for those).
# Every result goes to $OUT (default ./gpu_out): log.txt and one JSON per step.
#
#   bash benchmarks/gpu_checks.sh                  # gbmpo installed with its [trl] extra
#   WHEELS=.whl bash benchmarks/gpu_checks.sh      # offline: first install the wheels in .whl
#                                                  # to /tmp (transformers, trl, peft,
#                                                  # accelerate, datasets, tokenizers,
#                                                  # safetensors, huggingface_hub, math-verify)
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
  timeout 45 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/gbmpo_site "$WHEELS"/*.whl >>"$LOG" 2>&1 || echo "wheel install failed" | tee -a "$LOG"
  export PYTHONPATH="$PYTHONPATH:/tmp/gbmpo_site"
fi
{ timeout 5 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  timeout 15 "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  nproc; } 2>&1 | tee -a "$LOG"

# step NAME SECONDS ARGS...: python3 ARGS under a time limit, its output appended to the log; the
# lines that matter (ratios, summaries, errors) echoed
step() {
  local name=$1 limit=$2
  shift 2
  if [ -n "${SMOKE:-}" ]; then limit=$((limit * 4)); fi  # a shared CPU is slower than a card
  echo "== $name ($(date -u +%T))" | tee -a "$LOG"
  local t0=$SECONDS
  timeout "$limit" "$PY" "$@" >"$OUT/$name.out" 2>&1
  local rc=$?
  grep -v -E '^(W|V|I)[0-9]{4} ' "$OUT/$name.out" >>"$LOG"
  grep -E '^(\||decode:|rehearsal,|paper,|scale_rehearsal|decode_step|Traceback|[A-Za-z]*Error)' \
    "$OUT/$name.out" | head -n 60
  rm -f "$OUT/$name.out"
  echo "== $name rc=$rc in $((SECONDS - t0)) s" | tee -a "$LOG"
}

DEV=cuda SIZE=full MODEL=/tmp/gbmpo_qwen3_random
DECODE="--shape qwen3-1.7b --rows 8,64 --new-tokens 128 --lora 0,64 --reps 1"
if [ -n "${SMOKE:-}" ]; then
  DEV=cpu SIZE=tiny MODEL=/tmp/gbmpo_tiny_random
  DECODE="--shape tiny --rows 8 --new-tokens 8 --lora 0,8 --reps 1"
fi
# 1. the paper config's setting (LoRA r 64): own engine, TRL (decode_step auto: static and
# compiled on CUDA) and, with TRL_LEAN=1, TRL with decode_step lean (one step); builds the
# random model
TRL_DECODERS=auto PAPER_LIMIT=165
if [ -n "${TRL_LEAN:-}" ]; then TRL_DECODERS=auto,lean PAPER_LIMIT=195; fi
step scale_rehearsal_paper $PAPER_LIMIT benchmarks/scale_rehearsal.py --settings paper \
  --size $SIZE --device $DEV --model-dir $MODEL --trl-decoders $TRL_DECODERS \
  --trl-extra-steps 1 --out "$OUT/scale_rehearsal_paper.json"
# 2. the rehearsal's setting: own engine, planned micro-batch, by phase; the same random model
step scale_rehearsal 105 benchmarks/scale_rehearsal.py --settings rehearsal --engines gbmpo \
  --micro planned --size $SIZE --device $DEV --model-dir $MODEL \
  --out "$OUT/scale_rehearsal.json"
# 3. the decode steps at Qwen3-1.7B's shape (bf16): the static step (a CUDA graph) and the lean
# decoder at 8 and 64 rows x 128 tokens, and the static step with LoRA r 64 (merged), against
# the weights-only bound (measured copy bandwidth)
step decode_step 85 benchmarks/decode_step.py --device $DEV $DECODE --steps static,lean \
  --out "$OUT/decode_step.json"
echo "done $(date -u +%T)" | tee -a "$LOG"
