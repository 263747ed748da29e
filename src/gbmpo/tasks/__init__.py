"""Tasks: built-in offline arithmetic, GSM8K, MBPP, HumanEval, reasoning-gym."""

from gbmpo.tasks.base import TASKS, Example, Task, get_task

__all__ = ["TASKS", "Example", "Task", "get_task"]
