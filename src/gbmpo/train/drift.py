"""The own trainer's controlled coefficients (``objective.regularizer.coef: {target: ...}``,
:mod:`gbmpo.objectives.drift_control`): after each step, each controlled term's coefficient
moves by :func:`~gbmpo.objectives.drift_control.proportional_coef` from the measure the step
logged (``reg/kl_k3`` or the term's ``reg/<name>``, the rollout's drift from the reference), and
the objective of the next step uses it. The state is the objective's coefficients, saved in
checkpoints (``state.json``'s ``drift_coefs``) and restored on resume; each function returns the
objective to use next (a built objective is not changed in place).
"""

from __future__ import annotations

from typing import Any

from gbmpo.io.metrics import DRIFT_COEF_PREFIX, DRIFT_MEASURE_PREFIX, MONITOR_PREFIX
from gbmpo.objectives.spec import BuiltObjective

__all__ = ["control_drift", "drift_state", "restore_drift"]


def control_drift(objective: BuiltObjective, record: dict[str, Any]) -> BuiltObjective:
    """Log each controlled term's coefficient of this step and its measure into the step's
    ``record`` (``drift_coef/<term>``, ``drift_measure/<term>``); returns ``objective`` with
    the coefficients of the next step."""
    next_coefs: dict[str, float] = {}
    for term in objective.controlled:
        assert term.control is not None
        key = MONITOR_PREFIX + term.control.monitor(term.name)
        if key not in record:
            raise RuntimeError(
                f"the controlled coefficient of {term.name!r} reads {key}, which "
                "this step did not log (no reference log-probs?)"
            )
        measure = float(record[key])
        record[DRIFT_COEF_PREFIX + term.name] = term.coef
        record[DRIFT_MEASURE_PREFIX + term.name] = measure
        next_coefs[term.name] = term.control.step(term.coef, measure)
    return objective.with_coefs(next_coefs) if next_coefs else objective


def drift_state(objective: BuiltObjective) -> dict[str, float]:
    """The controlled coefficients of ``objective`` (the next step's), by term (``state.json``'s
    ``drift_coefs``; JSON keeps a float's every bit)."""
    return {t.name: t.coef for t in objective.controlled}


def restore_drift(objective: BuiltObjective, coefs: dict[str, float] | None) -> BuiltObjective:
    """``objective`` with the controlled coefficients of a checkpoint's ``drift_coefs``; a
    checkpoint without them for a controlled term is a ``ValueError`` (it was written without
    the controller, so its continuation would not be the run's)."""
    names = {t.name for t in objective.controlled}
    missing = names - set(coefs or {})
    if missing:
        raise ValueError(
            f"the checkpoint holds no controlled coefficient of {sorted(missing)}; "
            "it was written by a run without that controller"
        )
    if names:
        return objective.with_coefs({n: float((coefs or {})[n]) for n in names})
    return objective
