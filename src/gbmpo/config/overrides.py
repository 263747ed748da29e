"""Command-line overrides of the training configuration (``--optim.lr 1e-4``, aliases such as
``--lr 1e-4``): the key's annotation, its text parsed by that type, and :func:`load_config`
(defaults <- YAML file <- overrides).
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Union

import yaml

from gbmpo.config.convert import (
    config_fields,
    config_from_dict,
    config_to_dict,
    leaf_keys,
    read_yaml,
    rename_old_keys,
    renamed_key,
    type_name,
)
from gbmpo.config.schema import ALIASES, RENAMED_KEYS, ConfigError, TrainConfig
from gbmpo.objectives.spec import SpecError, did_you_mean, refuse_former_keys

__all__ = ["annotation_at", "apply_overrides", "canonical_key", "leaf_keys", "load_config"]


def annotation_at(path: Sequence[str]) -> Any:
    """The annotation of the dotted ``path`` (``Any`` inside a free ``params`` dict; a renamed
    key's old name, :data:`RENAMED_KEYS`, has the new key's)."""
    if ".".join(path) in RENAMED_KEYS:
        path = RENAMED_KEYS[".".join(path)].split(".")
    if len(path) == 2 and path[0] == "objective":  # a former objective key: refused, naming it
        try:
            refuse_former_keys({path[1]: None}, "objective")
        except SpecError as err:
            raise ConfigError(str(err)) from None
    tp: Any = TrainConfig
    for i, part in enumerate(path):
        prefix = ".".join(path[:i])
        if typing.get_origin(tp) in (Union, types.UnionType):
            # a section that may also be a list of sections (objective.regularizer): its keys
            # are the section's
            sections = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
            tp = sections[0] if sections else tp
        if dataclasses.is_dataclass(tp):
            fields = config_fields(tp)
            if part not in fields:
                where = f" under {prefix!r}" if prefix else ""
                raise ConfigError(
                    f"unknown key {'.'.join(path[: i + 1])!r}; valid keys{where}: "
                    f"{', '.join(fields)}{_override_hint(part, prefix, fields)}"
                )
            tp = fields[part]
        elif typing.get_origin(tp) is dict:
            tp = Any
        else:
            raise ConfigError(f"{prefix!r} is a {type_name(tp)}, it has no key {part!r}")
    return tp


def _override_hint(part: str, prefix: str, fields: Mapping[str, Any]) -> str:
    """The "did you mean" of an unknown override key: a field of the same section; at the top
    level also an alias (``--regulariser`` -> ``regularizer``) or the dotted key a bare field
    name belongs to (``--grad_clip`` -> ``optim.grad_clip``)."""
    if prefix:
        return did_you_mean(part, list(fields), prefix=f"{prefix}.")
    table = {name: name for name in fields}
    for alias in ALIASES:
        table.setdefault(alias, alias)
    for key in leaf_keys():
        table.setdefault(key.rsplit(".", 1)[-1], key)
    return did_you_mean(part, table)


def _parse_text(text: str, tp: Any, key: str) -> Any:
    """Turn a command-line string into a value of annotation ``tp``."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp) if origin in (Union, types.UnionType) else (tp,)
    if type(None) in args and text.strip().lower() in ("none", "null", "~"):
        return None
    concrete = [a for a in args if a is not type(None)]
    if len(concrete) == 1:
        base = concrete[0]
        if base is str:
            return text
        if base is bool:
            low = text.strip().lower()
            if low in ("true", "yes", "1", "on"):
                return True
            if low in ("false", "no", "0", "off"):
                return False
            raise ConfigError(f"{key!r} must be bool (true/false), got {text!r}")
        if base is int:
            try:
                return int(text)
            except ValueError:
                raise ConfigError(f"{key!r} must be int, got {text!r}") from None
        if base is float:
            try:
                return float(text)
            except ValueError:
                raise ConfigError(f"{key!r} must be float, got {text!r}") from None
        if typing.get_origin(base) is list and typing.get_args(base) == (str,):
            stripped = text.strip()
            if not stripped.startswith("["):
                return [s.strip() for s in stripped.split(",") if s.strip()]
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as err:
        if tp is Any:  # free params: text YAML cannot read is a string (e.g. "a: {x}: b")
            return text
        raise ConfigError(f"cannot parse the value {text!r} of {key!r}: {err}") from err
    if tp is Any and _reads_as_text(text, value):
        return text
    return value


