"""Two real TRL training steps on CPU for every regularizer and every clip mode, metrics logged.

One generation batch of 2 prompts x 4 completions feeds two optimizer steps
(``steps_per_generation=2``), so TRL computes old log-probs and the second step is off-policy.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

pytest.importorskip("trl")

import torch  # noqa: E402

from gbmpo.integrations.trl import GBMPOConfig, GBMPOTrainer  # noqa: E402
from gbmpo.objectives.mirror import NeuralMirrorMap  # noqa: E402
from gbmpo.objectives.regularizers import REGULARIZERS  # noqa: E402

#: on top of the ``cpu_args`` fixture
TRAIN: dict[str, Any] = {
    "steps_per_generation": 2,
    "max_completion_length": 6,
    "max_steps": 2,
    "learning_rate": 1e-2,
    "logging_steps": 1,
}

CASES: list[tuple[str, dict[str, Any]]] = [
    (name, {"regularizer": name, "regularizer_coef": 0.0 if name == "none" else 0.1,
            "regularizer_anchor": "old" if name.startswith("rpg_") else "ref"})
    for name in REGULARIZERS
] + [
    ("atr", {"clip_mode": "atr", "atr_delta": 0.02, "regularizer": "prob_l2",
             "regularizer_coef": 0.1}),
    ("divergence_prob_l2", {"clip_mode": "divergence", "clip_measure": "prob_l2",
                            "clip_delta": 0.01, "regularizer": "kl_k3",
                            "regularizer_coef": 0.05}),
    ("rpg_dual", {"clip_mode": "rpg_dual", "dual_clip_c": 3.0, "rpg_variant": "urkl",
                  "rpg_beta": 0.01, "regularizer": "rpg_ufkl", "regularizer_coef": 0.01,
                  "regularizer_anchor": "old"}),
    ("gspo_dr_grpo", {"importance_sampling_level": "sequence", "loss_type": "grpo",
                      "regularizer": "kl_k3", "regularizer_coef": 0.05,
                      "use_bias_correction_kl": False}),  # TRL's sequence-weighted KL: refused
]


def test_cases_cover_every_regularizer_and_clip_mode() -> None:
    from gbmpo.integrations.trl import CLIP_MODES

    covered_regs = {kw["regularizer"] for _, kw in CASES}
    covered_clips = {kw.get("clip_mode", "ratio") for _, kw in CASES}
    assert covered_regs == set(REGULARIZERS)
    assert covered_clips == set(CLIP_MODES)


@pytest.mark.parametrize(("case", "kwargs"), CASES, ids=[c for c, _ in CASES])
def test_two_steps(
    case: str,
    kwargs: dict[str, Any],
    tmp_path: Any,
    tiny_model_dir: str,
    tiny_dataset: Any,
    reward_fn: Any,
    cpu_args: dict[str, Any],
) -> None:
    kwargs = dict(kwargs)
    if kwargs["regularizer"] == "neural_mirror":
        path = tmp_path / "mirror.json"
        NeuralMirrorMap.random(scale=0.5, seed=1).save(path)
        kwargs["mirror_path"] = str(path)
    args = GBMPOConfig(output_dir=str(tmp_path / "out"), **cpu_args, **TRAIN, **kwargs)
    trainer = GBMPOTrainer(
        model=tiny_model_dir, reward_funcs=reward_fn, args=args, train_dataset=tiny_dataset
    )
    needs_ref = args.needs_reference_model
    assert (trainer.ref_model is not None) == needs_ref
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()

    logs = [h for h in trainer.state.log_history if "loss" in h and "step" in h]
    assert [h["step"] for h in logs] == [1, 2]
    expected = [
        "entropy",
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "clip_ratio/dual_mean",
        "ratio/mean",
        "ratio/min",
        "ratio/max",
        "pg_loss",
        "reg_loss",
        "reg_value",
    ]
    reg = kwargs["regularizer"]
    if needs_ref:
        # the optimised regularizer's D(pi_old || pi_ref) whenever the reference exists (under
        # its name after use_bias_correction_kl's mapping: kl_k3 -> kl_k3_is)
        expected += ["kl", f"reg/{args.regularizer}"]
    for h in logs:
        missing = [k for k in expected if k not in h]
        assert not missing, f"metrics not logged: {missing}"
        for k in expected:
            assert math.isfinite(h[k]), f"{k} = {h[k]}"
        assert math.isfinite(h["loss"])
    # the second step's batch is off-policy (the policy moved after step 1)
    assert logs[1]["ratio/max"] != 1.0 or logs[1]["ratio/min"] != 1.0
    if reg != "none":
        # after one update the policy differs from its anchor, so the divergence is non-zero
        assert logs[1]["reg_value"] != 0.0
        # the logged regularizer part of the loss is coef x the aggregated regularizer
        assert logs[1]["reg_loss"] != 0.0
    else:
        assert logs[1]["reg_loss"] == 0.0
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])]
    assert changed, "no parameter changed"


def test_monitored_divergences_are_logged_once_under_reg(
    tmp_path: Any, tiny_model_dir: str, tiny_dataset: Any, reward_fn: Any,
    cpu_args: dict[str, Any],
) -> None:
    """``monitor_regularizers``: every registered regularizer's D(pi_old || pi_ref) is in each
    log row once, as ``reg/<name>`` (the own engine's name), and under no other name (the former
    ``regularizer/<name>`` and ``reference/<name>`` are gone)."""
    args = GBMPOConfig(output_dir=str(tmp_path / "out"), **cpu_args, **TRAIN,
                       regularizer="prob_l2", regularizer_coef=0.0,
                       monitor_regularizers=True)  # fmt: skip
    trainer = GBMPOTrainer(
        model=tiny_model_dir, reward_funcs=reward_fn, args=args, train_dataset=tiny_dataset
    )
    assert trainer.ref_model is not None  # loaded for the monitors alone (coef 0)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "step" in h]
    assert logs
    names = set(REGULARIZERS.names()) - {"none"}
    for h in logs:
        assert {k for k in h if k.startswith("reg/")} == {f"reg/{n}" for n in names}
        assert not [k for k in h if k.startswith(("regularizer/", "reference/"))]
        for n in names:  # once: no other key names the same divergence
            assert [k for k in h if k.rsplit("/", 1)[-1] == n] == [f"reg/{n}"], n
            assert math.isfinite(h[f"reg/{n}"])
