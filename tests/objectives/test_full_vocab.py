"""Full-vocabulary Bregman divergences and the separable potentials behind them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from gbmpo.objectives.full_vocab import full_vocab_bregman, full_vocab_bregman_from_hidden
from gbmpo.objectives.mirror import NeuralMirrorMap
from gbmpo.objectives.potentials import (
    POTENTIALS,
    NegEntropy,
    Potential,
    Square,
    as_potential,
    get_potential,
)
from gbmpo.registry import UnknownNameError

F64 = torch.float64
MIRROR = NeuralMirrorMap.random(scale=0.5, seed=7)
POTS: dict[str, Potential] = {"neg_entropy": NegEntropy(), "square": Square(), "mirror": MIRROR}


def _logits(seed: int, shape: tuple[int, ...], dtype: torch.dtype = F64, scale: float = 2.0):
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(shape, generator=g, dtype=dtype)


# --- potentials -----------------------------------------------------------------------------------


def test_potential_registry() -> None:
    assert {"neg_entropy", "square", "prob_l2", "neural_mirror"} <= set(POTENTIALS.names())
    assert isinstance(get_potential("prob_l2"), Square)
    assert isinstance(get_potential("neg_entropy"), NegEntropy)
    nm = get_potential("neural_mirror", mirror=MIRROR)
    assert nm is MIRROR and isinstance(nm, Potential)
    assert torch.equal(get_potential("neural_mirror").to_vector(),
                       NeuralMirrorMap.random(0.01, 42).to_vector())
    with pytest.raises(UnknownNameError) as ei:
        get_potential("entropy")
    assert all(n in str(ei.value) for n in POTENTIALS.names())
    with pytest.raises(TypeError, match="scale"):
        get_potential("square", scale=2.0)
    with pytest.raises(TypeError, match="potential must be"):
        as_potential(3)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["neg_entropy", "square"])
def test_potential_bregman_matches_definition(name: str) -> None:
    pot = get_potential(name)
    y = torch.linspace(1e-6, 1.0, 50, dtype=F64, requires_grad=True)
    (dh,) = torch.autograd.grad(pot.potential(y).sum(), y)
    torch.testing.assert_close(dh, pot.derivative(y).detach())
    p, q = y.detach(), y.detach().flip(0)
    definition = pot.potential(p) - pot.potential(q) - pot.derivative(q) * (p - q)
    torch.testing.assert_close(pot.bregman(p, q), definition, rtol=1e-9, atol=1e-14)


# --- exactness ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_neg_entropy_is_torch_kl(dtype: torch.dtype) -> None:
    x, y = _logits(0, (2, 5, 37), dtype), _logits(1, (2, 5, 37), dtype)
    got = full_vocab_bregman(x, y, "neg_entropy")
    lp, lq = x.log_softmax(-1), y.log_softmax(-1)
    kl_div = F.kl_div(lq, lp, reduction="none", log_target=True).sum(-1)
    assert got.dtype == dtype and got.shape == (2, 5)
    assert torch.equal(got, kl_div)
    dist = torch.distributions.kl_divergence(
        torch.distributions.Categorical(logits=x), torch.distributions.Categorical(logits=y)
    )
    tol = 1e-12 if dtype == F64 else 1e-5
    torch.testing.assert_close(got, dist, rtol=tol, atol=tol)


def test_square_and_mirror_special_cases() -> None:
    x, y = _logits(2, (3, 4, 29)), _logits(3, (3, 4, 29))
    p, q = x.softmax(-1), y.softmax(-1)
    torch.testing.assert_close(full_vocab_bregman(x, y, "square"), ((p - q) ** 2).sum(-1))
    torch.testing.assert_close(full_vocab_bregman(x, y, "prob_l2"), ((p - q) ** 2).sum(-1))
    # mirror maps: a=2 -> sum (p-q)^2; c=1 -> generalized KL, which sums to the exact KL
    torch.testing.assert_close(
        full_vocab_bregman(x, y, NeuralMirrorMap(a=2.0)), ((p - q) ** 2).sum(-1))
    torch.testing.assert_close(
        full_vocab_bregman(x, y, NeuralMirrorMap(c=1.0)), full_vocab_bregman(x, y, "neg_entropy"),
        rtol=1e-10, atol=1e-12)
    # a general map: the per-entry divergences summed over the vocabulary
    torch.testing.assert_close(full_vocab_bregman(x, y, MIRROR), MIRROR.bregman(p, q).sum(-1))


# --- chunking and the hidden-state path -----------------------------------------------------------


@pytest.mark.parametrize("pot", sorted(POTS))
@pytest.mark.parametrize("chunk", [1, 7, 100])
def test_chunked_equals_unchunked_values_and_gradients(pot: str, chunk: int) -> None:
    x0, y = _logits(4, (2, 5, 23)), _logits(5, (2, 5, 23))
    mask = torch.ones(2, 5)
    mask[1, 3:] = 0
    outs, grads = [], []
    for c in (None, chunk):
        x = x0.clone().requires_grad_()
        out = full_vocab_bregman(x, y, POTS[pot], chunk_size=c, mask=mask)
        weights = torch.linspace(0.5, 2.0, 10, dtype=F64).reshape(2, 5)
        (g,) = torch.autograd.grad((out * weights).sum(), x)
        outs.append(out.detach())
        grads.append(g)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-13, atol=1e-15)
    assert (outs[0][1, 3:] == 0).all() and (grads[0][1, 3:] == 0).all()


def _naive_divergence(x: torch.Tensor, y: torch.Tensor, pot: str) -> torch.Tensor:
    """sum_v D_h(softmax x, softmax y) by plain autograd-able ops (independent of the kernels):
    KL from log-softmax, square from softmax, the mirror map from its definition h(p) - h(q) -
    h'(q)(p - q) (autograd through potential/derivative, not the analytic backward)."""
    if pot == "neg_entropy":
        lp, lq = x.log_softmax(-1), y.log_softmax(-1)
        return (lp.exp() * (lp - lq)).sum(-1)
    p, q = x.softmax(-1), y.softmax(-1)
    if pot == "square":
        return (p - q).square().sum(-1)
    return (MIRROR.potential(p) - MIRROR.potential(q) - MIRROR.derivative(q) * (p - q)).sum(-1)


