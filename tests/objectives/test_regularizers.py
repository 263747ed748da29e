"""Selected-token regularizers: values, analytic gradients (float64), masks, dtypes, registry."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gbmpo.objectives.mirror import NeuralMirrorMap
from gbmpo.objectives.regularizers import REGULARIZERS, Regularizer, get_regularizer
from gbmpo.registry import UnknownNameError

F64 = torch.float64
T = torch.Tensor
MIRROR = NeuralMirrorMap.random(scale=0.7, seed=3)  # large enough for a non-trivial gradient
LOG_FLOOR = math.log(1e-10)


def _inputs(seed: int = 0, shape: tuple[int, int] = (3, 6)) -> tuple[T, T, T]:
    g = torch.Generator().manual_seed(seed)
    logp = torch.rand(shape, generator=g, dtype=F64).clamp_min(1e-6).log()
    ref = torch.rand(shape, generator=g, dtype=F64).clamp_min(1e-6).log()
    old = (logp + 0.3 * torch.randn(shape, generator=g, dtype=F64)).clamp_max(0.0)
    return logp, ref, old


def _build(name: str) -> Regularizer:
    if name == "neural_mirror":
        return get_regularizer(name, mirror=MIRROR)
    return get_regularizer(name)


# name -> (independent value formula, analytic d value / d logp), with l, r, o = logp, ref, old
Case = tuple[Callable[[T, T, T], T], Callable[[T, T, T], T]]


def _k3(l: T, r: T) -> T:
    return torch.exp(r - l) - (r - l) - 1  # TRL's per_token_kl


CASES: dict[str, Case] = {
    "none": (lambda l, r, o: torch.zeros_like(l), lambda l, r, o: torch.zeros_like(l)),
    "kl_k1": (lambda l, r, o: l - r, lambda l, r, o: torch.ones_like(l)),
    "kl_k2": (lambda l, r, o: 0.5 * (l - r) ** 2, lambda l, r, o: l - r),
    "kl_k3": (lambda l, r, o: _k3(l, r), lambda l, r, o: 1 - torch.exp(r - l)),
    "kl_k3_is": (
        lambda l, r, o: torch.exp(l - o) * _k3(l, r),
        lambda l, r, o: torch.exp(l - o) * (_k3(l, r) + 1 - torch.exp(r - l)),
    ),
    "prob_l2": (
        lambda l, r, o: (l.exp() - r.exp()) ** 2,
        lambda l, r, o: 2 * (l.exp() - r.exp()) * l.exp(),
    ),
    "log_l2": (lambda l, r, o: (l - r) ** 2, lambda l, r, o: 2 * (l - r)),
    "neural_mirror": (
        lambda l, r, o: MIRROR.potential(l.exp()) - MIRROR.potential(r.exp())
        - MIRROR.derivative(r.exp()) * (l.exp() - r.exp()),
        lambda l, r, o: (MIRROR.derivative(l.exp()) - MIRROR.derivative(r.exp())) * l.exp(),
    ),
    # RPG Table 1 / Table 4 (docs/methods.md, section "RPG"), w = exp(l - r)
    "rpg_fkl": (lambda l, r, o: -(l - r), lambda l, r, o: -torch.ones_like(l)),
    "rpg_rkl": (
        lambda l, r, o: (l - r).exp() * (l - r),
        lambda l, r, o: (l - r).exp() * ((l - r) + 1),
    ),
    "rpg_ufkl": (
        lambda l, r, o: (l - r).exp() - (l - r) - 1,
        lambda l, r, o: (l - r).exp() - 1,
    ),
    "rpg_urkl": (
        lambda l, r, o: (l - r).exp() * ((l - r) - 1) + 1,
        lambda l, r, o: (l - r).exp() * (l - r),
    ),
    # straight-through KL (verl k1+ / k3+): value of k1 / k3, gradient of k2
    "kl_k1_st": (lambda l, r, o: l - r, lambda l, r, o: l - r),
    "kl_k3_st": (lambda l, r, o: _k3(l, r), lambda l, r, o: l - r),
}


def _f_case(g: Callable[[T], T], dg: Callable[[T], T]) -> Case:
    """An f-divergence's importance-weighted sampled form: value w_o g(t), derivative
    w_o (g(t) + g'(t)), w_o = exp(l - o), t = l - r."""
    return (
        lambda l, r, o: torch.exp(l - o) * g(l - r),
        lambda l, r, o: torch.exp(l - o) * (g(l - r) + dg(l - r)),
    )


_A = 0.5  # alpha's default
_L2 = math.log(2.0)
CASES.update({
    "fkl": _f_case(lambda t: 1 - torch.exp(-t) * (1 + t), lambda t: t * torch.exp(-t)),
    "chi2": _f_case(lambda t: torch.exp(t) - 2 + torch.exp(-t),
                    lambda t: torch.exp(t) - torch.exp(-t)),
    "hellinger": _f_case(lambda t: 0.5 * (1 - torch.exp(-t / 2)) ** 2,
                         lambda t: (1 - torch.exp(-t / 2)) * 0.5 * torch.exp(-t / 2)),
    "tv": _f_case(lambda t: 0.5 * (1 - torch.exp(-t)).abs(),
                  lambda t: 0.5 * torch.sign(1 - torch.exp(-t)) * torch.exp(-t)),
    "js": _f_case(
        lambda t: 0.5 * (_L2 - torch.log1p(torch.exp(-t))
                         + torch.exp(-t) * (_L2 - torch.log1p(torch.exp(t)))),
        lambda t: -0.5 * torch.exp(-t) * (_L2 - torch.log1p(torch.exp(t))),
    ),
    "alpha": _f_case(
        lambda t: (_A + (1 - _A) * torch.exp(-t) - torch.exp((_A - 1) * t)) / (_A * (1 - _A)),
        lambda t: (torch.exp((_A - 1) * t) - torch.exp(-t)) / _A,
    ),
    "kl_chi2": _f_case(
        lambda t: (t - 1 + torch.exp(-t)) + 0.5 * (torch.exp(t) - 2 + torch.exp(-t)),
        lambda t: (1 - torch.exp(-t)) + 0.5 * (torch.exp(t) - torch.exp(-t)),
    ),
})  # fmt: skip


def test_every_registered_regularizer_has_a_test_case() -> None:
    assert set(CASES) == set(REGULARIZERS.names())


@pytest.mark.parametrize("name", sorted(CASES))
def test_value_and_analytic_gradient_float64(name: str) -> None:
    value_fn, grad_fn = CASES[name]
    logp, ref, old = _inputs(seed=1)
    lp = logp.clone().requires_grad_()
    out = _build(name)(logp=lp, old_logp=old, anchor_logp=ref)
    assert out.dtype == F64 and out.shape == logp.shape
    torch.testing.assert_close(out.detach(), value_fn(logp, ref, old), rtol=1e-10, atol=1e-12)
    coef = 0.37
    if out.requires_grad:
        (grad,) = torch.autograd.grad(coef * out.sum(), lp)
    else:
        grad = torch.zeros_like(logp)
    torch.testing.assert_close(grad, coef * grad_fn(logp, ref, old), rtol=1e-9, atol=1e-12)


#: the straight-through forms (verl ``k1+`` / ``k3+``) take k2's gradient by design, not their
#: value's derivative, so finite differences of the value are no reference: their gradient is
#: checked against its closed form above
STRAIGHT_THROUGH = {"kl_k1_st", "kl_k3_st"}


@pytest.mark.parametrize("name", sorted(set(REGULARIZERS.names()) - STRAIGHT_THROUGH))
def test_gradient_is_float64_autograd_by_finite_differences(name: str) -> None:
    """``torch.autograd.gradcheck`` of every registered regularizer in float64, in the policy
    and the anchor log-probs, with a masked token: autograd's gradient (the custom backward of
    the neural mirror map's table included) is the finite-difference one."""
    logp, ref, old = _inputs(seed=5, shape=(2, 4))
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]], dtype=F64)
    reg = _build(name)

    def values(lp: T, r: T) -> T:
        return reg(logp=lp, old_logp=old, anchor_logp=r, mask=mask)

    # eps 1e-6: the central difference's truncation (~eps^2 times the third derivative) and
    # rounding (~1e-16 / eps) errors are both below 1e-9 here, far inside gradcheck's atol 1e-5
    assert torch.autograd.gradcheck(
        values, (logp.clone().requires_grad_(), ref.clone().requires_grad_()), eps=1e-6
    )


