"""Built-in offline task: multi-step arithmetic word problems answered as ``#### N``.

Five templates, each with 2 or 3 operations (``+``, ``-``, ``*``) on integers below 50; the
factors of every product are 2 to 9 and every intermediate value is non-negative. Example::

    prompt:   "Q: Anna has 28 eggs and 21 more in a box. She gives 5 friends 9 eggs each.
               How many eggs are left?\\nA:"
    solution: " 28+21=49. 5*9=45. 49-45=4. #### 4"      (the model is trained to add EOS)
    answer:   "4"

Generation is deterministic: each split is drawn from :class:`random.Random` seeded with a
string naming the split and the task seed (string seeds hash the same way in every process).
The held-out split ``"test"`` is ``num_test`` distinct problems; the ``"train"`` (RL) and
``"sft"`` (warm start) streams come from other seeds and skip every prompt of ``"test"``.
Every example carries ``prompt``, ``answer`` (the integer as a string) and ``solution`` (the
worked target text, without EOS).

The reward (:func:`arithmetic_reward`) is 1.0 iff the integer right after the first ``####`` of a
completion equals the answer, else 0.0.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from gbmpo.tasks.base import TASKS, Example, Task

__all__ = [
    "ArithmeticTask",
    "arithmetic_reward",
    "extract_final_integer",
    "generate_problem",
    "generate_problems",
]

#: (name, pronoun)
_PEOPLE: tuple[tuple[str, str], ...] = (
    ("Anna", "she"), ("Ben", "he"), ("Carla", "she"),
    ("David", "he"), ("Emma", "she"), ("Felix", "he"),
    ("Grace", "she"), ("Hugo", "he"), ("Ines", "she"),
    ("Jonas", "he"), ("Kira", "she"), ("Leo", "he"),
    ("Maya", "she"), ("Omar", "he"), ("Paula", "she"),
    ("Sam", "he"),
)

_SMALL = (1, 49)  # operands are integers below 50
_FACTOR = (2, 9)  # factors of every product


def _draw(rng: random.Random, bounds: tuple[int, int] = _SMALL) -> int:
    """A uniform integer in ``bounds`` (both ends included)."""
    return rng.randint(*bounds)


def _eggs(rng: random.Random, name: str, she: str) -> tuple[str, list[str], int] | None:
    a, b, c, d = _draw(rng), _draw(rng), _draw(rng, _FACTOR), _draw(rng, _FACTOR)
    s, p = a + b, c * d
    if s < p:
        return None
    q = (f"{name} has {a} eggs and {b} more in a box. {she.capitalize()} gives {c} friends "
         f"{d} eggs each. How many eggs are left?")
    return q, [f"{a}+{b}={s}", f"{c}*{d}={p}", f"{s}-{p}={s - p}"], s - p


def _pens(rng: random.Random, name: str, she: str) -> tuple[str, list[str], int] | None:
    c, d, a = _draw(rng, _FACTOR), _draw(rng, _FACTOR), _draw(rng)
    p = c * d
    if a > p:
        return None
    q = (f"{name}'s shop has {c} boxes with {d} pens in each box. {she.capitalize()} sells "
         f"{a} pens. How many pens are left?")
    return q, [f"{c}*{d}={p}", f"{p}-{a}={p - a}"], p - a


def _money(rng: random.Random, name: str, she: str) -> tuple[str, list[str], int] | None:
    a, c, d, b = _draw(rng), _draw(rng, _FACTOR), _draw(rng, _FACTOR), _draw(rng)
    p = c * d
    if a < p:
        return None
    x = a - p
    q = (f"{name} has {a} dollars. {she.capitalize()} buys {c} books at {d} dollars each and "
         f"then earns {b} dollars. How many dollars does {she} have now?")
    return q, [f"{c}*{d}={p}", f"{a}-{p}={x}", f"{x}+{b}={x + b}"], x + b


def _cars(rng: random.Random, name: str, she: str) -> tuple[str, list[str], int] | None:
    a, b, c, d = _draw(rng), _draw(rng), _draw(rng, _FACTOR), _draw(rng, _FACTOR)
    if b > a:
        return None
    x, p = a - b, c * d
    q = (f"{name} watches a parking lot with {a} cars. {b} cars leave, then {c} rows of {d} "
         f"cars arrive. How many cars are in the lot now?")
    return q, [f"{a}-{b}={x}", f"{c}*{d}={p}", f"{x}+{p}={x + p}"], x + p


def _apples(rng: random.Random, name: str, she: str) -> tuple[str, list[str], int] | None:
    a, b, c = _draw(rng), _draw(rng), _draw(rng)
    if b > a:
        return None
    x = a - b
    q = (f"{name} picks {a} apples. {she.capitalize()} eats {b} of them and then picks {c} "
         f"more. How many apples does {she} have now?")
    return q, [f"{a}-{b}={x}", f"{x}+{c}={x + c}"], x + c


_Template = Callable[[random.Random, str, str], "tuple[str, list[str], int] | None"]
_TEMPLATES: tuple[_Template, ...] = (_eggs, _pens, _money, _cars, _apples)


def generate_problem(rng: random.Random) -> Example:
    """Draw one problem from ``rng``: a template uniformly, then operands by rejection.

    Returns ``{"prompt": "Q: ...\\nA:", "answer": "N", "solution": " a+b=c. ... #### N"}``.
    """
    template = _TEMPLATES[rng.randrange(len(_TEMPLATES))]
    name, she = _PEOPLE[rng.randrange(len(_PEOPLE))]
    while (drawn := template(rng, name, she)) is None:
        pass
    question, steps, result = drawn
    return {
        "prompt": f"Q: {question}\nA:",
        "answer": str(result),
        "solution": " " + " ".join(f"{s}." for s in steps) + f" #### {result}",
    }


def generate_problems(
    n: int, seed: str | int, *, exclude: Iterable[str] = (), unique: bool = False
) -> list[Example]:
    """``n`` problems from ``random.Random(seed)``, skipping prompts in ``exclude``.

    With ``unique=True`` no prompt appears twice. Deterministic in ``(n, seed, exclude)``.
    """
    if n < 0:
        raise ValueError(f"number of problems must be >= 0, got {n}")
    rng = random.Random(seed)
    skip = set(exclude)
    out: list[Example] = []
    while len(out) < n:
        ex = generate_problem(rng)
        if ex["prompt"] in skip:
            continue
        if unique:
            skip.add(ex["prompt"])
        out.append(ex)
    return out


# ----------------------------------------------------------------------------------- verifier

_MARKER = re.compile("#{4,}")  # "####" (a longer run of "#" counts as one marker)
# an ASCII integer, then the end, whitespace, a special-token "<", or punctuation not followed by
# a digit (so "4." and "4," count as 4, but "4.5" and "4,000" are not integers here)
_FINAL_INT = re.compile(r"\s*([+-]?[0-9]+)(?=$|\s|<|[.,;:!?)](?![0-9]))", re.ASCII)


def extract_final_integer(completion: str) -> int | None:
    """The integer right after the first ``####`` of ``completion``, or ``None``.

    A longer run of ``#`` counts as the marker (``"#####5"`` gives 5). Leading whitespace is
    skipped; anything but an ASCII integer (``4.5``, ``four``, ``x4``, nothing) gives ``None``.
    No ``eval``.
    """
    marker = _MARKER.search(completion)
    if marker is None:
        return None
    m = _FINAL_INT.match(completion, marker.end())
    return int(m.group(1)) if m else None


def _completion_text(completion: Any) -> str:
    """A plain string, or the last message's ``content`` of a TRL conversational completion."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        content = completion[-1].get("content")
        if isinstance(content, str):
            return content
    raise TypeError(
        f"completion must be a str or a list of chat messages, got {type(completion).__name__}"
    )


