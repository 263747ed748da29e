"""Meta-learning of the divergence geometry: evolution strategies over neural mirror maps.

``gbmpo.meta.es`` (pure ES step and state), ``gbmpo.meta.backends`` (serial, local process pool,
Ray), ``gbmpo.meta.checkpoint`` (resumable state), ``gbmpo.meta.runner`` (outer loop),
``gbmpo.meta.fitness`` (a member = a short training run scored on a disjoint validation split),
``gbmpo.meta.config`` (the ``gbmpo es`` configuration; its command line is :mod:`gbmpo.cli.es`).
"""

from gbmpo.meta.backends import BACKENDS, Backend, get_backend
from gbmpo.meta.checkpoint import load_state, save_state
from gbmpo.meta.es import (
    ESTIMATORS,
    Elite,
    ESConfig,
    ESState,
    elite_count,
    es_step,
    estimate_gradient,
    init_state,
    sigma_at,
)
from gbmpo.meta.runner import export_mirror_map, run_es_loop

__all__ = [
    "BACKENDS",
    "ESTIMATORS",
    "Backend",
    "ESConfig",
    "ESState",
    "Elite",
    "elite_count",
    "es_step",
    "estimate_gradient",
    "export_mirror_map",
    "get_backend",
    "init_state",
    "load_state",
    "run_es_loop",
    "save_state",
    "sigma_at",
]