def test_k3_is_without_old_logp_is_on_policy() -> None:
    # w = exp(l - SG(l)): value = k3, gradient = k3 + 1 - rho (exact reverse-KL score gradient)
    logp, ref, _ = _inputs(seed=2)
    lp = logp.clone().requires_grad_()
    out = get_regularizer("kl_k3_is")(logp=lp, anchor_logp=ref)
    torch.testing.assert_close(out.detach(), _k3(logp, ref), rtol=1e-12, atol=0)
    (grad,) = torch.autograd.grad(out.sum(), lp)
    torch.testing.assert_close(grad, _k3(logp, ref) + 1 - torch.exp(ref - logp))


def test_mirror_special_cases_match_prob_l2_and_gkl() -> None:
    """The exact map (``evaluation: exact``) reproduces ProbL2 bit for bit and the generalized
    KL to rounding; the default tabulated one both to its 1e-6 relative bound."""
    logp, ref, _ = _inputs(seed=3)
    l2 = get_regularizer("prob_l2")(logp=logp, anchor_logp=ref)
    p, q = logp.exp(), ref.exp()
    gkl_ref = p * (logp - ref) - p + q
    nm = get_regularizer("neural_mirror", mirror=NeuralMirrorMap(a=2.0), evaluation="exact")
    assert torch.equal(nm(logp=logp, anchor_logp=ref), l2)
    gkl = get_regularizer("neural_mirror", mirror=NeuralMirrorMap(c=1.0), evaluation="exact")
    torch.testing.assert_close(gkl(logp=logp, anchor_logp=ref), gkl_ref, rtol=1e-9, atol=1e-15)
    for mirror, want in ((NeuralMirrorMap(a=2.0), l2), (NeuralMirrorMap(c=1.0), gkl_ref)):
        tab = get_regularizer("neural_mirror", mirror=mirror)(logp=logp, anchor_logp=ref)
        torch.testing.assert_close(tab, want, rtol=1e-6, atol=0)


