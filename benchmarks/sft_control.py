"""The equal-time control for the embedded default: supervised fine-tuning on the gold solutions.

    python benchmarks/sft_control.py [--seconds 180] [--seeds 0,1,2] [--lr 1e-3] [--threads 1]

Starts from the same shipped tiny model as ``gbmpo train`` and, instead of RL, continues the
warm-start's SFT recipe (batch 64, AdamW β 0.9/0.98, weight decay 0.01, grad clip 1, loss on the
completion tokens only, LR ``--lr`` (default the warm-start's 1e-3) after a linear warm-up of
``--warmup-steps`` (default 20: a fresh AdamW's first full-LR steps knocked the seed-0 asset from
45% to 4% held-out accuracy in one step)) on the
gold solutions of the *same* training prompts the RL run draws from (the ``arithmetic`` task's
``train`` split, shuffled by the seed), for ``--seconds`` of wall time. Held-out accuracy is
measured exactly as ``gbmpo train`` measures it (:func:`gbmpo.eval.evaluate`, greedy, the same
200 problems, 40 new tokens) before, at every ``--eval-every`` seconds and at the end; evaluation
time is outside the budget, as in the trainer. Prints one line per seed and writes
``benchmarks/results/sft_control.json``.

RL gets rewards only; this control gets the full worked solution of every prompt, so it is an
upper reference for what the same seconds of gradient steps can buy with the gold data, not a
like-for-like method comparison.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from _common import finish_result, load_average, start_result  # noqa: E402
from build_tiny_model import collate, encode_sft, lr_at  # noqa: E402

from gbmpo.eval import evaluate  # noqa: E402
from gbmpo.models import load_model_and_tokenizer  # noqa: E402
from gbmpo.tasks.arithmetic import ArithmeticTask  # noqa: E402


def heldout_accuracy(model: Any, tokenizer: Any, task: ArithmeticTask) -> float:
    """Greedy accuracy on the test split, with the trainer's evaluation settings."""
    model.eval()
    out = evaluate(model, tokenizer, task, split="test", samples=1, temperature=0.0,
                   max_new_tokens=40, batch_size=64, generator="gbmpo")
    model.train()
    return float(out["metrics"]["accuracy"])


def run(seed: int, seconds: float, lr: float, warmup: int, eval_every: float,
        batch_size: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model, tokenizer = load_model_and_tokenizer(None)
    task = ArithmeticTask()
    examples = task.split("train")
    random.Random(seed).shuffle(examples)
    data = encode_sft(examples, tokenizer)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    curve = [{"seconds": 0.0, "steps": 0, "accuracy": heldout_accuracy(model, tokenizer, task)}]
    model.train()
    spent, step, next_eval = 0.0, 0, eval_every
    while spent < seconds:
        t0 = time.perf_counter()
        j = step % (len(data) // batch_size)
        ids, mask, labels = collate(data[j * batch_size:(j + 1) * batch_size],
                                    tokenizer.pad_token_id)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, lr, warmup)
        logits = model(input_ids=ids, attention_mask=mask).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
            ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        spent += time.perf_counter() - t0
        if spent >= next_eval or spent >= seconds:
            curve.append({"seconds": round(spent, 1), "steps": step,
                          "accuracy": heldout_accuracy(model, tokenizer, task)})
            next_eval += eval_every
    return {"seed": seed, "steps": step, "train_seconds": round(spent, 1), "curve": curve,
            "before": curve[0]["accuracy"], "after": curve[-1]["accuracy"],
            "gain_points": round(100 * (curve[-1]["accuracy"] - curve[0]["accuracy"]), 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=180.0, help="SFT wall budget per seed")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--lr", type=float, default=1e-3, help="the warm-start SFT's LR")
    ap.add_argument("--warmup-steps", type=int, default=20, help="linear LR warm-up")
    ap.add_argument("--eval-every", type=float, default=60.0, help="seconds between evals")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the trainer's 1)")
    ap.add_argument("--out", default=None, help="result JSON (default benchmarks/results/)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = start_result("sft_control")
    result["settings"] = {k: v for k, v in vars(args).items() if k != "out"}
    result["runs"] = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        load = load_average()
        r = run(seed, args.seconds, args.lr, args.warmup_steps, args.eval_every, args.batch_size)
        r["loadavg_start"] = load
        result["runs"].append(r)
        curve = " / ".join(f"{100 * c['accuracy']:.1f}" for c in r["curve"])
        print(f"seed {seed}: {100 * r['before']:.1f} -> {100 * r['after']:.1f} "
              f"({r['gain_points']:+.1f} points) in {r['steps']} SFT steps, "
              f"{r['train_seconds']:.0f} s; curve {curve}; load {load[0]:.1f}", flush=True)
    gains = [r["gain_points"] for r in result["runs"]]
    result["mean_gain_points"] = round(sum(gains) / len(gains), 2)
    print(f"mean gain {result['mean_gain_points']:+.1f} points over {len(gains)} seeds")
    print(f"wrote {finish_result(result, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
