#!/usr/bin/env bash
# RL against supervised fine-tuning on the gold solutions, the same 180 s from the same start
# (docs/results.md#sft-control): five RL seeds of `gbmpo train --time-budget 180`, the SFT
# control's three seeds, and the RL'd models of seeds 0-2 (and the start) on 937 problems none
# of them was chosen on. Two lanes, one per core, each process on one thread; the run
# directories go to $1 (default /tmp/sft-control), the result files to docs/results/sft-control/.
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-/tmp/sft-control}
out=docs/results/sft-control
py=${PYTHON:-.venv/bin/python}
gbmpo=${GBMPO:-.venv/bin/gbmpo}
mkdir -p "$work" "$out"

rl() { "$gbmpo" train --time-budget 180 --seed "$1" --run.num_threads 1 \
         --output-dir "$work/rl-seed$1" > "$work/rl-seed$1.log" 2>&1; }

(rl 0; rl 1; rl 2; rl 3) &
lane_a=$!
("$py" benchmarks/sft_control.py --seconds 180 --seeds 0,1,2 --threads 1 \
    --out "$out/sft.json" > "$work/sft.log" 2>&1; rl 4) &
lane_b=$!
wait "$lane_a" "$lane_b"

"$py" scripts/collect_summaries.py "$out/rl_runs.json" \
    "gbmpo train --time-budget 180 --seed N --run.num_threads 1" "$work"/rl-seed{0,1,2,3,4}

"$py" scripts/fresh_arithmetic_problems.py "$work/fresh.jsonl"
fresh() {  # $1: a model directory (or tiny), $2: the result's name
  "$gbmpo" eval --model "$1" --task jsonl --task-param "path=$work/fresh.jsonl" \
      --task-param "test_path=$work/fresh.jsonl" \
      --task-param reward=gbmpo.tasks.arithmetic:arithmetic_reward --template base \
      --batch-size 64 --output "$work/fresh-$2.jsonl" > /dev/null
  cp "$work/fresh-$2.summary.json" "$out/fresh-$2.summary.json"
}
fresh tiny start
for s in 0 1 2; do fresh "$work/rl-seed$s/model" "rl-seed$s"; done
# the start's pass@16 at temperature 1 on the 200 held-out problems
"$gbmpo" eval --task arithmetic --samples 16 --temperature 1.0 \
    --output "$work/start-pass16.jsonl" > /dev/null
cp "$work/start-pass16.summary.json" "$out/start-pass16.summary.json"
echo "results in $out"