def test_clamp_matches_verl_and_rpg_code() -> None:
    logp = torch.tensor([[-8.0, -0.1, -0.5]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[-0.1, -8.0, -0.5]], dtype=F64)
    k3 = get_regularizer("kl_k3", clamp=10.0)(logp=logp, anchor_logp=ref)
    assert k3[0, 0].item() == 10.0  # exp(7.9) - 7.9 - 1 > 10
    assert k3[0, 1].item() == pytest.approx(math.exp(-7.9) + 7.9 - 1)
    (g,) = torch.autograd.grad(k3.sum(), logp)
    assert g[0, 0].item() == 0.0 and g[0, 2].item() == 0.0
    for name in ("rpg_rkl", "rpg_ufkl", "rpg_urkl", "rpg_fkl"):
        v = get_regularizer(name, clamp=2.0)(logp=logp.detach(), anchor_logp=ref)
        assert v.abs().max().item() <= 2.0
        assert torch.equal(v, CASES[name][0](logp.detach(), ref, ref).clamp(-2.0, 2.0))
    assert (
        get_regularizer("kl_k3")(logp=logp.detach(), anchor_logp=ref)[0, 0].item() > 2000
    )  # TRL: no clamp


def test_rpg_regularizers_have_no_anchor_of_their_own() -> None:
    """The anchor is the caller's anchor_logp (the objective's anchor); the deprecated RPG
    ``anchor`` parameter is refused here and lifted to the term's anchor by the spec."""
    logp, _, old = _inputs(seed=4)
    for name in ("rpg_fkl", "rpg_rkl", "rpg_ufkl", "rpg_urkl"):
        reg = get_regularizer(name)
        assert reg.needs_ref is True and reg.params == {"clamp": None}
        with pytest.raises(ValueError, match="needs anchor_logp"):
            reg(logp=logp, old_logp=old)
        with pytest.raises(TypeError, match=r"'anchor'.*valid parameters: clamp"):
            get_regularizer(name, anchor="old")


