"""The own trainer's controlled coefficients (``objective.regularizer.coef: {target: ...}``,
:mod:`gbmpo.objectives.drift_control`): after each step, each controlled term's coefficient
moves by :func:`~gbmpo.objectives.drift_control.proportional_coef` from the measure the step
logged (``reg/kl_k3`` or the term's ``reg/<name>``, the rollout's drift from the reference), and
the objective of the next step uses it. The state is ``tr.objective``'s coefficients, saved in
checkpoints (``state.json``'s ``drift_coefs``) and restored on resume.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gbmpo.io.metrics import DRIFT_COEF_PREFIX, DRIFT_MEASURE_PREFIX, MONITOR_PREFIX

if TYPE_CHECKING:
    from gbmpo.train.trainer import Trainer

__all__ = ["control_drift", "drift_state", "restore_drift"]


def control_drift(tr: Trainer, record: dict[str, Any]) -> None:
    """Log each controlled term's coefficient of this step and its measure into ``record``
    (``drift_coef/<term>``, ``drift_measure/<term>``), then move the coefficients of
    ``tr.objective`` for the next step."""
    new: dict[str, float] = {}
    for t in tr.objective.controlled:
        assert t.control is not None
        key = MONITOR_PREFIX + t.control.monitor(t.name)
        if key not in record:
            raise RuntimeError(
                f"the controlled coefficient of {t.name!r} reads {key}, which "
                "this step did not log (no reference log-probs?)"
            )
        measure = float(record[key])
        record[DRIFT_COEF_PREFIX + t.name] = t.coef
        record[DRIFT_MEASURE_PREFIX + t.name] = measure
        new[t.name] = t.control.step(t.coef, measure)
    if new:
        tr.objective = tr.objective.with_coefs(new)


def drift_state(tr: Trainer) -> dict[str, float]:
    """The controlled coefficients of the next step, by term (``state.json``'s
    ``drift_coefs``; JSON keeps a float's every bit)."""
    return {t.name: t.coef for t in tr.objective.controlled}


def restore_drift(tr: Trainer, coefs: dict[str, float] | None) -> None:
    """Set the controlled coefficients from a checkpoint's ``drift_coefs``; a checkpoint
    without them for a controlled term is a ``ValueError`` (it was written without the
    controller, so its continuation would not be the run's)."""
    names = {t.name for t in tr.objective.controlled}
    missing = names - set(coefs or {})
    if missing:
        raise ValueError(
            f"the checkpoint holds no controlled coefficient of {sorted(missing)}; "
            "it was written by a run without that controller"
        )
    if names:
        tr.objective = tr.objective.with_coefs({n: float((coefs or {})[n]) for n in names})
