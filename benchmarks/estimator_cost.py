"""The cost of ``objective.regularizer.estimator: full`` in the own trainer's loss path.

One micro-batch of the update, forward + backward, as :func:`gbmpo.train.step.accumulate_gradients`
runs it, with the regularizer ``kl_k3`` at coefficient 0.05 under the clip surrogate:

* ``sample``: the policy's forward gives the sampled tokens' log-probs (gbmpo's chunked
  selective log-softmax); the reference's log-probs are precomputed (as the step does once per
  batch); k3 on the sampled tokens;
* ``full``: the same forward, whose completion logits also feed the exact KL(pi || pi_ref) over
  the vocabulary (:func:`gbmpo.train.full.logprobs_and_full`: one no-grad reference forward
  of the micro-batch, :func:`gbmpo.objectives.full_vocab.full_vocab_bregman` in chunks).

The model is a randomly initialised Qwen3-shaped causal LM with the Qwen3 vocabulary (151,936)
and a small trunk (``--hidden``, ``--layers``), so the vocabulary-sized tensors dominate, as
they do at the papers' scale per token; the reference is the same model with noise on its
weights. float32 on CPU. Each variant runs in a fresh process; "extra" is the peak resident set
during forward + backward minus the RSS just before it, in GB and in units of one micro-batch
logits tensor (B x C x V floats). The expected difference of ``full`` over ``sample`` is two
such tensors (the reference's logits and the divergence's gradient buffer).

    python benchmarks/estimator_cost.py                  # 4 x 128 tokens, about a minute
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    best_of,
    finish_result,
    measure,
    run_child_logged,
    serve_child,
    start_result,
)

VARIANTS = ("sample", "full")
COEF = 0.05


def _setup(a: argparse.Namespace) -> tuple[Any, Any, Any, Any]:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from gbmpo.train.policy import PolicyModels

    torch.manual_seed(0)
    torch.set_num_threads(a.threads)
    cfg = Qwen3Config(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=2 * a.hidden,
        num_hidden_layers=a.layers, num_attention_heads=2, num_key_value_heads=1,
        head_dim=a.hidden // 2, tie_word_embeddings=False,
    )  # fmt: skip
    model = Qwen3ForCausalLM(cfg).float().train()
    ref = Qwen3ForCausalLM(cfg).float().eval()
    ref.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
        for p in ref.parameters():
            p.requires_grad_(False)
    b, c, s = a.batch, a.completion, a.prompt
    batch = SimpleNamespace(
        prompt_ids=torch.randint(0, a.vocab, (b, s), generator=g),
        prompt_mask=torch.ones(b, s, dtype=torch.long),
        completion_ids=torch.randint(0, a.vocab, (b, c), generator=g),
        completion_mask=torch.ones(b, c, dtype=torch.long),
    )
    rollout = SimpleNamespace(temperature=1.0, share_prompts=False, lean_forward=True)
    models = PolicyModels(model, ref, rollout)  # type: ignore[arg-type]
    return models, batch, model, ref


def child_measure(a: argparse.Namespace) -> dict[str, Any]:
    import torch

    from gbmpo.objectives import compute_policy_loss, get_regularizer
    from gbmpo.objectives.estimators import FullValues
    from gbmpo.objectives.loss import LossTerm
    from gbmpo.objectives.spec import BuiltTerm
    from gbmpo.rollout.logprobs import completion_logprobs
    from gbmpo.train.full import logprobs_and_full

    models, batch, model, ref = _setup(a)
    ids = (batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask)
    mask = batch.completion_mask.float()
    advantages = torch.linspace(-1, 1, a.batch)
    k3 = get_regularizer("kl_k3")
    term = BuiltTerm("kl_k3", k3, COEF, "ref", "loss", "full")
    with torch.no_grad():  # the step computes log pi_ref once per batch
        ref_logp, _ = completion_logprobs(ref, *ids, share_prompts=False)
    runs = []
    value = 0.0
    for _ in range(a.repeats):
        model.zero_grad(set_to_none=True)
        with measure() as m:
            if a.variant == "sample":
                logp, _ = completion_logprobs(model, *ids, share_prompts=False)
                reg: Any = k3
            else:
                logp, _, full_values = logprobs_and_full(models, batch, mask, [term],
                                                         with_entropy=False)
                reg = FullValues("kl_k3", full_values["kl_k3"])
            loss, metrics = compute_policy_loss(
                logp=logp,
                old_logp=None,
                advantages=advantages,
                mask=mask,
                surrogate="clip",
                terms=[LossTerm("kl_k3", reg, COEF, ref_logp)],
                aggregation="dr_grpo",
                max_len=a.completion,
            )  # fmt: skip
            loss.backward()
        runs.append(m.record())
        value = metrics["reg_value"]
        del logp, loss
    return {**best_of(runs), "reg_value": value}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4, help="sequences per micro-batch")
    ap.add_argument("--completion", type=int, default=128, help="completion tokens")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=None, help="result JSON (default benchmarks/results/)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if serve_child(a, {"measure": child_measure}):
        return 0

    result = start_result("estimator_cost")
    logits_gb = a.batch * a.completion * a.vocab * 4 / 1e9
    result["shape"] = {"batch": a.batch, "completion": a.completion, "prompt": a.prompt,
                       "vocab": a.vocab, "hidden": a.hidden, "layers": a.layers,
                       "threads": a.threads, "logits_gb": logits_gb}  # fmt: skip
    common = [f"--{k}={getattr(a, k)}" for k in
              ("batch", "completion", "prompt", "vocab", "hidden", "layers", "threads",
               "repeats")]  # fmt: skip
    variants = [v for v in a.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"unknown variant {v!r}; valid: {', '.join(VARIANTS)}")
        res = run_child_logged([__file__, "--child", "measure", f"--variant={v}", *common])
        res["extra_in_logits_tensors"] = res["extra_peak_gb"] / logits_gb
        result[v] = res
    summary = "estimator_cost:"
    if "sample" in result and "full" in result:
        s, f = result["sample"], result["full"]
        result["full_vs_sample"] = {
            "time_ratio": f["seconds_min"] / s["seconds_min"],
            "extra_logits_tensors": f["extra_in_logits_tensors"] - s["extra_in_logits_tensors"],
        }
        r = result["full_vs_sample"]
        summary += (f" full {r['time_ratio']:.2f}x the sample time, "
                    f"{r['extra_logits_tensors']:+.2f} logits tensors of memory")  # fmt: skip
    path = finish_result(result, a.out)
    print(f"{summary} -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
