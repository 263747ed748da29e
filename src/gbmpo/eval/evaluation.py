"""Evaluate a model on a task: generate, grade, and summarise per problem and overall.

:func:`evaluate` returns ``{"metrics": {...}, "records": [...], "config": {...}}``:

* ``metrics``: ``n`` (problems), ``samples`` (per problem), ``mean_response_tokens``,
  ``truncated_fraction``, ``mean_reward``; for math tasks ``accuracy`` (mean over problems of
  the fraction of correct samples) and ``accuracy_stderr``; for code tasks ``pass@1`` and, with
  several samples, ``pass@k`` for the k of :func:`gbmpo.eval.metrics.default_ks` (1, 2, 4,
  ..., ``samples``: a pass@k curve, with the unbiased estimator of Chen et al.; math tasks get
  the same pass@k keys when ``samples > 1``), and two diversity measures:
  ``distinct_answers`` (mean over problems of the number of different final answers among the
  samples, :func:`gbmpo.eval.metrics.distinct_answers`) and ``token_entropy`` (the mean
  per-token entropy of the sampling distribution along the samples, in nats, from one no-grad
  forward of the completions).
* ``records``: one dict per problem: ``index``, ``task_id`` (when the data has one),
  ``prompt``, ``answer``, ``completions``, ``num_tokens``, ``rewards``, ``correct``,
  ``num_correct``, the task's per-sample ``details`` (extracted answer, sandbox status...) and,
  with several samples, ``distinct_answers`` and ``token_entropy`` (per sample, the mean over
  its tokens).

A sample is *correct* when the task's ``grade`` says so (tasks of this package: every test
passed, or the final answer matched) or, for tasks without ``grade``, when its reward is at
least 1. Decoding is greedy by default (``temperature=0``); several samples need
``temperature > 0``.
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from gbmpo.eval.metrics import default_ks, distinct_answers, mean_and_stderr, pass_at_k
from gbmpo.tasks import TASKS, Task, get_task
from gbmpo.tasks.reasoning_gym import list_datasets

__all__ = ["evaluate", "resolve_task", "score_samples", "summarize"]


def held_out_examples(
    task: Any, split: str | None, limit: int | None, tokenizer: Any = None
) -> tuple[Any, str, list[Any]]:
    """``(task, split name, examples)``: the first ``limit`` examples of ``split`` (default: the
    task's ``eval_split``) of ``task`` (a task or a name, :func:`resolve_task`); ``ValueError``
    for an empty selection. What :func:`evaluate` and the drift measurement evaluate on."""
    task_obj = resolve_task(task, tokenizer=tokenizer)
    split_name = split or task_obj.eval_split
    examples = task_obj.split(split_name)
    if limit is not None:
        examples = examples[:limit]
    if not examples:
        raise ValueError(f"split {split_name!r} of task {task_obj.name!r} is empty")
    return task_obj, split_name, examples


def resolve_task(
    name_or_task: str | Task, *, tokenizer: Any = None, template: str = "auto", **params: Any
) -> Task:
    """A task object from a registered name or a reasoning-gym data set name.

    ``tokenizer`` and ``template`` are passed to tasks that accept them (chat templates);
    ``params`` go to the task's constructor.
    """
    if isinstance(name_or_task, Task):
        if params:
            raise ValueError("task parameters given together with a task object")
        return name_or_task
    name = str(name_or_task)
    if name not in TASKS:
        try:
            gym_names = list_datasets()
        except ImportError:
            gym_names = []
        if name in gym_names:
            params = {"dataset": name, **params}
            name = "reasoning_gym"
        else:
            TASKS.get(name)  # raises UnknownNameError listing the valid names
    factory = TASKS.get(name)
    try:
        accepted = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # pragma: no cover - builtins without signatures
        accepted = {}
    if "template" in accepted and "template" not in params:
        params["template"] = template
    if "tokenizer" in accepted and "tokenizer" not in params:
        params["tokenizer"] = tokenizer
    return get_task(name, **params)


def score_samples(
    task: Task, completions: Sequence[str], examples: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Per-sample ``{"reward", "correct", ...details}`` (via ``task.grade`` when it exists)."""
    grade: Callable[..., list[dict[str, Any]]] | None = getattr(task, "grade", None)
    if grade is not None:
        out = grade(list(completions), list(examples))
    else:
        prompts = [ex["prompt"] for ex in examples]
        rewards = task.reward(prompts, list(completions), **task.columns(list(examples)))
        out = [
            {"reward": r, "correct": r is not None and float(r) >= 1.0 - 1e-9} for r in rewards
        ]
    if len(out) != len(completions):
        raise ValueError(f"task {task.name!r} scored {len(out)} of {len(completions)} samples")
    return out


def summarize(
    records: Sequence[dict[str, Any]], *, kind: str, samples: int, ks: Sequence[int] | None = None
) -> dict[str, Any]:
    """The ``metrics`` dict of :func:`evaluate` from its per-problem ``records``."""
    if not records:
        raise ValueError("no problems were evaluated")
    frac = [r["num_correct"] / samples for r in records]
    tokens = [t for r in records for t in r["num_tokens"]]
    rewards = [float(x) for r in records for x in r["rewards"] if x is not None]
    truncated = [t for r in records for t in r.get("truncated", [])]
    metrics: dict[str, Any] = {
        "n": len(records),
        "samples": samples,
        "mean_response_tokens": sum(tokens) / len(tokens) if tokens else 0.0,
        "truncated_fraction": sum(truncated) / len(truncated) if truncated else 0.0,
        "mean_reward": sum(rewards) / len(rewards) if rewards else 0.0,
    }
    failed = [d["reward_failure"] for r in records for d in r.get("details", [])
              if d.get("reward_failure")]
    if failed:  # samples whose reward was unusable (scored 0): how many, and why
        metrics["reward_failures"] = len(failed)
        metrics["reward_failure_kinds"] = sorted(set(failed))
    unjudged = [d["unjudged"] for r in records for d in r.get("details", [])
                if d.get("unjudged")]
    if unjudged:  # code: samples with tests the sandbox could not judge (never passed)
        metrics["unjudged_samples"] = len(unjudged)
        metrics["unjudged_tests"] = sum(unjudged)
    mean, stderr = mean_and_stderr(frac)
    if kind == "code":
        metrics["pass@1"] = mean
        metrics["pass@1_stderr"] = stderr
    else:
        metrics["accuracy"] = mean
        metrics["accuracy_stderr"] = stderr
    if samples > 1:
        for k in ks or default_ks(samples):
            if k > samples:
                raise ValueError(f"pass@{k} needs at least {k} samples per problem")
            vals = [pass_at_k(samples, r["num_correct"], k) for r in records]
            metrics[f"pass@{k}"] = sum(vals) / len(vals)
        distinct = [r["distinct_answers"] for r in records if "distinct_answers" in r]
        if distinct:
            metrics["distinct_answers"] = sum(distinct) / len(distinct)
        weighted = [(h, n) for r in records
                    for h, n in zip(r.get("token_entropy", []), r["num_tokens"], strict=False)
                    if h is not None]  # fmt: skip
        n_tok = sum(n for _, n in weighted)
        if n_tok > 0:
            metrics["token_entropy"] = sum(h * n for h, n in weighted) / n_tok
    return metrics


def _sample_entropies(
    model: Any, rollout: Any, temperature: float, rows: int
) -> list[float | None]:
    """Per sample, the mean over its tokens of the entropy (nats) of the sampling distribution
    (logits / ``temperature``), from no-grad forwards of ``rows`` samples at a time (memory:
    ``rows x C x V`` logits); None for an empty completion."""
    # deferred: torch is heavy; gbmpo.eval imports without it (reward scoring, ES workers)
    import torch

    from gbmpo.rollout.logprobs import completion_logprobs

    out: list[float | None] = []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for lo in range(0, len(rollout), rows):
                sub = rollout.select(slice(lo, lo + rows))
                _, ent = completion_logprobs(
                    model, sub.prompt_ids, sub.prompt_mask, sub.completion_ids,
                    sub.completion_mask, temperature=temperature, with_entropy=True,
                )  # fmt: skip
                assert ent is not None
                m = sub.completion_mask.to(ent.device).float()
                n = m.sum(-1)
                mean = (ent.float() * m).sum(-1) / n.clamp_min(1.0)
                out += [float(h) if k > 0 else None for h, k in zip(mean, n, strict=True)]
    finally:
        model.train(was_training)
    return out


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return str(value)


def evaluate(
    model: Any,
    tokenizer: Any,
    task: str | Task,
    *,
    split: str | None = None,
    limit: int | None = None,
    samples: int = 1,
    temperature: float = 0.0,
    top_p: float = 1.0,
    max_new_tokens: int = 256,
    batch_size: int = 8,
    seed: int = 0,
    ks: Sequence[int] | None = None,
    progress: Callable[[int, int], None] | None = None,
    generator: str = "gbmpo",
) -> dict[str, Any]:
    """Generate ``samples`` completions per problem of ``split`` and grade them:
    ``{"metrics", "records", "config"}`` (module docstring).

    ``model``, ``tokenizer``: a causal LM and its tokenizer (e.g. from
    :func:`gbmpo.models.load_model_and_tokenizer`); ``task``: a :class:`~gbmpo.tasks.Task` or a
    name (:func:`resolve_task`); ``split`` defaults to ``task.eval_split``, ``limit`` keeps the
    first problems. ``temperature`` 0 is greedy, and ``samples > 1`` needs it above 0; pass@k is
    reported for ``ks`` then. Chunk ``i`` of ``batch_size`` problems is sampled with seed
    ``seed + i`` (``generator`` of :func:`gbmpo.rollout.generate`: ``"gbmpo"`` or ``"hf"``),
    then ``progress(done, total)`` is called."""
    # deferred: gbmpo.rollout imports torch; gbmpo.eval imports without it
    from gbmpo.rollout.sampling import generate

    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if samples > 1 and temperature == 0:
        raise ValueError("several samples per problem need temperature > 0 (greedy repeats)")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    task_obj, split_name, examples = held_out_examples(task, split, limit, tokenizer)

    start = time.monotonic()
    records: list[dict[str, Any]] = []
    for chunk_i, lo in enumerate(range(0, len(examples), batch_size)):
        chunk = examples[lo : lo + batch_size]
        rollout = generate(
            model, tokenizer, [ex["prompt"] for ex in chunk],
            num_return_sequences=samples, max_new_tokens=max_new_tokens,
            do_sample=temperature > 0, temperature=temperature if temperature > 0 else 1.0,
            top_p=top_p, generator_seed=seed + chunk_i, generator=generator,
        )
        texts = list(rollout.texts)
        if len(texts) != len(chunk) * samples:
            raise RuntimeError(f"generate returned {len(texts)} texts for {len(chunk)} prompts")
        truncated = list(getattr(rollout, "truncated", []) or [False] * len(texts))
        flat_examples = [ex for ex in chunk for _ in range(samples)]
        scored = score_samples(task_obj, texts, flat_examples)
        entropies = (  # a real rollout (token tensors) of a model: the sampling entropy
            _sample_entropies(model, rollout, temperature, max(1, batch_size))
            if samples > 1 and model is not None and hasattr(rollout, "completion_ids") else None
        )
        for j, ex in enumerate(chunk):
            sl = slice(j * samples, (j + 1) * samples)
            grades = scored[sl]
            rec: dict[str, Any] = {"index": lo + j}
            if "task_id" in ex:
                rec["task_id"] = ex["task_id"]
            rec.update(
                prompt=ex["prompt"],
                answer=ex.get("answer"),
                completions=texts[sl],
                num_tokens=[int(t) for t in rollout.num_tokens[sl]],
                truncated=[bool(t) for t in truncated[sl]],
                rewards=[g.get("reward") for g in grades],
                correct=[bool(g.get("correct")) for g in grades],
                details=[{k: v for k, v in g.items() if k not in ("reward", "correct")}
                         for g in grades],
            )
            rec["num_correct"] = sum(rec["correct"])
            if samples > 1:
                rec["distinct_answers"] = distinct_answers(rec["completions"], rec["details"])
                if entropies is not None:
                    rec["token_entropy"] = entropies[sl]
            records.append(_json_safe(rec))
        if progress is not None:
            progress(len(records), len(examples))

    metrics = summarize(records, kind=task_obj.kind, samples=samples, ks=ks)
    metrics["seconds"] = time.monotonic() - start
    config = {
        "task": task_obj.name, "split": split_name, "limit": limit, "samples": samples,
        "temperature": temperature, "top_p": top_p, "max_new_tokens": max_new_tokens,
        "batch_size": batch_size, "seed": seed,
    }
    for attr in ("dataset", "template"):
        if hasattr(task_obj, attr):
            config[attr] = getattr(task_obj, attr)
    return {"metrics": metrics, "records": records, "config": config}
