"""Selected-token log-probs over a large vocabulary: memory and time against the naive form.

log pi(o_t | h_t) = z_{o_t} - logsumexp_v z_v for a [B, T] = [4, 256] batch of float32 logits
over the Qwen3 vocabulary V = 151,936, with (``grad``: the training forward + backward, weighted
sum) and without gradient (``nograd``: behaviour / reference log-probs).

Variants:

* ``naive``: ``torch.log_softmax(logits, -1).gather(-1, index)`` (a full [B, T, V] log-softmax);
* ``trl``: TRL 1.16's ``trl.trainer.utils.selective_log_softmax`` (gather, then a logsumexp per
  sequence; skipped when TRL is not installed);
* ``before``: gbmpo's previous ``selective_log_softmax`` (autograd through 1024-row chunks);
* ``gbmpo``: :func:`gbmpo.rollout.logprobs.selective_log_softmax` (chunks of about 4M logits, a
  custom backward that writes the gradient in place).

Layouts: ``contiguous`` ([B, T, V] logits) and ``sliced`` (the view ``logits[:, :-1]`` of a
[B, T + 1, V] tensor, which is what a causal LM's output looks like before the last position is
dropped; it cannot be flattened to [B*T, V] without a copy).

Measurement as in ``full_vocab.py``: a fresh process per variant, extra = peak RSS during the
call minus RSS before it (after the inputs exist), including the gradient it produces in ``grad``
mode (one [B, T, V] tensor, 0.62 GB, for every variant); time = the fastest of ``--repeats``.

    python benchmarks/logprobs.py
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
    run_child,
    run_child_logged,
    serve_child,
    start_result,
)

VARIANTS = ("naive", "trl", "before", "gbmpo")


def _before(logits: Any, index: Any, chunk_rows: int = 1024) -> Any:
    """gbmpo's previous selective_log_softmax (autograd through row chunks)."""
    import torch

    flat = logits.reshape(-1, logits.shape[-1])
    idx = index.reshape(-1, 1)
    parts = []
    for s in range(0, flat.shape[0], chunk_rows):
        z = flat[s : s + chunk_rows].float()
        parts.append(z.gather(-1, idx[s : s + chunk_rows]).squeeze(-1) - torch.logsumexp(z, -1))
    return torch.cat(parts).reshape(index.shape)


