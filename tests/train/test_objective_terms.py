"""One objective representation: a regularizer given as one mapping and the same term given as a
list of one build the same terms, and give bit-for-bit the same loss and gradient on the own
engine's loss path (``gbmpo.train.step.policy_loss``) and on the TRL objective path
(``GBMPOTrainer._loss_terms``): both build their loss terms with
``gbmpo.objectives.loss.loss_terms``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import Tensor

from gbmpo.objectives import compute_policy_loss
from gbmpo.objectives.spec import BuiltObjective, BuiltTerm, ObjectiveSpec, SpecError
from gbmpo.train.step import policy_loss

TERMS = [
    {"name": "kl_k3", "coef": 0.2, "anchor": "ref"},
    {"name": "prob_l2", "coef": 0.05, "anchor": "ref"},
    {"name": "rpg_fkl", "coef": 0.1, "anchor": "old", "params": {"clamp": 10.0}},
]
BASE = {"advantage": "grpo", "surrogate": {"name": "clip", "params": {"eps_high": 0.28}},
        "aggregation": "dr_grpo", "monitor_regularizers": False}  # fmt: skip
B, T = 6, 7


def _pair(term: dict[str, Any]) -> tuple[BuiltObjective, BuiltObjective]:
    one = ObjectiveSpec.from_dict({**BASE, "regularizer": term}).build()
    listed = ObjectiveSpec.from_dict({**BASE, "regularizer": [term]}).build()
    return one, listed


def _key(t: BuiltTerm) -> tuple[Any, ...]:
    reg = t.regularizer
    return (t.name, t.coef, t.anchor, t.placement, t.estimator, type(reg), reg.name,
            dict(getattr(reg, "params", {})))  # fmt: skip


def _batch() -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(3)
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2 - 0.05
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    return {
        "logp": logp,
        "old": logp + 0.3 * (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5),
        "ref": logp + 0.6 * (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5),
        "adv": torch.randn(B, generator=g, dtype=torch.float64),
        "mask": (torch.arange(T)[None, :] < lengths[:, None]).float(),
    }


def _own(built: BuiltObjective, x: dict[str, Tensor]) -> tuple[Tensor, Tensor, dict[str, float]]:
    """The own engine's micro-batch loss (gbmpo.train.step.policy_loss) and its gradient."""
    logp = x["logp"].clone().requires_grad_()
    anchors = {"ref": x["ref"], "old": x["old"]}
    loss, m = policy_loss(
        built, T, logp, x["old"], anchors, x["adv"], x["mask"], B, float(x["mask"].sum())
    )
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad, m


def test_a_term_and_a_list_of_one_build_the_same_terms() -> None:
    for term in TERMS:
        one, listed = _pair(term)
        assert len(one.terms) == len(listed.terms) == 1
        assert _key(one.terms[0]) == _key(listed.terms[0])
        assert one.loss_terms == one.terms and listed.loss_terms == listed.terms
        assert (one.surrogate, one.aggregation, one.advantage) == (
            listed.surrogate, listed.aggregation, listed.advantage)
        assert set(one.monitors) == set(listed.monitors) == {term["name"]}
        assert (one.needs_ref, one.anchored_on_ref) == (listed.needs_ref, listed.anchored_on_ref)
    # the first-term fields are gone: the terms are the only representation
    assert not hasattr(one, "coef") and not hasattr(one, "regularizer")
    assert not hasattr(one, "anchor") and not hasattr(one, "single_loss_term")


def test_a_built_objective_needs_its_terms() -> None:
    one, _ = _pair(TERMS[0])
    with pytest.raises(SpecError, match="non-empty tuple of BuiltTerm"):
        BuiltObjective(spec=one.spec, advantage=one.advantage, surrogate=one.surrogate,
                       terms=(), aggregation="grpo")  # fmt: skip


