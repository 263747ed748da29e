"""A CPU rollout for verl (``actor_rollout_ref.rollout.name=hf``): a ``transformers`` model
sampled in one Ray actor, wired through verl's registries by
:mod:`gbmpo.engines.verl.cpu.plugin` (by name, so that this module is imported only where
verl uses it: it imports verl, whose import loads the plugin).

verl 0.9.1's trainer always samples through rollout *servers*: a ``RolloutReplica`` (picked by
name from ``RolloutReplicaRegistry``) starts the server actors, the agent loop sends each prompt
to ``server.generate(prompt_ids, sampling_params) -> TokenOutput``, and a ``BaseRollout``
adapter inside each training worker (picked from ``_ROLLOUT_REGISTRY[(name, "async")]``) receives
the trained weights after every step (``update_weights``). Only vLLM, SGLang and TensorRT-LLM are
registered, all GPU-only. This module adds:

* :class:`HFRolloutServer`: the model in float32 (``rollout.dtype``) on the CPU; ``generate``
  samples with temperature / top-p / top-k (greedy at temperature 0) up to the response length
  and returns, per sampled token, :math:`\\log\\mathrm{softmax}(z_t/T)` of the unprocessed logits
  :math:`z_t` at temperature :math:`T` (the quantity verl's actor recomputes as
  ``old_log_prob``, so ``training/rollout_probs_diff_mean`` measures the weight hand-over);
* :class:`HFReplica`: one such server per replica (named :func:`server_name`);
* :class:`HFServerAdapter`: pushes the FSDP actor's full weights into the server with
  ``load_state_dict`` (strict but for tied weights).

LoRA rollouts are not wired (the adapter refuses a PEFT hand-over); the support matrix refuses
``lora.enabled`` on a CPU verl run.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import ray
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, DynamicCache
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput

__all__ = ["HFReplica", "HFRolloutServer", "HFServerAdapter", "sample", "server_name"]

_log = logging.getLogger(__name__)

def server_name(replica_rank: int) -> str:
    """The Ray actor name of replica ``replica_rank``'s server."""
    return f"gbmpo_hf_rollout_server_{replica_rank}"


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if hasattr(cfg, "get"):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


class HFRolloutServer:
    """One rollout server (a Ray actor): the policy on the CPU, sampled with
    :func:`sample` (a KV-cached decode loop); see the module doc."""

    def __init__(self, config: Any, model_config: Any, replica_rank: int = 0) -> None:
        torch.set_num_threads(1)
        self.config = config
        path = _get(model_config, "local_path") or _get(model_config, "path")
        dtype = getattr(torch, str(_get(config, "dtype", "float32")))
        remote = bool(_get(model_config, "trust_remote_code", False))
        self.model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, trust_remote_code=remote
        ).eval()
        self.tied = {"lm_head.weight"} if self.model.config.tie_word_embeddings else set()
        gen = self.model.generation_config
        eos = gen.eos_token_id if gen.eos_token_id is not None else self.model.config.eos_token_id
        self.eos: list[int] = [eos] if isinstance(eos, int) else list(eos or [])
        self.pad = gen.pad_token_id if gen.pad_token_id is not None else (self.eos or [0])[0]
        self.generator = torch.Generator().manual_seed(int(_get(config, "seed", 0)) + replica_rank)
        self.global_steps: int | None = None

    async def generate(self, request_id: str, *, prompt_ids: list[int],
                       sampling_params: dict[str, Any], **kwargs: Any) -> TokenOutput:  # fmt: skip
        """Sample one completion of ``prompt_ids`` (verl's token-in/token-out server call)."""
        params = dict(sampling_params)
        limit = int(_get(self.config, "response_length", 512))
        max_tokens = min(int(params.pop("max_tokens", params.pop("max_new_tokens", limit))), limit)
        temperature = float(params.get("temperature", 1.0))
        ids, logps = sample(self.model, prompt_ids, max_tokens=max(1, max_tokens),
                            temperature=temperature, top_p=float(params.get("top_p", 1.0)),
                            top_k=int(params.get("top_k", -1)), eos=self.eos,
                            generator=self.generator)  # fmt: skip
        return TokenOutput(
            token_ids=ids,
            log_probs=logps if params.get("logprobs") else None,
            stop_reason="completed",
            extra_fields={"global_steps": self.global_steps},
        )

    async def load_weights(self, state: dict[str, torch.Tensor]) -> int:
        """Load the actor's full weights; returns the number of tensors loaded."""
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        missing = [k for k in missing if k not in self.tied]
        if missing or unexpected:
            raise RuntimeError(f"hf rollout: weights do not match the model (missing "
                               f"{missing[:5]}, unexpected {unexpected[:5]})")  # fmt: skip
        return len(state)

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    # the replica's controls: nothing to free or resume on a CPU
    async def wake_up(self, *args: Any, **kwargs: Any) -> None: ...
    async def sleep(self, *args: Any, **kwargs: Any) -> None: ...
    async def clear_kv_cache(self) -> None: ...
    async def release_kv_cache(self) -> None: ...
    async def resume_kv_cache(self) -> None: ...
    async def abort_all_requests(self, reject_request: bool = False) -> None: ...
    async def resume_generation(self) -> None: ...
    async def start_profile(self, **kwargs: Any) -> None: ...
    async def stop_profile(self) -> None: ...


