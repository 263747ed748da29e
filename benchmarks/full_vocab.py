"""Full-vocabulary divergence, forward + backward: naive whole-batch against gbmpo's.

The quantity is the exact KL(pi_theta || pi_ref) over the whole vocabulary (``--potential
square`` for GBMPO's ProbL2 sum (p - q)^2) at every token of a [B, T] = [4, 256] batch with the
Qwen3 vocabulary V = 151,936 in float32, weighted per token and summed, then backpropagated.

Two settings (``--modes``):

* ``logits``: the inputs are the policy logits (a leaf that requires grad) and the reference
  logits, [B, T, V] each. The gradient w.r.t. the policy logits is itself one logits-sized tensor.
  - ``naive``: log_softmax of both, ``kl_div`` (or (p - q)^2), sum, backward;
  - ``before``: gbmpo's previous implementation: rows in chunks, each wrapped in
    ``torch.utils.checkpoint`` (the forward runs again in backward);
  - ``gbmpo``: :func:`gbmpo.objectives.full_vocab_bregman` (closed-form gradient written into
    one [N, V] buffer during the forward, scaled in place in the backward).
* ``hidden``: the inputs are hidden states [B, T, H] (grad) and the LM-head weight [V, H] (grad;
  the reference uses the same weight, detached, and its own hidden states) - the training path.
  - ``naive``: both projections in full, then as above;
  - ``before``: the previous ``full_vocab_bregman_from_hidden`` (checkpoint per chunk);
  - ``gbmpo``: :func:`gbmpo.objectives.full_vocab_bregman_from_hidden` (chunk buffers reused,
    closed-form chunk gradients, recomputation in the backward).

Measurement: every variant runs in a fresh process, one at a time. "Extra" is the peak resident
set size during forward + backward minus the RSS just before it (after the inputs exist), read
from /proc/self/status (VmHWM after resetting it through /proc/self/clear_refs). It includes
everything the process really holds: the gradients produced (the policy logits' gradient in
``logits`` mode, the weight's and hidden states' in ``hidden`` mode), autograd's saved tensors,
temporaries, and what glibc malloc keeps mapped after frees. The time is the wall time of
forward + backward; each variant is repeated ``--repeats`` times in its process (the first run
gives the memory figure, the fastest the time).

    python benchmarks/full_vocab.py                       # both modes, about 10 minutes
    python benchmarks/full_vocab.py --modes logits --repeats 2
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    best_of,
    finish_result,
    load_average,
    measure,
    rss_bytes,
    run_child,
    run_child_logged,
    serve_child,
    start_result,
)

VARIANTS = ("naive", "before", "gbmpo")
GOAL_EXTRA_LOGITS = 1.0  # at most one logits tensor of extra memory ...
GOAL_TIME_RATIO = 1.5  # ... at no more than 1.5x the naive time


def _potential(name: str) -> Any:
    from gbmpo.objectives.potentials import get_potential

    return get_potential(name)


def _naive_rows(x: Any, y: Any, potential: str) -> Any:
    """The textbook whole-batch divergence from two logit tensors (autograd does the rest)."""
    import torch
    import torch.nn.functional as F

    lp = torch.log_softmax(x, dim=-1)
    lq = torch.log_softmax(y, dim=-1)
    if potential == "neg_entropy":
        return F.kl_div(lq, lp, reduction="none", log_target=True).sum(-1)
    return (lp.exp() - lq.exp()).square().sum(-1)


def _before_logits(x: Any, y: Any, potential: str, chunk: int) -> Any:
    """gbmpo's previous full_vocab_bregman with grad: checkpointed row chunks."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from gbmpo.objectives.full_vocab import bregman_rows

    pot = _potential(potential)
    v = x.shape[-1]
    fx, fy = x.reshape(-1, v), y.reshape(-1, v)
    outs = [
        checkpoint(lambda a, b: bregman_rows(a, b, pot), fx[s : s + chunk], fy[s : s + chunk],
                   use_reentrant=False)
        for s in range(0, fx.shape[0], chunk)
    ]
    return torch.cat(outs).reshape(x.shape[:-1])


def _before_hidden(h: Any, w: Any, rh: Any, potential: str, chunk: int) -> Any:
    """gbmpo's previous full_vocab_bregman_from_hidden: projection inside checkpointed chunks."""
    import torch
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    from gbmpo.objectives.full_vocab import bregman_rows

    pot = _potential(potential)
    rw = w.detach()
    rows, ref_rows = h.reshape(-1, h.shape[-1]), rh.reshape(-1, rh.shape[-1])

    def fn(hc: Any, rc: Any, weight: Any) -> Any:
        logits = F.linear(hc, weight)
        with torch.no_grad():
            ref = F.linear(rc, rw)
        return bregman_rows(logits, ref, pot)

    outs = [
        checkpoint(fn, rows[s : s + chunk], ref_rows[s : s + chunk], w, use_reentrant=False)
        for s in range(0, rows.shape[0], chunk)
    ]
    return torch.cat(outs).reshape(h.shape[:-1])


