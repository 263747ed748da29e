"""fp32 master weights for bf16 parameters (mixed-precision training, Micikevicius et al. 2018,
arXiv 1710.03740).

A bf16 weight has an 8-bit mantissa: an AdamW update smaller than half its spacing
(:math:`|\\Delta w| < 2^{-9}|w|`) rounds back to the same weight, so at small learning rates
(1e-6) updating bf16 weights directly changes almost nothing. :class:`MasterWeightOptimizer`
keeps an fp32 copy of each low-precision trainable parameter, steps the optimizer on the copies
(gradients cast up from the model's) and writes the rounded copies back into the model, so
updates accumulate in fp32 across steps. fp16 (5-bit exponent: gradients underflow without loss
scaling) is refused for training (:func:`check_train_dtype`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from gbmpo.config import ConfigError

__all__ = ["MasterWeightOptimizer", "check_train_dtype", "needs_master_weights"]

_LOW_PRECISION = (torch.bfloat16, torch.float16)


def check_train_dtype(dtype: str, lora: bool) -> None:
    """Refuse ``float16`` training: without loss scaling its gradients underflow."""
    if dtype == "float16":
        raise ConfigError(
            "'model.dtype' float16 is not supported for training (gradients underflow without "
            "loss scaling); use bfloat16 (trained with fp32 master weights) or float32"
            + ("; LoRA adapters are float32 either way" if lora else "")
        )


def needs_master_weights(params: list[Tensor]) -> bool:
    """True when some trainable parameter is bf16/fp16."""
    return any(p.dtype in _LOW_PRECISION for p in params)


class MasterWeightOptimizer:
    """An optimizer stepping fp32 copies of the model's trainable parameters.

    ``build(master_params)`` makes the inner optimizer (e.g. AdamW). Use it like a torch
    optimizer, with :meth:`grads_to_masters` between ``backward`` and gradient clipping (clip
    :attr:`masters`); :meth:`step` updates the copies and writes them back into the model.
    The state dict holds the inner optimizer's state and the fp32 copies, so a resumed run
    continues from the same fp32 weights.
    """

    def __init__(self, params: list[Tensor], build: Callable[[list[Tensor]], Any]) -> None:
        self.params = params
        self.masters = [
            torch.nn.Parameter(p.detach().to(torch.float32, copy=True)) for p in params
        ]
        self.inner = build(self.masters)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups  # type: ignore[no-any-return]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)
        for p in self.params:
            p.grad = None

    def grads_to_masters(self) -> None:
        """Cast the model's gradients up onto the fp32 copies (and free the low-precision ones)."""
        for p, m in zip(self.params, self.masters, strict=True):
            m.grad = None if p.grad is None else p.grad.to(torch.float32)
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        self.inner.step()
        for p, m in zip(self.params, self.masters, strict=True):
            p.copy_(m)

    def state_dict(self) -> dict[str, Any]:
        return {
            "inner": self.inner.state_dict(),
            "masters": [m.detach().clone() for m in self.masters],
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state["inner"])
        for p, m, saved in zip(self.params, self.masters, state["masters"], strict=True):
            m.copy_(saved)
            p.copy_(m)