def _parse_answer(answer: Any) -> int:
    if isinstance(answer, bool):
        raise ValueError(f"answer must be an integer, got {answer!r}")
    if isinstance(answer, int):
        return answer
    if isinstance(answer, str) and re.fullmatch(r"\s*[+-]?[0-9]+\s*", answer, re.ASCII):
        return int(answer)
    raise ValueError(f"answer must be an integer or an integer string, got {answer!r}")


def arithmetic_reward(completions: Sequence[Any], answer: Sequence[Any], **_: Any) -> list[float]:
    """Exact-match reward: ``r_i = 1[int after the first '####' in completion_i == answer_i]``.

    TRL reward-function convention (extra columns are ignored). ``answer`` entries are ints or
    integer strings; anything else raises ``ValueError``. Lengths must match.
    """
    if len(completions) != len(answer):
        raise ValueError(
            f"got {len(completions)} completions but {len(answer)} answers; they must match"
        )
    out: list[float] = []
    for completion, ans in zip(completions, answer, strict=True):
        target = _parse_answer(ans)
        got = extract_final_integer(_completion_text(completion))
        out.append(1.0 if got is not None and got == target else 0.0)
    return out


# --------------------------------------------------------------------------------------- task


@TASKS.register("arithmetic")
class ArithmeticTask(Task):
    """The built-in offline task (see the module docstring).

    Splits: ``"train"`` (``num_train`` RL prompts), ``"test"`` (``num_test`` held-out problems,
    disjoint from the others), ``"sft"`` (``num_sft`` warm-start examples). ``seed`` selects a
    different but equally deterministic set of all three.
    """

    name = "arithmetic"
    kind = "math"
    train_split = "train"
    eval_split = "test"
    splits = ("train", "test", "sft")

    def __init__(
        self, num_train: int = 20_000, num_test: int = 200, num_sft: int = 40_000, seed: int = 0
    ) -> None:
        for key, value in (("num_train", num_train), ("num_test", num_test), ("num_sft", num_sft)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"arithmetic task: {key} must be a positive integer, got {value!r}"
                )
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"arithmetic task: seed must be an integer, got {seed!r}")
        self.num_train, self.num_test, self.num_sft, self.seed = num_train, num_test, num_sft, seed
        self._cache: dict[str, list[Example]] = {}

    def split(self, name: str) -> list[Example]:
        if name not in self.splits:
            raise ValueError(
                f"arithmetic task has no split {name!r}; valid splits: {', '.join(self.splits)}"
            )
        if name not in self._cache:
            if name == "test":
                data = generate_problems(
                    self.num_test, f"gbmpo-arithmetic:test:{self.seed}", unique=True
                )
            else:
                held_out = {ex["prompt"] for ex in self.split("test")}
                n = self.num_train if name == "train" else self.num_sft
                seed = f"gbmpo-arithmetic:{name}:{self.seed}"
                data = generate_problems(n, seed, exclude=held_out)
            self._cache[name] = data
        return [dict(ex) for ex in self._cache[name]]

    def reward(
        self, prompts: Sequence[str], completions: Sequence[Any], **columns: Any
    ) -> list[float | None]:
        if "answer" not in columns:
            raise ValueError("arithmetic reward needs the 'answer' column")
        if len(prompts) != len(completions):
            raise ValueError(
                f"got {len(prompts)} prompts but {len(completions)} completions; they must match"
            )
        return list(arithmetic_reward(completions, columns["answer"]))
