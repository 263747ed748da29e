"""Imported by verl's processes in a CPU run (``VERL_USE_EXTERNAL_MODULES``): the version check,
the ``cpu`` platform, the ``hf`` rollout and the patches (:mod:`gbmpo.engines.verl.cpu`)."""

from __future__ import annotations

import importlib

from gbmpo.engines.verl.cpu import check_version
from gbmpo.engines.verl.cpu.patches import apply

__all__ = ["ROLLOUT", "install"]

#: the rollout name (``actor_rollout_ref.rollout.name``)
ROLLOUT = "hf"
_ROLLOUT_MODULE = "gbmpo.engines.verl.cpu.rollout"


def install() -> None:
    """Version check, platform, rollout and patches (idempotent)."""
    check_version()
    # deferred: verl is optional; imported after check_version() names a missing or unsupported one
    from verl.plugin.platform import PlatformRegistry
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    from gbmpo.engines.verl.cpu.platform import PlatformCPU

    PlatformRegistry.register("cpu")(PlatformCPU)
    # the hf rollout, by name (gbmpo.engines.verl.cpu.rollout imports verl)
    RolloutReplicaRegistry.register(ROLLOUT, _hf_replica)
    _ROLLOUT_REGISTRY[(ROLLOUT, "async")] = f"{_ROLLOUT_MODULE}.HFServerAdapter"
    apply()


def _hf_replica() -> type:
    return importlib.import_module(_ROLLOUT_MODULE).HFReplica


install()
