"""The support matrix's vocabulary: one key on one engine (:class:`Support`: honoured, refused or
no effect, with the host setting it becomes), the table shorthands :func:`H`, :func:`R`,
:func:`N`, and the config keys and their defaults that every engine's table covers. The tables
are :mod:`gbmpo.config.hosts` (one module per engine); :mod:`gbmpo.config.support` applies and
renders them.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from gbmpo.config.schema import TrainConfig

__all__ = ["HONOURED", "NO_EFFECT", "REFUSED", "H", "N", "R", "Setting", "Support", "Together",
           "any_full", "config_keys", "default_of", "host_values", "never_default",
           "probe_settings", "same", "value_at"]  # fmt: skip

HONOURED, REFUSED, NO_EFFECT = "honoured", "refused", "no_effect"

#: one host setting's value: ``(value, cfg, *context) -> host value``, ``value`` the key's value
#: in ``cfg``; ``context`` is what the host's argument builder adds (TRL: the batch layout)
Setting = Callable[..., Any]


@dataclass(frozen=True)
class Support:
    """One key on one engine.

    ``refuse(value, cfg)`` returns ``True`` for the values the engine cannot honour (for
    ``status == REFUSED``; ``None`` refuses every value but the default); ``how`` is the host
    setting (honoured), the reason (refused) or what the key changes (no effect); ``probe`` is
    a second valid value whose effect on the host's configuration a test checks (honoured keys
    of the ``trl`` and ``verl`` engines); ``sets`` maps each host setting the key decides to
    its :data:`Setting` (the host's arguments are built from these: :func:`host_values`)."""

    status: str
    how: str = ""
    refuse: Callable[[Any, Any], bool] | None = None
    probe: Any = None
    sets: Mapping[str, Setting] = field(default_factory=dict)


@dataclass(frozen=True)
class Together:
    """A probe that needs other keys set with it (``settings``: ``(key, value)`` pairs, the
    entry's own key among them), e.g. ``eval.after: false`` refused only with an ``eval.every``
    that misses the last step."""

    settings: tuple[tuple[str, Any], ...]


def probe_settings(key: str, probe: Any) -> list[tuple[str, Any]]:
    """The config settings of ``key``'s ``probe`` (:class:`Together`: its settings)."""
    return list(probe.settings) if isinstance(probe, Together) else [(key, probe)]


def H(how: str = "", probe: Any = None, sets: Mapping[str, Setting] | None = None) -> Support:  # noqa: N802 - table shorthand
    return Support(HONOURED, how, probe=probe, sets=dict(sets or {}))


def R(why: str, refuse: Callable[[Any, Any], bool] | None = None, probe: Any = None,  # noqa: N802
      sets: Mapping[str, Setting] | None = None) -> Support:
    return Support(REFUSED, why, refuse, probe, dict(sets or {}))


def same(value: Any, cfg: Any, *context: Any) -> Any:
    """The :data:`Setting` that passes the key's value on unchanged."""
    return value


def host_values(table: Mapping[str, Support], cfg: Any, *context: Any) -> dict[str, Any]:
    """Every host setting ``table``'s keys decide for ``cfg`` (each entry's ``sets``, in the
    table's order), ``context`` passed on to each :data:`Setting`."""
    out: dict[str, Any] = {}
    for key, entry in table.items():
        value = value_at(cfg, key) if entry.sets else None
        for name, setting in entry.sets.items():
            out[name] = setting(value, cfg, *context)
    return out


def N(what: str) -> Support:  # noqa: N802
    return Support(NO_EFFECT, what)


def any_full(value: Any) -> bool:
    """``estimator: full`` on the term, or on any term of a list."""
    return "full" in (value if isinstance(value, list) else [value])


def never_default(key: str) -> Callable[[Any, Any], bool]:
    return lambda value, cfg: value != default_of(key)


def config_keys() -> list[str]:
    """Every dotted key of :class:`gbmpo.config.TrainConfig` (free ``params`` dicts are
    one key each)."""
    def walk(cls: type, prefix: str) -> Iterator[str]:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            key = f"{prefix}{f.name}"
            sections = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
            if sections:  # a section or a list of sections (objective.regularizer): the list
                yield key  # form is a key of its own, then the section's keys
                yield from walk(typing.cast(type, sections[0]), key + ".")
            elif dataclasses.is_dataclass(tp):
                yield from walk(typing.cast(type, tp), key + ".")
            else:
                yield key

    return list(walk(TrainConfig, ""))


def value_at(cfg: Any, key: str) -> Any:
    """The value at ``key``; below a list of sections (regularizer terms), the list of the
    terms' values."""
    node = cfg
    for part in key.split("."):
        if isinstance(node, list):
            node = [getattr(item, part) for item in node]
        else:
            node = getattr(node, part)
    return node


def _listed(value: Any, cfg: Any) -> bool:
    """Whether ``objective.regularizer`` is a list of terms."""
    return isinstance(value, list)


def default_of(key: str) -> Any:
    return value_at(TrainConfig(), key)


