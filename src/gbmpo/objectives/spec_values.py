"""The values of an objective spec: numbers, coefficients, keys and their errors.

:class:`SpecError` names a bad key by its dotted path; :func:`parse_number` and
:func:`parse_coefficient` are the one rule for a float value of the objective (every engine's
path reads them); :func:`did_you_mean` suggests the closest valid name. Used by
:mod:`gbmpo.objectives.spec` (which re-exports them) and the config readers.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "FORMER_KEYS",
    "SpecError",
    "did_you_mean",
    "parse_coefficient",
    "parse_number",
    "refuse_former_keys",
]

#: Former names of objective settings -> the one name that replaces each: refused (a
#: :class:`SpecError` naming the replacement), not read as aliases.
FORMER_KEYS: dict[str, str] = {
    "monitor_reference": "monitor_regularizers",
    "log_all_regularizers": "monitor_regularizers",
}


class SpecError(ValueError):
    """A malformed objective spec (unknown key, wrong type, bad value); the message names the
    key by its dotted path."""


#: A number in YAML 1.2's core syntax (``5e-2``, ``1E5``, ``0.05``, ``-3``, ``.5``).
_NUMBER = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")
#: The numbers among them that YAML 1.1 (PyYAML) reads as text: an exponent without a dot
#: (``5e-2``, ``1e5``) or without a sign (``1.0e5``).
_EXPONENT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)[eE][-+]?[0-9]+")


def parse_number(value: Any, where: str) -> float:
    """The one rule for a float value of the objective: an int or a float (not a bool), or a
    string written as a number (YAML 1.2 syntax: PyYAML, a YAML 1.1 reader, returns ``5e-2`` or
    ``1e5`` unquoted in a file as the string ``"5e-2"``, and a quoted ``"0.05"`` is a string
    too), as a float; anything else is a :class:`SpecError` naming ``where``."""
    if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        return float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(f"'{where}' must be float, got {type(value).__name__} {value!r}")
    try:
        return float(value)
    except OverflowError:  # an int beyond float range
        raise SpecError(f"'{where}' must be float, got an int out of float range") from None


def parse_coefficient(value: Any, where: str) -> float:
    """A regularizer coefficient: :func:`parse_number`, finite and ``>= 0``.

    Negative coefficients are refused on every path (the ``objective:`` section, the TRL
    drop-in's ``regularizer_coef`` / ``beta``): every registered regularizer is a divergence
    from the anchor (``>= 0`` per token, or in expectation for ``kl_k1``), so ``coef < 0`` would
    reward moving away from the anchor, not penalise it; 0 switches the term off."""
    coef = parse_number(value, where)
    if not math.isfinite(coef) or coef < 0:
        raise SpecError(
            f"'{where}' must be finite and >= 0, got {coef:g}: the regularizer is a divergence "
            "from the anchor, so a negative coefficient would reward drifting away from it; "
            "use 0 to switch the term off"
        )
    return coef


def _param_value(value: Any) -> Any:
    """A free parameter as given, except a number that YAML 1.1 left as text (``5e-2``), which
    becomes the float YAML 1.2 reads (names and paths stay strings)."""
    if isinstance(value, str) and _EXPONENT.fullmatch(value.strip()):
        return float(value)
    return value



def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise SpecError(f"{where!r} must be a mapping (section), got {type(value).__name__}")
    return value


def refuse_former_keys(d: Mapping[str, Any], where: str) -> None:
    """:class:`SpecError` for a former name of a setting (:data:`FORMER_KEYS`), naming the one
    that replaces it: a setting is honoured or refused, never silently aliased."""
    for key in d:
        if key in FORMER_KEYS:
            raise SpecError(
                f"'{where}.{key}' was renamed: use '{where}.{FORMER_KEYS[key]}' (one setting "
                "for the monitored divergences reg/<name> on every engine)"
            )


def _known(d: Mapping[str, Any], where: str, valid: tuple[str, ...]) -> None:
    for key in d:
        if key not in valid:
            hint = did_you_mean(str(key), valid, prefix=f"{where}.")
            raise SpecError(
                f"unknown key '{where}.{key}'; valid keys under {where!r}: {', '.join(valid)}"
                f"{hint}"
            )


def did_you_mean(word: str, candidates: Mapping[str, str] | Sequence[str], *,
                 prefix: str = "") -> str:
    """``"; did you mean 'NAME'?"`` for the candidate closest to ``word``, or ``""`` when none
    is close (:func:`difflib.get_close_matches`, ratio >= 0.75, case, ``-`` and ``_`` ignored).

    ``candidates``: names, or a mapping of names to what to suggest for each (an alias to
    itself, a field name to its dotted key); ``prefix`` is put before a suggested plain name.
    """
    table = dict(candidates) if isinstance(candidates, Mapping) else {
        c: f"{prefix}{c}" for c in candidates}
    norm: dict[str, str] = {}
    for name, shown in table.items():
        norm.setdefault(name.lower().replace("-", "_"), shown)
    key = word.lower().replace("-", "_")
    best = difflib.get_close_matches(key, list(norm), n=1, cutoff=0.75)
    return f"; did you mean {norm[best[0]]!r}?" if best else ""


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise SpecError(f"{where!r} must be str, got {type(value).__name__} {value!r}")
    return value


def _params(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    d = _mapping(value, where)
    for k in d:
        if not isinstance(k, str):
            raise SpecError(f"{where!r} keys must be strings, got {k!r}")
    return {k: _param_value(v) for k, v in d.items()}
