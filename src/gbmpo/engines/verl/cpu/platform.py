"""verl's platform for a CPU (``VERL_PLATFORM=cpu``): :class:`PlatformCPU`, registered with verl's
``PlatformRegistry`` by :mod:`gbmpo.engines.verl.cpu`.

verl 0.9.1 resolves the device through ``verl.plugin.platform`` (``get_platform()``: the device
name, the ``torch.<device>`` namespace, the collective backend, the Ray resource) and ships
platforms for NVIDIA, Ascend and ROCm only. The CPU platform answers with device ``cpu`` and the
``gloo`` backend, and keeps Ray's resource name ``GPU``: verl's placement groups count only
``GPU``/``NPU`` bundles (``single_controller/ray/base.py``), so a CPU run starts Ray with one
*logical* GPU (``ray_kwargs.ray_init.num_gpus=1``, :mod:`gbmpo.engines.verl.args`), a token that
places the one worker; no CUDA is touched (the CPU build of torch has none).
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psutil
import torch
from verl.plugin.platform import PlatformBase

__all__ = ["PlatformCPU", "cpu_device_module"]


def _mem_get_info(device: Any = None) -> tuple[int, int]:
    """``(free, total)`` bytes of host memory (``torch.cuda.mem_get_info``'s meaning)."""
    vm = psutil.virtual_memory()
    return int(vm.available), int(vm.total)


def _zero(*args: Any, **kwargs: Any) -> int:
    return 0


def _none(*args: Any, **kwargs: Any) -> None:
    return None


class _CPUDeviceModule(types.ModuleType):
    """``torch.cpu`` plus the ``torch.cuda`` functions verl calls on ``get_torch_device()``
    that ``torch.cpu`` lacks: memory queries (host memory; 0 for the allocator counters),
    cache and IPC no-ops, the RNG state (torch's global CPU generator) and a device name."""

    def __init__(self) -> None:
        super().__init__("gbmpo_verl_cpu_device")
        self.empty_cache = _none
        self.ipc_collect = _none
        self.reset_peak_memory_stats = _none
        self.set_per_process_memory_fraction = _none
        self.memory_allocated = _zero
        self.max_memory_allocated = _zero
        self.memory_reserved = _zero
        self.max_memory_reserved = _zero
        self.mem_get_info = _mem_get_info
        self.get_rng_state = lambda device=None: torch.get_rng_state()
        self.set_rng_state = lambda state, device=None: torch.set_rng_state(state)
        self.manual_seed = torch.manual_seed
        self.manual_seed_all = torch.manual_seed
        self.get_device_name = lambda device=None: "cpu"

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)


#: the ``device_module`` of :class:`PlatformCPU`
cpu_device_module = _CPUDeviceModule()


class PlatformCPU(PlatformBase):
    """verl platform ``cpu``: device ``cpu``, backend ``gloo``, Ray resource ``GPU`` (logical;
    see the module doc). Registered under ``cpu`` and selected with ``VERL_PLATFORM=cpu``; never
    auto-detected (:meth:`is_platform_available` is ``False``), so loading it on a GPU machine
    changes nothing unless selected."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return cpu_device_module

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return False

    def current_device(self) -> str:  # type: ignore[override]
        """``"cpu"``: verl moves tensors with ``.to(get_device_id())``, where ``0`` would mean
        ``cuda:0``."""
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str) -> Iterator[None]:
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {"num_gpus": num_gpus}

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None