_LEADING_ZERO = re.compile(r"[-+]?0[0-9_]+")


def _reads_as_text(text: str, value: Any) -> bool:
    """Whether a free-params value that YAML read as a mapping or list was meant as text: a
    template such as ``"Q: {question}\nA:"`` or ``"{prompt}"`` (block syntax not opened by
    ``{``/``[``, or a flow mapping with an empty value); also a number YAML 1.1 read in base 60
    (``1:2:3``) or in octal (``010``), and text YAML reads as a comment (``# {prompt}``)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and (
        ":" in text or _LEADING_ZERO.fullmatch(text.strip())
    ):
        return True  # YAML 1.1 base 60 ("1:2:3" = 3723) or octal ("010" = 8): not what was typed
    if value is None and text.strip() not in ("", "~", "null", "Null", "NULL"):
        return True  # a YAML comment: "# Question: {prompt}"
    if not isinstance(value, (dict, list)):
        return False
    if not text.lstrip().startswith(("{", "[")):
        return True
    return isinstance(value, dict) and any(v is None for v in value.values())


def _set_path(data: dict[str, Any], path: Sequence[str], value: Any) -> None:
    node = data
    for i, part in enumerate(path[:-1]):
        nxt = node.get(part)
        if isinstance(nxt, list):
            where = ".".join(path[: i + 1])
            raise ConfigError(
                f"{'.'.join(path)!r}: {where!r} is a list of {len(nxt)} terms here (from the "
                f"config file), so a key of one term cannot be overridden on the command line; "
                f"edit the list in the file or set the whole list, e.g. --{where} "
                "'[{name: prob_l2, coef: 0.05}, {name: kl_k3, coef: 0.01}]'"
            )
        if not isinstance(nxt, dict):
            nxt = {}
            node[part] = nxt
        node = nxt
    node[path[-1]] = value


def canonical_key(key: str) -> str:
    """``--optim.grad-clip`` / ``optim.grad_clip`` / an alias -> the dotted config key."""
    k = key.lstrip("-")
    if k in ALIASES:
        return ALIASES[k]
    if k.replace("_", "-") in ALIASES:
        return ALIASES[k.replace("_", "-")]
    parts = k.split(".")
    # params dicts keep their keys verbatim; section and field names use underscores
    out = []
    in_params = False
    for part in parts:
        out.append(part if in_params else part.replace("-", "_"))
        in_params = in_params or part == "params"
    return ".".join(out)


def apply_overrides(data: dict[str, Any], overrides: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """Apply ``(dotted key or alias, value)`` pairs to a nested dict; string values are parsed
    according to the field's annotation. Unknown keys raise :class:`ConfigError`."""
    given = {canonical_key(k) for k, _ in overrides}
    for raw_key, raw_value in overrides:
        key = canonical_key(raw_key)
        if key in RENAMED_KEYS:  # the old name of a key: read as the new one
            key = renamed_key(key, both=RENAMED_KEYS[key] in given)
        path = key.split(".")
        tp = annotation_at(path)
        value = _parse_text(raw_value, tp, key) if isinstance(raw_value, str) else raw_value
        if dataclasses.is_dataclass(tp):
            raise ConfigError(f"{key!r} is a section; set one of its keys instead")
        _set_path(data, path, value)
    return data


def load_config(
    path: str | Path | None = None, overrides: Sequence[tuple[str, Any]] = ()
) -> TrainConfig:
    """Defaults <- YAML file ``path`` <- ``overrides``; keys and types are checked (values are
    checked by :func:`validate`)."""
    data = config_to_dict(TrainConfig())
    if path is not None:
        _deep_merge(data, rename_old_keys(read_yaml(path)), "")
    apply_overrides(data, overrides)
    return config_from_dict(data)


def _deep_merge(base: dict[str, Any], new: Mapping[str, Any], path: str) -> None:
    for key, value in new.items():
        full = f"{path}.{key}" if path else str(key)
        if key not in base:
            # let the typed builder produce the "unknown key" message
            base[key] = value
            continue
        if (
            isinstance(base[key], dict)
            and isinstance(value, Mapping)
            and not full.endswith("params")
        ):
            _deep_merge(base[key], value, full)
        else:
            base[key] = value
