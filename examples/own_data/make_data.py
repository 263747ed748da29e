"""Write the example data of README "Your own data": word problems as a user would bring them.

    python examples/own_data/make_data.py

The rows come from gbmpo's own problem generator (``gbmpo.tasks.arithmetic``) under seeds that
the built-in task does not use, re-shaped into the columns a user's file might have
(``question``, ``final``, ``worked``), so the README commands run offline with the tiny model.
"""

from __future__ import annotations

import json
from pathlib import Path

from gbmpo.tasks.arithmetic import generate_problems

HERE = Path(__file__).resolve().parent


def rows(n: int, seed: str) -> list[dict[str, str]]:
    out = []
    for ex in generate_problems(n, seed, unique=True):
        question = ex["prompt"].removeprefix("Q: ").removesuffix("\nA:")
        out.append({"question": question, "final": ex["answer"], "worked": ex["solution"].strip()})
    return out


def main() -> None:
    train = rows(400, "own-data-example:train")
    seen = {r["question"] for r in train}
    test = [r for r in rows(140, "own-data-example:test") if r["question"] not in seen][:100]
    for name, data in (("word_problems.jsonl", train), ("word_problems_test.jsonl", test)):
        with open(HERE / name, "w", encoding="utf-8") as f:
            for r in data:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
