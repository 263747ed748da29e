import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gbmpo.objectives import ADVANTAGES, group_advantages
from gbmpo.registry import UnknownNameError

finite_reward = st.floats(min_value=-1e4, max_value=1e4, allow_nan=False)
maybe_reward = st.one_of(finite_reward, st.none())
# float64 rewards over a huge range, including subnormals: stresses under/overflow of std
wide_reward = st.floats(min_value=-1e150, max_value=1e150, allow_nan=False)


@st.composite
def grouped_rewards(draw, elements=finite_reward, max_groups=6, max_g=8):
    g = draw(st.integers(1, max_g))
    n_groups = draw(st.integers(1, max_groups))
    values = draw(st.lists(elements, min_size=g * n_groups, max_size=g * n_groups))
    return values, g


def test_grpo_matches_hand_computation_with_unbiased_std():
    r = torch.tensor([1.0, 0.0, 1.0, 1.0, 3.0, 5.0], dtype=torch.float64)
    adv = group_advantages(r, 3, "group", eps=0.0)
    g1, g2 = r[:3], r[3:]
    exp1 = (g1 - g1.mean()) / g1.std(unbiased=True)
    exp2 = (g2 - g2.mean()) / g2.std(unbiased=True)
    torch.testing.assert_close(adv, torch.cat([exp1, exp2]))
    # the eps enters the denominator
    adv_eps = group_advantages(r, 3, "group", eps=0.5)
    torch.testing.assert_close(adv_eps[:3], (g1 - g1.mean()) / (g1.std() + 0.5))


def test_batch_scale_uses_group_mean_and_batch_std():
    r = torch.tensor([0.0, 2.0, 10.0, 14.0], dtype=torch.float64)
    adv = group_advantages(r, 2, "batch", eps=0.0)
    expected = torch.tensor([-1.0, 1.0, -2.0, 2.0], dtype=torch.float64) / r.std()
    torch.testing.assert_close(adv, expected)


def test_dr_grpo_is_mean_only():
    r = torch.tensor([0.0, 2.0, 10.0, 14.0])
    torch.testing.assert_close(group_advantages(r, 2, "none"), torch.tensor([-1.0, 1.0, -2.0, 2.0]))


def test_nan_rewards_excluded_and_zero():
    r = [1.0, None, 0.0, 1.0, None, None, 2.0, 2.0]
    adv = group_advantages(r, 4, "group", eps=0.0)
    valid = torch.tensor([1.0, 0.0, 1.0])
    expected = (valid - valid.mean()) / valid.std()
    torch.testing.assert_close(adv[[0, 2, 3]], expected)
    assert adv[1] == 0 and adv[4] == 0 and adv[5] == 0
    assert torch.all(adv[6:] == 0)  # constant valid rewards
    # NaN tensors behave like None
    adv2 = group_advantages(torch.tensor([1.0, math.nan, 0.0, 1.0]), 4, "none")
    torch.testing.assert_close(adv2, torch.tensor([1 / 3, 0.0, -2 / 3, 1 / 3]))


def test_singleton_groups_and_all_nan_groups_are_zero():
    assert torch.all(group_advantages(torch.tensor([3.0, -1.0, 7.0]), 1, "group") == 0)
    assert torch.all(group_advantages(torch.tensor([3.0, -1.0, 7.0]), 1, "batch") == 0)
    assert torch.all(group_advantages([None, None], 2) == 0)


def test_constant_group_exact_zero_even_with_zero_eps():
    # 0.1 * 3 / 3 != 0.1 in floating point: a naive (r - mean) / std would be garbage
    r = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7])
    for scale in ("group", "batch", "none"):
        adv = group_advantages(r, 3, scale, eps=0.0)
        assert torch.all(adv == 0), scale


def test_validation_errors():
    with pytest.raises(ValueError, match="not divisible by group_size=4"):
        group_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="valid scales: group, batch, none"):
        group_advantages(torch.zeros(4), 2, scale="std")
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.zeros(4), 0)
    with pytest.raises(ValueError, match="inf"):
        group_advantages(torch.tensor([1.0, math.inf]), 2)
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.zeros(2, 2), 2)
    with pytest.raises(ValueError, match="eps"):
        group_advantages(torch.zeros(4), 2, eps=-1.0)


