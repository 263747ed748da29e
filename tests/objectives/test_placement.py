"""Where the divergence goes: ``placement: reward`` vs ``placement: loss``, checked exactly on a
policy small enough to enumerate (2 steps, 3 tokens: all 9 sequences, float64).

The policy is autoregressive with its logits as parameters: ``pi(a1) = softmax(theta1)``,
``pi(a2 | a1) = softmax(theta2[a1])``; the reference has fixed logits of the same shape. Every
expectation below is the exact sum over the 9 sequences weighted by ``pi(s)`` (detached where a
sampler would be), so there is no Monte-Carlo noise: an "estimator's gradient" is the exact
expectation of what its samples would give.

* The k1 divergence placed in the reward (REINFORCE with
  ``r(s) - beta * sum_t (log pi - log pi_ref)``, gbmpo's :func:`reward_penalty` /
  :func:`sequence_divergence`) has exactly the gradient of ``E[r] - beta * KL(pi || pi_ref)``.
* The k3 divergence placed in the loss (GRPO's per-token term, gradient through k3 with the
  sampled tokens fixed) does not: its expected gradient is that of ``KL(pi_ref || pi)`` summed
  per position, and it misses the score-function term of later tokens. On this fixture (seed 0,
  beta 0.5) the bias ``|| g_k3_loss - g_exact ||_2`` is 0.22395 against
  ``|| beta * grad KL ||_2`` = 0.32781 (a relative bias of 0.68315), measured by
  ``test_k3_in_the_loss_is_biased`` below.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import Tensor

from gbmpo.objectives.loss import (
    LossTerm,
    compute_policy_loss,
    reward_penalty,
    sequence_divergence,
)
from gbmpo.objectives.regularizers import get_regularizer

V, T, BETA = 3, 2, 0.5
SEQS = torch.tensor(list(itertools.product(range(V), repeat=T)))  # [9, 2]
MASK = torch.ones(len(SEQS), T, dtype=torch.float64)

#: measured on this fixture (module docstring, docs/methods.md)
K3_LOSS_BIAS = 0.22395
KL_GRAD_NORM = 0.32781


def _fixture() -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    theta1 = torch.randn(V, generator=g, dtype=torch.float64).requires_grad_()
    theta2 = torch.randn(V, V, generator=g, dtype=torch.float64).requires_grad_()
    ref1 = torch.randn(V, generator=g, dtype=torch.float64)
    ref2 = torch.randn(V, V, generator=g, dtype=torch.float64)
    rewards = torch.rand(len(SEQS), generator=g, dtype=torch.float64)
    return theta1, theta2, ref1, ref2, rewards


def _token_logp(l1: Tensor, l2: Tensor) -> Tensor:
    """``[9, 2]`` log-probs of each sequence's tokens under logits ``(l1, l2)``."""
    first = torch.log_softmax(l1, -1)[SEQS[:, 0]]
    second = torch.log_softmax(l2, -1)[SEQS[:, 0], SEQS[:, 1]]
    return torch.stack([first, second], dim=1)


def _exact_gradient(theta1, theta2, ref1, ref2, rewards) -> tuple[Tensor, Tensor]:
    """Autograd of ``J = E_pi[r] - beta * KL(pi || pi_ref)`` over the 9 sequences; returns the
    full gradient and the gradient of ``beta * KL`` alone."""
    seq = _token_logp(theta1, theta2).sum(1)
    ref_seq = _token_logp(ref1, ref2).sum(1)
    p = seq.exp()
    kl = (p * (seq - ref_seq)).sum()
    j = (p * rewards).sum() - BETA * kl
    g = torch.cat(
        [x.flatten() for x in torch.autograd.grad(j, (theta1, theta2), retain_graph=True)]
    )
    g_kl = torch.cat([x.flatten() for x in torch.autograd.grad(BETA * kl, (theta1, theta2))])
    return g, g_kl


def _reinforce_loss(logp: Tensor, advantages: Tensor, p: Tensor) -> Tensor:
    """The exact expectation of the on-policy clip surrogate: ``-sum_s pi(s) A(s) sum_t
    log pi`` in gradient (compute_policy_loss with the sequence weights pi(s) * N)."""
    loss, _ = compute_policy_loss(
        logp=logp,
        old_logp=None,
        advantages=advantages,
        mask=MASK,
        surrogate="clip",
        terms=(),
        aggregation="seq_mean_token_sum",
        token_weights=(p * len(SEQS))[:, None],
    )  # fmt: skip
    return loss


def _grad(loss: Tensor, theta1: Tensor, theta2: Tensor) -> Tensor:
    return torch.cat([x.flatten() for x in torch.autograd.grad(loss, (theta1, theta2))])