def _logp(variant: str, logits: Any, index: Any) -> Any:
    import torch

    if variant == "naive":
        return torch.log_softmax(logits, dim=-1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
    if variant == "trl":
        from trl.trainer.utils import selective_log_softmax as trl_selective_log_softmax

        return trl_selective_log_softmax(logits, index)
    if variant == "before":
        return _before(logits, index)
    from gbmpo.rollout.logprobs import selective_log_softmax

    return selective_log_softmax(logits, index)


def _inputs(a: argparse.Namespace, batch: int, seq: int) -> tuple[Any, Any, Any, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    extra = 1 if a.layout == "sliced" else 0
    base = torch.randn((batch, seq + extra, a.vocab), generator=g).mul_(a.logit_scale)
    base.requires_grad_(a.mode == "grad")
    logits = base[:, :-1] if extra else base
    index = torch.randint(0, a.vocab, (batch, seq), generator=g)
    weights = torch.rand((batch, seq), generator=g) + 0.5
    return base, logits, index, weights


def child_measure(a: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(a.threads)
    if a.variant == "trl":
        import trl.trainer.utils  # noqa: F401  (import cost outside the measurement)
    base, logits, index, weights = _inputs(a, a.batch, a.seq)
    gc.collect()
    runs = []
    for _ in range(a.repeats):
        base.grad = None
        with measure() as m:
            if a.mode == "grad":
                lp = _logp(a.variant, logits, index)
                (lp * weights).sum().backward()
            else:
                with torch.no_grad():
                    lp = _logp(a.variant, logits, index)
        del lp
        runs.append(m.record())
    return {"variant": a.variant, "mode": a.mode, "layout": a.layout, "runs": runs,
            **best_of(runs),
            "extra_peak_gb_repeat": runs[-1]["extra_peak_gb"],
            "loadavg_end": load_average()}


def child_check(a: argparse.Namespace) -> dict[str, Any]:
    """Values and gradients of every variant against ``naive`` on a few rows at full V."""
    import torch

    torch.set_num_threads(a.threads)
    out: dict[str, Any] = {}
    for layout in ("contiguous", "sliced"):
        b = argparse.Namespace(**{**vars(a), "layout": layout, "mode": "grad"})
        base0, _, index, weights = _inputs(b, 2, a.check_rows // 2)
        res = {}
        for variant in ["naive", *[v for v in a.variants.split(",") if v != "naive"]]:
            base = base0.detach().clone().requires_grad_(True)
            logits = base[:, :-1] if layout == "sliced" else base
            lp = _logp(variant, logits, index)
            (lp * weights).sum().backward()
            res[variant] = (lp.detach(), base.grad)
        ref_v, ref_g = res["naive"]
        for variant, (v, g) in res.items():
            if variant != "naive":
                out[f"{layout}/{variant}"] = {
                    "value_max_abs_diff": float((v - ref_v).abs().max()),
                    "grad_max_abs_diff": float((g - ref_g).abs().max()),
                }
    return out


def _available() -> list[str]:
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        return [v for v in VARIANTS if v != "trl"]
    return list(VARIANTS)


def _args(a: argparse.Namespace, extra: list[str]) -> list[str]:
    return [__file__, "--batch", str(a.batch), "--seq", str(a.seq), "--vocab", str(a.vocab),
            "--threads", str(a.threads), "--repeats", str(a.repeats), "--logit-scale",
            str(a.logit_scale), "--check-rows", str(a.check_rows), "--variants",
            ",".join(v for v in a.variants.split(",") if v in _available()), *extra]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--modes", default="grad,nograd")
    p.add_argument("--layouts", default="contiguous,sliced")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--logit-scale", type=float, default=2.0)
    p.add_argument("--check-rows", type=int, default=16)
    p.add_argument("--out", default=None)
    p.add_argument("--child", choices=["measure", "check"], help=argparse.SUPPRESS)
    p.add_argument("--mode", default="grad", help=argparse.SUPPRESS)
    p.add_argument("--layout", default="contiguous", help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    a = p.parse_args()
    if serve_child(a, {"measure": child_measure, "check": child_check}):
        return

    logits_gb = a.batch * a.seq * a.vocab * 4 / 1e9
    variants = [v for v in a.variants.split(",") if v in _available()]
    result: dict[str, Any] = {
        **start_result("logprobs"),
        "settings": {"batch": a.batch, "seq": a.seq, "vocab": a.vocab, "dtype": "float32",
                     "threads": a.threads, "repeats": a.repeats},
        "one_logits_tensor_gb": logits_gb,
        "check": run_child(_args(a, ["--child", "check"])),
        "results": {},
    }
    summary = []
    for mode in [m for m in a.modes.split(",") if m]:
        for layout in [x for x in a.layouts.split(",") if x]:
            key = f"{mode}/{layout}"
            entry: dict[str, Any] = {}
            for variant in variants:
                res = entry[variant] = run_child_logged(
                    _args(a, ["--child", "measure", "--mode", mode, "--layout", layout,
                              "--variant", variant]))
                print(f"[{key}] {variant}: {res['seconds_min']:.3f} s (CPU "
                      f"{res['cpu_seconds_min']:.3f} s), extra "
                      f"{res['extra_peak_gb']:.3f} GB "
                      f"({res['extra_peak_gb'] / logits_gb:.2f} logits tensors) "
                      f"(load {res['loadavg_start'][0]})", flush=True)
            if "naive" in entry and "gbmpo" in entry:
                entry["speedup_vs_naive"] = (entry["naive"]["seconds_min"]
                                             / entry["gbmpo"]["seconds_min"])
                entry["cpu_speedup_vs_naive"] = (entry["naive"]["cpu_seconds_min"]
                                                 / entry["gbmpo"]["cpu_seconds_min"])
                entry["memory_saving_vs_naive"] = (entry["naive"]["extra_peak_gb"]
                                                   / max(entry["gbmpo"]["extra_peak_gb"], 1e-3))
                summary.append(f"{key} {entry['gbmpo']['extra_peak_gb']:.2f} vs "
                               f"{entry['naive']['extra_peak_gb']:.2f} GB, "
                               f"{entry['speedup_vs_naive']:.2f}x naive speed")
            result["results"][key] = entry
    path = finish_result(result, a.out)
    print(f"logprobs: gbmpo vs naive extra memory / speed: {'; '.join(summary)} -> {path}")


if __name__ == "__main__":
    main()
