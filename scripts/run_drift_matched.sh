#!/usr/bin/env bash
# The divergences at equal drift (gbmpo compare --match-drift): KL k3, ProbL2, the neural mirror
# map, forward KL and JS, each with a controlled coefficient holding the rollout's k3 against the
# reference (reg/kl_k3) at 0.025, the middle of the frontier's matched band (held-out exact KL
# 0.021-0.028, docs/results.md#passk-frontier), 3 seeds x 60 steps of the default recipe on the
# embedded task, greedy accuracy and pass@k (eval.samples 8): 15 runs. The first coefficients are
# those that land near 0.025 on the frontier (KL 0.1, ProbL2 0.6, mirror map 16, forward KL 0.12,
# JS 0.64); the controller moves each by at most 4% a step (horizon 5).
# Runtime: one such run (prob_l2, 60 steps, no evaluation) took 621 s on 2 shared cores at load
# 12-18, so the 15 runs with their evaluations take hours there. Usage:
# scripts/run_drift_matched.sh DIR
set -euo pipefail
out=${1:?usage: $0 OUTPUT_DIR}
exec gbmpo compare --regularizers kl_k3,prob_l2,neural_mirror,fkl,js \
    --coefs kl_k3=0.1,prob_l2=0.6,neural_mirror=16,fkl=0.12,js=0.64 \
    --match-drift 0.025 --match-horizon 5 --seeds 0,1,2 --steps 60 --time-budget null \
    --eval-every 0 --run.checkpoint_every 0 --eval.samples 8 \
    --backend local --workers 2 --output-dir "$out"