def test_k1_in_the_reward_is_the_exact_kl_regularized_gradient() -> None:
    theta1, theta2, ref1, ref2, rewards = _fixture()
    logp = _token_logp(theta1, theta2)
    ref_logp = _token_logp(ref1, ref2)
    p = logp.sum(1).exp().detach()
    k1 = get_regularizer("kl_k1")
    seq = sequence_divergence(k1, rollout_logp=logp, ref_logp=ref_logp, mask=MASK)
    assert not seq.requires_grad
    torch.testing.assert_close(seq, (logp - ref_logp).sum(1).detach())
    shaped = reward_penalty(rewards, [(BETA, seq)])
    g_reward = -_grad(_reinforce_loss(logp, shaped, p), theta1, theta2)
    g_exact, _ = _exact_gradient(theta1, theta2, ref1, ref2, rewards)
    torch.testing.assert_close(g_reward, g_exact, rtol=1e-10, atol=1e-12)


def test_k3_in_the_loss_is_biased() -> None:
    """Nonzero bias, reported (and its value pinned, so the number in the docs is measured)."""
    theta1, theta2, ref1, ref2, rewards = _fixture()
    logp = _token_logp(theta1, theta2)
    ref_logp = _token_logp(ref1, ref2)
    p = logp.sum(1).exp().detach()
    k3 = get_regularizer("kl_k3")
    # pg part: REINFORCE on the task reward; regularizer part: E_pi[sum_t beta * k3_t], the
    # tokens fixed (pi detached), gradient through k3 only -- what GRPO's loss term computes
    reg = (
        p[:, None] * BETA * k3(logp=logp, old_logp=logp.detach(), anchor_logp=ref_logp, mask=MASK)
    ).sum()
    # its expected gradient per position is that of KL(pi_ref || pi) at that position's
    # context: beta * (pi - pi_ref) in the first step's logits
    (g_reg1,) = torch.autograd.grad(reg, (theta1,), retain_graph=True)
    expected_first = BETA * (torch.softmax(theta1, -1) - torch.softmax(ref1, -1))
    torch.testing.assert_close(g_reg1, expected_first.detach(), rtol=1e-10, atol=1e-12)
    g_loss = -_grad(_reinforce_loss(logp, rewards, p) + reg, theta1, theta2)
    g_exact, g_kl = _exact_gradient(theta1, theta2, ref1, ref2, rewards)
    bias = float((g_loss - g_exact).norm())
    kl_norm = float(g_kl.norm())
    print(f"k3-in-loss gradient bias: {bias:.5f} (|| beta grad KL || = {kl_norm:.5f}, "
          f"relative {bias / kl_norm:.5f})")  # fmt: skip
    assert bias > 1e-3
    assert bias == pytest.approx(K3_LOSS_BIAS, abs=1e-5)
    assert kl_norm == pytest.approx(KL_GRAD_NORM, abs=1e-5)


def test_a_sum_of_terms_is_the_sum_of_each_term_alone() -> None:
    """``terms`` adds the per-token terms: the loss and gradient of ProbL2 + k3 (each with its
    coefficient) equal the surrogate plus each term's own contribution."""
    theta1, theta2, ref1, ref2, rewards = _fixture()
    ref_logp = _token_logp(ref1, ref2)
    adv = rewards - rewards.mean()

    def run(**kw):
        logp = _token_logp(theta1, theta2)
        loss, m = compute_policy_loss(
            logp=logp,
            old_logp=None,
            advantages=adv,
            mask=MASK,
            surrogate="clip",
            aggregation="dr_grpo",
            max_len=T,
            **kw,
        )  # fmt: skip
        return loss, _grad(loss, theta1, theta2), m

    pl2, k3 = get_regularizer("prob_l2"), get_regularizer("kl_k3")
    loss_sum, g_sum, m = run(
        terms=[LossTerm("prob_l2", pl2, 0.3, ref_logp), LossTerm("kl_k3", k3, 0.2, ref_logp)],
    )
    loss0, g0, _ = run(terms=())
    loss_a, g_a, m_a = run(terms=[LossTerm("prob_l2", pl2, 0.3, ref_logp)])
    loss_b, g_b, m_b = run(terms=[LossTerm("kl_k3", k3, 0.2, ref_logp)])
    torch.testing.assert_close(loss_sum, loss_a + loss_b - loss0)
    torch.testing.assert_close(g_sum, g_a + g_b - g0)
    assert m["reg_loss/prob_l2"] == pytest.approx(m_a["reg_loss"])
    assert m["reg_loss/kl_k3"] == pytest.approx(m_b["reg_loss"])
    assert m["reg_loss"] == pytest.approx(m_a["reg_loss"] + m_b["reg_loss"])
    assert m["reg_value"] == pytest.approx(m_a["reg_value"] + m_b["reg_value"])


def test_sequence_penalty_equals_verl_token_level_rewards() -> None:
    """verl's apply_kl_penalty: token rewards = scores (outcome at the last valid token) -
    beta * kld per token; their sequence sum is the reward minus beta * sum_t D."""
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(4, 5, generator=g, dtype=torch.float64)
    ref = -torch.rand(4, 5, generator=g, dtype=torch.float64)
    mask = (torch.arange(5) < torch.tensor([5, 3, 1, 4])[:, None]).double()
    rewards = torch.rand(4, generator=g, dtype=torch.float64)
    k3 = get_regularizer("kl_k3")
    scores = torch.zeros(4, 5, dtype=torch.float64)
    scores[torch.arange(4), mask.sum(1).long() - 1] = rewards
    kld = k3(logp=old, old_logp=old, anchor_logp=ref, mask=mask) * mask
    verl = (scores - 0.7 * kld).sum(-1)
    seq = sequence_divergence(k3, rollout_logp=old, ref_logp=ref, mask=mask)
    ours = reward_penalty(rewards, [(0.7, seq)])
    torch.testing.assert_close(ours, verl)


