"""``gbmpo eval``: evaluate a model on a task and write per-problem JSONL + a summary JSON.

    gbmpo eval --model PATH --task gsm8k|mbpp|mbpp_sanitized|humaneval|arithmetic|<gym name>
               [--split S] [--limit N] [--samples K --temperature T] [--output FILE]
    gbmpo eval --task jsonl --task-param path=FILE --task-param reward=math|exact|code|mod:fn
    gbmpo eval --model DIR --reference MODEL --task T     # + drift from the reference

Greedy decoding by default. ``--output FILE`` writes one JSON record per problem to ``FILE``
and the summary (``{"metrics", "config"}``) to ``FILE`` with its ``.jsonl`` suffix replaced by
``.summary.json`` (or ``FILE.summary.json``). The summary is also printed on stdout, followed by
a one-line digest. ``--model tiny`` (the default) is the embedded tiny model.

``--reference MODEL`` also measures the model's drift from ``MODEL`` on the same prompts
(:func:`gbmpo.eval.drift.measure_drift`: one completion per prompt sampled at temperature 1
with ``--seed``, exact full-vocabulary divergences per token): the summary gets ``drift`` (the
keys of :data:`gbmpo.eval.drift.DRIFT_KEYS`) and ``config.reference``, and the digest gets a
second line. It is how runs of every engine are measured from their saved models.

The main CLI (:func:`gbmpo.cli.main`) adds this subcommand with :func:`add_eval_parser` and runs
it with :func:`run_eval`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

from gbmpo import models
from gbmpo.cli.args import one_line, positive_int
from gbmpo.config import ConfigError
from gbmpo.eval import evaluation
from gbmpo.eval.drift import measure_drift
from gbmpo.rewards.scoring import RewardError
from gbmpo.sandbox import SandboxUnavailableError
from gbmpo.train.device import check_device

__all__ = ["add_eval_parser", "parse_task_params", "run_eval", "summary_path"]


def add_eval_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``eval`` subcommand to an ``argparse`` subparsers object; returns the parser."""
    p = subparsers.add_parser(
        "eval",
        help="evaluate a model on a task (accuracy or pass@k)",
        description=(
            "Generate completions for a task's held-out split and grade them: accuracy for math "
            "tasks, pass@1 and unbiased pass@k for code tasks, mean response length in tokens; "
            "with --samples N: pass@k for k = 1, 2, 4, ..., N, the mean number of distinct final "
            "answers per problem and the mean token entropy."
        ),
    )
    p.add_argument("--model", default="tiny",
                   help="model directory or hub id ('tiny' = the embedded tiny model)")
    p.add_argument("--task", required=True,
                   help="gsm8k, mbpp, mbpp_sanitized, humaneval, arithmetic, reasoning_gym, "
                        "jsonl (your own data: --task-param path=FILE --task-param reward=...), "
                        "a plugin's task, or a reasoning-gym data set name (e.g. chain_sum)")
    p.add_argument("--split", default=None,
                   help="split to evaluate (default: the task's eval split)")
    p.add_argument("--limit", type=positive_int, default=None, help="first N problems only")
    p.add_argument("--samples", type=positive_int, default=1, help="completions per problem")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=positive_int, default=256)
    p.add_argument("--batch-size", type=positive_int, default=8, help="problems per generate call")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--template", choices=("auto", "base", "chat"), default="auto",
                   help="prompt template (auto: chat if the tokenizer has a chat template)")
    p.add_argument("--task-param", action="append", default=[], metavar="KEY=VALUE",
                   help="extra task parameter (JSON value or string), repeatable, e.g. "
                        "--task-param size=500 --task-param path=/data/gsm8k")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--device", default="cpu",
                   help="torch device to evaluate on, e.g. cpu, cuda, cuda:1 (default: cpu)")
    p.add_argument("--allow-unsandboxed-code", action="store_true",
                   help="run model-written code even where the sandbox lacks an isolation layer "
                        "(same as GBMPO_ALLOW_UNSANDBOXED_CODE=1); by default it refuses")
    p.add_argument("--reference", default=None, metavar="MODEL",
                   help="also measure the drift from this model (directory, hub id or 'tiny'): "
                        "exact KL both ways, ProbL2, total variation and entropy per token along "
                        "samples of --model at temperature 1")
    p.add_argument("--output", default=None, metavar="FILE",
                   help="per-problem JSONL; the summary goes next to it (.summary.json)")
    p.set_defaults(func=run_eval)
    return p


