"""Held-out arithmetic problems that no choice of the shipped model saw: the first ``--n`` test
problems of the task's seed 1, minus those that occur in any split of seed 0 (the RL prompts,
the warm-start's SFT data and the 200 held-out problems the model was chosen on).

    python scripts/fresh_arithmetic_problems.py OUT.jsonl [--n 1000]

Writes one ``{"prompt", "answer"}`` object per line, for
``gbmpo eval --task jsonl --task-param path=OUT.jsonl --task-param test_path=OUT.jsonl
--task-param reward=gbmpo.tasks.arithmetic:arithmetic_reward --template base``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from gbmpo.tasks.arithmetic import ArithmeticTask


def fresh_problems(n: int) -> list[dict[str, object]]:
    """Seed 1's first ``n`` test problems without any prompt of seed 0's splits."""
    seen = ArithmeticTask(seed=0)
    used = {ex["prompt"] for split in seen.splits for ex in seen.split(split)}
    return [{"prompt": ex["prompt"], "answer": ex["answer"]}
            for ex in ArithmeticTask(num_test=n, seed=1).split("test")
            if ex["prompt"] not in used]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--n", type=int, default=1000, help="seed 1's test problems to start from")
    args = ap.parse_args()
    rows = fresh_problems(args.n)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} of {args.n} problems -> {args.out}")


if __name__ == "__main__":
    main()
