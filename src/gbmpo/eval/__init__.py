"""Evaluation: accuracy / unbiased pass@k curves of a model on a task, answer diversity and token
entropy, per-problem records, CLI."""

from gbmpo.eval.evaluation import evaluate, resolve_task, score_samples, summarize
from gbmpo.eval.metrics import (
    default_ks,
    distinct_answers,
    final_answer,
    mean_and_stderr,
    pass_at_k,
)

__all__ = [
    "default_ks",
    "distinct_answers",
    "evaluate",
    "final_answer",
    "mean_and_stderr",
    "pass_at_k",
    "resolve_task",
    "score_samples",
    "summarize",
]