@torch.no_grad()
def sample(model: Any, prompt_ids: list[int], *, max_tokens: int, temperature: float,
           top_p: float = 1.0, top_k: int = -1, eos: Iterable[int] = (),
           generator: torch.Generator | None = None) -> tuple[list[int], list[float]]:  # fmt: skip
    """Sample up to ``max_tokens`` tokens after ``prompt_ids`` (stopping after an ``eos`` token)
    from the logits :math:`z_t` filtered by ``top_k`` / ``top_p`` at ``temperature`` (greedy at
    0); returns the token ids and, per token, :math:`\\log\\mathrm{softmax}(z_t / T)` at the
    sampled token, unfiltered (``T`` = 1 when greedy), the log-probability verl's actor
    recomputes."""
    eos = set(eos)
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    cache = DynamicCache()
    out_ids: list[int] = []
    out_logps: list[float] = []
    step_input = ids
    for _ in range(max_tokens):
        logits = model(input_ids=step_input, past_key_values=cache, use_cache=True).logits[0, -1]
        logits = logits.float()
        scaled = logits / (temperature if temperature > 0 else 1.0)
        logp = torch.log_softmax(scaled, dim=-1)
        if temperature <= 0:
            token = int(torch.argmax(logits))
        else:
            filtered = scaled.clone()
            if top_k is not None and 0 < top_k < filtered.numel():
                kth = torch.topk(filtered, top_k).values[-1]
                filtered[filtered < kth] = float("-inf")
            if top_p < 1.0:
                sorted_logits, order = torch.sort(filtered, descending=True)
                probs = torch.softmax(sorted_logits, dim=-1)
                drop = torch.cumsum(probs, dim=-1) - probs > top_p  # keep the smallest set >= p
                filtered[order[drop]] = float("-inf")
            probs = torch.softmax(filtered, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=generator))
        out_ids.append(token)
        out_logps.append(float(logp[token]))
        if token in eos:
            break
        step_input = torch.tensor([[token]], dtype=torch.long)
    return out_ids, out_logps


class HFReplica(RolloutReplica):
    """A rollout replica of one :class:`HFRolloutServer` (hybrid mode: next to the training
    workers it takes its weights from)."""

    async def launch_servers(self) -> None:
        name = server_name(self.replica_rank)
        server = ray.remote(HFRolloutServer).options(
            name=name, num_cpus=0, max_concurrency=self.max_concurrency,
        ).remote(self.config, self.model_config, self.replica_rank)  # fmt: skip
        self.servers = [server]
        self._server_handle = server
        self._server_address = name  # the load balancer's key; no HTTP server


class HFServerAdapter(BaseRollout):
    """The rollout side of a training worker: hands the actor's weights to the replica's
    :class:`HFRolloutServer` after each step (the rank that leads its replica sends them)."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any, *args: Any,
                 **kwargs: Any) -> None:  # fmt: skip
        super().__init__(config, model_config, device_mesh, *args, **kwargs)

        size = (self.config.tensor_model_parallel_size * self.config.data_parallel_size
                * self.config.pipeline_model_parallel_size)  # fmt: skip
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.replica_rank, self.leader = rank // size, rank % size == 0
        self._server: Any = None

    async def resume(self, tags: list[str]) -> None:
        return None

    async def release(self) -> None:
        return None

    async def update_weights(self, weights: Any, wire_format: str = "named_tensors",
                             **kwargs: Any) -> None:  # fmt: skip
        if kwargs.get("peft_config") is not None:
            raise NotImplementedError("the hf rollout takes full weights only (no LoRA adapters)")
        if wire_format != "named_tensors":
            raise NotImplementedError(f"the hf rollout takes named tensors, not {wire_format!r}")
        state = {name: t.detach().to("cpu", copy=True) for name, t in weights}
        if not self.leader:
            return
        if self._server is None:
            self._server = ray.get_actor(server_name(self.replica_rank))
        await self._server.load_weights.remote(state)
        if kwargs.get("global_steps") is not None:
            await self._server.set_global_steps.remote(kwargs["global_steps"])


