"""Math reward: tricky formats, every GSM8K gold solution, thread/process safety, no eval."""

from __future__ import annotations

import builtins
import json
import multiprocessing as mp
import os
import secrets
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gbmpo.rewards import REWARDS, extract_answer, math_reward, parse_number
from gbmpo.rewards.math import math_reward_fn

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"

# (completion, gold, expected reward)
TRICKY = [
    ("The answer is 72.", "72", 1.0),
    ("#### 72", "72", 1.0),
    ("$\\boxed{72}$", "72", 1.0),
    ("\\boxed{10.00}", "10", 1.0),
    ("so the total is 10.5", "10.50", 1.0),
    ("so the total is 10.5", "10", 0.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("The final answer is \\frac{3}{4}", "0.75", 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "3/4", 1.0),
    ("She has 3/4 of the pie left", "0.75", 1.0),
    ("\\boxed{1234}", "1,234", 1.0),
    ("#### 1,234,567", "1234567", 1.0),
    ("It costs 1{,}000 dollars", "1000", 1.0),
    ("It costs 1\\,000 dollars", "1000", 1.0),
    ("She earns \\$1,200 per week.\n#### $1,200", "1200", 1.0),
    ("so $18.00 in total", "18", 1.0),
    ("The answer is €45", "45", 1.0),
    ("#### 18 dollars", "18", 1.0),
    ("\\boxed{18 \\text{ dollars}}", "18", 1.0),
    ("It takes 18 minutes", "18", 1.0),
    ("The speed is 60 km/h", "60", 1.0),
    ("The result is 50%", "50", 1.0),
    ("\\boxed{50\\%}", "50", 1.0),
    ("answer: -7", "-7", 1.0),
    ("answer: −7", "-7", 1.0),
    ("x = 5", "5", 1.0),
    ("\\boxed{x = 5}", "5", 1.0),
    ("The answer is 5. I hope this helps with your 2 questions.", "5", 1.0),
    ("Final Answer: The final answer is $8$. I hope it is correct.", "8", 1.0),
    ("<think>maybe 3</think>The answer is 4", "4", 1.0),
    ("\\boxed{16}", "18", 0.0),
    ("#### 73", "72", 0.0),
    ("no number here", "5", 0.0),
    ("", "5", 0.0),
    ("The numbers are 3, 4", "34", 0.0),
    ("\\boxed{3, 4}", "34", 0.0),
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{\\sqrt{2}}{2}", 1.0),
    ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{\\sqrt{2}}{2}", 1.0),
    ("\\boxed{2\\pi}", "2\\pi", 1.0),
    ("\\boxed{\\pi}", "2\\pi", 0.0),
]


@pytest.mark.parametrize("completion,gold,expected", TRICKY)
def test_tricky_formats(completion: str, gold: str, expected: float) -> None:
    assert math_reward(completion, gold) == expected


def test_extraction_priorities() -> None:
    assert extract_answer("first 3 then \\boxed{4} then 5") == "4"
    assert extract_answer("#### 6\n#### 7") == "6"  # the first #### line ends a GSM8K answer
    assert extract_answer("the answer is 8, not 9") == "8"
    assert extract_answer("1 2 3") == "3"
    assert extract_answer("nothing") is None
    assert parse_number("about five") is None
    assert parse_number("1, 2") is None


def _gsm8k_rows() -> list[dict[str, str]]:
    rows = []
    for split in ("train", "test"):
        path = DATA / "gsm8k" / f"{split}.jsonl"
        if not path.is_file():
            pytest.skip(f"GSM8K data not found at {path}")
        rows += [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    return rows


def test_every_gsm8k_gold_solution_scores_one_and_a_changed_number_zero() -> None:
    rows = _gsm8k_rows()
    assert len(rows) == 8792
    wrong_ok, right_bad = [], []
    for row in rows:
        solution = row["answer"]
        body, final = solution.rsplit("####", 1)
        gold = final.strip()
        if math_reward(solution, gold) != 1.0:
            right_bad.append(gold)
        changed = f"{body}#### {int(gold.replace(',', '')) + 1}"
        if math_reward(changed, gold) != 0.0:
            wrong_ok.append(gold)
    assert right_bad == [] and wrong_ok == []


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(-10**9, 10**9),
    fmt=st.sampled_from(["{}", "#### {}", "\\boxed{{{}}}", "The answer is {}.", "$ {}",
                         "{} dollars", "{}.00", "So it is {} in the end."]),
    commas=st.booleans(),
)
def test_formats_of_integers(n: int, fmt: str, commas: bool) -> None:
    text = f"{n:,}" if commas else str(n)
    assert math_reward(fmt.format(text), str(n)) == 1.0
    assert math_reward(fmt.format(f"{n + 1:,}" if commas else str(n + 1)), str(n)) == 0.0


def test_no_eval_of_model_output(monkeypatch: pytest.MonkeyPatch) -> None:
    marker = Path(f"/tmp/gbmpo-pwned-{secrets.token_hex(6)}")
    hostile = f"\\boxed{{__import__('os').system('touch {marker}')}}"
    assert math_reward(hostile, "0") == 0.0
    assert math_reward(f"The answer is {hostile}", "\\frac{1}{2}") == 0.0
    assert not marker.exists()

    def forbidden(*_a: object, **_k: object) -> None:
        raise AssertionError("eval/exec called")

    assert math_reward("#### 2", "2") == 1.0  # imports done before eval/exec are patched
    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    assert math_reward("#### 1,234", "1234") == 1.0
    assert math_reward("\\boxed{\\frac{3}{4}}", "0.75") == 1.0
    assert math_reward("\\boxed{10.00}", "10") == 1.0
    assert math_reward("It is 2.5/0.5", "5") == 1.0


def test_pathological_latex_is_bounded() -> None:
    # A power tower makes SymPy compute for a very long time: the helper is killed at the bound.
    assert math_reward("\\boxed{9^{9^{9^{9}}}}", "5", timeout_s=1.0) == 0.0
    assert math_reward("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}") == 1.0


def test_safe_in_worker_threads() -> None:
    items = [("#### 12", "12"), ("\\boxed{\\frac{\\sqrt{3}}{3}}", "\\frac{1}{\\sqrt{3}}"),
             ("\\boxed{0.25}", "1/4"), ("#### 7", "8")] * 8
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda cg: math_reward(*cg), items))
    assert got == [1.0, 1.0, 1.0, 0.0] * 8


