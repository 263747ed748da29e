"""f-divergence regularizers (``fkl``, ``js``, ``chi2``, ``hellinger``, ``tv``, ``alpha``,
``kl_chi2``): the exact full-vocabulary form against entry-by-entry vocabulary sums in float64
(value and gradient), the sampled estimator's unbiasedness (value and gradient, by enumerating the
vocabulary), the alpha limits, symmetry where it holds, finite values at +-1000 logits, and the
regularizer's own declaration of its exact form (a plugin regularizer with ``estimator: full``)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from gbmpo.objectives import full_vocab_divergence, get_regularizer
from gbmpo.objectives.estimators import check_estimator, full_forms
from gbmpo.objectives.f_divergences import F_DIVERGENCES
from gbmpo.objectives.full_vocab import RowDivergence, full_vocab_bregman

F64 = torch.float64
B, T, V = 2, 3, 9
T_ = torch.Tensor


def _pair(seed: int = 0, scale: float = 1.5) -> tuple[T_, T_]:
    g = torch.Generator().manual_seed(seed)
    x = scale * torch.randn(B, T, V, generator=g, dtype=F64)
    y = x + 0.8 * torch.randn(B, T, V, generator=g, dtype=F64)
    return x, y


def _term(name: str, pv: T_, qv: T_, a: float, w: float) -> T_:
    """One vocabulary entry's term of the divergence (textbook formulas)."""
    mv = 0.5 * (pv + qv)
    if name == "fkl":
        return qv * torch.log(qv / pv)
    if name == "js":
        return 0.5 * pv * torch.log(pv / mv) + 0.5 * qv * torch.log(qv / mv)
    if name == "chi2":
        return (pv - qv) ** 2 / qv
    if name == "hellinger":
        return 0.5 * (pv.sqrt() - qv.sqrt()) ** 2
    if name == "tv":
        return 0.5 * (pv - qv).abs()
    if name == "alpha":
        return (a * pv + (1 - a) * qv - pv**a * qv ** (1 - a)) / (a * (1 - a))
    if name == "kl_chi2":
        return pv * torch.log(pv / qv) + 0.5 * w * (pv - qv) ** 2 / qv
    raise AssertionError(name)


def _brute(name: str, x: T_, y: T_, **params: float) -> T_:
    """The divergence written entry by entry over the vocabulary."""
    p, q = torch.softmax(x, -1), torch.softmax(y, -1)
    out = torch.zeros(x.shape[:-1], dtype=x.dtype)
    a, w = params.get("alpha", 0.5), params.get("weight", 1.0)
    for v in range(x.shape[-1]):
        out = out + _term(name, p[..., v], q[..., v], a, w)
    return out


CASES = [
    ("fkl", {}), ("js", {}), ("chi2", {}), ("hellinger", {}), ("tv", {}),
    ("alpha", {"alpha": 0.5}), ("alpha", {"alpha": 0.3}), ("alpha", {"alpha": 2.0}),
    ("alpha", {"alpha": -0.5}), ("kl_chi2", {"weight": 1.0}), ("kl_chi2", {"weight": 0.25}),
]  # fmt: skip


def test_every_f_divergence_is_registered_and_declares_its_full_form() -> None:
    forms = full_forms()
    for name in F_DIVERGENCES:
        reg = get_regularizer(name)
        assert isinstance(reg.full, RowDivergence) and name in forms, name
        assert reg.clampable is False
    for name in ("kl_k1", "kl_k3", "kl_k1_st", "kl_k3_st", "prob_l2", "neural_mirror"):
        assert name in forms
    assert "log_l2" not in forms and "rpg_fkl" not in forms