def test_needs_ref_and_names() -> None:
    for name in REGULARIZERS.names():
        reg = _build(name)
        assert reg.name == name
        assert reg.needs_ref is (name != "none")
    logp, _, _ = _inputs()
    assert torch.equal(get_regularizer("none")(logp=logp, anchor_logp=None), torch.zeros_like(logp))
    with pytest.raises(ValueError, match="needs anchor_logp"):
        get_regularizer("kl_k3")(logp=logp, anchor_logp=None)


def test_mask_zeroes_values_and_gradients_even_with_garbage() -> None:
    logp, ref, old = _inputs(seed=5)
    mask = torch.ones_like(logp)
    mask[:, -2:] = 0
    logp = logp.clone()
    logp[:, -2:] = float("-inf")  # padding garbage
    ref = ref.clone()
    ref[:, -1] = float("nan")
    for name in REGULARIZERS.names():
        lp = logp.clone().requires_grad_()
        out = _build(name)(logp=lp, old_logp=old, anchor_logp=ref, mask=mask)
        assert torch.isfinite(out).all(), name
        assert (out[:, -2:] == 0).all(), name
        if out.requires_grad:
            (g,) = torch.autograd.grad(out.sum(), lp)
            assert torch.isfinite(g).all() and (g[:, -2:] == 0).all(), name
        torch.testing.assert_close(
            out[:, :-2],
            _build(name)(logp=logp[:, :-2], old_logp=old[:, :-2], anchor_logp=ref[:, :-2]),
        )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision_inputs_finite_float32(dtype: torch.dtype) -> None:
    logp = torch.linspace(LOG_FLOOR, 0.0, 40).reshape(4, 10)
    ref = logp.flip(-1)
    old = logp.roll(3, -1)
    for name in REGULARIZERS.names():
        lp = logp.to(dtype).requires_grad_()
        out = _build(name)(logp=lp, old_logp=old.to(dtype), anchor_logp=ref.to(dtype))
        assert out.dtype == torch.float32 and torch.isfinite(out).all(), name
        if out.requires_grad:
            (g,) = torch.autograd.grad(out.sum(), lp)
            assert torch.isfinite(g.float()).all(), name


NONNEG = {"kl_k2", "kl_k3", "kl_k3_is", "prob_l2", "log_l2", "neural_mirror", "rpg_ufkl",
          "rpg_urkl", "kl_k3_st", "fkl", "js", "chi2", "hellinger", "tv", "alpha", "kl_chi2"}
LOGP = st.floats(LOG_FLOOR, 0.0)


@settings(max_examples=40, deadline=None)
@given(l=LOGP, r=LOGP, o=LOGP)
@example(l=0.0, r=-5.960464477539063e-08, o=0.0)  # js cancelled to -3e-8 in float32
def test_finite_everywhere_and_divergences_nonnegative(l: float, r: float, o: float) -> None:
    for dt in (torch.float32, F64):
        lt, rt, ot = (torch.tensor([[x]], dtype=dt) for x in (l, r, o))
        for name in REGULARIZERS.names():
            reg = _build(name)
            val = reg(logp=lt, old_logp=ot, anchor_logp=rt).item()
            assert math.isfinite(val), name
            if name in NONNEG:
                assert val >= 0.0, name
                # = 0 when p = q
                assert reg(logp=lt, old_logp=lt, anchor_logp=lt).item() == 0.0, name


