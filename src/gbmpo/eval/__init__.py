"""Evaluation: accuracy / unbiased pass@k of a model on a task, per-problem records, CLI."""

from gbmpo.eval.evaluation import evaluate, resolve_task, score_samples, summarize
from gbmpo.eval.metrics import default_ks, mean_and_stderr, pass_at_k

__all__ = [
    "default_ks",
    "evaluate",
    "mean_and_stderr",
    "pass_at_k",
    "resolve_task",
    "score_samples",
    "summarize",
]