def _inputs(a: argparse.Namespace, mode: str) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    shape = (a.batch, a.seq)
    weights = torch.rand(shape, generator=g) + 0.5  # per-token loss weights (non-uniform dL/dD)
    if mode == "logits":
        x = torch.randn((*shape, a.vocab), generator=g).mul_(a.logit_scale)
        y = torch.randn((*shape, a.vocab), generator=g).mul_(a.logit_scale)
        return {"x": x.requires_grad_(True), "y": y, "weights": weights}
    h = torch.randn((*shape, a.hidden), generator=g)
    rh = h + 0.1 * torch.randn((*shape, a.hidden), generator=g)
    w = torch.randn((a.vocab, a.hidden), generator=g).mul_(a.logit_scale / a.hidden**0.5)
    return {"h": h.requires_grad_(True), "rh": rh, "w": w.requires_grad_(True),
            "weights": weights}


def _forward(variant: str, mode: str, t: dict[str, Any], a: argparse.Namespace) -> Any:
    import torch.nn.functional as F

    from gbmpo.objectives import full_vocab_bregman, full_vocab_bregman_from_hidden

    pot = a.potential
    variant, _, chunk = variant.partition("@")  # "gbmpo@256": another chunk size
    chunk_logits = int(chunk) if chunk else a.chunk_logits
    chunk_hidden = int(chunk) if chunk else a.chunk_hidden
    if mode == "logits":
        if variant == "naive":
            return _naive_rows(t["x"], t["y"], pot)
        if variant == "before":
            return _before_logits(t["x"], t["y"], pot, chunk_logits)
        return full_vocab_bregman(t["x"], t["y"], pot, chunk_size=chunk_logits)
    if variant == "naive":
        w = t["w"]
        return _naive_rows(F.linear(t["h"], w), F.linear(t["rh"], w.detach()), pot)
    if variant == "before":
        return _before_hidden(t["h"], t["w"], t["rh"], pot, chunk_hidden)
    return full_vocab_bregman_from_hidden(t["h"], t["w"], pot, ref_hidden=t["rh"],
                                          chunk_size=chunk_hidden)


