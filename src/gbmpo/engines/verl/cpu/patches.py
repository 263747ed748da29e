"""The two changes to verl's internals that a CPU run needs, in one place, for the verl version
they were written against (:data:`TESTED_VERL`); :func:`check_version` refuses any other with one
line, before a CPU run starts (``gbmpo train``) and in every verl process that loads
:mod:`gbmpo.engines.verl.cpu.plugin`.

1. ``verl.utils.distributed.initialize_global_process_group_ray`` joins
   ``f"cpu:gloo,{device}:{backend}"``, which on a CPU is ``"cpu:gloo,cpu:gloo"`` ("Duplicate
   device type cpu"): its default ``backend`` becomes ``"cpu:gloo"`` (the function object's
   defaults, so every module that imported the name sees it).
2. ``verl.workers.engine.fsdp.transformer_impl`` builds forward-only FSDP2 engines (the reference
   model) with ``CPUOffloadPolicy(pin_memory=True)``; pinning needs an accelerator ("Cannot
   access accelerator device"): the module's ``CPUOffloadPolicy`` becomes a subclass that never
   pins. Applied when verl imports the module (:class:`_AfterImport`), so loading this package
   stays light.

Each patch first checks the source text it replaces and raises :class:`VerlCPUError` naming it
when verl changed it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import inspect
import sys
from types import ModuleType
from typing import Any

from gbmpo.engines.verl.cpu import TESTED_VERL, VerlCPUError, check_version

__all__ = ["apply", "patch_distributed", "patch_transformer_impl"]

_DISTRIBUTED = "verl.utils.distributed"
_TRANSFORMER_IMPL = "verl.workers.engine.fsdp.transformer_impl"


def _require(source: str, needle: str, where: str) -> None:
    if needle not in source:
        raise VerlCPUError(f"{where} no longer contains {needle!r} (verl changed it); the CPU "
                           f"patches were written for verl {', '.join(TESTED_VERL)}")  # fmt: skip


def patch_distributed(module: ModuleType) -> None:
    """Patch 1 (module doc); idempotent."""
    fn = module.initialize_global_process_group_ray
    if getattr(fn, "_gbmpo_cpu", False):
        return
    _require(inspect.getsource(fn),
             'backend or f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"',
             f"{_DISTRIBUTED}.initialize_global_process_group_ray")  # fmt: skip
    params = list(inspect.signature(fn).parameters)
    if params != ["timeout_second", "backend"]:
        raise VerlCPUError(f"{_DISTRIBUTED}.initialize_global_process_group_ray{params} changed")
    fn.__defaults__ = (None, "cpu:gloo")
    fn._gbmpo_cpu = True  # type: ignore[attr-defined]


def patch_transformer_impl(module: ModuleType) -> None:
    """Patch 2 (module doc); idempotent."""
    base = module.CPUOffloadPolicy
    if getattr(base, "_gbmpo_cpu", False):
        return
    _require(inspect.getsource(module), "CPUOffloadPolicy(pin_memory=True)", _TRANSFORMER_IMPL)

    class UnpinnedCPUOffloadPolicy(base):  # type: ignore[misc, valid-type]
        """``CPUOffloadPolicy`` that never pins host memory (no accelerator to pin for)."""

        _gbmpo_cpu = True

        def __init__(self, pin_memory: bool = False, **kwargs: Any) -> None:
            super().__init__(pin_memory=False, **kwargs)

    module.CPUOffloadPolicy = UnpinnedCPUOffloadPolicy


_PATCHES = {_DISTRIBUTED: patch_distributed, _TRANSFORMER_IMPL: patch_transformer_impl}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Applies a patch right after verl imports the patched module (a meta-path finder that
    wraps the module's loader)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _PATCHES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                loader = spec.loader
                original = loader.exec_module

                def exec_module(module: ModuleType, _orig: Any = original) -> None:
                    _orig(module)
                    _PATCHES[module.__name__](module)

                loader.exec_module = exec_module  # type: ignore[method-assign]
                return spec
        return None


def apply() -> None:
    """Check the version, then apply both patches now (modules already imported) or when verl
    imports them."""
    check_version()
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
    for name, patch in _PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
