"""The task interface shared by the trainer, evaluation, ES and the TRL drop-in.

A task is a set of named splits of examples plus a verifiable reward. An example is a plain
dict with at least ``"prompt"`` (the text fed to the model, already templated) and
``"answer"`` (what the reward checks against); any other key is a *column* and reaches the
reward function by name, following TRL's reward-function convention
``fn(prompts, completions, **columns) -> list[float | None]``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

from gbmpo.registry import Registry
from gbmpo.sandbox import require_sandbox

Example = dict[str, Any]

#: ``name -> factory(**params) -> Task`` (built-ins plus plugins of the ``gbmpo.tasks``
#: entry-point group)
TASKS: Registry[Callable[..., Task]] = Registry("task", entry_point_group="gbmpo.tasks")


class Task(ABC):
    """A data source with splits and a verifiable reward."""

    #: registry name
    name: str = ""
    #: "math" (accuracy) or "code" (pass@k)
    kind: str = "math"
    #: split used for training and the default held-out split for evaluation
    train_split: str = "train"
    eval_split: str = "test"

    @abstractmethod
    def split(self, name: str) -> list[Example]:
        """Return the examples of split ``name``; unknown split names raise ``ValueError``."""

    @abstractmethod
    def reward(self, prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> list[
        float | None
    ]:
        """Score completions (TRL convention); ``columns`` are the examples' extra keys."""

    @property
    def requires_sandbox(self) -> bool:
        """Whether :meth:`reward` runs model-written code (in :mod:`gbmpo.sandbox`): true for
        code tasks."""
        return self.kind == "code"

    def prepare_reward(self, *, allow_unsandboxed_code: bool = False) -> None:
        """Start what :meth:`reward` needs, before a command writes anything.

        A task whose reward runs model-written code starts the process-wide sandbox here
        (:func:`gbmpo.sandbox.require_sandbox`): where an isolation layer is missing this raises
        :class:`gbmpo.sandbox.SandboxUnavailableError` naming it, unless
        ``allow_unsandboxed_code``. Other tasks need nothing.
        """
        if self.requires_sandbox:
            require_sandbox(allow_unsandboxed_code)

    def columns(self, examples: Sequence[Example]) -> dict[str, list[Any]]:
        """Gather every non-prompt key of ``examples`` into lists, one per column."""
        keys = [k for k in examples[0] if k != "prompt"] if examples else []
        return {k: [ex[k] for ex in examples] for k in keys}


def get_task(name: str, **params: Any) -> Task:
    """Build the task registered as ``name`` (unknown names list the valid ones)."""
    return TASKS.build(name, **params)  # type: ignore[no-any-return]