@settings(max_examples=40, deadline=None)
@given(l=LOGP, r=LOGP)
def test_prob_l2_zero_iff_equal(l: float, r: float) -> None:
    lt, rt = torch.tensor([l], dtype=F64), torch.tensor([r], dtype=F64)
    val = get_regularizer("prob_l2")(logp=lt, anchor_logp=rt).item()
    p, q = math.exp(l), math.exp(r)
    assert val == pytest.approx((p - q) ** 2, rel=1e-12, abs=0)
    assert (val == 0.0) == (p == q)


def test_unknown_name_lists_valid_names() -> None:
    with pytest.raises(UnknownNameError) as ei:
        get_regularizer("kl_k4")
    msg = str(ei.value)
    assert "kl_k4" in msg and all(n in msg for n in REGULARIZERS.names())


def test_unknown_or_bad_params_are_named() -> None:
    with pytest.raises(TypeError, match="beta"):
        get_regularizer("kl_k3", beta=0.1)
    with pytest.raises(TypeError, match=r"prob_l2.*floor.*valid parameters: \(none\)"):
        get_regularizer("prob_l2", floor=1e-10)
    with pytest.raises(ValueError, match="clamp"):
        get_regularizer("kl_k3", clamp=-1.0)
    with pytest.raises(TypeError, match="clamp"):
        get_regularizer("rpg_rkl", clamp="10")
    with pytest.raises(TypeError, match="mirror must be"):
        get_regularizer("neural_mirror", mirror=1.0)


def test_shape_mismatch_is_reported() -> None:
    logp, ref, _ = _inputs()
    with pytest.raises(ValueError, match="anchor_logp has shape"):
        get_regularizer("kl_k1")(logp=logp, anchor_logp=ref[:, :-1])
    with pytest.raises(ValueError, match="mask has shape"):
        get_regularizer("kl_k1")(logp=logp, old_logp=None, anchor_logp=ref, mask=torch.ones(3))


def test_neural_mirror_from_path_and_default(tmp_path) -> None:
    logp, ref, _ = _inputs(seed=6)
    path = MIRROR.save(tmp_path / "m.json")
    from_path = get_regularizer("neural_mirror", mirror=str(path))(logp=logp, anchor_logp=ref)
    assert torch.equal(
        from_path, get_regularizer("neural_mirror", mirror=MIRROR)(logp=logp, anchor_logp=ref)
    )
    default = get_regularizer("neural_mirror")
    rand = NeuralMirrorMap.random(scale=0.01, seed=42)
    assert torch.equal(
        default(logp=logp, anchor_logp=ref),
        get_regularizer("neural_mirror", mirror=rand)(logp=logp, anchor_logp=ref),
    )
    with pytest.raises(FileNotFoundError, match="nope.json"):
        get_regularizer("neural_mirror", mirror=tmp_path / "nope.json")


def test_retired_hand_derivative_arguments_warn_and_are_ignored() -> None:
    """A plugin built for the hand-derivative layer keeps working: ``value_and_grad``,
    ``value_and_backward`` and ``zero_at_zero`` give a DeprecationWarning and autograd's
    gradient; any other unknown keyword is a TypeError."""
    def wrong(l: T, r: T, o: T | None) -> tuple[T, T]:
        return l - r, torch.zeros_like(l)  # a derivative that is not used

    with pytest.warns(DeprecationWarning, match="value_and_grad, zero_at_zero"):
        reg = Regularizer("mine", lambda l, r, o: (l - r).square(), value_and_grad=wrong,
                          zero_at_zero=True)  # fmt: skip
    logp, ref, _ = _inputs(seed=2)
    lp = logp.clone().requires_grad_()
    (grad,) = torch.autograd.grad(reg(logp=lp, anchor_logp=ref).sum(), lp)
    torch.testing.assert_close(grad, 2 * (logp - ref))
    with pytest.raises(TypeError, match="unexpected keyword arguments: \\['nonsense'\\]"):
        Regularizer("mine", lambda l, r, o: l - r, nonsense=1)
