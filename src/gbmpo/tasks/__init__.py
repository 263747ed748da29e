"""Tasks: built-in offline arithmetic, GSM8K, MBPP, HumanEval, reasoning-gym, and ``jsonl`` (your
own data file and reward); plugins add more through the ``gbmpo.tasks`` entry-point group."""

# Importing a task module registers it in TASKS.
from gbmpo.tasks import arithmetic, custom, gsm8k, humaneval, mbpp, reasoning_gym  # noqa: F401
from gbmpo.tasks._common import DataUnavailable
from gbmpo.tasks.base import TASKS, Example, Task, get_task

__all__ = ["TASKS", "DataUnavailable", "Example", "Task", "get_task"]
