"""Former home of the reward-calling helpers: they live in :mod:`gbmpo.rewards.scoring` (used
by tasks, evaluation and training alike); the names stay importable here."""

from gbmpo.rewards.scoring import RewardError, RewardFn, ScoredBatch, score_completions

__all__ = ["RewardError", "RewardFn", "ScoredBatch", "score_completions"]
