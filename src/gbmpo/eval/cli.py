"""Former home of ``gbmpo eval``'s command-line code, now :mod:`gbmpo.cli.eval`; its names stay
importable here. Nothing in gbmpo imports this module (the layers contract allows it this one
upward import)."""

from gbmpo.cli.eval import add_eval_parser, parse_task_params, run_eval, summary_path

__all__ = ["add_eval_parser", "parse_task_params", "run_eval", "summary_path"]
