"""``placement: reward`` on verl: the in-reward KL that ``algorithm.use_kl_in_reward=true`` runs in
verl's driver (``apply_kl_penalty``: ``token_level_scores - kl_coef * kl_penalty(old, ref)``)
with ``kl_penalty=gbmpo_<name>`` subtracts exactly gbmpo's per-sequence penalty, through the
plugin's hook on ``kl_penalty_forward``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from verl.trainer.ppo import core_algos

import gbmpo.integrations.verl as gv
from gbmpo.objectives.loss import reward_penalty, sequence_divergence
from gbmpo.objectives.regularizers import get_regularizer

NAMES = ["kl_k1", "kl_k3", "prob_l2"]
COEF = 0.3


def _batch() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    b, t = 4, 6
    lengths = torch.tensor([6, 3, 1, 5])
    rewards = torch.rand(b, generator=g)
    scores = torch.zeros(b, t)
    scores[torch.arange(b), lengths - 1] = rewards  # the outcome reward on the last token
    return {
        "old": -torch.rand(b, t, generator=g) * 2,
        "ref": -torch.rand(b, t, generator=g) * 2,
        "mask": (torch.arange(t)[None, :] < lengths[:, None]).float(),
        "rewards": rewards,
        "scores": scores,
    }


def _ours(name: str, x: dict[str, Any]) -> torch.Tensor:
    seq = sequence_divergence(
        get_regularizer(name), rollout_logp=x["old"], ref_logp=x["ref"], mask=x["mask"]
    )
    return reward_penalty(x["rewards"], [(COEF, seq)])


@pytest.mark.parametrize("name", NAMES)
def test_kl_penalty_in_the_reward_is_gbmpo_reward_penalty(name: str) -> None:
    gv.configure_kl({})
    x = _batch()
    # apply_kl_penalty's arithmetic, on verl's kl_penalty (served by the gbmpo hook)
    kld = core_algos.kl_penalty(x["old"], x["ref"], kl_penalty=gv.PREFIX + name) * x["mask"]
    verl_seq = (x["scores"] - COEF * kld).sum(-1)
    ours = _ours(name, x)
    torch.testing.assert_close(verl_seq, ours, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(ours, x["rewards"])


@pytest.mark.parametrize("name", NAMES)
def test_verl_apply_kl_penalty(name: str) -> None:
    """verl's own function, where its trainer module imports (it needs ray's extras)."""
    try:
        from verl import DataProto
        from verl.trainer.ppo.ray_trainer import apply_kl_penalty
    except ImportError as err:
        pytest.skip(f"verl.trainer.ppo.ray_trainer does not import here: {err}")
    gv.configure_kl({})
    x = _batch()
    tensors = {"response_mask": x["mask"], "token_level_scores": x["scores"],
               "old_log_probs": x["old"], "ref_log_prob": x["ref"]}  # fmt: skip
    data = DataProto.from_dict(tensors=tensors)
    out, _ = apply_kl_penalty(data, core_algos.FixedKLController(kl_coef=COEF),
                              kl_penalty=gv.PREFIX + name)  # fmt: skip
    torch.testing.assert_close(out.batch["token_level_rewards"].sum(-1), _ours(name, x),
                               rtol=1e-6, atol=1e-6)  # fmt: skip
