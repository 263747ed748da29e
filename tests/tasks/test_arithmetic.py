"""The built-in arithmetic task: deterministic splits, disjointness, worked solutions, verifier."""

from __future__ import annotations

import operator
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gbmpo.registry import UnknownNameError
from gbmpo.tasks import TASKS, get_task
from gbmpo.tasks.arithmetic import (
    ArithmeticTask,
    arithmetic_reward,
    extract_final_integer,
    generate_problems,
)

OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
STEP = re.compile(r"(\d+)([+\-*])(\d+)=(\d+)\.")


@pytest.fixture(scope="module")
def task() -> ArithmeticTask:
    return ArithmeticTask(num_train=3000, num_sft=3000)


def test_registered_with_interface() -> None:
    assert "arithmetic" in TASKS
    t = get_task("arithmetic", num_train=10)
    assert isinstance(t, ArithmeticTask)
    assert (t.kind, t.train_split, t.eval_split) == ("math", "train", "test")
    assert len(t.split("train")) == 10
    assert len(t.split("test")) == 200


def test_generation_is_deterministic_and_seeded() -> None:
    a = ArithmeticTask(num_train=300, num_sft=50)
    b = ArithmeticTask(num_train=300, num_sft=50)
    for name in ("train", "test", "sft"):
        assert a.split(name) == b.split(name)
    other = ArithmeticTask(num_train=300, seed=1)
    assert other.split("test") != a.split("test")
    assert other.split("train") != a.split("train")
    # the canonical held-out set does not move: pin its first problem
    first = a.split("test")[0]
    assert first["prompt"] == (
        "Q: David's shop has 6 boxes with 5 pens in each box. He sells 16 pens. "
        "How many pens are left?\nA:"
    )
    assert first["solution"] == " 6*5=30. 30-16=14. #### 14"
    assert first["answer"] == "14"


def test_split_returns_copies(task: ArithmeticTask) -> None:
    task.split("test")[0]["answer"] = "mutated"
    assert task.split("test")[0]["answer"] != "mutated"


def test_splits_disjoint_from_heldout() -> None:
    t = ArithmeticTask()  # the default sizes: 20k train, 200 test, 40k sft
    test = [ex["prompt"] for ex in t.split("test")]
    assert len(set(test)) == len(test) == 200
    assert not set(test) & {ex["prompt"] for ex in t.split("train")}
    assert not set(test) & {ex["prompt"] for ex in t.split("sft")}
    # the exclusion is real: without it the streams would hit held-out prompts
    assert set(test) & {ex["prompt"] for ex in generate_problems(20_000, "gbmpo-arithmetic:"
                                                                  "train:0")}


def test_problem_structure(task: ArithmeticTask) -> None:
    templates = set()
    for ex in task.split("train") + task.split("test"):
        prompt, sol = ex["prompt"], ex["solution"]
        assert prompt.startswith("Q: ") and prompt.endswith("?\nA:")
        assert sol.startswith(" ")
        body, final = sol.split(" #### ")
        steps = STEP.findall(body)
        assert " ".join(f"{a}{op}{b}={c}." for a, op, b, c in steps) == body.strip()
        assert 2 <= len(steps) <= 3
        for a, op, b, c in steps:
            assert OPS[op](int(a), int(b)) == int(c) >= 0
            if op == "*":
                assert 2 <= int(a) <= 9 and 2 <= int(b) <= 9
        assert int(steps[-1][3]) == int(final) == int(ex["answer"])
        assert all(int(n) < 50 for n in re.findall(r"\d+", prompt))
        templates.add(re.sub(r"\d+|^Q: \w+|\b([Ss]he|[Hh]e)\b", "#", prompt))
    assert len(templates) == 5