def _score(cg: tuple[str, str]) -> float:
    return math_reward(*cg)


def test_safe_in_daemonic_worker_processes() -> None:
    items = [("#### 12", "12"), ("\\boxed{\\frac{\\sqrt{3}}{3}}", "\\frac{1}{\\sqrt{3}}"),
             ("#### 7", "8")]
    with mp.get_context("fork").Pool(2) as pool:  # pool workers are daemonic
        assert pool.map(_score, items) == [1.0, 1.0, 0.0]
    assert os.getpid() > 0


def test_trl_reward_function() -> None:
    fn = REWARDS.get("math")
    assert fn is math_reward_fn
    comps = ["#### 4", [{"role": "assistant", "content": "\\boxed{5}"}], "nope"]
    assert fn(prompts=["a", "b", "c"], completions=comps, answer=["4", "5", "6"],
              extra=[1, 2, 3]) == [1.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="answers"):
        fn(prompts=["a"], completions=["1"], answer=[])
    with pytest.raises(TypeError):
        math_reward(None, "1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="empty"):
        math_reward("1", " ")


def test_extraction_is_linear_on_pathological_text() -> None:
    for text in ("\\boxed{" * 20000, "<think>" * 50000, "1," * 100000, "\\frac{" * 20000):
        assert math_reward(text, "5") == 0.0