def test_registry_names_and_unknown():
    assert set(ADVANTAGES.names()) == {"grpo", "dr_grpo", "batch", "rpg"}
    r = torch.tensor([0.0, 1.0, 5.0, 5.0, 2.0, 4.0])
    torch.testing.assert_close(ADVANTAGES.get("grpo")(r, 3), group_advantages(r, 3, "group"))
    torch.testing.assert_close(ADVANTAGES.get("batch")(r, 3), group_advantages(r, 3, "batch"))
    torch.testing.assert_close(ADVANTAGES.get("dr_grpo")(r, 3), group_advantages(r, 3, "none"))
    torch.testing.assert_close(ADVANTAGES.get("rpg")(r, 3), group_advantages(r, 3, "none"))
    with pytest.raises(UnknownNameError, match="batch, dr_grpo, grpo, rpg"):
        ADVANTAGES.get("gae")


def test_dtypes():
    r = torch.tensor([0.0, 1.0, 1.0, 0.5], dtype=torch.bfloat16)
    adv = group_advantages(r, 2)
    assert adv.dtype == torch.float32 and torch.isfinite(adv).all()
    assert group_advantages(torch.tensor([0, 1, 1, 1]), 2).dtype == torch.float32
    assert group_advantages(torch.zeros(2, dtype=torch.float64), 2).dtype == torch.float64


@settings(max_examples=150, deadline=None)
@given(grouped_rewards(elements=maybe_reward), st.sampled_from(["group", "batch", "none"]))
def test_property_finite_and_group_mean_zero(data, scale):
    values, g = data
    adv = group_advantages(values, g, scale).double()
    assert adv.shape == (len(values),)
    assert torch.isfinite(adv).all()
    r = torch.tensor([math.nan if v is None else v for v in values], dtype=torch.float64)
    assert torch.all(adv[torch.isnan(r)] == 0)
    for k in range(len(values) // g):
        a = adv[k * g : (k + 1) * g]
        rv = r[k * g : (k + 1) * g]
        valid = ~torch.isnan(rv)
        scale_ref = max(1.0, float(a[valid].abs().max()) if valid.any() else 1.0)
        assert abs(float(a[valid].sum())) <= 1e-5 * scale_ref * g  # float32 math
        if valid.sum() <= 1 or rv[valid].max() == rv[valid].min():
            assert torch.all(a == 0)


@settings(max_examples=200, deadline=None)
@given(grouped_rewards(elements=wide_reward), st.sampled_from([0.0, 1e-6]))
def test_property_group_scale_has_unit_std(data, eps):
    values, g = data
    r = torch.tensor(values, dtype=torch.float64)
    adv = group_advantages(r, g, "group", eps=eps)
    assert torch.isfinite(adv).all()
    for scale in ("batch", "none"):
        assert torch.isfinite(group_advantages(r, g, scale, eps=eps)).all()
    for k in range(len(values) // g):
        rv, a = r[k * g : (k + 1) * g], adv[k * g : (k + 1) * g]
        if g >= 2 and rv.max() != rv.min():
            s = float(rv.abs().max())
            std = s * float((rv / s).std())  # scaled, so the reference does not underflow
            # std / (std + eps): exactly 1 with eps = 0
            expected = 1.0 if eps == 0 else std / (std + eps)
            assert float(a.std()) == pytest.approx(expected, rel=1e-6, abs=1e-9)
        else:
            assert torch.all(a == 0)


def test_denormal_rewards_give_finite_advantages():
    """A group whose largest reward is denormal: eps / scale is a tensor division (a Python
    scalar over a tensor goes through the reciprocal, and 0 * inf is NaN). Found by hypothesis."""
    r = torch.tensor([0.0, 2.2e-313], dtype=torch.float64)
    for scale in ("group", "batch", "none"):
        adv = group_advantages(r, 2, scale, eps=0.0)
        assert torch.isfinite(adv).all(), (scale, adv)
        assert adv[0] < 0 < adv[1]
