"""The policy loss over the whole registry (:func:`gbmpo.objectives.compute_policy_loss`): every
surrogate (every ``divergence_clip`` measure but the neural mirror's) x every regularizer x every
aggregation, float32 and float64, with several terms, token weights and micro-batch normalisers.

Two references: the float64 evaluation of the same batch (float32 within its rounding), and the
package at 91973f4 (read from git where the repository has it), whose loss carried hand-written
derivatives in one fused backward node: the same loss and metrics, the gradient within a few
roundings (the hand derivatives formed the same products in another order).
"""

from __future__ import annotations

import importlib
import math
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import Tensor

from gbmpo.objectives import LossTerm, compute_policy_loss, get_regularizer, get_surrogate
from gbmpo.objectives.aggregate import AGGREGATIONS
from gbmpo.objectives.clip_measures import CLIP_MEASURES
from gbmpo.objectives.regularizers import REGULARIZERS
from gbmpo.objectives.surrogates import SURROGATES

ROOT = Path(__file__).resolve().parents[2]
#: the last package with the hand-derivative layer (the fused loss)
FUSED = "91973f4"

# --- the cases ------------------------------------------------------------------------------


def _surrogate_cases() -> dict[str, tuple[str, dict[str, Any]]]:
    """Every registered surrogate with parameters that make it run (every clip measure)."""
    cases: dict[str, tuple[str, dict[str, Any]]] = {}
    for name in SURROGATES.names():
        if name == "divergence_clip":
            # not the neural-mirror measure: building its interval table for the default map
            # takes about a minute; its loss is the per-token-bounds clip of ``prob_l2``'s
            for measure in (m for m in CLIP_MEASURES if m != "neural_mirror"):
                delta = {"dppo_tv": 0.15, "dppo_kl": 0.05, "k1": 0.2, "ratio": 0.2}.get(
                    measure, 0.02
                )
                cases[f"dc:{measure}"] = (name, {"measure": measure, "delta": delta})
            # unequal radii (prob_l2's bounds form sqrt(delta) / p once per radius)
            cases["dc:prob_l2+asym"] = (
                name, {"measure": "prob_l2", "delta_low": 0.01, "delta_high": 0.03},
            )  # fmt: skip
            cases["dc:dppo_kl+asym"] = (
                name, {"measure": "dppo_kl", "delta_low": 0.02, "delta_high": 0.08},
            )  # fmt: skip
        elif name == "gspo":
            cases[name] = (name, {})
            cases["gspo+dual+cap"] = (name, {"dual_clip_c": 3.0, "ratio_cap": 2.0})
        elif name == "rpg_reinforce":
            cases[name] = (name, {"variant": "urkl"})
            # every variant, a large beta (C_KL flips the sign of w A), a dual clip that binds
            # (c = 1.5) and none
            cases["rpg_reinforce:rkl+dual"] = (name, {"variant": "rkl", "beta": 0.5, "c": 1.5})
            cases["rpg_reinforce:fkl+dual"] = (name, {"variant": "fkl", "beta": 0.3, "c": 1.5})
            cases["rpg_reinforce:ufkl-dual"] = (name, {"variant": "ufkl", "beta": 0.5, "c": None})
            cases["rpg_reinforce:urkl+dual"] = (name, {"variant": "urkl", "beta": 0.5, "c": 1.5})
        elif name == "rpg_clip":
            cases[name] = (name, {})
            # the regularized advantages (rkl's is -beta where masked) with a binding dual clip
            cases["rpg_clip:urkl"] = (name, {"variant": "urkl", "beta": 0.5, "c": 1.5})
            cases["rpg_clip:rkl"] = (name, {"variant": "rkl", "beta": 0.5, "c": 1.5})
        elif name == "atr":
            cases[name] = (name, {"delta": 0.02})
        elif name == "clip":
            cases[name] = (name, {"eps_low": 0.2, "eps_high": 0.28})
            cases["clip+dual+cap"] = (
                name, {"eps_low": 0.2, "eps_high": 0.28, "dual_clip_c": 3.0, "ratio_cap": 2.0},
            )  # fmt: skip
        else:
            cases[name] = (name, {})
    return cases


SURROGATE_CASES = _surrogate_cases()
REGULARIZER_NAMES = REGULARIZERS.names()
AGGREGATION_NAMES = AGGREGATIONS.names()