def test_spec_terms_round_trip_and_errors() -> None:
    from gbmpo.objectives.spec import ObjectiveSpec, SpecError

    spec = ObjectiveSpec.from_dict(
        {"regularizer": [{"name": "prob_l2", "coef": 0.05},
                         {"name": "kl_k1", "coef": 0.1, "placement": "reward"}]}
    )  # fmt: skip
    assert ObjectiveSpec.from_dict(spec.to_dict()) == spec
    built = spec.build()
    assert [t.name for t in built.loss_terms] == ["prob_l2"]
    assert [t.name for t in built.reward_terms] == ["kl_k1"]
    assert built.needs_ref and built.anchored_on_ref and len(built.loss_terms) == 1
    default = ObjectiveSpec().build()  # the default: one term in the loss, a tuple of one
    assert len(default.terms) == 1 and default.loss_terms == default.terms
    for bad, match in (
        ({"regularizer": []}, "empty list"),
        ({"regularizer": [{"name": "none"}, {"name": "kl_k3"}]}, "'none' beside"),
        ({"regularizer": {"name": "kl_k3", "placement": "bogus"}}, "placement. must be"),
        ({"regularizer": [{"name": "kl_k3", "bogus": 1}]}, r"regularizer\[0\].bogus"),
    ):
        with pytest.raises(SpecError, match=match):
            ObjectiveSpec.from_dict(bad).build()
    with pytest.raises(SpecError, match="empty list"):
        ObjectiveSpec(regularizer=[]).build()


# ------------------------------------------------ both placements x both advantages (FRPO)


def _population_advantage(r: Tensor, p: Tensor, normalise: bool) -> Tensor:
    """The population form of the group advantage over the 9 sequences (weights pi(s)):
    ``dr_grpo``: r - E_pi[r]; ``grpo``: (r - E_pi[r]) / std_pi(r)."""
    mean = (p * r).sum()
    centred = r - mean
    if not normalise:
        return centred
    return centred / (p * centred**2).sum().sqrt()


@pytest.mark.parametrize("advantage", ["dr_grpo", "grpo"])
@pytest.mark.parametrize("placement", ["reward", "advantage"])
def test_placements_under_both_advantages(placement: str, advantage: str) -> None:
    """k1 placed in the reward or in the advantage, with the plain (Dr. GRPO) or the
    std-normalised (GRPO) advantage; the exact expected gradient of each:

    * reward + dr_grpo, advantage + dr_grpo: grad (E[r] - beta KL), exactly;
    * reward + grpo: grad (E[r] - beta KL) / std(r - beta S): beta is divided by the std;
    * advantage + grpo (FRPO): grad E[r] / std(r) - beta grad KL: beta keeps its scale.
    """
    from gbmpo.objectives.placement import advantage_penalty, future_sum

    theta1, theta2, ref1, ref2, rewards = _fixture()
    logp = _token_logp(theta1, theta2)
    ref_logp = _token_logp(ref1, ref2)
    p = logp.sum(1).exp().detach()
    k1 = get_regularizer("kl_k1")
    normalise = advantage == "grpo"
    if placement == "reward":
        seq = sequence_divergence(k1, rollout_logp=logp, ref_logp=ref_logp, mask=MASK)
        shaped = reward_penalty(rewards, [(BETA, seq)])
        adv = _population_advantage(shaped, p, normalise)
        scale = 1.0 / float((p * (shaped - (p * shaped).sum()) ** 2).sum().sqrt())
    else:
        old = logp.detach()
        values = k1(logp=old, old_logp=old, anchor_logp=ref_logp, mask=MASK)
        torch.testing.assert_close(future_sum(values, MASK)[:, 0], values.sum(1))
        base = _population_advantage(rewards, p, normalise)
        adv = advantage_penalty(base, [(BETA, values)], MASK)
        assert adv.shape == (len(SEQS), T)
        scale = 1.0 / float((p * (rewards - (p * rewards).sum()) ** 2).sum().sqrt())
    g = -_grad(_reinforce_loss(logp, adv, p), theta1, theta2)
    g_exact, g_kl = _exact_gradient(theta1, theta2, ref1, ref2, rewards)
    g_reward = g_exact + g_kl  # grad E[r]
    if not normalise:
        want = g_exact
    elif placement == "reward":
        want = scale * g_exact  # beta / std: the penalty is rescaled with the reward
    else:
        want = scale * g_reward - g_kl  # FRPO: beta keeps its scale
    torch.testing.assert_close(g, want, rtol=1e-10, atol=1e-12)
    if normalise:  # the two placements differ under std normalisation
        assert float(scale) != pytest.approx(1.0, abs=1e-3)
