"""GBMPOTrainer's ``reg/<name>`` is the own engine's quantity: D(pi_old || pi_ref), the masked
token mean over the whole batch (not a mean of micro-batch means), for the optimised regularizer
and, when monitoring, every registered one; and the reference model is loaded for it when the
loss does not need one."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("trl")

import torch  # noqa: E402

from gbmpo.integrations.trl import GBMPOConfig, GBMPOTrainer, build_objective  # noqa: E402
from gbmpo.objectives.regularizers import REGULARIZERS, get_regularizer  # noqa: E402


def _args(**objective: object) -> GBMPOConfig:
    spec = {"advantage": "dr_grpo", "aggregation": "dr_grpo", **objective}
    return GBMPOConfig(output_dir="unused", use_cpu=True, num_generations=4,
                       per_device_train_batch_size=4, objective=spec)  # fmt: skip


def test_monitors_are_the_own_engines_set() -> None:
    obj = build_objective(_args(regularizer={"name": "prob_l2", "coef": 0.1}))
    assert set(obj.monitors) == set(REGULARIZERS.names()) - {"none"}
    obj = build_objective(_args(regularizer={"name": "kl_k3", "coef": 0.1},
                                monitor_regularizers=False))  # fmt: skip
    assert set(obj.monitors) == {"kl_k3"}


def test_the_token_mean_over_the_batch_of_d_old_ref() -> None:
    torch.manual_seed(0)
    old, ref = -torch.rand(6, 5) * 3, -torch.rand(6, 5) * 3
    mask = torch.ones(6, 5)
    mask[0, 2:] = 0  # micro-batches with different token counts
    mask[4, 1:] = 0
    regs = {"kl_k3": get_regularizer("kl_k3"), "prob_l2": get_regularizer("prob_l2")}
    fake = SimpleNamespace(_gbmpo=SimpleNamespace(monitors=regs, controlled=()))
    for rows in (slice(0, 2), slice(2, 6)):  # two micro-batches
        GBMPOTrainer._add_monitored_divergences(fake, old[rows], ref[rows], mask[rows])
    for name, reg in regs.items():
        want = float(
            (reg(logp=old, old_logp=old, anchor_logp=ref, mask=mask) * mask).sum() / mask.sum()
        )
        got = fake._monitor_sums[name] / fake._monitor_tokens
        assert got == pytest.approx(want, rel=1e-6), name
    # D(pi_old || pi_ref), not D(pi_ref || pi_old): kl_k3 is not symmetric
    k3 = regs["kl_k3"](logp=ref, old_logp=ref, anchor_logp=old, mask=mask)
    swapped = float((k3 * mask).sum() / mask.sum())
    assert fake._monitor_sums["kl_k3"] / fake._monitor_tokens != pytest.approx(swapped)


def test_monitoring_loads_the_reference_when_the_loss_does_not() -> None:
    """TRL computes reference log-probs exactly when beta != 0: with monitor_regularizers and a
    coefficient of 0 (or anchor old) beta switches the reference on; the loss keeps coef 0.
    The objective section's setting is GBMPOConfig's (the same name, the same effect)."""
    spec = {"regularizer": {"name": "prob_l2", "coef": 0.0}}
    assert _args(monitor_regularizers=False, **spec).beta == 0.0
    args = _args(**spec)  # the spec's default, as gbmpo train's: monitor every regularizer
    assert args.monitor_regularizers and args.beta != 0.0
    assert build_objective(args).terms[0].coef == 0.0
    args = _args(regularizer={"name": "kl_k3", "coef": 0.3, "anchor": "old"})
    assert args.beta != 0.0 and build_objective(args).terms[0].anchor == "old"
    # TRL's spelling: the field of the same name, off by default (no reference model unless
    # the loss needs one, as TRL)
    plain = dict(output_dir="unused", use_cpu=True, num_generations=4,
                 per_device_train_batch_size=4, regularizer="prob_l2", regularizer_coef=0.0)
    assert GBMPOConfig(**plain).beta == 0.0
    monitored = GBMPOConfig(**plain, monitor_regularizers=True)
    assert monitored.beta != 0.0
    assert set(build_objective(monitored).monitors) == set(REGULARIZERS.names()) - {"none"}


@pytest.mark.parametrize("old", ["monitor_reference", "log_all_regularizers"])
def test_the_former_monitoring_fields_are_refused_naming_the_one_setting(old: str) -> None:
    with pytest.raises(TypeError, match=f"'{old}' was renamed: use 'monitor_regularizers'"):
        GBMPOConfig(output_dir="unused", use_cpu=True, **{old: True})


def test_window_means_weight_micro_batches_by_their_tokens() -> None:
    from gbmpo.integrations.trl import window_means

    metrics = {"clip_ratio/low_mean": [0.5, 0.0], "ratio/min": [0.9, 0.8], "ratio/max": [1.1, 1.3],
               "reward": [0.25]}  # fmt: skip
    weights = {"clip_ratio/low_mean": [10.0, 30.0]}
    window_means(metrics, weights)
    assert metrics == {"clip_ratio/low_mean": [0.125], "ratio/min": [0.8], "ratio/max": [1.3],
                       "reward": [0.25]}  # fmt: skip
    assert weights == {}
