"""A second device on a CPU-only machine, for catching device mixing in tests.

Inside :class:`SimulatedDevice`, a tensor moved or created on :data:`DEVICE` holds CPU data but
reports ``DEVICE`` as its device; an op that mixes it with a CPU tensor of one or more dimensions
raises ``RuntimeError("Expected all tensors to be on the same device ...")`` as it would on a
GPU (0-dim CPU tensors may mix, as in PyTorch). Values stay real, so ``float()``/``.item()``
and autograd work (which ``FakeTensorMode`` cannot offer a whole training step). The simulated
device is labelled ``meta``: ``cuda`` cannot be used on a CPU-only build (autograd asks its
device guard, which is not linked in). It is stricter than CUDA in one way: CPU index tensors
into device tensors are refused too.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

#: the simulated device
DEVICE = torch.device("meta")


class OnDevice(torch.Tensor):
    """A CPU tensor (``elem``) that reports :data:`DEVICE` as its device."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> OnDevice:
        t = torch.Tensor._make_wrapper_subclass(
            cls, elem.size(), strides=elem.stride(), storage_offset=elem.storage_offset(),
            dtype=elem.dtype, layout=elem.layout, device=DEVICE, requires_grad=False,
        )
        t.elem = elem
        return t

    def __repr__(self) -> str:  # type: ignore[override]
        return f"OnDevice({self.elem!r})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return _run(func, args, kwargs or {})


def _on_device(device: Any) -> bool:
    return device is not None and torch.device(device).type == DEVICE.type


#: ops whose CPU index tensors may index a device tensor (CUDA allows it)
_INDEXING = {
    torch.ops.aten.index.Tensor,
    torch.ops.aten.index_put.default,
    torch.ops.aten.index_put_.default,
    torch.ops.aten._index_put_impl_.default,
}


def _run(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    devices = set()
    checked = (args[0], *args[2:]) if func in _INDEXING else (args, kwargs)
    for a in tree_flatten(checked)[0]:
        if isinstance(a, OnDevice):
            devices.add(str(DEVICE))
        elif isinstance(a, torch.Tensor) and a.device.type == DEVICE.type:
            raise RuntimeError(f"{func}: a tensor was made on {DEVICE} outside the simulation")
        elif isinstance(a, torch.Tensor) and a.dim() > 0:
            devices.add(str(a.device))
    if len(devices) > 1:
        raise RuntimeError(
            "Expected all tensors to be on the same device, but found at least two devices, "
            f"{' and '.join(sorted(devices))}! ({func})"
        )
    on_device = devices == {str(DEVICE)}
    if "device" in kwargs:  # factories and .to(): the target device decides
        on_device = _on_device(kwargs["device"])
        if on_device:
            kwargs = {**kwargs, "device": torch.device("cpu")}
    wrappers: dict[int, OnDevice] = {}

    def unwrap(a: Any) -> Any:
        if isinstance(a, OnDevice):
            wrappers[id(a.elem)] = a
            return a.elem
        return a

    out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))

    def wrap(o: Any) -> Any:
        if isinstance(o, torch.Tensor) and not isinstance(o, OnDevice):
            if id(o) in wrappers:  # in-place ops return their input
                return wrappers[id(o)]
            return OnDevice(o) if on_device else o
        return o

    return tree_map(wrap, out)


class _Factories(TorchFunctionMode):
    """``torch.tensor(data, device=DEVICE)`` copies below the dispatcher: build it on the CPU
    and move it through :func:`_run` instead; ``.tolist()`` reads the CPU data."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func in (torch.tensor, torch.as_tensor) and _on_device(kwargs.get("device")):
            device = kwargs.pop("device")
            return func(*args, **kwargs).to(device)
        if func is torch._C.TensorBase.tolist and isinstance(args[0], OnDevice):
            return args[0].elem.tolist()  # a read back to Python, like ``.item()``
        return func(*args, **kwargs)


class SimulatedDevice(TorchDispatchMode):
    """Context manager: while active, :data:`DEVICE` behaves like a separate device."""

    def __enter__(self) -> SimulatedDevice:
        self._factories = _Factories()
        self._factories.__enter__()
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._factories.__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return _run(func, args, kwargs or {})
