r"""What the TRL and verl packages (:mod:`gbmpo.engines.trl`, :mod:`gbmpo.engines.verl`) share:
host clip settings -> surrogate parameters (:func:`clip_params`), and the check of a host
library's internals.

Both hosts spell the ratio clip their own way (TRL: ``epsilon`` / ``epsilon_high`` / ``delta``;
verl: ``clip_ratio_low`` / ``clip_ratio_high`` / ``clip_ratio_c``); :func:`clip_params` maps
them onto the parameters of a gbmpo surrogate, once. The other host spellings of the objective
(aggregation and advantage names) are in each host's table (:mod:`gbmpo.config.hosts.trl`,
:mod:`gbmpo.config.hosts.verl`).

:func:`check_signatures`, :func:`check_fields` and :func:`check_sources` are the one helper
both hosts use to fail loudly, naming the method, parameter, field or source text, when a host
library's internals that they hook have moved.

Imports neither TRL nor verl.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["check_fields", "check_signatures", "check_sources", "clip_params"]

#: surrogate -> (its lower-eps, upper-eps, dual-clip and ratio-cap parameter names; None where
#: the surrogate has no such parameter). Plugin surrogates take none of the host's settings.
_CLIP_PARAM_NAMES: dict[str, tuple[str | None, str | None, str | None, str | None]] = {
    "clip": ("eps_low", "eps_high", "dual_clip_c", "ratio_cap"),
    "gspo": ("eps_low", "eps_high", "dual_clip_c", "ratio_cap"),
    "atr": (None, None, "dual_clip_c", None),
    "divergence_clip": (None, None, "dual_clip_c", None),
    "rpg_clip": ("eps_low", "eps_high", "c", None),
    "rpg_reinforce": ("eps_low", "eps_high", "c", None),
}


def clip_params(
    surrogate: str,
    *,
    eps_low: float | None = None,
    eps_high: float | None = None,
    dual_clip_c: float | None = None,
    ratio_cap: float | None = None,
) -> dict[str, Any]:
    r"""The parameters of gbmpo surrogate ``surrogate`` that a host's ratio-clip settings give.

    A host clips the ratio to :math:`[1-\varepsilon_{\text{low}}, 1+\varepsilon_{\text{high}}]`
    (TRL ``epsilon`` / ``epsilon_high``; verl ``clip_ratio_low`` / ``clip_ratio_high``), may
    apply the dual clip :math:`c` for negative advantages (verl ``clip_ratio_c``) and may cap
    the unclipped ratio at :math:`\rho_{\text{cap}}` (``ratio_cap``; TRL ``delta``). Each
    surrogate takes the settings it has a parameter for, under its own name (``rpg_*`` call the
    dual clip ``c``; ``atr`` and ``divergence_clip`` derive their bounds from their own radius
    and take only the dual clip); settings left at ``None`` are not passed (the surrogate's
    default applies). Unknown (plugin) surrogates get ``{}``.
    """
    names = _CLIP_PARAM_NAMES.get(surrogate)
    if names is None:
        return {}
    out: dict[str, Any] = {}
    for name, value in zip(names, (eps_low, eps_high, dual_clip_c, ratio_cap), strict=True):
        if name is not None and value is not None:
            out[name] = value
    return out


# --------------------------------------------------------------------------------------------
# The check of a host library's internals
# --------------------------------------------------------------------------------------------


def check_signatures(
    owner: Any,
    methods: Mapping[str, tuple[str, ...]],
    *,
    error: type[Exception],
    context: str,
    static: bool = False,
    owner_name: str | None = None,
) -> None:
    """Raise ``error`` naming the first function of ``methods`` missing from ``owner`` (a class
    or a module) or no longer accepting one of its listed parameters (a subset check: new
    parameters are fine). ``static``: look methods up with ``inspect.getattr_static`` (class
    attributes, unwrapping static/class methods); otherwise ``getattr`` and ``__wrapped__``.
    ``context`` ends each message (host version and what supports it)."""
    label = owner_name or getattr(owner, "__name__", type(owner).__name__)
    for name, params in methods.items():
        if static:
            fn = inspect.getattr_static(owner, name, None)
            if isinstance(fn, (staticmethod, classmethod)):
                fn = fn.__func__
        else:
            fn = getattr(owner, name, None)
        if fn is None or not callable(fn):
            raise error(f"{label}.{name} no longer exists ({context})")
        target = getattr(fn, "__wrapped__", fn)
        try:
            sig = inspect.signature(target)
        except (TypeError, ValueError) as e:  # pragma: no cover - builtins only
            raise error(f"cannot read the signature of {label}.{name}: {e}") from None
        missing = [p for p in params if p not in sig.parameters]
        if missing:
            raise error(
                f"{label}.{name} no longer takes {', '.join(missing)} (signature now {sig}; "
                f"{context})"
            )


def check_fields(
    cls: type, wanted: tuple[str, ...], *, error: type[Exception], context: str
) -> None:
    """Raise ``error`` naming the first of ``wanted`` that is not a field of dataclass ``cls``."""
    names = {f.name for f in dataclasses.fields(cls)}
    for f in wanted:
        if f not in names:
            raise error(f"{cls.__name__} has no field {f!r} any more ({context})")


def check_sources(
    facts: Mapping[str, tuple[Callable[..., Any], tuple[str, ...]]],
    *,
    error: type[Exception],
    context: str,
    flatten_whitespace: bool = False,
) -> None:
    """Raise ``error`` naming the first function (``label -> (function, needles)``) whose source
    lacks one of its needles (text checks: what a hook relies on that a signature cannot
    show). ``flatten_whitespace`` compares with runs of whitespace collapsed."""
    for label, (fn, needles) in facts.items():
        target = getattr(fn, "__wrapped__", fn)
        try:
            src = inspect.getsource(target)
        except (OSError, TypeError) as e:
            raise error(f"cannot read the source of {label}: {e}") from None
        if flatten_whitespace:
            src = " ".join(src.split())
        for needle in needles:
            probe = " ".join(needle.split()) if flatten_whitespace else needle
            if probe not in src:
                raise error(f"{label} no longer contains {needle!r} ({context})")
