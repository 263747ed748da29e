"""Sampled-token divergence estimators against the exact full-vocabulary value, on real policies.

For each policy pi (a trained run's ``model/``, or the reference with Gaussian noise added to
its weights) and the reference pi_ref (default: the embedded tiny model), completions are
sampled from pi at temperature 1 (the distribution the estimators assume) on held-out prompts.
At every completion token x_t, with p = pi(. | h_t) and q = pi_ref(. | h_t):

* exact values (gbmpo.eval.drift.drift_rows): KL(p || q) = sum_v p_v log(p_v / q_v) and
  ProbL2 = sum_v (p_v - q_v)^2;
* sampled estimators of KL(p || q) on the token x_t (gbmpo.objectives.regularizers): k1 =
  log p_x - log q_x, k2 = (log p_x - log q_x)^2 / 2, k3 = q_x / p_x - 1 - log(q_x / p_x);
* sampled forms of ProbL2: the ``prob_l2`` regularizer (p_x - q_x)^2 (what training adds per
  token; its expectation is sum_v p_v (p_v - q_v)^2, not the full-vocabulary value) and its
  importance-weighted form (p_x - q_x)^2 / p_x, whose expectation under x ~ p is the
  full-vocabulary ProbL2.

Each row gives the token mean of an estimator, its bias against the exact value on the same
tokens (mean of estimator - exact), the standard error of that bias and of the mean over
prompts (completions of one prompt are one cluster: the delta-method standard error of a ratio
of sums), and the per-token standard deviation. The exact row's own standard error is the
spread that comes from sampling the trajectories; an estimator adds its own on top. Per pair,
the JSON also holds the share of sum_v p_v k3(v) (= the KL) carried by the tokens the policy makes
rare (p_v < RARE) and the probability of sampling one of them.

    python benchmarks/estimator_table.py --policy "30 RL steps=runs/p30/model"  # + 2 noised
    python benchmarks/estimator_table.py --policy DIR --noise 0.01,0.03 --limit 200 --samples 4

Prints a Markdown table and writes ``benchmarks/results/estimator_table.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _common import finish_result, start_result  # noqa: E402

from gbmpo.eval.drift import drift_rows  # noqa: E402
from gbmpo.eval.evaluation import resolve_task  # noqa: E402
from gbmpo.models import load_model_and_tokenizer  # noqa: E402
from gbmpo.objectives.regularizers import kl_k1, kl_k2, kl_k3, prob_l2  # noqa: E402
from gbmpo.rollout.logprobs import logits_forward  # noqa: E402
from gbmpo.rollout.sampling import generate  # noqa: E402

#: a token is rare for the policy below this probability (the ``k3_rare`` / ``p_rare`` figures)
RARE = 0.01

#: estimator -> the exact quantity it is compared with
ESTIMATORS: dict[str, str] = {
    "k1": "kl", "k2": "kl", "k3": "kl", "prob_l2 (sampled)": "prob_l2",
    "prob_l2 / p (IS)": "prob_l2",
}  # fmt: skip


def noisy(model: Any, scale: float, seed: int) -> Any:
    """``model`` with N(0, (scale * std of each tensor)^2) noise added to every weight."""
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            std = float(p.float().std()) if p.numel() > 1 else 0.0
            p.add_(scale * std * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return out


@torch.no_grad()
def token_values(policy: Any, reference: Any, tokenizer: Any, prompts: list[str], *,
                 samples: int, max_new_tokens: int, batch_size: int,
                 seed: int) -> dict[str, list[list[float]]]:  # fmt: skip
    """Per prompt, the per-token values of the exact quantities and of every estimator."""
    out: dict[str, list[list[float]]] = {
        k: [] for k in ("kl", "prob_l2", *ESTIMATORS, "k3_rare", "p_rare")
    }
    for chunk_i, lo in enumerate(range(0, len(prompts), batch_size)):
        chunk = prompts[lo : lo + batch_size]
        ro = generate(policy, tokenizer, chunk, num_return_sequences=samples,
                      max_new_tokens=max_new_tokens, do_sample=True, temperature=1.0, top_p=1.0,
                      top_k=0, generator_seed=seed + chunk_i)  # fmt: skip
        rows = (ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask)
        x = torch.cat(logits_forward(policy).sequence_logits(*rows), dim=1).float()
        y = torch.cat(logits_forward(reference).sequence_logits(*rows), dim=1).float()
        exact = drift_rows(x.flatten(0, 1), y.flatten(0, 1))
        # where k3's expectation sits: its terms p_v k3(q_v / p_v) on the tokens the policy
        # makes rare (p_v < RARE), and the chance of sampling one of them
        lpv, lqv = torch.log_softmax(x, -1).flatten(0, 1), torch.log_softmax(y, -1).flatten(0, 1)
        terms = lqv.exp() - lpv.exp() + lpv.exp() * (lpv - lqv)  # p_v k3(v), exactly
        rare = lpv < math.log(RARE)
        k3_rare = (terms * rare).sum(-1)
        p_rare = (lpv.exp() * rare).sum(-1)
        lp = torch.log_softmax(x, -1).gather(-1, ro.completion_ids.unsqueeze(-1)).squeeze(-1)
        lq = torch.log_softmax(y, -1).gather(-1, ro.completion_ids.unsqueeze(-1)).squeeze(-1)
        lp, lq = lp.flatten(), lq.flatten()
        vals = {
            "kl": exact["kl"], "prob_l2": exact["prob_l2"], "k1": kl_k1(lp, lq),
            "k2": kl_k2(lp, lq), "k3": kl_k3(lp, lq), "prob_l2 (sampled)": prob_l2(lp, lq),
            "prob_l2 / p (IS)": prob_l2(lp, lq) / lp.exp(), "k3_rare": k3_rare, "p_rare": p_rare,
        }  # fmt: skip
        mask = ro.completion_mask.bool()
        width = mask.shape[1]
        for j in range(len(chunk)):  # the `samples` completions of prompt j: one cluster
            sel = mask[j * samples : (j + 1) * samples].flatten()
            base = j * samples * width
            for k, v in vals.items():
                out[k].append(v[base : base + samples * width][sel].double().tolist())
    return out


def stats(values: list[list[float]], exact: list[list[float]] | None = None) -> dict[str, float]:
    """Token mean, per-token std, cluster standard error of the mean; with ``exact`` also the
    bias (mean of value - exact) and its cluster standard error."""

    def ratio_se(sums: list[float], counts: list[int]) -> float:
        n, total = len(sums), sum(counts)
        r = sum(sums) / total
        var = sum((s - r * c) ** 2 for s, c in zip(sums, counts, strict=True)) * n / (n - 1)
        return math.sqrt(var) / total

    flat = [v for vs in values for v in vs]
    counts = [len(vs) for vs in values]
    mean = sum(flat) / len(flat)
    out = {
        "mean": mean,
        "std": math.sqrt(sum((v - mean) ** 2 for v in flat) / (len(flat) - 1)),
        "se": ratio_se([sum(vs) for vs in values], counts),
    }
    if exact is not None:
        diffs = [[a - b for a, b in zip(vs, es, strict=True)]
                 for vs, es in zip(values, exact, strict=True)]  # fmt: skip
        out["bias"] = sum(sum(d) for d in diffs) / len(flat)
        out["bias_se"] = ratio_se([sum(d) for d in diffs], counts)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reference", default="tiny", help="reference model ('tiny': embedded)")
    ap.add_argument("--policy", action="append", default=[], metavar="[LABEL=]PATH",
                    help="a trained policy, repeatable")
    ap.add_argument("--noise", default="0.01,0.03",
                    help="relative weight-noise scales of perturbed references ('' for none)")
    ap.add_argument("--task", default="arithmetic")
    ap.add_argument("--limit", type=int, default=200, help="held-out prompts")
    ap.add_argument("--samples", type=int, default=4, help="completions per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    result = start_result("estimator_table")
    ref_id = None if args.reference == "tiny" else args.reference
    reference, tokenizer = load_model_and_tokenizer(ref_id)
    task = resolve_task(args.task, tokenizer=tokenizer)
    prompts = [ex["prompt"] for ex in task.split(task.eval_split)[: args.limit]]
    policies: list[tuple[str, Any]] = []
    for item in args.policy:
        label, _, path = item.rpartition("=")
        policies.append((label or f"trained: {path}", load_model_and_tokenizer(path)[0]))
    for i, s in enumerate(float(x) for x in args.noise.split(",") if x.strip()):
        policies.append((f"reference + {s:g} x std noise", noisy(reference, s, seed=100 + i)))
    result["settings"] = {k: v for k, v in vars(args).items() if k != "out"}
    result["pairs"] = {}
    lines = ["| policy | quantity | exact (± s.e.) | estimator | mean | bias (± s.e.) | "
             "std per token | s.e. of mean |", "|---|---|---|---|---|---|---|---|"]
    for name, policy in policies:
        t = time.perf_counter()
        vals = token_values(policy, reference, tokenizer, prompts, samples=args.samples,
                            max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                            seed=args.seed)  # fmt: skip
        pair: dict[str, Any] = {"tokens": sum(len(v) for v in vals["kl"]),
                                "seconds": time.perf_counter() - t}  # fmt: skip
        for q in ("kl", "prob_l2"):
            pair[q] = stats(vals[q])
        pair["k3_share_on_rare_tokens"] = stats(vals["k3_rare"])["mean"] / pair["kl"]["mean"]
        pair["prob_of_sampling_a_rare_token"] = stats(vals["p_rare"])["mean"]
        for est, q in ESTIMATORS.items():
            st = pair[est] = stats(vals[est], vals[q])
            ex = pair[q]
            lines.append(
                f"| {name} | {q} | {ex['mean']:.4g} ± {ex['se']:.2g} | {est} | {st['mean']:.4g} | "
                f"{st['bias']:+.3g} ± {st['bias_se']:.2g} | {st['std']:.3g} | {st['se']:.2g} |"
            )
        result["pairs"][name] = pair
        print(f"{name}: {pair['tokens']} tokens in {pair['seconds']:.1f} s; tokens with p < "
              f"{RARE:g} carry {pair['k3_share_on_rare_tokens']:.1%} of the KL's k3 terms and are "
              f"sampled with probability {pair['prob_of_sampling_a_rare_token']:.2%}")
    table = "\n".join(lines)
    result["table"] = table
    path = finish_result(result, args.out)
    print(table)
    print(f"estimator_table: {len(policies)} policy pairs, {args.limit} prompts x "
          f"{args.samples} samples; results in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
