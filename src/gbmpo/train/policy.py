"""The models a step runs forwards of (:class:`PolicyModels`): the policy being trained, its frozen
reference, and the rollout settings every forward of the step uses."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from gbmpo.config.schema import RolloutConfig
from gbmpo.rollout.logprobs import completion_logprobs
from gbmpo.rollout.sampling import Rollout

__all__ = ["PolicyModels"]


@dataclass(frozen=True)
class PolicyModels:
    """The policy, its reference and the settings of their forwards (built per step: cheap)."""

    #: the policy being trained (a PEFT model with ``lora.enabled``)
    model: Any
    #: a frozen copy of the initial weights; ``None`` with LoRA (the reference is then the policy
    #: with its adapters disabled) or when no term needs a reference
    ref_model: Any
    #: temperature, prompt sharing and lean forward of every forward
    rollout: RolloutConfig

    def logprobs(
        self, model: Any, batch: Rollout, *, with_entropy: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """Per-token log-probs (and entropies) of ``batch``'s completions under ``model``
        (:func:`gbmpo.rollout.logprobs.completion_logprobs`), with the rollout's temperature:
        every log-prob forward of the step goes through here."""
        ro = self.rollout
        return completion_logprobs(
            model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
            batch.completion_mask, temperature=ro.temperature, with_entropy=with_entropy,
            share_prompts=ro.share_prompts, lean=ro.lean_forward,
        )  # fmt: skip

    @contextlib.contextmanager
    def scoring(self, *, reference: bool) -> Iterator[Any]:
        """The model of the rollout policy (current weights) or of the reference (frozen copy /
        adapters disabled), in eval mode for the block (the policy's mode is restored after)."""
        if reference and self.ref_model is not None:
            yield self.ref_model
            return
        ctx = self.model.disable_adapter() if reference else contextlib.nullcontext()
        was_training = self.model.training
        self.model.eval()
        try:
            with ctx:
                yield self.model
        finally:
            self.model.train(was_training)