@pytest.mark.parametrize("term", TERMS, ids=[t["name"] for t in TERMS])
def test_own_engine_loss_is_bit_for_bit_the_same(term: dict[str, Any]) -> None:
    x = _batch()
    one, listed = _pair(term)
    loss_a, grad_a, m_a = _own(one, x)
    loss_b, grad_b, m_b = _own(listed, x)
    assert torch.equal(loss_a, loss_b) and torch.equal(grad_a, grad_b) and m_a == m_b
    assert m_a["reg_loss"] != 0 and m_a[f"reg_loss/{term['name']}"] == m_a["reg_loss"]
    # and the term is really in the loss: the surrogate alone differs
    alone, _ = compute_policy_loss(logp=x["logp"], old_logp=x["old"], advantages=x["adv"],
                                   mask=x["mask"], surrogate=one.surrogate,
                                   aggregation="dr_grpo", max_len=T, num_sequences=B,
                                   num_tokens=float(x["mask"].sum()))  # fmt: skip
    assert not torch.equal(alone, loss_a)


@pytest.mark.parametrize("term", TERMS, ids=[t["name"] for t in TERMS])
def test_trl_objective_path_is_bit_for_bit_the_own_engines(term: dict[str, Any]) -> None:
    pytest.importorskip("trl")
    from gbmpo.integrations.trl import GBMPOConfig, GBMPOTrainer, build_objective

    x = _batch()
    results = []
    for regularizer in (term, [term]):
        args = GBMPOConfig(output_dir="unused", use_cpu=True, bf16=False, report_to="none",
                           max_completion_length=T,
                           objective={**BASE, "regularizer": regularizer})  # fmt: skip
        obj = build_objective(args)
        assert isinstance(obj, BuiltObjective) and len(obj.terms) == 1  # one is a list of one
        logp = x["logp"].clone().requires_grad_()
        trainer = SimpleNamespace(_gbmpo=obj, beta=args.beta)
        terms = GBMPOTrainer._loss_terms(trainer, x["ref"], x["old"], {})
        loss, m = compute_policy_loss(
            logp=logp, old_logp=x["old"], advantages=x["adv"], mask=x["mask"],
            surrogate=obj.surrogate, terms=terms, aggregation=obj.aggregation,
            max_len=args.max_completion_length, num_sequences=B,
            num_tokens=float(x["mask"].sum()),
        )  # fmt: skip
        (grad,) = torch.autograd.grad(loss, logp)
        results.append((loss.detach(), grad, m))
    (loss_a, grad_a, m_a), (loss_b, grad_b, m_b) = results
    assert torch.equal(loss_a, loss_b) and torch.equal(grad_a, grad_b) and m_a == m_b
    own_loss, own_grad, own_m = _own(ObjectiveSpec.from_dict({**BASE, "regularizer": term})
                                     .build(), x)  # fmt: skip
    assert torch.equal(loss_a, own_loss) and torch.equal(grad_a, own_grad) and m_a == own_m


def test_an_unanchored_inactive_term_is_left_out_and_an_active_one_refused() -> None:
    pytest.importorskip("trl")
    from gbmpo.integrations.trl import GBMPOConfig, GBMPOTrainer, build_objective
    from gbmpo.objectives.loss import loss_terms

    x = _batch()
    idle = GBMPOConfig(output_dir="unused", use_cpu=True, bf16=False, report_to="none",
                       objective={**BASE, "regularizer": {"name": "kl_k3", "coef": 0.0},
                                  "monitor_regularizers": False})  # fmt: skip
    assert idle.beta == 0.0  # TRL computes no reference log-probs
    built = build_objective(idle)
    assert loss_terms(built.terms, {"ref": None, "old": x["old"]}) == []
    trainer = SimpleNamespace(_gbmpo=built, beta=idle.beta)
    assert GBMPOTrainer._loss_terms(trainer, None, x["old"], {}) == []
    active = build_objective(GBMPOConfig(output_dir="unused", use_cpu=True, bf16=False,
                                         report_to="none", objective={**BASE, "regularizer":
                                                                      TERMS[0]}))  # fmt: skip
    with pytest.raises(RuntimeError, match=r"\['kl_k3'\] are anchored on the reference"):
        GBMPOTrainer._loss_terms(SimpleNamespace(_gbmpo=active, beta=0.0), None, x["old"], {})
    with pytest.raises(ValueError, match="'kl_k3' is anchored on 'ref', whose log-probs"):
        loss_terms(active.terms, {"ref": None, "old": x["old"]})
