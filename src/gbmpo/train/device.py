"""Where a run executes: the device check, the one-process check and the memory estimate.

gbmpo's own trainer runs one process on one device. :func:`check_device` refuses a device that
is not there (before anything is loaded), :func:`check_single_process` refuses a multi-process
launch (``torchrun``), and :func:`estimate_memory` adds up what a run keeps on its device, so
``gbmpo train --dry-run`` can say whether a configuration fits before it is started.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from gbmpo.config import ConfigError, TrainConfig

__all__ = [
    "ONE_DEVICE_REFERENCE_BYTES",
    "check_device",
    "check_single_process",
    "device_memory_bytes",
    "estimate_memory",
    "peak_memory_bytes",
]

#: what "one device" means when the configured device is not on this machine (an 80 GiB GPU)
ONE_DEVICE_REFERENCE_BYTES = 80 * 2**30

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: the environment variables a multi-process launcher (torchrun, torch.distributed) sets
_LAUNCHER_VARS = ("WORLD_SIZE", "LOCAL_WORLD_SIZE")


def parse_device(name: str) -> torch.device:
    """``torch.device(name)``; a string torch does not accept raises :class:`ConfigError`."""
    try:
        return torch.device(name)
    except (RuntimeError, TypeError) as err:
        raise ConfigError(f"device {name!r} is not a torch device ({err})") from err


def device_absent_reason(name: str) -> str | None:
    """Why the device ``name`` cannot be used on this machine, or None when it can."""
    device = parse_device(name)
    kind = device.type
    if kind in ("cpu", "meta"):
        return None
    backend = getattr(torch, kind, None)
    available = getattr(backend, "is_available", None)
    if kind == "mps":
        available = torch.backends.mps.is_available
    if available is None or not available():
        return f"no {kind} device on this machine"
    count = getattr(backend, "device_count", lambda: 1)()
    if device.index is not None and device.index >= count:
        return f"{name} asked for, this machine has {count} {kind} device(s)"
    return None


def check_device(name: str, option: str = "model.device") -> torch.device:
    """The device ``name`` when this machine has it; else :class:`ConfigError` naming it (and
    the ``option`` that set it)."""
    reason = device_absent_reason(name)
    if reason is not None:
        raise ConfigError(
            f"{option} is {name!r} but {reason}; use --{option} cpu or a machine that has it"
        )
    return parse_device(name)


def check_single_process(environ: dict[str, str] | None = None) -> None:
    """Refuse a multi-process launch (``torchrun``, ``WORLD_SIZE`` > 1): gbmpo's own trainer is
    one process on one device, and N copies would share one device and one run directory."""
    env = os.environ if environ is None else environ
    for var in _LAUNCHER_VARS:
        value = env.get(var)
        if value is None:
            continue
        try:
            size = int(value)
        except ValueError:
            continue
        if size > 1:
            raise ConfigError(
                f"{var}={size}: gbmpo's own trainer runs in one process on one device and is not "
                "started with torchrun; for several GPUs use the engines that scale, TRL "
                "(gbmpo.integrations.trl) or verl (gbmpo.integrations.verl)"
            )


def device_memory_bytes(name: str) -> int | None:
    """Total memory of the device ``name`` on this machine (RAM for the CPU), or None when the
    device is absent or does not say."""
    if device_absent_reason(name) is not None:
        return None
    device = parse_device(name)
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device.index or 0).total_memory)
    if device.type == "cpu":
        try:
            return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        except (ValueError, OSError, AttributeError):
            return None
    return None


def peak_memory_bytes(device: torch.device) -> int | None:
    """Peak memory allocated by torch on ``device`` so far (CUDA), else None."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return None


def _count_parameters(model_config: Any, lora: Any) -> tuple[int, int]:
    """``(all parameters, LoRA adapter parameters)`` of the architecture ``model_config``,
    counted on the meta device (no memory, no weights)."""
    # deferred: transformers is heavy; gbmpo.train imports without it
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    total = sum(p.numel() for p in model.parameters())
    adapters = 0
    if lora.enabled:
        targets = set(lora.target_modules)
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets:
                adapters += lora.r * (module.in_features + module.out_features)
    return total, adapters


def _kv_cache_bytes(model_config: Any, rows: int, length: int, dtype_bytes: int) -> int | None:
    """Keys and values of every layer for ``rows`` sequences of ``length`` tokens:
    ``2 * layers * kv_heads * head_dim * rows * length * bytes``."""
    cfg = getattr(model_config, "text_config", None) or model_config
    layers = getattr(cfg, "num_hidden_layers", None)
    heads = getattr(cfg, "num_attention_heads", None)
    hidden = getattr(cfg, "hidden_size", None)
    if layers is None or heads is None or hidden is None:
        return None
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    return 2 * layers * kv_heads * head_dim * rows * length * dtype_bytes


def estimate_memory(
    cfg: TrainConfig, model_config: Any, prompt_tokens: int, needs_ref: bool
) -> dict[str, Any]:
    """Bytes a run keeps on its device, by part: weights, the frozen reference (full fine-tuning
    with a reference-anchored regularizer), gradients, optimizer state (AdamW's two fp32 moments,
    plus fp32 master weights for bf16 parameters) and the rollout's KV cache (longest prompt +
    ``max_new_tokens`` for one generate call). Activations are not included."""
    dtype_bytes = _BYTES[cfg.model.dtype]
    total, adapters = _count_parameters(model_config, cfg.lora)
    if cfg.lora.enabled:  # adapters are float32
        trainable, grad_bytes, master = adapters, 4, 0
    else:
        trainable, grad_bytes, master = total, dtype_bytes, 4 if dtype_bytes < 4 else 0
    ro = cfg.rollout
    rows = (ro.batch_size or ro.prompts_per_step) * ro.num_generations
    kv = _kv_cache_bytes(model_config, rows, prompt_tokens + ro.max_new_tokens, dtype_bytes)
    parts = {
        "weights": total * dtype_bytes + adapters * 4,
        "reference": total * dtype_bytes if needs_ref and not cfg.lora.enabled else 0,
        "gradients": trainable * grad_bytes,
        "optimizer": trainable * (8 + master),
        "kv_cache": kv,
    }
    known = sum(v for v in parts.values() if v is not None)
    return {"parameters": total, "trainable_parameters": trainable, **parts, "total": known}
