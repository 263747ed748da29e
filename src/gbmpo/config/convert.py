"""The training configuration between its dataclass tree, nested dicts and YAML: typed
building with errors that name the key by its dotted path (:func:`config_from_dict`),
:func:`config_to_dict`, :func:`dump_yaml` and the YAML reader.
"""

from __future__ import annotations

import dataclasses
import types
import typing
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Union

import yaml

from gbmpo.config.schema import ALIASES, RENAMED_KEYS, ConfigError, TrainConfig
from gbmpo.objectives.drift_control import DriftControl
from gbmpo.objectives.spec import ObjectiveSpec, SpecError, did_you_mean

__all__ = [
    "config_fields",
    "config_from_dict",
    "config_to_dict",
    "dump_yaml",
    "leaf_keys",
    "read_yaml",
    "rename_old_keys",
    "renamed_key",
    "type_name",
]


def type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        args = ", ".join(type_name(a) for a in typing.get_args(tp))
        return f"{origin.__name__}[{args}]"
    if tp is type(None):
        return "None"
    if tp is Any:
        return "any"
    return getattr(tp, "__name__", str(tp))


def config_fields(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _describe(value: Any, limit: int = 200) -> str:
    """``type value`` for messages; a long value is cut (``...`` and its length)."""
    try:
        text = repr(value)
    except ValueError:  # an int with more digits than Python prints
        text = f"<{value.bit_length()}-bit int>" if isinstance(value, int) else "<unprintable>"
    if len(text) > limit:
        text = f"{text[:limit]}... ({len(text)} characters)"
    return f"{type(value).__name__} {text}"


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against the annotation ``tp`` (converting where lossless) or raise."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"{path!r} must be {type_name(tp)}, got None")
        errors = []
        for arg in args:
            # a section or a list of sections (objective.regularizer): the arm of the value's
            # shape reports its own errors (an unknown key inside a term, say)
            if dataclasses.is_dataclass(arg) and isinstance(value, Mapping):
                return _coerce(value, arg, path)
            if typing.get_origin(arg) is list and isinstance(value, (list, tuple)):
                return _coerce(value, arg, path)
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, path)
            except ConfigError as err:
                errors.append(err)
        raise ConfigError(f"{path!r} must be {type_name(tp)}, got {_describe(value)}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path!r} must be a mapping (section), got {_describe(value)}")
        if tp is ObjectiveSpec:  # one parser for the objective, whichever path reads it
            try:
                return ObjectiveSpec.from_dict(value, path)
            except ConfigError:
                raise
            except SpecError as err:
                raise ConfigError(str(err)) from None
        return _build(tp, value, path)
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path!r} must be a mapping, got {_describe(value)}")
        for k in value:
            if not isinstance(k, str):
                raise ConfigError(f"{path!r} keys must be strings, got {k!r}")
        return dict(value)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, str) or not isinstance(value, Sequence):
            raise ConfigError(f"{path!r} must be {type_name(tp)}, got {_describe(value)}")
        return [_coerce(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        item_tps = typing.get_args(tp)
        if isinstance(value, str) or not isinstance(value, Sequence) or len(value) != len(item_tps):
            raise ConfigError(
                f"{path!r} must be a list of {len(item_tps)} values ({type_name(tp)}), got "
                f"{_describe(value)}"
            )
        return tuple(
            _coerce(v, t, f"{path}[{i}]")
            for i, (v, t) in enumerate(zip(value, item_tps, strict=True))
        )
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path!r} must be bool (true/false), got {_describe(value)}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{path!r} must be int, got {_describe(value)}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:  # an int beyond float range
                raise ConfigError(f"{path!r} must be float, got {_describe(value)} (out of "
                                  "float range)") from None
        # PyYAML reads exponent notation without a dot ("5e-5") as a string
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{path!r} must be float, got {_describe(value)}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{path!r} must be str, got {_describe(value)}")
    raise TypeError(f"unsupported config annotation {tp!r} at {path!r}")  # pragma: no cover


def leaf_keys(cls: type | None = None, prefix: str = "") -> list[str]:
    """Every dotted key of the configuration down to its values (``optim.lr``, ...; a free
    ``params`` dict is one key)."""
    out: list[str] = []
    for name, tp in config_fields(TrainConfig if cls is None else cls).items():
        key = f"{prefix}{name}"
        sections = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        if sections:  # a section or a list of sections (objective.regularizer): the whole
            out.append(key)  # value is a key of its own, and so is each key of the section
            out += leaf_keys(sections[0], f"{key}.")
        elif dataclasses.is_dataclass(tp):
            out += leaf_keys(tp, f"{key}.")
        else:
            out.append(key)
    return out


def top_level_hint(key: str) -> str:
    """The "did you mean" of an unknown top-level key of a config file: a command-line alias
    (``regularizer``) or a bare field name (``lr``) points to its nested key, as
    ``--regularizer`` and ``--lr`` do on the command line."""
    table = dict(ALIASES)
    for full in leaf_keys():
        table.setdefault(full.rsplit(".", 1)[-1], full)
    hint = did_you_mean(key, table)
    if not hint:
        return ""
    full = hint.split("'")[1]
    if "." not in full:
        return hint
    nested = ": ".join(full.split(".")) + ": ..."
    return f"{hint} (in a YAML file: {nested})"


def _build(cls: type, data: Mapping[str, Any], path: str) -> Any:
    fields = config_fields(cls)
    kwargs = {}
    for key, value in data.items():
        full = f"{path}.{key}" if path else str(key)
        if key not in fields:
            where = f" under {path!r}" if path else ""
            hint = did_you_mean(str(key), list(fields), prefix=f"{path}." if path else "")
            if not path and not hint:  # a top-level key: also an alias or a field's own name
                hint = top_level_hint(str(key))
            raise ConfigError(
                f"unknown key {full!r}; valid keys{where}: {', '.join(fields)}{hint}"
            )
        kwargs[key] = _coerce(value, fields[key], full)
    return cls(**kwargs)


def renamed_key(old: str, *, both: bool) -> str:
    """The new name of the renamed key ``old`` (:data:`RENAMED_KEYS`), with a
    ``DeprecationWarning`` saying so; ``both``: the new key is given too, a ``ConfigError``."""
    new = RENAMED_KEYS[old]
    if both:
        raise ConfigError(
            f"both {old!r} and {new!r} are given; {old!r} is the old name of {new!r}: keep only "
            f"{new!r}"
        )
    warnings.warn(
        f"{old!r} is deprecated: it is now {new!r} (same values); the old key is still read",
        DeprecationWarning,
        stacklevel=3,
    )
    return new


def rename_old_keys(data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` (a nested mapping) with every old key of :data:`RENAMED_KEYS` moved to its new
    name in the same section (:func:`renamed_key`: a warning; both given: ``ConfigError``)."""
    out = dict(data)
    for old, new in RENAMED_KEYS.items():
        section, old_leaf = old.rsplit(".", 1)
        new_leaf = new.rsplit(".", 1)[1]
        sub = out.get(section)
        if not isinstance(sub, Mapping) or old_leaf not in sub:
            continue
        sub = dict(sub)
        renamed_key(old, both=new_leaf in sub)
        sub[new_leaf] = sub.pop(old_leaf)
        out[section] = sub
    return out


def config_from_dict(data: Mapping[str, Any]) -> TrainConfig:
    """Build a :class:`TrainConfig` from a nested mapping (missing keys keep their defaults;
    a renamed key is read under its new name, :func:`rename_old_keys`)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"the configuration must be a mapping, got {_describe(data)}")
    return typing.cast(TrainConfig, _build(TrainConfig, rename_old_keys(data), ""))


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """A plain nested dict (tuples become lists) that :func:`config_from_dict` reads back."""

    def plain(x: Any) -> Any:
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            return {f.name: plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
        if isinstance(x, DriftControl):  # a named tuple written as its mapping
            return x.to_dict()
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        return x

    return typing.cast(dict[str, Any], plain(cfg))


def dump_yaml(cfg: TrainConfig, path: str | Path | None = None) -> str:
    """The resolved configuration as YAML (written to ``path`` if given)."""
    text = yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=False)
    if path is not None:
        Path(path).write_text(text)
    return text


def _yaml_problem(err: yaml.YAMLError) -> str:
    """PyYAML's error in one line: the problem and where (``line L, column C``)."""
    problem = getattr(err, "problem", None)
    mark = getattr(err, "problem_mark", None)
    if not problem:
        return " ".join(str(err).split())
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    context = getattr(err, "context", None)
    return f"{context + ': ' if context else ''}{problem}{where}"


def read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        found = p.is_file()
    except OSError as err:  # a name longer than the file system allows, ...
        text = str(path)
        shown = text if len(text) <= 200 else f"{text[:200]}... ({len(text)} characters)"
        raise ConfigError(f"config file {shown!r} cannot be read: {err.strerror}") from None
    if not found:
        if p.is_dir():
            yamls = sorted(str(f) for f in p.rglob("*.y*ml"))[:3]
            example = f", e.g. {', '.join(yamls)}" if yamls else ""
            raise ConfigError(f"config file {str(path)!r} is a directory; name a YAML file in "
                              f"it{example}")  # fmt: skip
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8-sig"))
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {_yaml_problem(err)}"
                          ) from err
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text: {err}") from err
    if data is None or data == {}:
        raise ConfigError(
            f"config file {str(path)!r} is empty (no settings); write the keys to change "
            "(`gbmpo train --print-config` shows them all) or drop --config to train the defaults"
        )
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping, got {_describe(data)}")
    _check_kind(path, data)
    return data


def _check_kind(path: str | Path, data: Mapping[str, Any]) -> None:
    """A file none of whose top-level keys is a key of the configuration, and fewer than half
    close to one, is another kind of file (a model's config.json, an ES config, ...): say so
    in one line."""
    fields = config_fields(TrainConfig)
    keys = [str(k) for k in data]
    if any(k in fields or k in RENAMED_KEYS or k.split(".")[0] in fields for k in keys):
        return
    close = sum(bool(did_you_mean(k, list(fields)) or top_level_hint(k)) for k in keys)
    if 2 * close >= len(keys):
        return  # typos: the unknown-key error names the first and its fix
    shown = ", ".join(keys[:5]) + (", ..." if len(keys) > 5 else "")
    raise ConfigError(
        f"config file {str(path)!r} is not a gbmpo training config: its top-level keys "
        f"({shown}) are none of {', '.join(fields)}"
    )