def _batch(dtype: torch.dtype, b: int = 12, t: int = 40, seed: int = 0) -> dict[str, Tensor]:
    """Ragged batch: ratios on both sides of every clip, references near and far, one fully
    masked sequence, advantages of both signs."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.distributions.Exponential(2.0).sample((b, t)).to(dtype) - 1e-3
    old = logp + 0.3 * torch.randn(b, t, generator=g, dtype=dtype)
    ref = logp + 0.5 * torch.randn(b, t, generator=g, dtype=dtype)
    adv = torch.randn(b, generator=g, dtype=dtype)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[0], lengths[1] = t, 0
    mask = (torch.arange(t)[None, :] < lengths[:, None]).to(dtype)
    return {"logp": logp, "old": old, "ref": ref, "adv": adv, "mask": mask}


def _run(
    fn: Any,
    x: dict[str, Tensor],
    surrogate: Any,
    regs: Sequence[tuple[str, float]],
    aggregation: str,
    **kw: Any,
) -> tuple[Tensor, Tensor | None, dict[str, float]]:
    lp = x["logp"].clone().requires_grad_(True)
    terms = [LossTerm(f"{name}#{i}", get_regularizer(name), coef, x["ref"])
             for i, (name, coef) in enumerate(regs)]  # fmt: skip
    loss, metrics = fn(logp=lp, old_logp=x["old"], advantages=x["adv"], mask=x["mask"],
                       surrogate=surrogate, terms=terms, aggregation=aggregation, **kw)  # fmt: skip
    grad = torch.autograd.grad(loss, lp)[0] if loss.requires_grad else None
    return loss.detach(), grad, metrics


def _same_metrics(a: dict[str, float], b: dict[str, float]) -> bool:
    return list(a) == list(b) and all(
        a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in a
    )


#: the fused backward formed each token's gradient from the same factors as autograd (the
#: aggregation's weight, the weight and coefficient, the term's derivative: at most ~8 roundings
#: on a sum of at most 5 parts), in another order; 16 roundings of the largest entry bound it
#: (measured: 2)
ROUNDINGS = 16


def _mismatch(new: tuple, old: tuple) -> str | None:
    """Same loss and metrics, gradients within :data:`ROUNDINGS` of the largest entry."""
    (l1, g1, m1), (l2, g2, m2) = new, old
    if not torch.equal(l1, l2):
        return f"loss {l1.item()!r} != {l2.item()!r}"
    if (g1 is None) != (g2 is None):
        return "a gradient on one side only"
    if g1 is not None:
        tol = ROUNDINGS * torch.finfo(g1.dtype).eps * float(g2.abs().max().clamp_min(1e-30))
        if not torch.equal(torch.isnan(g1), torch.isnan(g2)):
            return "NaN gradients differ"
        diff = float((g1 - g2).nan_to_num(0.0).abs().max())
        if diff > tol:
            return f"gradient differs by {diff:.3g} > {tol:.3g}"
    if not _same_metrics(m1, m2):
        return f"metrics differ: {[k for k in m1 if m1.get(k) != m2.get(k)]}"
    return None


# --- the tests --------------------------------------------------------------------------------


SEVERAL = [
    [("kl_k3", 0.04), ("prob_l2", 0.3), ("log_l2", 0.01), ("kl_k1", 0.02)],
    [("kl_k3_is", 0.1), ("kl_k3", 0.04), ("rpg_urkl", 0.2)],
    [("kl_k3", 0.0), ("prob_l2", 0.3), ("rpg_rkl", 0.0)],  # zero coefficients: values only
    [("none", 0.5), ("kl_k2", 0.04)],
]
OPTIONS: list[dict[str, Any]] = [
    {},
    {"token_weights": "tokens"},
    {"token_weights": "sequences"},
    {"num_sequences": 20, "num_tokens": 301.5, "max_len": 48},
]


def _options(kw: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    w = 0.5 + torch.rand(12, 40, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    w = w.to(dtype)
    if kw.get("token_weights") == "tokens":
        return {"token_weights": w}
    if kw.get("token_weights") == "sequences":
        return {"token_weights": w[:, :1]}
    return kw


#: float32 against float64 on the same batch: the per-token values and gradients are sums and
#: products of O(1) terms after one exp (ratios up to e^1.5 here): 1e-4 relative covers float32's
#: 6e-8 rounding through the exp's condition number and the aggregation's sums over 480 tokens
F32_RTOL = 1e-4


@pytest.mark.parametrize("case", list(SURROGATE_CASES))
def test_float32_loss_is_the_float64_loss_within_rounding(case):
    """Every surrogate x every regularizer x every aggregation, and several terms with token
    weights and normalisers: the float32 loss, gradient and metrics within :data:`F32_RTOL` of
    the float64 ones on the same batch (float64 inputs rounded to float32)."""
    x64 = _batch(torch.float64)
    x32 = {k: v.to(torch.float32) for k, v in x64.items()}
    x64 = {k: v.to(torch.float64) for k, v in x32.items()}
    name, params = SURROGATE_CASES[case]
    surr = get_surrogate(name, **params)
    runs = [(agg, [] if reg is None else [(reg, 0.04)], {})
            for agg in AGGREGATION_NAMES for reg in [None, *REGULARIZER_NAMES]]  # fmt: skip
    runs += [(agg, regs, kw) for agg in AGGREGATION_NAMES for regs in SEVERAL for kw in OPTIONS]
    bad = []
    for aggregation, regs, kw in runs:
        l32, g32, m32 = _run(compute_policy_loss, x32, surr, regs, aggregation,
                             **_options(kw, torch.float32))  # fmt: skip
        l64, g64, m64 = _run(compute_policy_loss, x64, surr, regs, aggregation,
                             **_options(kw, torch.float64))  # fmt: skip
        scale = float(g64.abs().max()) if g64 is not None else 0.0
        ok = math.isclose(float(l32), float(l64), rel_tol=F32_RTOL, abs_tol=F32_RTOL)
        ok &= g32 is None or float((g32.double() - g64).abs().max()) <= F32_RTOL * max(scale, 1)
        ok &= list(m32) == list(m64) and all(
            math.isclose(m32[k], m64[k], rel_tol=F32_RTOL, abs_tol=F32_RTOL) for k in m32
        )
        if not ok:
            bad.append(f"{aggregation} / {regs} / {sorted(kw)}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("garbage", [math.nan, math.inf])
def test_garbage_under_the_mask_and_a_bool_mask(garbage):
    """NaN / inf at masked positions of every input, and a bool mask: the loss, gradient and
    metrics of the clean batch, bit for bit (masked inputs are replaced before any formula)."""
    x = _batch(torch.float32, seed=5)
    m = x["mask"] == 0
    dirty = {k: (v.masked_fill(m, garbage) if k in ("logp", "old", "ref") else v)
             for k, v in x.items()}  # fmt: skip
    dirty_bool = {**dirty, "mask": x["mask"] != 0}
    for case in ("clip", "cispo", "sapo", "dc:k3", "gmpo", "rpg_reinforce:rkl+dual"):
        name, params = SURROGATE_CASES[case]
        surr = get_surrogate(name, **params)
        for aggregation in AGGREGATION_NAMES:
            for regs in SEVERAL[:2]:
                clean = _run(compute_policy_loss, x, surr, regs, aggregation)
                for batch in (dirty, dirty_bool):
                    got = _run(compute_policy_loss, batch, surr, regs, aggregation)
                    assert torch.equal(got[0], clean[0]), (case, aggregation, regs)
                    assert torch.equal(got[1], clean[1]) and _same_metrics(got[2], clean[2])


def _objectives_at(rev: str) -> ModuleType:
    """``gbmpo.objectives`` of git revision ``rev`` under another module name (skip the test
    where the repository has no such commit, e.g. a shallow clone)."""
    name = f"_objectives_{rev}"
    if name in sys.modules:
        return sys.modules[name]
    try:
        files = subprocess.run(
            ["git", "ls-tree", "-r", "--name-only", rev, "src/gbmpo/objectives/"],
            cwd=ROOT, capture_output=True, text=True, check=True,
        ).stdout.split()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        pytest.skip(f"git revision {rev} not available")
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="objectives_before_"))
    for f in files:
        if f.endswith(".py"):
            text = subprocess.run(["git", "show", f"{rev}:{f}"], cwd=ROOT, capture_output=True,
                                  text=True, check=True).stdout  # fmt: skip
            dest = tmp / name / Path(f).relative_to("src/gbmpo/objectives")
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(text.replace("gbmpo.objectives", name))
    sys.path.insert(0, str(tmp))
    return importlib.import_module(name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_loss_is_the_fused_package_loss(dtype):
    """Against 91973f4's objectives package (hand-written derivatives in one fused backward
    node): every surrogate x every regularizer, the aggregation in turn, the same loss and
    metrics and the gradient within :data:`ROUNDINGS`; several terms with token weights too."""
    before = _objectives_at(FUSED)
    x = _batch(dtype, seed=2)
    bad = []
    runs = [(reg, [] if reg is None else [(reg, 0.04)], {}) for reg in [None, *REGULARIZER_NAMES]]
    runs += [(str(regs), regs, kw) for regs in SEVERAL for kw in OPTIONS]
    for i, (case, (name, params)) in enumerate(SURROGATE_CASES.items()):
        new_s, old_s = get_surrogate(name, **params), before.get_surrogate(name, **params)
        for j, (label, regs, kw) in enumerate(runs):
            aggregation = AGGREGATION_NAMES[(i + j) % len(AGGREGATION_NAMES)]
            opts = _options(kw, dtype)
            new = _run(compute_policy_loss, x, new_s, regs, aggregation, **opts)
            lp = x["logp"].clone().requires_grad_(True)
            terms = [before.LossTerm(f"{n}#{k}", before.get_regularizer(n), c, x["ref"])
                     for k, (n, c) in enumerate(regs)]  # fmt: skip
            loss, metrics = before.compute_policy_loss(
                logp=lp, old_logp=x["old"], advantages=x["adv"], mask=x["mask"],
                surrogate=old_s, terms=terms, aggregation=aggregation, **opts,
            )  # fmt: skip
            old = (loss.detach(), torch.autograd.grad(loss, lp)[0], metrics)
            why = _mismatch(new, old)
            if why:
                bad.append(f"{case} / {aggregation} / {label} / {sorted(kw)}: {why}")
    assert not bad, "\n".join(bad)