def test_every_solution_scores_one_and_a_changed_answer_zero(task: ArithmeticTask) -> None:
    examples = task.split("test") + task.split("sft")
    sols = [ex["solution"] for ex in examples]
    answers = [ex["answer"] for ex in examples]
    assert arithmetic_reward(sols, answers) == [1.0] * len(examples)
    wrong = [s.rsplit(" ", 1)[0] + f" {int(a) + 1}" for s, a in zip(sols, answers, strict=True)]
    assert arithmetic_reward(wrong, answers) == [0.0] * len(examples)
    # the Task method, fed with columns the TRL way, agrees
    cols = task.columns(examples)
    assert set(cols) == {"answer", "solution"}
    assert task.reward([ex["prompt"] for ex in examples], sols, **cols) == [1.0] * len(examples)


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        (" 2+3=5. #### 5", 5),
        ("####5", 5),
        ("#### \n\t 5\n", 5),
        ("#### 5.", 5),
        ("#### 5, done", 5),
        ("#### 5<|im_end|>", 5),
        ("#### -3", -3),
        ("#### +7", 7),
        ("#### 007", 7),
        ("#### 5 #### 6", 5),  # the first marker counts
        ("#####5", 5),  # a longer run of "#" is one marker
        ("#### x #### 5", None),  # ... even if it is malformed
        ("no marker 5", None),
        ("", None),
        ("####", None),
        ("#### ", None),
        ("#### 4.5", None),
        ("#### 4,000", None),
        ("#### four", None),
        ("#### 5x", None),
        ("#### x5", None),
        ("#### 1e3", None),
        ("#### ٥", None),  # non-ASCII digits are not integers here
        ("### 5", None),
        ("#### __import__('os')", None),
    ],
)
def test_extract_final_integer(completion: str, expected: int | None) -> None:
    assert extract_final_integer(completion) == expected


def test_reward_on_malformed_outputs() -> None:
    comps = ["#### 4", "4", "#### 4.0", "#### 4 #### 5", "#### 5 #### 4", "####  4  ", ""]
    assert arithmetic_reward(comps, ["4"] * len(comps)) == [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    # int answers and TRL conversational completions
    conv = [[{"role": "assistant", "content": " 1+1=2. #### 2"}]]
    assert arithmetic_reward(conv, [2]) == [1.0]
    assert arithmetic_reward(["#### -2"], ["-2"]) == [1.0]


def test_reward_bad_input_raises() -> None:
    with pytest.raises(ValueError, match="2 completions but 1 answers"):
        arithmetic_reward(["#### 1", "#### 2"], ["1"])
    with pytest.raises(ValueError, match="answer must be an integer"):
        arithmetic_reward(["#### 1"], ["one"])
    with pytest.raises(ValueError, match="answer must be an integer"):
        arithmetic_reward(["#### 1"], [1.5])
    with pytest.raises(TypeError, match="completion must be a str"):
        arithmetic_reward([None], ["1"])
    with pytest.raises(ValueError, match="'answer' column"):
        ArithmeticTask(num_train=1).reward(["q"], ["#### 1"])


def test_bad_split_and_params() -> None:
    with pytest.raises(ValueError, match="no split 'validation'; valid splits: train, test, sft"):
        ArithmeticTask(num_train=1).split("validation")
    with pytest.raises(ValueError, match="num_test must be a positive integer"):
        ArithmeticTask(num_test=0)
    with pytest.raises(ValueError, match="seed must be an integer"):
        ArithmeticTask(seed="0")  # type: ignore[arg-type]
    with pytest.raises(UnknownNameError, match="valid names: .*arithmetic"):
        get_task("arithmetc")
    with pytest.raises(ValueError, match=">= 0"):
        generate_problems(-1, 0)


@given(
    prefix=st.text().filter(lambda s: "####" not in s),
    n=st.integers(-(10**9), 10**9),
    ws=st.sampled_from(["", " ", "  ", "\n", "\t "]),
    tail=st.sampled_from(["", ".", "\n", " ok"]),
)
def test_extract_property(prefix: str, n: int, ws: str, tail: str) -> None:
    assert extract_final_integer(f"{prefix}####{ws}{n}{tail}") == n
    assert arithmetic_reward([f"{prefix}####{ws}{n}{tail}"], [str(n + 1)]) == [0.0]


@given(st.text())
def test_extract_never_raises(text: str) -> None:
    got = extract_final_integer(text)
    assert got is None or isinstance(got, int)
    if "####" not in text:
        assert got is None


def test_problems_vary_with_rng() -> None:
    a = generate_problems(50, 3)
    assert len({ex["prompt"] for ex in a}) > 45