@pytest.mark.parametrize(("name", "params"), CASES)
def test_full_form_equals_the_entrywise_vocabulary_sum_value_and_gradient(
    name: str, params: dict[str, float]
) -> None:
    x, y = _pair()
    xg = x.clone().requires_grad_()
    got = full_vocab_divergence(name, xg, y, **params)
    want = _brute(name, x, y, **params)
    assert got.shape == (B, T) and got.dtype == F64
    torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-13)
    wt = torch.rand(B, T, generator=torch.Generator().manual_seed(2), dtype=F64)
    (g,) = torch.autograd.grad((got * wt).sum(), xg)
    xb = x.clone().requires_grad_()
    (gb,) = torch.autograd.grad((_brute(name, xb, y, **params) * wt).sum(), xb)
    torch.testing.assert_close(g, gb, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(("name", "params"), CASES)
def test_chunked_and_masked_equal_the_one_pass_result(name: str, params: dict[str, float]) -> None:
    x, y = _pair(seed=3)
    form = get_regularizer(name, **params).full
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 1] = mask[1, 2] = False
    x = x.clone()
    x[0, 1] = float("nan")  # masked garbage
    xs = [x.clone().requires_grad_() for _ in range(2)]
    one = full_vocab_bregman(xs[0], y, form, chunk_size=None, mask=mask)
    chunked = full_vocab_bregman(xs[1], y, form, chunk_size=2, mask=mask)
    torch.testing.assert_close(one, chunked, rtol=1e-13, atol=1e-15)
    assert one[0, 1] == 0 and one[1, 2] == 0
    g1, g2 = (torch.autograd.grad(o.sum(), xi)[0] for o, xi in zip((one, chunked), xs, strict=True))
    torch.testing.assert_close(g1, g2, rtol=1e-12, atol=1e-14)
    assert torch.isfinite(g1).all() and (g1[0, 1] == 0).all()


