"""Radii of the clip-measure comparison, matched to the ratio clip's interval width.

The ratio clip with eps = 0.2 admits w in [0.8, 1.2], width 0.4. For every other measure of
``divergence_clip`` (gbmpo.objectives.clip_measures) this picks the radius delta whose admissible
interval [l, u] has the same width u - l = 0.4 (symmetric delta on both sides):

* k1: e^d - e^-d = 0.4, so d = asinh(0.2);
* k2: e^s - e^-s = 0.4 with s = sqrt(2 d), so d = asinh(0.2)^2 / 2;
* k3: u(d) - l(d) = 0.4 with the Lambert-W ends, solved by bisection;
* prob_l2: the width 2 sqrt(d) / p depends on the token's old probability p; matched at the
  median p of the tokens the initial policy samples on the embedded task (the default run's
  first RL step for seeds 0, 1, 2: 3 x 8 prompts x 8 completions), so d = (0.2 p_med)^2.

Run: PYTHONPATH=src python docs/results/clip-measures/match_widths.py (about a minute on CPU).
"""

from __future__ import annotations

import math

import torch

from gbmpo.objectives.clip_measures import k3_interval
from gbmpo.rollout import generate
from gbmpo.train import Trainer, load_config
from gbmpo.train.batching import derive_seed
from gbmpo.train.step import no_grad_logprobs

WIDTH = 0.4  # ratio clip eps = 0.2


def k3_delta(width: float) -> float:
    lo, hi = 1e-6, 1.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        a, b = k3_interval(mid, mid)
        lo, hi = (mid, hi) if b - a < width else (lo, mid)
    return 0.5 * (lo + hi)


def old_probabilities(seeds: tuple[int, ...] = (0, 1, 2)) -> torch.Tensor:
    probs = []
    for seed in seeds:
        cfg = load_config(None, [("run.seed", str(seed)), ("run.progress", "false")])
        tr = Trainer(cfg)
        ro = cfg.rollout
        examples = [tr.train_data[i] for i in tr.sampler.take(ro.prompts_per_step)]
        batch = generate(
            tr.model, tr.tokenizer, [ex["prompt"] for ex in examples],
            num_return_sequences=ro.num_generations, max_new_tokens=ro.max_new_tokens,
            do_sample=True, temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k,
            generator_seed=derive_seed(seed, "rollout", 0), batch_size=ro.batch_size,
            engine=ro.generator, lean_decoder=ro.lean_decoder,
        )  # fmt: skip
        logp = no_grad_logprobs(tr, batch, reference=False)
        mask = batch.completion_mask.bool()
        probs.append(torch.exp(logp[mask].double()))
    return torch.cat(probs)


if __name__ == "__main__":
    d_k1 = math.asinh(WIDTH / 2)
    d_k2 = d_k1**2 / 2
    d_k3 = k3_delta(WIDTH)
    p = old_probabilities()
    p_med, n = float(p.median()), int(p.numel())
    d_l2 = (WIDTH / 2 * p_med) ** 2
    print("ratio   eps   = 0.2       interval [0.8, 1.2]")
    print(f"k1      delta = {d_k1:.6f}  interval [{math.exp(-d_k1):.4f}, {math.exp(d_k1):.4f}]")
    s = math.sqrt(2 * d_k2)
    print(f"k2      delta = {d_k2:.6f}  interval [{math.exp(-s):.4f}, {math.exp(s):.4f}]")
    lo, hi = k3_interval(d_k3, d_k3)
    print(f"k3      delta = {d_k3:.6f}  interval [{lo:.4f}, {hi:.4f}]")
    print(f"prob_l2 median p_old = {p_med:.4f} over {n} sampled tokens of the initial policy")
    qs = (0.05, 0.1, 0.25, 0.5)
    quant = ", ".join(f"{q:.0%}: {float(p.quantile(q)):.4f}" for q in qs)
    low = float((p < 0.9).double().mean())
    print(f"        p_old quantiles {quant}; share with p_old < 0.9: {low:.3f}")
    r = math.sqrt(d_l2) / p_med
    print(f"prob_l2 delta = {d_l2:.6f}  interval at the median p [{1 - r:.4f}, {1 + r:.4f}]")