@pytest.mark.parametrize("pot", sorted(POTS))
@pytest.mark.parametrize("chunk", [None, 1, 5, 16, 37])
def test_closed_form_gradients_match_naive_autograd_float64(pot: str, chunk: int | None) -> None:
    # 37 rows: chunk 5 uses the gradient buffer's unwritten rows as scratch and then the small
    # tail buffer; chunk 16 splits the last chunks into tail sub-chunks of 8 rows.
    x0, y = _logits(40, (37, 29), scale=3.0), _logits(41, (37, 29), scale=3.0)
    weights = torch.linspace(-1.0, 2.0, 37, dtype=F64)
    x = x0.clone().requires_grad_()
    out = full_vocab_bregman(x, y, POTS[pot], chunk_size=chunk)
    (g,) = torch.autograd.grad((out * weights).sum(), x)
    xr = x0.clone().requires_grad_()
    ref = _naive_divergence(xr, y, pot)
    (g_ref,) = torch.autograd.grad((ref * weights).sum(), xr)
    tol = 1e-12
    torch.testing.assert_close(out.detach(), ref.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(g, g_ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("pot", sorted(POTS))
def test_from_hidden_gradients_match_naive_autograd_float64(pot: str) -> None:
    B, T, H, V = 3, 7, 6, 41
    h0, rh = _logits(42, (B, T, H), scale=1.0), _logits(43, (B, T, H), scale=1.0)
    w0, b0 = _logits(44, (V, H), scale=0.8), _logits(45, (V,), scale=0.3)
    rw = _logits(46, (V, H), scale=0.8)
    weights = torch.linspace(-1.0, 2.0, B * T, dtype=F64).reshape(B, T)
    h, w, b = (t.clone().requires_grad_() for t in (h0, w0, b0))
    out = full_vocab_bregman_from_hidden(h, w, POTS[pot], ref_hidden=rh, ref_lm_head_weight=rw,
                                         lm_head_bias=b, chunk_size=4)
    grads = torch.autograd.grad((out * weights).sum(), (h, w, b))
    hr, wr, br = (t.clone().requires_grad_() for t in (h0, w0, b0))
    ref = _naive_divergence(F.linear(hr, wr, br), F.linear(rh, rw), pot)
    grads_ref = torch.autograd.grad((ref * weights).sum(), (hr, wr, br))
    tol = 1e-12
    torch.testing.assert_close(out.detach(), ref.detach(), rtol=tol, atol=tol)
    for gg, gr in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(gg, gr, rtol=tol, atol=tol)


def _from_logits_reference(h, w, b, rh, rw, rb, pot, mask=None):
    logits = F.linear(h, w, b)
    ref = F.linear(rh, rw, rb)
    return full_vocab_bregman(logits, ref, pot, mask=mask)


@pytest.mark.parametrize("pot", sorted(POTS))
def test_from_hidden_equals_from_logits(pot: str) -> None:
    B, T, H, V = 2, 6, 8, 31
    h0, rh = _logits(6, (B, T, H), scale=1.0), _logits(7, (B, T, H), scale=1.0)
    w0, b0 = _logits(8, (V, H), scale=0.5), _logits(9, (V,), scale=0.1)
    rw = _logits(10, (V, H), scale=0.5)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, :2] = False
    weights = torch.linspace(0.5, 2.0, B * T, dtype=F64).reshape(B, T)
    results = []
    for kind in ("logits", "hidden", "hidden_ref_logits"):
        h, w, b = (t.clone().requires_grad_() for t in (h0, w0, b0))
        if kind == "logits":
            out = _from_logits_reference(h, w, b, rh, rw, None, POTS[pot], mask)
        elif kind == "hidden":
            out = full_vocab_bregman_from_hidden(
                h, w, POTS[pot], ref_hidden=rh, ref_lm_head_weight=rw, lm_head_bias=b,
                chunk_size=5, mask=mask)
        else:
            out = full_vocab_bregman_from_hidden(
                h, w, POTS[pot], ref_logits=F.linear(rh, rw), lm_head_bias=b, chunk_size=4,
                mask=mask)
        grads = torch.autograd.grad((out * weights).sum(), (h, w, b))
        results.append((out.detach(), grads))
    for out, grads in results[1:]:
        torch.testing.assert_close(out, results[0][0], rtol=1e-12, atol=1e-14)
        for g, g_ref in zip(grads, results[0][1], strict=True):
            torch.testing.assert_close(g, g_ref, rtol=1e-11, atol=1e-13)
    assert (results[1][0][0, :2] == 0).all()


def test_from_hidden_default_ref_head_is_policy_head_without_grad() -> None:
    h0, rh = _logits(11, (3, 4, 6), scale=1.0), _logits(12, (3, 4, 6), scale=1.0)
    w0 = _logits(13, (17, 6), scale=0.5)
    w = w0.clone().requires_grad_()
    out = full_vocab_bregman_from_hidden(h0, w, "neg_entropy", ref_hidden=rh, chunk_size=5)
    (g,) = torch.autograd.grad(out.sum(), w)
    w2 = w0.clone().requires_grad_()
    ref = full_vocab_bregman(F.linear(h0, w2), F.linear(rh, w0), "neg_entropy")
    (g2,) = torch.autograd.grad(ref.sum(), w2)  # reference side detached
    torch.testing.assert_close(out.detach(), ref.detach())
    torch.testing.assert_close(g, g2)


def test_from_hidden_backward_never_saves_vocab_sized_activations() -> None:
    # With per-chunk checkpointing only the chunk inputs (hidden rows, weight) are saved for
    # backward; no [rows, V] logits / probabilities stay alive across chunks.
    B, T, H, V = 2, 16, 8, 64
    h = _logits(14, (B, T, H), torch.float32).requires_grad_()
    w = _logits(15, (V, H), torch.float32, scale=0.3).requires_grad_()
    rh = _logits(16, (B, T, H), torch.float32)
    saved: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(tuple(t.shape))
        return t

    for pot in ("neg_entropy", MIRROR):
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = full_vocab_bregman_from_hidden(h, w, pot, ref_hidden=rh, chunk_size=8)
        out.sum().backward()
        assert saved and not any(s and s[-1] == V for s in saved), saved
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            full_vocab_bregman(F.linear(h, w), F.linear(rh, w.detach()), pot)  # unchunked
        assert any(s and s[-1] == V for s in saved)  # the hook does see vocab-sized tensors


# --- properties -----------------------------------------------------------------------------------


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), scale=st.floats(0.0, 20.0), shift=st.floats(-30.0, 30.0))
def test_nonnegative_and_zero_iff_same_distribution(seed: int, scale: float, shift: float) -> None:
    x, y = _logits(seed, (2, 3, 19), scale=scale), _logits(seed + 1, (2, 3, 19), scale=scale)
    for pot in POTS.values():
        d = full_vocab_bregman(x, y, pot)
        assert torch.isfinite(d).all()
        # Exact KL from log-softmax can round to -1e-16 for nearly equal distributions.
        assert (d >= (-1e-13 if isinstance(pot, NegEntropy) else 0.0)).all()
        assert torch.equal(full_vocab_bregman(x, x, pot), torch.zeros(2, 3, dtype=F64))
        same = full_vocab_bregman(x, x + shift, pot)  # the same softmax up to rounding
        assert same.abs().max() < 1e-12
        if scale > 0.5:  # all three are strictly convex (MIRROR has a, c > 0): D > 0
            assert (d > 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_logits_finite_float32(dtype: torch.dtype) -> None:
    x, y = _logits(20, (2, 4, 50), torch.float32, 8.0), _logits(21, (2, 4, 50), torch.float32, 8.0)
    for pot in POTS.values():
        xl = x.to(dtype).requires_grad_()
        d = full_vocab_bregman(xl, y.to(dtype), pot, chunk_size=3)
        assert d.dtype == torch.float32 and torch.isfinite(d).all() and (d >= -1e-6).all()
        (g,) = torch.autograd.grad(d.sum(), xl)
        assert torch.isfinite(g.float()).all()
        h = x[..., :10].to(dtype)
        w = _logits(22, (50, 10), torch.float32).to(dtype)
        d2 = full_vocab_bregman_from_hidden(h, w, pot, ref_hidden=h.flip(1), chunk_size=3)
        assert d2.dtype == torch.float32 and torch.isfinite(d2).all()


# --- errors ---------------------------------------------------------------------------------------


def test_bad_arguments_are_reported() -> None:
    x, y = _logits(30, (2, 3, 11)), _logits(31, (2, 3, 11))
    with pytest.raises(ValueError, match="same shape"):
        full_vocab_bregman(x, y[..., :10])
    with pytest.raises(ValueError, match="chunk_size"):
        full_vocab_bregman(x, y, chunk_size=0)
    with pytest.raises(ValueError, match="mask has shape"):
        full_vocab_bregman(x, y, mask=torch.ones(2, 4))
    with pytest.raises(UnknownNameError, match="neg_entropy"):
        full_vocab_bregman(x, y, "kl")
    h, w = _logits(32, (2, 3, 4)), _logits(33, (11, 4))
    with pytest.raises(ValueError, match="exactly one"):
        full_vocab_bregman_from_hidden(h, w)
    with pytest.raises(ValueError, match="exactly one"):
        full_vocab_bregman_from_hidden(h, w, ref_hidden=h, ref_logits=x)
    with pytest.raises(ValueError, match="lm_head_weight"):
        full_vocab_bregman_from_hidden(h, w.T, ref_hidden=h)
    with pytest.raises(ValueError, match="ref_logits has shape"):
        full_vocab_bregman_from_hidden(h, w, ref_logits=x[..., :5])


def test_total_variation_rows() -> None:
    from gbmpo.objectives.full_vocab import bregman_rows, total_variation_rows

    x, y = _logits(11, (64, 9)), _logits(12, (64, 9))
    tv = total_variation_rows(x, y)
    p, q = torch.softmax(x, -1), torch.softmax(y, -1)
    torch.testing.assert_close(tv, 0.5 * (p - q).abs().sum(-1))
    torch.testing.assert_close(tv, total_variation_rows(y, x))  # symmetric
    assert bool(((tv >= 0) & (tv <= 1)).all()) and tv.dtype == F64
    # Pinsker: TV <= sqrt(KL / 2), for both directions of the KL
    for a, b in ((x, y), (y, x)):
        assert bool((tv <= torch.sqrt(bregman_rows(a, b, NegEntropy()) / 2) + 1e-12).all())
    assert float(total_variation_rows(x, x).abs().max()) == 0.0
    # disjoint supports: TV = 1; a -inf logit is probability 0; bf16 is computed in float32
    inf = float("-inf")
    a = torch.tensor([[0.0, inf, inf]])
    b = torch.tensor([[inf, 0.0, 0.0]])
    assert float(total_variation_rows(a, b)) == pytest.approx(1.0)
    out = total_variation_rows(x.to(torch.bfloat16), y.to(torch.bfloat16))
    assert out.dtype == torch.float32


def test_from_hidden_takes_a_row_divergence() -> None:
    """An f-divergence's full form (a RowDivergence: autograd inside each chunk) from hidden
    states: the same values and gradients as from the whole logits (float64; 1e-11, the
    tolerance of the potentials above, whose paths differ in summation order only)."""
    from gbmpo.objectives.estimators import full_potential

    form = full_potential("js", None)
    B, T, H, V = 2, 5, 8, 29
    h0, rh = _logits(16, (B, T, H), scale=1.0), _logits(17, (B, T, H), scale=1.0)
    w0, rw = _logits(18, (V, H), scale=0.5), _logits(19, (V, H), scale=0.5)
    weights = torch.linspace(0.5, 2.0, B * T, dtype=F64).reshape(B, T)
    h, w = (t.clone().requires_grad_() for t in (h0, w0))
    out = full_vocab_bregman_from_hidden(h, w, form, ref_hidden=rh, ref_lm_head_weight=rw,
                                         chunk_size=3)
    grads = torch.autograd.grad((out * weights).sum(), (h, w))
    hr, wr = (t.clone().requires_grad_() for t in (h0, w0))
    ref = full_vocab_bregman(F.linear(hr, wr), F.linear(rh, rw), form)
    grads_ref = torch.autograd.grad((ref * weights).sum(), (hr, wr))
    assert float(ref.detach().abs().sum()) > 1e-3
    torch.testing.assert_close(out.detach(), ref.detach(), rtol=1e-11, atol=1e-13)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, g_ref, rtol=1e-11, atol=1e-13)