def test_alpha_limits_are_the_two_kls() -> None:
    x, y = _pair(seed=4)
    rkl = full_vocab_divergence("kl_k3", x, y)
    fkl = full_vocab_divergence("fkl", x, y)
    assert torch.equal(full_vocab_divergence("alpha", x, y, alpha=1.0), rkl) or torch.allclose(
        full_vocab_divergence("alpha", x, y, alpha=1.0), rkl, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(full_vocab_divergence("alpha", x, y, alpha=0.0), fkl,
                               rtol=1e-13, atol=1e-15)
    for eps in (1e-4, 1e-5):
        torch.testing.assert_close(full_vocab_divergence("alpha", x, y, alpha=1 - eps), rkl,
                                   rtol=50 * eps, atol=1e-9)
        torch.testing.assert_close(full_vocab_divergence("alpha", x, y, alpha=eps), fkl,
                                   rtol=50 * eps, atol=1e-9)
    # alpha = 1/2 is 4 H^2, alpha = 2 is chi^2 / 2
    torch.testing.assert_close(full_vocab_divergence("alpha", x, y, alpha=0.5),
                               4 * full_vocab_divergence("hellinger", x, y))
    torch.testing.assert_close(full_vocab_divergence("alpha", x, y, alpha=2.0),
                               0.5 * full_vocab_divergence("chi2", x, y))
    # sampled form too: alpha -> 1 is k3
    logp = torch.log_softmax(x, -1)[..., 0]
    ref = torch.log_softmax(y, -1)[..., 0]
    torch.testing.assert_close(get_regularizer("alpha", alpha=1.0)(logp=logp, anchor_logp=ref),
                               get_regularizer("kl_k3")(logp=logp, anchor_logp=ref))


def test_symmetry_where_it_holds() -> None:
    x, y = _pair(seed=5)
    for name in ("js", "hellinger", "tv"):
        torch.testing.assert_close(full_vocab_divergence(name, x, y),
                                   full_vocab_divergence(name, y, x), rtol=1e-12, atol=1e-14)
    # alpha(a)(p || q) = alpha(1 - a)(q || p); KL and chi2 are not symmetric
    torch.testing.assert_close(full_vocab_divergence("alpha", x, y, alpha=0.3),
                               full_vocab_divergence("alpha", y, x, alpha=0.7))
    torch.testing.assert_close(full_vocab_divergence("fkl", x, y),
                               full_vocab_divergence("kl_k1", y, x))
    assert not torch.allclose(full_vocab_divergence("chi2", x, y),
                              full_vocab_divergence("chi2", y, x))


def test_bounds_and_zero_at_equality() -> None:
    x, y = _pair(seed=6, scale=3.0)
    js = full_vocab_divergence("js", x, y)
    assert (js >= 0).all() and (js <= math.log(2) + 1e-12).all()
    for name in ("hellinger", "tv"):
        d = full_vocab_divergence(name, x, y)
        assert (d >= 0).all() and (d <= 1 + 1e-12).all()
    for name, params in CASES:
        assert full_vocab_divergence(name, x, x, **params).abs().max() < 1e-12, name


@pytest.mark.parametrize("dtype", [torch.float32, F64, torch.bfloat16])
@pytest.mark.parametrize(("name", "params"), CASES)
def test_finite_at_plus_minus_1000_logits(name: str, params: dict[str, float], dtype) -> None:
    x = torch.tensor([[[1000.0, -1000.0, 0.0, -1000.0], [0.0, 0.0, 0.0, 0.0],
                       [-1000.0, 1000.0, 3.0, float("-inf")]]], dtype=dtype)
    y = torch.tensor([[[-1000.0, 1000.0, 0.0, 0.0], [1000.0, -1000.0, 0.0, -1000.0],
                       [1000.0, -1000.0, 3.0, 0.0]]], dtype=dtype)
    xg = x.clone().requires_grad_()
    d = full_vocab_divergence(name, xg, y, **params)
    assert torch.isfinite(d).all(), d
    (g,) = torch.autograd.grad(d.sum(), xg)
    assert torch.isfinite(g).all(), g
    # sampled form: log-probs down to -2000, both ways
    logp = torch.tensor([[-2000.0, 0.0, -0.3, -50.0]], dtype=dtype)
    ref = torch.tensor([[0.0, -2000.0, -0.2, -0.1]], dtype=dtype)
    old = torch.tensor([[0.0, -2000.0, -0.4, -60.0]], dtype=dtype)
    lp = logp.clone().requires_grad_()
    v = get_regularizer(name, **params)(logp=lp, old_logp=old, anchor_logp=ref)
    (gs,) = torch.autograd.grad(v.sum(), lp)
    assert torch.isfinite(v).all() and torch.isfinite(gs).all(), (v, gs)


@pytest.mark.parametrize(("name", "params"), CASES)
def test_sampled_estimator_is_unbiased_in_value_and_gradient(
    name: str, params: dict[str, float]
) -> None:
    """Enumerate the vocabulary: E_{v ~ pi_old}[w_o g(t_v)] = D_full and its gradient with
    respect to the policy logits = grad D_full (tokens from pi_old, importance-weighted)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(V, generator=g, dtype=F64)
    y = x + 0.9 * torch.randn(V, generator=g, dtype=F64)
    z = x + 0.5 * torch.randn(V, generator=g, dtype=F64)  # pi_old: neither pi nor pi_ref
    old = torch.log_softmax(z, -1)
    reg = get_regularizer(name, **params)

    def estimate(xx: T_) -> T_:
        logp = torch.log_softmax(xx, -1)
        vals = reg(logp=logp[None], old_logp=old[None], anchor_logp=torch.log_softmax(y, -1)[None])
        return (old.exp() * vals[0]).sum()

    xg = x.clone().requires_grad_()
    est = estimate(xg)
    (g_est,) = torch.autograd.grad(est, xg)
    xe = x.clone().requires_grad_()
    exact = full_vocab_divergence(name, xe[None, None], y[None, None], **params)[0, 0]
    (g_exact,) = torch.autograd.grad(exact, xe)
    torch.testing.assert_close(est, exact.detach(), rtol=1e-11, atol=1e-13)
    torch.testing.assert_close(g_est, g_exact, rtol=1e-9, atol=1e-12)
    # on-policy (old_logp None): each token's value is g >= 0, 0 where p = q
    logp = torch.log_softmax(x, -1)[None]
    vals = reg(logp=logp, anchor_logp=torch.log_softmax(y, -1)[None])
    assert (vals >= -1e-15).all()
    assert reg(logp=logp, anchor_logp=logp).abs().max() < 1e-15


def test_params_are_checked_by_name() -> None:
    with pytest.raises(ValueError, match="alpha must be a finite number"):
        get_regularizer("alpha", alpha=float("nan"))
    with pytest.raises(ValueError, match="weight must be >= 0"):
        get_regularizer("kl_chi2", weight=-1.0)
    with pytest.raises(TypeError, match="clamp"):
        get_regularizer("js", clamp=10.0)
    with pytest.raises(ValueError, match=r"no full-vocabulary form.*fkl"):
        full_vocab_divergence("log_l2", torch.zeros(1, 1, 3), torch.zeros(1, 1, 3))
    check_estimator("fkl", "full", "ref", {})  # declared on the regularizer: accepted


PLUGIN = '''
import torch
from gbmpo.objectives import Regularizer
from gbmpo.objectives.full_vocab import RowDivergence
from gbmpo.objectives.regularizers import REGULARIZERS


def _rows(log_p, log_q):
    # sum_v (log p_v - log q_v)^2 p_v : a plugin's own exact form
    return (log_p.exp() * (log_p - log_q).square()).sum(-1)


@REGULARIZERS.register("plugin_sq_logratio")
def make():
    return Regularizer(
        "plugin_sq_logratio",
        lambda l, r, o: (l - r).square(),
        full=RowDivergence("plugin_sq_logratio", _rows, "sum_v p_v (log p_v - log q_v)^2"),
    )
'''


def test_a_plugin_regularizer_declares_its_full_form_and_trains_with_it(tmp_path: Path) -> None:
    """A regularizer registered from a plugin file (``--import``) with its own exact form
    trains with ``estimator: full`` (in a child process, so the registry here stays as is)."""
    import json
    import os
    import subprocess

    (tmp_path / "fdiv_plugin_mod.py").write_text(PLUGIN)
    out = tmp_path / "run"
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), src])}
    env.pop("GBMPO_PLUGINS", None)
    proc = subprocess.run([
        sys.executable, "-m", "gbmpo.cli", "--import", "fdiv_plugin_mod", "train", "--steps", "2",
        "--rollout.prompts_per_step", "2", "--num-generations", "2", "--max-new-tokens", "6",
        "--eval.before", "false", "--eval.after", "false", "--eval-every", "0",
        "--time-budget", "null", "--run.progress", "false", "--mu", "1",
        "--optim.mini_batch_size", "null",
        "--objective.regularizer.name", "plugin_sq_logratio",
        "--objective.regularizer.coef", "0.1",
        "--objective.regularizer.estimator", "full",
        "--output-dir", str(out),
    ], capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "reg_value" in m]
    assert len(steps) == 2 and all(math.isfinite(m["reg_value"]) for m in steps)
    assert all(m["reg_value"] > 0 for m in steps[1:])  # the policy moved: exact value > 0
    # the same plugin without its full form is refused with full, naming it
    (tmp_path / "fdiv_plugin_mod.py").write_text(PLUGIN.replace(
        "full=RowDivergence(", "full=None and RowDivergence("))
    proc = subprocess.run([
        sys.executable, "-m", "gbmpo.cli", "--import", "fdiv_plugin_mod", "train", "--steps", "1",
        "--objective.regularizer.name", "plugin_sq_logratio",
        "--objective.regularizer.estimator", "full", "--output-dir", str(tmp_path / "run2"),
    ], capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert proc.returncode == 2 and "plugin_sq_logratio" in proc.stderr
    assert "no full-vocabulary form" in proc.stderr or "declares no" in proc.stderr


def test_a_regularizer_object_carries_its_full_form_into_the_estimator() -> None:
    from gbmpo.objectives import Regularizer
    from gbmpo.objectives.estimators import full_divergence, full_potential

    def rows(log_p: T_, log_q: T_) -> T_:
        return (log_p.exp() * (log_p - log_q).square()).sum(-1)

    reg = Regularizer("mine", lambda l, r, o: (l - r).square(),
                      full=RowDivergence("mine", rows, "sum_v p_v (log p_v - log q_v)^2"))
    check_estimator("mine", "full", "ref", {}, reg)
    x, y = _pair(seed=8)
    got = full_divergence(x, y, full_potential("mine", reg), torch.ones(B, T))
    lp, lq = torch.log_softmax(x, -1), torch.log_softmax(y, -1)
    torch.testing.assert_close(got, (lp.exp() * (lp - lq) ** 2).sum(-1))
    with pytest.raises(ValueError, match="declares no full-vocabulary form"):
        check_estimator("mine", "full", "ref", {}, Regularizer("mine", lambda l, r, o: l - r))