def parse_task_params(items: list[str]) -> dict[str, Any]:
    """``["size=500", "path=/x"]`` -> ``{"size": 500, "path": "/x"}`` (JSON values if valid)."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--task-param needs KEY=VALUE, got {item!r}")
        key, raw = item.split("=", 1)
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw
    return out


def summary_path(output: str | Path) -> Path:
    """Where the summary JSON goes for a per-problem JSONL at ``output``."""
    p = Path(output)
    if p.suffix == ".jsonl":
        return p.with_suffix(".summary.json")
    return p.with_name(p.name + ".summary.json")


def run_eval(args: argparse.Namespace) -> int:
    """Run ``gbmpo eval`` from parsed arguments; returns the exit code (0 on success, 2 on bad
    input, reported in one line on stderr)."""
    # deferred: transformers is heavy; `gbmpo --help` imports this module without it
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # stderr carries the progress and the error line only

    def bad_input(err: BaseException) -> int:
        print(f"gbmpo eval: error: {one_line(err)}", file=sys.stderr)
        return 2

    try:
        params = parse_task_params(list(getattr(args, "task_param", []) or []))
        if not math.isfinite(args.temperature) or args.temperature < 0:
            raise ValueError(f"--temperature must be a finite number >= 0, got "
                             f"{args.temperature}")
        if not 0 < args.top_p <= 1:  # NaN fails this too
            raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
        if not -(2**63) <= args.seed < 2**63:  # what torch's generators take
            raise ValueError(f"--seed must be in [-2**63, 2**63), got {args.seed}")
        if args.samples > 1 and args.temperature <= 0:
            raise ValueError("--samples > 1 needs --temperature > 0 (greedy repeats itself)")
    except ValueError as err:
        return bad_input(err)

    try:  # an absent device stops before the model is loaded
        device = check_device(args.device, option="device")
    except ConfigError as err:
        return bad_input(err)
    model_id = None if args.model in (None, "", "tiny") else args.model
    dtype = getattr(torch, args.dtype)
    model, tokenizer = models.load_model_and_tokenizer(model_id, dtype=dtype, device=device)
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(context, int) and args.max_new_tokens > context:
        return bad_input(ValueError(
            f"--max-new-tokens {args.max_new_tokens} exceeds the model's context of {context} "
            "tokens (max_position_embeddings)"))

    def progress(done: int, total: int) -> None:
        print(f"[eval] {done}/{total} problems", file=sys.stderr, flush=True)

    try:  # bad task names, parameters, splits or missing data files are input errors
        task = evaluation.resolve_task(args.task, tokenizer=tokenizer, template=args.template,
                                       **params)
        task.split(args.split or task.eval_split)
    except (ValueError, ImportError, FileNotFoundError, TypeError) as err:
        return bad_input(err)

    try:  # a code task refuses before generating anything when isolation is missing
        task.prepare_reward(allow_unsandboxed_code=args.allow_unsandboxed_code)
    except SandboxUnavailableError as err:
        return bad_input(err)
    reference = getattr(args, "reference", None)
    drift = None
    if reference is not None:  # first, so that a reference it cannot compare with stops at once

        ref_id = None if reference in ("", "tiny") else reference
        ref_model, _ = models.load_model_and_tokenizer(ref_id, dtype=dtype, device=device)
        try:
            drift = measure_drift(
                model, ref_model, tokenizer, task, split=args.split, limit=args.limit,
                max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, seed=args.seed,
            )  # fmt: skip
        except ValueError as err:  # e.g. another vocabulary
            return bad_input(err)
        del ref_model

    try:  # a reward function that fails for a whole batch is an input error too
        result = evaluation.evaluate(
            model, tokenizer, task, split=args.split, limit=args.limit, samples=args.samples,
            temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size, seed=args.seed, progress=progress,
        )
    except RewardError as err:
        return bad_input(err)
    result["config"]["model"] = args.model
    result["config"]["device"] = str(device)
    summary: dict[str, Any] = {"metrics": result["metrics"], "config": result["config"]}
    if drift is not None:
        result["config"]["reference"] = reference
        summary["drift"] = drift
    if args.output:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "w", encoding="utf-8") as f:
            for rec in result["records"]:
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        spath = summary_path(out)
        spath.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        summary["files"] = {"records": str(out), "summary": str(spath)}
    print(json.dumps(summary, indent=2))
    m = result["metrics"]
    head = "accuracy" if "accuracy" in m else "pass@1"
    extra = "".join(f", {k} {100 * v:.1f}%" for k, v in m.items()
                    if k.startswith("pass@") and k not in ("pass@1", "pass@1_stderr"))
    if "distinct_answers" in m:
        extra += f", {m['distinct_answers']:.2f} distinct answers per problem"
    if "token_entropy" in m:
        extra += f", token entropy {m['token_entropy']:.3f} nats"
    failures = (f"; {m['reward_failures']} reward(s) unusable, scored 0 "
                f"({', '.join(m['reward_failure_kinds'])[:300]})"
                if m.get("reward_failures") else "")
    print(f"eval {result['config']['task']}/{result['config']['split']}: {head} "
          f"{100 * m[head]:.1f}% (n={m['n']}, samples={m['samples']}{extra}), "
          f"mean response {m['mean_response_tokens']:.1f} tokens{failures}")
    if drift is not None:
        d = drift
        print(f"drift from {reference}: KL {d['kl']:.4g} (reverse {d['kl_reverse']:.4g}), "
              f"ProbL2 {d['prob_l2']:.4g}, TV {d['tv']:.4g}, entropy {d['entropy']:.4g} per "
              f"token ({d['n_tokens']} sampled tokens of {d['n_prompts']} prompts)")
    return 0
