"""verl's environment can run verl, and the pieces of a CPU run (``gbmpo.engines.verl.cpu``)
in verl's own environment: the trainer imports (what ``requirements-verl.txt`` installs beyond
verl's own requirements), the platform, the patches with their version guard, and the rollout's
sampler against a full forward of the model (the training run itself is
``tests/engines/test_verl_cpu_train.py``)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

pytest.importorskip("verl")

import torch  # noqa: E402


def test_the_trainer_imports() -> None:
    """verl's entry point and both trainers: cachetools (rollout/router.py), fastapi and uvicorn
    (rollout/utils.py) are verl-core extras that a plain verl pin lacks."""
    import verl.trainer.main_ppo as main_ppo
    from verl.trainer.main_ppo_v0 import TaskRunner
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    assert callable(main_ppo.main) and TaskRunner is not None and RayPPOTrainer is not None


def test_no_cuda_torch() -> None:
    assert torch.version.cuda is None and not torch.cuda.is_available()


@pytest.fixture(scope="module")
def plugin() -> Any:
    import gbmpo.engines.verl.cpu.plugin as plugin

    return plugin


def test_platform_is_registered_and_not_auto_detected(plugin: Any) -> None:
    from verl.plugin.platform import PlatformRegistry

    cls = PlatformRegistry.get("cpu")
    assert cls is not None and cls.__module__ == "gbmpo.engines.verl.cpu.platform"
    p = cls()
    assert (p.device_name, p.communication_backend_name(), p.ray_resource_name()) == (
        "cpu", "gloo", "GPU")  # fmt: skip
    assert not p.is_platform_available(use_smi_check=True)  # selected with VERL_PLATFORM only
    x = torch.ones(2)
    assert x.to(p.current_device()).device.type == "cpu"  # verl's .to(get_device_id())
    dm = p.device_module
    dm.empty_cache()
    free, total = dm.mem_get_info()
    assert 0 < free <= total
    state = dm.get_rng_state()
    a = torch.rand(3)
    dm.set_rng_state(state)
    assert torch.equal(a, torch.rand(3))
    assert dm.synchronize is torch.cpu.synchronize  # the rest is torch.cpu's


def test_rollout_is_registered(plugin: Any) -> None:
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.replica import get_rollout_replica_class

    from gbmpo.engines.verl.cpu.rollout import HFReplica, HFServerAdapter

    assert get_rollout_replica_class("hf") is HFReplica
    assert get_rollout_class("hf", "async") is HFServerAdapter


def test_patches(plugin: Any) -> None:
    import verl.utils.distributed as dist
    import verl.workers.engine.fsdp.transformer_impl as impl

    sig = inspect.signature(dist.initialize_global_process_group_ray)
    assert sig.parameters["backend"].default == "cpu:gloo"  # not "cpu:gloo,cpu:gloo"
    policy = impl.CPUOffloadPolicy(pin_memory=True)  # what verl builds for the reference model
    assert policy.pin_memory is False
    from torch.distributed.fsdp import CPUOffloadPolicy

    assert isinstance(policy, CPUOffloadPolicy)


def test_version_guard_refuses_an_untested_verl_in_one_line() -> None:
    from gbmpo.engines.verl.cpu import TESTED_VERL, VerlCPUError, check_version

    assert check_version() in TESTED_VERL
    with pytest.raises(VerlCPUError) as err:
        check_version("0.9.2")
    msg = str(err.value)
    assert "\n" not in msg and "0.9.2" in msg and "0.9.1" in msg


def test_a_changed_source_is_named() -> None:
    import types

    from gbmpo.engines.verl.cpu import VerlCPUError
    from gbmpo.engines.verl.cpu.patches import patch_distributed

    def initialize_global_process_group_ray(timeout_second=None, backend=None):  # noqa: ANN001, ANN202
        return backend or "nccl"

    fake = types.SimpleNamespace(
        initialize_global_process_group_ray=initialize_global_process_group_ray)
    with pytest.raises(VerlCPUError, match="initialize_global_process_group_ray"):
        patch_distributed(fake)  # type: ignore[arg-type]


def test_sampler_log_probs_are_the_models() -> None:
    """``sample``'s per-token log-probs equal log_softmax(logits / T) of one full forward over
    prompt + completion (what verl's actor recomputes), and greedy decoding is the argmax."""
    from transformers import AutoModelForCausalLM

    from gbmpo.engines.verl.cpu.rollout import sample
    from gbmpo.models import resolve_model_path

    model = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny"),
                                                 dtype=torch.float32).eval()  # fmt: skip
    prompt = [5, 17, 42, 8, 3]
    for temperature, top_p, top_k in ((1.0, 1.0, -1), (0.7, 0.9, 20), (0.0, 1.0, -1)):
        g = torch.Generator().manual_seed(0)
        ids, logps = sample(model, prompt, max_tokens=12, temperature=temperature, top_p=top_p,
                            top_k=top_k, generator=g)  # fmt: skip
        assert len(ids) == len(logps) == 12
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + ids])).logits[0].float()
        steps = logits[len(prompt) - 1 : -1]
        t = temperature if temperature > 0 else 1.0
        full = torch.log_softmax(steps / t, dim=-1)
        want = full.gather(1, torch.tensor(ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(logps), want, atol=1e-4), (temperature, logps, want)
        if temperature == 0:
            assert ids == steps.argmax(-1).tolist()
