"""``objective.regularizer.estimator: full``: the exact divergence equals a brute-force sum over
the vocabulary (value and gradient, float64), enters the loss like a sampled term, and is refused
for regularizers without a full-vocabulary form."""

from __future__ import annotations

import pytest
import torch

from gbmpo.objectives import LossTerm, compute_policy_loss, get_regularizer
from gbmpo.objectives.aggregate import aggregate
from gbmpo.objectives.estimators import (
    FULL_FORMS,
    FullValues,
    full_divergence,
    full_potential,
)
from gbmpo.objectives.mirror import NeuralMirrorMap
from gbmpo.objectives.spec import ObjectiveSpec, SpecError
from gbmpo.registry import UnknownNameError

F64 = torch.float64
B, T, V = 3, 4, 11


def _pair(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = 2.0 * torch.randn(B, T, V, generator=g, dtype=F64)
    y = x + 0.7 * torch.randn(B, T, V, generator=g, dtype=F64)
    mask = torch.ones(B, T, dtype=F64)
    mask[0, 3] = mask[2, 2:] = 0
    return x, y, mask


def _brute(name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """sum over v of the divergence, written out entry by entry of the vocabulary."""
    p, q = torch.softmax(x, -1), torch.softmax(y, -1)
    out = torch.zeros(x.shape[:-1], dtype=x.dtype)
    for v in range(x.shape[-1]):
        if name.startswith("kl_"):
            out = out + p[..., v] * (torch.log(p[..., v]) - torch.log(q[..., v]))
        elif name == "prob_l2":
            out = out + (p[..., v] - q[..., v]) ** 2
        else:
            raise AssertionError(name)
    return out


@pytest.mark.parametrize("name", ["kl_k1", "kl_k2", "kl_k3", "kl_k3_is", "prob_l2"])
def test_exact_value_and_gradient_equal_the_brute_force_sum(name: str) -> None:
    x, y, mask = _pair()
    pot = full_potential(name, get_regularizer(name))
    xg = x.clone().requires_grad_()
    got = full_divergence(xg, y, pot, mask)
    want = _brute(name, x, y) * mask
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)
    w = torch.rand(B, T, generator=torch.Generator().manual_seed(1), dtype=F64)
    (g,) = torch.autograd.grad((got * w).sum(), xg)
    xb = x.clone().requires_grad_()
    (gb,) = torch.autograd.grad((_brute(name, xb, y) * mask * w).sum(), xb)
    torch.testing.assert_close(g, gb, rtol=1e-10, atol=1e-12)
    assert g[0, 3].abs().max() == 0 and g[2, 2:].abs().max() == 0  # masked: no gradient


def test_neural_mirror_full_form_is_the_maps_bregman_summed_over_the_vocabulary() -> None:
    mirror = NeuralMirrorMap.random(scale=0.5, seed=7)
    x, y, mask = _pair(2)
    pot = full_potential("neural_mirror", get_regularizer("neural_mirror", mirror=mirror))
    got = full_divergence(x, y, pot, mask)
    p, q = torch.softmax(x, -1), torch.softmax(y, -1)
    want = mirror.bregman(p, q).sum(-1) * mask
    torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-6, atol=1e-8)


def test_exact_values_enter_the_loss_as_a_sampled_term_would() -> None:
    """compute_policy_loss with the exact values: loss = agg(surrogate + coef * D_full), and the
    gradient into the policy logits is that of the brute-force loss."""
    x, y, mask = _pair(3)
    idx = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(4))
    adv = torch.tensor([1.0, -0.5, 0.25], dtype=F64)
    coef = 0.3

    def loss_of(logits: torch.Tensor, exact: bool) -> tuple[torch.Tensor, dict[str, float]]:
        logp = torch.log_softmax(logits, -1).gather(-1, idx.unsqueeze(-1)).squeeze(-1)
        if exact:
            values = full_divergence(logits, y, full_potential("kl_k3", None), mask)
            reg = FullValues("kl_k3", values)
        else:
            brute = _brute("kl_k3", logits, y) * mask
            reg = FullValues("kl_k3", brute)
        return compute_policy_loss(
            logp=logp,
            old_logp=None,
            advantages=adv,
            mask=mask,
            surrogate="clip",
            terms=[LossTerm("kl_k3", reg, coef, None)],
            aggregation="dr_grpo",
            max_len=T,
        )  # fmt: skip

    xa = x.clone().requires_grad_()
    loss, metrics = loss_of(xa, True)
    loss.backward()
    xb = x.clone().requires_grad_()
    want, _ = loss_of(xb, False)
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-10, atol=1e-12)
    brute = _brute("kl_k3", x, y) * mask
    # metrics are float32 means
    assert metrics["reg_value"] == pytest.approx(float(brute.sum() / mask.sum()), rel=1e-6)
    reg_loss = float(aggregate(coef * brute, mask, "dr_grpo", T))
    assert metrics["reg_loss"] == pytest.approx(reg_loss, rel=1e-6)


# --- the spec ---------------------------------------------------------------------------------


def test_spec_reads_writes_and_builds_the_estimator_per_term() -> None:
    spec = ObjectiveSpec.from_dict({"regularizer": [
        {"name": "prob_l2", "coef": 0.05, "estimator": "full"},
        {"name": "kl_k3", "coef": 0.01},
        {"name": "kl_k1", "coef": 0.02, "placement": "reward", "estimator": "full"},
    ]})  # fmt: skip
    assert ObjectiveSpec.from_dict(spec.to_dict()) == spec
    built = spec.build()
    assert [t.estimator for t in built.terms] == ["full", "sample", "full"]
    assert ObjectiveSpec().build().terms[0].estimator == "sample"


@pytest.mark.parametrize("name", ["none", "log_l2", "rpg_fkl", "rpg_rkl", "rpg_ufkl", "rpg_urkl"])
def test_full_is_refused_for_a_regularizer_without_a_full_form(name: str) -> None:
    spec = ObjectiveSpec.from_dict({"regularizer": {"name": name, "estimator": "full"}})
    with pytest.raises(SpecError, match=rf"estimator.*'{name}'.*{', '.join(FULL_FORMS)}"):
        spec.check()


@pytest.mark.parametrize(
    ("term", "match"),
    [
        ({"name": "kl_k3", "estimator": "exact"}, "'sample' or 'full', got 'exact'"),
        ({"name": "kl_k3", "estimator": "full", "anchor": "old"}, "anchor must be 'ref'"),
        ({"name": "kl_k3", "estimator": "full", "params": {"clamp": 10}}, "nothing to clamp"),
    ],
)
def test_full_refuses_what_it_cannot_mean(term: dict, match: str) -> None:
    with pytest.raises(SpecError, match=match):
        ObjectiveSpec.from_dict({"regularizer": term}).check()


def test_estimator_is_a_string() -> None:
    with pytest.raises(SpecError, match="estimator"):
        ObjectiveSpec.from_dict({"regularizer": {"name": "kl_k3", "estimator": 1}})


def test_config_refuses_with_a_config_error_naming_the_key() -> None:
    from gbmpo.config import ConfigError, load_config, validate

    cfg = load_config(None, [("objective.regularizer.name", "log_l2"),
                             ("objective.regularizer.estimator", "full")])  # fmt: skip
    with pytest.raises(ConfigError, match="objective.regularizer.estimator.*log_l2"):
        validate(cfg)


def test_unknown_regularizer_still_lists_names() -> None:
    spec = ObjectiveSpec.from_dict({"regularizer": {"name": "kl_k9", "estimator": "full"}})
    with pytest.raises(UnknownNameError):
        spec.check()
