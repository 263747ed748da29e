"""The configuration of ``gbmpo es``: the embedded default and the YAML file that overrides it.

Sections of the YAML file (any part of :data:`DEFAULT_ES_CONFIG` may be overridden):

``es``       :class:`gbmpo.meta.es.ESConfig` (population, iterations, sigma0, sigma_decay,
             step_size, estimator, acceptance, elites, elites_in_gradient, seed)
``init``     ``scale`` and ``seed`` of the initial map, ``NeuralMirrorMap.random`` (U[0, scale))
``fitness``  ``steps`` (T), ``validation_size``, ``validation_seed``, ``metric``, ``device``
``train``    the inner run's ``TrainConfig`` (as ``gbmpo train --config``; regularizer
             ``neural_mirror``, the map is set per member)
``backend``  ``name`` (local | ray | serial), ``workers`` (local pool size), ``address`` (Ray
             cluster), ``cpus_per_member`` (Ray), ``threads`` (torch threads per member; default
             cores // workers for local, cpus_per_member for Ray, 1 for serial)
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from gbmpo.meta.fitness import default_inner_config

__all__ = ["DEFAULT_ES_CONFIG", "load_es_config"]

#: the embedded default of ``gbmpo es`` (completes in a few minutes on 2 CPU cores)
DEFAULT_ES_CONFIG: dict[str, Any] = {
    "es": {
        "population": 4,
        "iterations": 4,
        "sigma0": 0.05,
        "sigma_decay": 0.95,
        "step_size": 0.05,
        "estimator": "centered",
        "acceptance": "best",
        "elites": True,
        "elites_in_gradient": False,
        "seed": 42,
    },
    "init": {"scale": 0.01, "seed": 42},
    "fitness": {
        "steps": 4,
        "validation_size": 100,
        "validation_seed": 0,
        "metric": None,
        "device": "auto",
    },
    "train": None,  # None: gbmpo.meta.fitness.default_inner_config()
    "backend": {
        "name": "local",
        "workers": None,
        "address": None,
        "cpus_per_member": 1,
        "threads": None,
    },
}

_SECTION_KEYS = {
    "init": {"scale", "seed"},
    "fitness": {"steps", "validation_size", "validation_seed", "metric", "device"},
    "backend": {"name", "workers", "address", "cpus_per_member", "threads"},
}


def _deep_merge(base: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in new.items():
        if isinstance(out.get(key), dict) and isinstance(value, dict) and key != "params":
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def load_es_config(path: str | Path | None = None) -> dict[str, Any]:
    """The embedded default, overridden by the YAML file ``path``; keys are checked."""
    cfg = copy.deepcopy(DEFAULT_ES_CONFIG)
    cfg["train"] = default_inner_config()
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"ES config file {str(path)!r} does not exist")
        try:
            data = yaml.safe_load(p.read_text(encoding="utf-8-sig")) or {}
        except yaml.YAMLError as err:
            raise ValueError(f"ES config file {str(path)!r} is not valid YAML: {err}") from err
        if not isinstance(data, dict):
            raise ValueError(f"ES config file {str(path)!r} must hold a mapping")
        unknown = sorted(map(str, set(data) - set(cfg)))
        if unknown:
            raise ValueError(
                f"unknown ES config section(s) {', '.join(unknown)}; valid: {', '.join(cfg)}"
            )
        cfg = _deep_merge(cfg, data)
    for section, value in cfg.items():
        if not isinstance(value, dict):
            raise ValueError(f"ES config section {section!r} must be a mapping, got "
                             f"{type(value).__name__} {value!r}"[:300])
    for section, keys in _SECTION_KEYS.items():
        extra = sorted(map(str, set(cfg[section]) - keys))
        if extra:
            raise ValueError(
                f"unknown key(s) {', '.join(extra)} in ES config section {section!r}; "
                f"valid: {', '.join(sorted(keys))}"
            )
    return cfg
