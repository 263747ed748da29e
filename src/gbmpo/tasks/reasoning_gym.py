"""Any reasoning-gym data set (procedurally generated, offline) as a task.

``get_task("reasoning_gym", dataset="chain_sum", size=1000, test_size=200, seed=42,
**config)``: ``config`` goes to :func:`reasoning_gym.create_dataset` (e.g. ``min_terms=2``).
Splits: ``train`` (``size`` items drawn with ``seed``, minus any question that also appears in
``test``) and ``test`` (``test_size`` items drawn with ``seed + 1``).

Each example: ``prompt``, ``answer`` (the gold answer string), ``question``, ``metadata`` (the
data set's metadata, which its scorer may need).

Prompts:

* base: ``"Q: {question}\\nA:"``, the final answer expected on a ``#### <answer>`` line;
* chat: system prompt :data:`CHAT_SYSTEM` (answer inside ``<answer>...</answer>``), user
  message = the question.

Reward: the data set's own ``score_answer`` (a float in [0, 1]) of the extracted answer: the
last ``<answer>...</answer>`` span, else the first ``####`` line, else nothing (score 0). A
completion counts as correct when the score is 1.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from gbmpo.tasks import _common as common
from gbmpo.tasks.base import TASKS, Example, Task

__all__ = ["BASE_TEMPLATE", "CHAT_SYSTEM", "ReasoningGymTask", "extract_final", "list_datasets"]

BASE_TEMPLATE = "Q: {question}\nA:"
CHAT_SYSTEM = (
    "Think through the problem step by step. Then give only the final answer, in the format "
    "the question asks for, between <answer> and </answer>."
)
SPLITS = ("train", "test")
_HASH_RE = re.compile(r"####\s*([^\n]*)")


def list_datasets() -> list[str]:
    """Names of every reasoning-gym data set (needs ``pip install reasoning-gym``)."""
    return sorted(_factory().DATASETS)


def _factory() -> Any:
    try:
        # deferred: reasoning_gym is optional (the gym extra)
        import reasoning_gym.factory as factory
    except ImportError as exc:
        raise ImportError(
            "the reasoning_gym task needs `pip install reasoning-gym` (extra: gbmpo[gym])"
        ) from exc
    return factory


def extract_final(completion: str) -> str | None:
    """The last ``<answer>...</answer>`` span, else the first ``#### ...`` line, else None."""
    end = completion.rfind("</answer>")
    if end != -1:
        start = completion.rfind("<answer>", 0, end)
        if start != -1:
            return completion[start + len("<answer>") : end].strip()
    m = _HASH_RE.search(completion)
    if m and m.group(1).strip():
        return m.group(1).strip()
    return None


@TASKS.register("reasoning_gym")
class ReasoningGymTask(common.TemplatedPrompts, Task):
    """A reasoning-gym data set scored by its own verifier. See the module docstring."""

    name = "reasoning_gym"
    kind = "math"
    train_split = "train"
    eval_split = "test"

    def __init__(
        self,
        dataset: str,
        *,
        size: int = 1000,
        test_size: int = 200,
        seed: int = 42,
        template: str = "base",
        tokenizer: Any = None,
        system_prompt: str | None = None,
        **config: Any,
    ) -> None:
        factory = _factory()
        if dataset not in factory.DATASETS:
            valid = ", ".join(sorted(factory.DATASETS))
            raise ValueError(f"unknown reasoning-gym dataset {dataset!r}; valid: {valid}")
        if size < 1 or test_size < 1:
            raise ValueError(f"size and test_size must be >= 1, got {size}, {test_size}")
        self.dataset = dataset
        self.size, self.test_size, self.seed = int(size), int(test_size), int(seed)
        self.config = dict(config)
        self._init_prompts(template, tokenizer, system_prompt, CHAT_SYSTEM)
        self._train = factory.create_dataset(dataset, size=self.size, seed=self.seed, **config)
        self._test = factory.create_dataset(
            dataset, size=self.test_size, seed=self.seed + 1, **config
        )
        self._cache: dict[str, list[Example]] = {}

    def prompt(self, question: str) -> str:
        return self._render(question, BASE_TEMPLATE.format(question=question))

    def _example(self, item: dict[str, Any]) -> Example:
        return {
            "prompt": self.prompt(item["question"]),
            "answer": str(item["answer"]),
            "question": item["question"],
            "metadata": item["metadata"],
        }

    def split(self, name: str) -> list[Example]:
        if name not in SPLITS:
            raise common.split_error(self.name, name, list(SPLITS))
        if name not in self._cache:
            test = [self._example(self._test[i]) for i in range(len(self._test))]
            held_out = {ex["question"] for ex in test}
            train = [self._example(self._train[i]) for i in range(len(self._train))]
            self._cache = {
                "test": test,
                "train": [ex for ex in train if ex["question"] not in held_out],
            }
        return [dict(ex) for ex in self._cache[name]]

    def score(self, completion: str, answer: str, question: str, metadata: Any) -> float:
        """The data set's own score of ``completion``'s extracted answer."""
        entry = {"question": question, "answer": answer, "metadata": metadata}
        return float(self._train.score_answer(answer=extract_final(completion), entry=entry))

    def reward(
        self, prompts: Sequence[str], completions: Sequence[str], **columns: Any
    ) -> list[float | None]:
        for key in ("answer", "question", "metadata"):
            if key not in columns:
                raise ValueError(f"reasoning_gym reward needs the {key!r} column")
        return [
            self.score(c, a, q, m)
            for c, a, q, m in zip(completions, columns["answer"], columns["question"],
                                  columns["metadata"], strict=True)
        ]

    def grade(
        self, completions: Sequence[str], examples: Sequence[Example]
    ) -> list[dict[str, Any]]:
        """Per-completion record for evaluation (correct = score 1)."""
        out = []
        for c, ex in zip(completions, examples, strict=True):
            s = self.score(c, ex["answer"], ex["question"], ex["metadata"])
            out.append({"reward": s, "correct": s >= 1.0, "extracted": extract_final(c)})
        return out
