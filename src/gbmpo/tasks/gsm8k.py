"""GSM8K (Cobbe et al., 2021): grade-school math word problems, reward = final-answer match.

Splits: ``train`` (7,473) and ``test`` (1,319), read from ``gsm8k/{train,test}.jsonl``: the
package carries them (MIT licence beside them); see :mod:`gbmpo.tasks._common` for where else
files are looked up (hub id ``openai/gsm8k``, config ``main``).

Each example: ``prompt`` (templated), ``answer`` (the gold final number after ``####``, with
thousands separators removed, e.g. ``"1200"``), ``solution`` (the worked gold solution, for
SFT), ``question``.

Prompts:

* base: ``"Q: {question}\\nA:"`` (the format of the built-in arithmetic task; the model is
  expected to end with ``#### <number>``);
* chat: system prompt :data:`CHAT_SYSTEM` (solve step by step, finish with ``#### <number>``),
  user message = the question.

Reward: :func:`gbmpo.rewards.math_reward` (``\\boxed{}``, ``####``, "the answer is", or the last
number; checked with math-verify).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gbmpo.rewards.math import extract_answer, math_reward
from gbmpo.tasks import _common as common
from gbmpo.tasks.base import TASKS, Example, Task

__all__ = ["BASE_TEMPLATE", "CHAT_SYSTEM", "GSM8KTask", "gold_answer"]

HUB_ID, HUB_CONFIG = "openai/gsm8k", "main"
SPLITS = ("train", "test")
BASE_TEMPLATE = "Q: {question}\nA:"
CHAT_SYSTEM = (
    "Solve the math word problem. Reason step by step, then write the final numeric answer "
    "on its own last line in the form '#### <number>'."
)


def gold_answer(solution: str) -> str:
    """The final answer of a GSM8K solution: the text after ``####``, commas removed."""
    if "####" not in solution:
        raise ValueError(f"GSM8K solution has no '####' line: {solution[-80:]!r}")
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


@TASKS.register("gsm8k")
class GSM8KTask(common.TemplatedPrompts, Task):
    """GSM8K with a final-answer reward. See the module docstring."""

    name = "gsm8k"
    kind = "math"
    train_split = "train"
    eval_split = "test"

    def __init__(
        self,
        *,
        path: str | None = None,
        template: str = "base",
        tokenizer: Any = None,
        system_prompt: str | None = None,
        hub: bool | None = None,
    ) -> None:
        self.path = path  # a directory holding train.jsonl / test.jsonl, or None
        self._init_prompts(template, tokenizer, system_prompt, CHAT_SYSTEM)
        self.hub = common.hub_allowed(hub)
        self._cache: dict[str, list[Example]] = {}

    def _rows(self, split: str) -> list[dict[str, Any]]:
        explicit = None if self.path is None else f"{self.path.rstrip('/')}/{split}.jsonl"
        return common.load_rows(f"gsm8k/{split}.jsonl", explicit, self.hub, HUB_ID, HUB_CONFIG,
                                [split])

    def prompt(self, question: str) -> str:
        return self._render(question, BASE_TEMPLATE.format(question=question))

    def split(self, name: str) -> list[Example]:
        if name not in SPLITS:
            raise common.split_error(self.name, name, list(SPLITS))
        if name not in self._cache:
            self._cache[name] = [
                {
                    "prompt": self.prompt(row["question"]),
                    "answer": gold_answer(row["answer"]),
                    "solution": row["answer"],
                    "question": row["question"],
                }
                for row in self._rows(name)
            ]
        return [dict(ex) for ex in self._cache[name]]

    def reward(
        self, prompts: Sequence[str], completions: Sequence[str], **columns: Any
    ) -> list[float | None]:
        answers = columns.get("answer")
        if answers is None:
            raise ValueError("gsm8k reward needs the 'answer' column")
        if len(answers) != len(completions):
            raise ValueError(f"{len(completions)} completions but {len(answers)} answers")
        return [math_reward(c, a) for c, a in zip(completions, answers, strict=True)]

    def grade(
        self, completions: Sequence[str], examples: Sequence[Example]
    ) -> list[dict[str, Any]]:
        """Per-completion record for evaluation: reward, correctness and the extracted answer."""
        out = []
        for c, ex in zip(completions, examples, strict=True):
            r = math_reward(c, ex["answer"])
            out.append({"reward": r, "correct": r == 1.0, "extracted": extract_answer(c)})
        return out
