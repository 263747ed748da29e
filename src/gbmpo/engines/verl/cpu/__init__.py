"""verl on a CPU: the platform, the rollout and the patches that let verl's own trainer
(``python -m verl.trainer.main_ppo``) train on a machine without a GPU.

Loaded only for a CPU run: ``gbmpo train --engine verl`` with ``model.device: cpu`` adds
:data:`PLUGIN` to ``VERL_USE_EXTERNAL_MODULES`` and sets :data:`ENV` for verl's processes
(:mod:`gbmpo.engines.verl.runner`); a GPU run never imports it. Importing :data:`PLUGIN` (in every
verl process, through ``import verl``)

* checks the verl version (:func:`check_version`: one line naming the tested version
  otherwise);
* registers the platform ``cpu`` (:class:`gbmpo.engines.verl.cpu.platform.PlatformCPU`)
  with ``verl.plugin.platform.PlatformRegistry``;
* registers the rollout ``hf`` (:mod:`gbmpo.engines.verl.cpu.rollout`) with verl's rollout
  registries;
* applies the two patches of verl internals (:mod:`gbmpo.engines.verl.cpu.patches`).

The overrides of a CPU run are :func:`gbmpo.engines.verl.args.cpu_overrides` (one logical Ray
GPU, ``trainer.device=cpu``, ``rollout.name=hf``, SDPA attention, no torch.compile).
``VERL_ENGINE_DEVICE=cuda`` selects verl's FSDP engine class (registered for the devices cuda and
npu only), which then places everything on the platform's device, the CPU.

This package itself imports nothing from verl (the driver reads :data:`TESTED_VERL` and
:func:`check_version` from it in gbmpo's own environment).
"""

from __future__ import annotations

import importlib.metadata

__all__ = ["ENV", "PLUGIN", "TESTED_VERL", "VerlCPUError", "check_version"]

#: the verl versions the CPU platform, the HF rollout and the patches were tested with
TESTED_VERL: tuple[str, ...] = ("0.9.1",)

#: the module verl's processes import (``VERL_USE_EXTERNAL_MODULES``) in a CPU run
PLUGIN = "gbmpo.engines.verl.cpu.plugin"

#: the environment of verl's processes in a CPU run (besides ``VERL_USE_EXTERNAL_MODULES``)
ENV: dict[str, str] = {"VERL_PLATFORM": "cpu", "VERL_ENGINE_DEVICE": "cuda"}


class VerlCPUError(RuntimeError):
    """The installed verl is not one whose internals the CPU run was tested with."""


def check_version(version: str | None = None) -> str:
    """The installed verl version (or ``version``); :class:`VerlCPUError` in one line unless it
    is one of :data:`TESTED_VERL`."""
    if version is None:
        try:
            version = importlib.metadata.version("verl")
        except importlib.metadata.PackageNotFoundError:
            raise VerlCPUError("a CPU verl run needs verl: `make verl` builds .venv-verl") from None
    if version not in TESTED_VERL:
        raise VerlCPUError(
            f"model.device 'cpu' on engine verl patches verl internals tested with verl "
            f"{', '.join(TESTED_VERL)} only, found verl {version}: install "
            f"verl=={TESTED_VERL[-1]} (requirements-verl.txt) or run on GPUs (model.device: cuda)"
        )
    return version