def child_measure(a: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(a.threads)
    rss_start = rss_bytes()
    t = _inputs(a, a.mode)
    leaves = [v for v in t.values() if v.requires_grad]
    gc.collect()
    rss_inputs = rss_bytes()
    runs = []
    for _ in range(a.repeats):
        for leaf in leaves:
            leaf.grad = None
        with measure() as m:
            d = _forward(a.variant, a.mode, t, a)
            (d * t["weights"]).sum().backward()
        del d
        runs.append({**m.record(), "rss_before_gb": m.rss_before / 1e9, "peak_gb": m.peak / 1e9})
    grad_bytes = sum(leaf.grad.numel() * leaf.grad.element_size() for leaf in leaves)
    return {
        "variant": a.variant,
        "mode": a.mode,
        "runs": runs,
        **best_of(runs),
        "extra_peak_gb_max": max(r["extra_peak_gb"] for r in runs),
        "rss_after_import_gb": rss_start / 1e9,
        "rss_inputs_gb": rss_inputs / 1e9,
        "gradient_gb": grad_bytes / 1e9,
        "threads": torch.get_num_threads(),
        "loadavg_end": load_average(),
    }


def child_check(a: argparse.Namespace) -> dict[str, Any]:
    """Values and gradients of every variant against ``naive`` on a few rows at full V."""
    import torch

    torch.set_num_threads(a.threads)
    small = argparse.Namespace(**{**vars(a), "batch": 2, "seq": a.check_rows // 2})
    out: dict[str, Any] = {}
    for mode in ("logits", "hidden"):
        base = _inputs(small, mode)
        results = {}
        for variant in VARIANTS:
            t = {k: (v.detach().clone().requires_grad_(v.requires_grad)) for k, v in base.items()}
            d = _forward(variant, mode, t, small)
            (d * t["weights"]).sum().backward()
            grads = [v.grad for v in t.values() if v.requires_grad]
            results[variant] = (d.detach(), grads)
        ref_d, ref_g = results["naive"]
        for variant in ("before", "gbmpo"):
            d, gs = results[variant]
            out[f"{mode}/{variant}"] = {
                "value_max_rel_diff": float((d - ref_d).abs().max() / ref_d.abs().max()),
                "grad_max_rel_diff": max(
                    float((g - r).abs().max() / r.abs().max()) for g, r in zip(gs, ref_g,
                                                                               strict=True)
                ),
            }
    return out


def _args(a: argparse.Namespace, extra: list[str]) -> list[str]:
    return [__file__, "--batch", str(a.batch), "--seq", str(a.seq), "--vocab", str(a.vocab),
            "--hidden", str(a.hidden), "--potential", a.potential, "--threads", str(a.threads),
            "--chunk-logits", str(a.chunk_logits), "--chunk-hidden", str(a.chunk_hidden),
            "--repeats", str(a.repeats), "--logit-scale", str(a.logit_scale),
            "--check-rows", str(a.check_rows), *extra]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--modes", default="logits,hidden")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help="naive, before, gbmpo; 'gbmpo@N' = gbmpo with chunks of N rows")
    p.add_argument("--extra-hidden-chunks", default="256",
                   help="comma list: also time gbmpo@N in hidden mode ('' for none)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--hidden", type=int, default=1024, help="hidden size H (hidden mode)")
    p.add_argument("--potential", default="neg_entropy", choices=["neg_entropy", "square"])
    p.add_argument("--chunk-logits", type=int, default=32, help="rows per chunk, logits mode")
    p.add_argument("--chunk-hidden", type=int, default=128,
                   help="rows per chunk, hidden mode (the library default)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--logit-scale", type=float, default=2.0)
    p.add_argument("--check-rows", type=int, default=16, help="rows of the correctness check")
    p.add_argument("--out", default=None)
    p.add_argument("--child", choices=["measure", "check"], help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    a = p.parse_args()
    if serve_child(a, {"measure": child_measure, "check": child_check}):
        return

    n_rows = a.batch * a.seq
    logits_gb = n_rows * a.vocab * 4 / 1e9
    result: dict[str, Any] = {
        **start_result("full_vocab"),
        "settings": {"batch": a.batch, "seq": a.seq, "vocab": a.vocab, "hidden": a.hidden,
                     "potential": a.potential, "dtype": "float32", "threads": a.threads,
                     "chunk_logits": a.chunk_logits, "chunk_hidden": a.chunk_hidden,
                     "repeats": a.repeats},
        "one_logits_tensor_gb": logits_gb,
        "check": run_child(_args(a, ["--child", "check"])),
        "modes": {},
    }
    summary = []
    for mode in [m for m in a.modes.split(",") if m]:
        entry: dict[str, Any] = {}
        variants = [v for v in a.variants.split(",") if v]
        if mode == "hidden" and "gbmpo" in variants:
            variants += [f"gbmpo@{c}" for c in a.extra_hidden_chunks.split(",") if c]
        for variant in variants:
            res = entry[variant] = run_child_logged(
                _args(a, ["--child", "measure", "--mode", mode, "--variant", variant]))
            print(f"[{mode}] {variant}: {res['seconds_min']:.2f} s (CPU "
                  f"{res['cpu_seconds_min']:.2f} s), extra "
                  f"{res['extra_peak_gb']:.3f} GB ({res['extra_peak_gb'] / logits_gb:.2f} logits "
                  f"tensors; gradients {res['gradient_gb']:.3f} GB) "
                  f"(load {res['loadavg_start'][0]})", flush=True)
        if "naive" in entry and "gbmpo" in entry:
            ours, naive = entry["gbmpo"], entry["naive"]
            entry["time_ratio_vs_naive"] = ours["seconds_min"] / naive["seconds_min"]
            entry["cpu_time_ratio_vs_naive"] = ours["cpu_seconds_min"] / naive["cpu_seconds_min"]
            # first call in a fresh process (includes one-time library initialisation, ~20 MB)
            # and a repeated call in the same process
            entry["extra_in_logits_tensors"] = ours["extra_peak_gb"] / logits_gb
            entry["extra_in_logits_tensors_repeat"] = ours["runs"][-1]["extra_peak_gb"] / logits_gb
            # what the divergence needs beyond the gradients it returns (hidden mode: the LM
            # head's weight gradient exists in any training step anyway)
            entry["extra_beyond_gradients_in_logits_tensors"] = (
                ours["extra_peak_gb"] - ours["gradient_gb"]) / logits_gb
            entry["memory_saving_vs_naive"] = naive["extra_peak_gb"] / ours["extra_peak_gb"]
            # goal: at most one logits tensor of extra memory (logits mode: the gradient itself,
            # a logits tensor, counts; hidden mode: beyond the parameter gradients), at most 1.5x
            # the naive time (wall and CPU)
            memory = (entry["extra_in_logits_tensors_repeat"] if mode == "logits"
                      else entry["extra_beyond_gradients_in_logits_tensors"])
            entry["goal_met"] = bool(memory <= GOAL_EXTRA_LOGITS + 0.02
                                     and entry["time_ratio_vs_naive"] <= GOAL_TIME_RATIO
                                     and entry["cpu_time_ratio_vs_naive"] <= GOAL_TIME_RATIO)
            summary.append(f"{mode}: extra {ours['extra_peak_gb']:.2f} GB "
                           f"({entry['extra_in_logits_tensors']:.2f} logits tensors) vs naive "
                           f"{naive['extra_peak_gb']:.2f} GB, time "
                           f"{entry['time_ratio_vs_naive']:.2f}x naive (CPU time "
                           f"{entry['cpu_time_ratio_vs_naive']:.2f}x)")
        result["modes"][mode] = entry
    path = finish_result(result, a.out)
    print(f"full_vocab: {'; '.join(summary)} -> {path}")


if __name__ == "__main__":
    main()
