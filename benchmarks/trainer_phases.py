"""Where one step of gbmpo's own trainer spends its CPU time, by phase, on the work of
``trainer_vs_trl.py`` (same random Qwen3, same settings, one torch thread).

The trainer runs ``--steps`` steps through ``Trainer.train()``; the step's parts are wrapped with
``time.process_time`` timers (CPU time of this process: with one thread, the work done, much
less sensitive to other jobs than wall time): sampling (``sample_completions``: prefill, decode
loop, tokenizer), rewards (``score``), the no-grad log-prob passes (``no_grad_logprobs``:
reference, and the old policy when needed), advantages, the policy's log-prob forward with
gradient (``PolicyModels.logprobs`` under grad; ``Trainer.logprobs`` before it), the loss
(``policy_loss_packed``), the backward (``Tensor.backward``), gradient clipping, the AdamW step
and the metrics (``step_record``).
The first ``--warmup`` steps are dropped; medians per step are printed (and written to
``--out``), and the time between consecutive step ends (``step``), which also holds what the run
loop does between steps (metrics line, status file).

    python benchmarks/trainer_phases.py --size 0.2M --steps 14
    PYTHONPATH=/tmp/before/src python benchmarks/trainer_phases.py --size 10M --steps 6
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import trainer_vs_trl as bench  # noqa: E402

#: the step functions timed, by the name printed
STEP_PARTS = ("sample_completions", "score", "no_grad_logprobs", "shaped_advantages",
              "policy_loss_packed", "step_record")


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else 0.0


def _timed(fn: Callable[..., Any], times: list[float]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            times.append(time.process_time() - t0)

    return wrapper


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="0.2M", choices=sorted(bench.SIZES))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="also write the result to this JSON file")
    a = p.parse_args()
    if a.steps <= a.warmup:
        print("trainer_phases: --steps must be larger than --warmup", file=sys.stderr)
        sys.exit(2)

    import torch
    import torch.nn.utils

    import gbmpo
    import gbmpo.train.step as step
    import gbmpo.train.trainer as trainer_module
    from gbmpo.train.trainer import Trainer

    torch.set_num_threads(a.threads)
    work = tempfile.mkdtemp(prefix="gbmpo-phases-")
    bench.build_model(a.size, work)
    knobs = argparse.Namespace(num_train=512, prompts=8, generations=8, max_new_tokens=40,
                               threads=a.threads)
    cfg = bench._our_config(work, os.path.join(work, "run"), a.steps, knobs, role="ours")

    times: dict[str, list[float]] = {}
    for name in STEP_PARTS:  # where the step looks each part up (step_record: the trainer's)
        for module in (step, trainer_module):
            if hasattr(module, name):
                setattr(module, name, _timed(getattr(module, name), times.setdefault(name, [])))
    clip = torch.nn.utils.clip_grad_norm_
    torch.nn.utils.clip_grad_norm_ = _timed(clip, times.setdefault("clip_grad_norm", []))
    backward = torch.Tensor.backward
    torch.Tensor.backward = _timed(backward, times.setdefault("backward", []))  # type: ignore

    trainer = Trainer(cfg)
    grad_times = times.setdefault("policy_forward", [])
    try:  # the step's forwards: PolicyModels.logprobs (before it: the trainer's method)
        from gbmpo.train.policy import PolicyModels
    except ImportError:
        PolicyModels = None  # noqa: N806
    owner: Any = PolicyModels if PolicyModels is not None else trainer
    logprobs = owner.logprobs

    def timed_logprobs(*args: Any, with_entropy: bool = False) -> Any:
        if not torch.is_grad_enabled():
            return logprobs(*args, with_entropy=with_entropy)
        return _timed(logprobs, grad_times)(*args, with_entropy=with_entropy)

    owner.logprobs = timed_logprobs
    trainer.optimizer.step = _timed(trainer.optimizer.step,  # type: ignore[method-assign]
                                    times.setdefault("adamw", []))
    ends: list[float] = []
    train_step = trainer.train_step

    def counted_step() -> dict[str, Any]:
        record = train_step()
        ends.append(time.process_time())
        return record

    trainer.train_step = counted_step  # type: ignore[method-assign]
    try:
        trainer.train()
    finally:
        torch.Tensor.backward = backward  # type: ignore[method-assign]
        torch.nn.utils.clip_grad_norm_ = clip
    kept = a.steps - a.warmup
    steps = [b - e for e, b in zip(ends[a.warmup - 1 : -1], ends[a.warmup:], strict=True)]
    result: dict[str, Any] = {
        "size": a.size,
        "gbmpo_module": str(Path(gbmpo.__file__).resolve().parent),
        "steps_kept": kept,
        "step_cpu_ms": round(_median(steps) * 1e3, 2),
    }
    for name, values in times.items():
        per_step = len(values) // a.steps or 1
        result[f"{name}_cpu_ms"] = round(_median(values[a.warmup * per_step :]) * 1e3, 2)
    print(json.dumps(result))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"trainer_phases: {a.size} step {result['step_cpu_ms']} CPU ms"
          + (f" -> {a.out}" if a.out else ""))


if __name__ == "__main__":
    main()
