"""The GBMPO authors' shaped MBPP reward (docs/methods.md, section "Shaped MBPP reward"): every term
on hand-built cases, properties of the group terms, and one end-to-end run through the sandbox on
real MBPP data."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gbmpo.registry import UnknownNameError
from gbmpo.rewards import REWARDS, get_reward
from gbmpo.rewards.code import make_code_reward
from gbmpo.rewards.code_shaping import (
    OUTCOMES,
    SPEC_BANNED_TOKENS,
    brevity_bonus,
    classify_outcome,
    consecutive_groups,
    count_banned_tokens,
    duplicate_penalties,
    format_penalty,
    length_tiebreak,
    outcome_penalty,
    parses,
    sample_reward,
    shape_group,
    shaped_code_rewards,
    validate_banned_tokens,
)
from gbmpo.rewards.scoring import score_completions
from gbmpo.sandbox import STATUSES, RunResult, SandboxError, get_default_sandbox
from gbmpo.tasks.mbpp import MBPPTask

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
GOOD = "def f(x):\n    return x + 1\n"  # parses, 28 characters stripped
LONG = "def f(x):\n    return x + 1  # " + "a" * 150 + "\n"  # parses, >= 150 characters


def run(status: str = "ok", passed: int = 3, total: int = 3) -> RunResult:
    return RunResult(status=status, passed=passed, total=total)


def approx(values: Any) -> Any:
    return pytest.approx(values, abs=1e-12)


# ------------------------------------------------------------------------ per-completion terms


@pytest.mark.parametrize("result,program,outcome,expected", [
    (run("ok", 3, 3), LONG, "all_pass", 1.0),                     # no brevity bonus at >= 150
    (run("failed", 2, 3), GOOD, "partial", 2 / 3),
    (run("failed", 0, 3), GOOD, "no_pass", -0.10),                # no test passes
    (run("timeout", 0, 3), GOOD, "timeout", -0.25),               # not -0.35: one outcome term
    (run("timeout", 1, 3), GOOD, "timeout", 1 / 3 - 0.25),        # keeps the tests it passed
    (run("error", 0, 3), GOOD, "exec_error", -0.15),              # runtime error at top level
    (run("killed", 0, 3), GOOD, "exec_error", -0.15),             # output limit / signal
    (run("error", 0, 3), "def f(x:\n    return 1\n", "unparseable", -0.10),  # syntax error
    (run("error", 0, 3), "def f():\nreturn 1\n", "unparseable", -0.10),      # IndentationError
    (run("failed", 0, 0), GOOD, "no_tests", -0.10),
])
def test_outcome_terms(result: RunResult, program: str, outcome: str, expected: float) -> None:
    assert classify_outcome(result, parses(program)) == outcome
    assert sample_reward(result, program, program) == approx(expected)


def test_outcome_names_and_parse_edge_cases() -> None:
    assert set(OUTCOMES) == {"no_tests", "unparseable", "timeout", "exec_error", "no_pass",
                             "partial", "all_pass"}
    with pytest.raises(ValueError, match="valid: no_tests, unparseable"):
        outcome_penalty("crashed")
    assert not parses("x = 1\x00")
    assert not parses("(" * 10_000)
    assert parses('s = "\\d"')  # a SyntaxWarning, not an error
    assert parses("")


def test_banned_tokens_and_fences() -> None:
    one_block = "Here:\n```python\ndef f(x):\n    return input(x)\n```\n"
    assert count_banned_tokens(one_block) == 1  # input( ; the block's two fences are expected
    two_blocks = one_block + "Example:\n```python\nprint(f(1))\n```\n"
    assert count_banned_tokens(two_blocks) == 1 + 1 + 2  # input(, Example:, two extra fences
    assert count_banned_tokens(two_blocks, allowed_fences=0) == 1 + 1 + 4
    assert count_banned_tokens(two_blocks, ["print("]) == 1  # the list is a parameter
    assert count_banned_tokens("input(input(") == 2
    assert format_penalty(two_blocks) == approx(-0.02 * 4)
    assert format_penalty("x = 1") == 0.0
    assert SPEC_BANNED_TOKENS == ("```", "input(", "Example:")


def test_non_ascii_is_one_flat_penalty() -> None:
    assert format_penalty("x = 'é'") == approx(-0.03)
    assert format_penalty("x = 'éèü→' # ∑") == approx(-0.03)
    assert format_penalty("Example: 'é'") == approx(-0.05)


def test_format_terms_skip_the_thinking_block() -> None:
    thought = "<think>Example: input( → ```x``` ```y```</think>\n```python\n" + GOOD + "```"
    assert sample_reward(run("failed", 0, 3), thought, GOOD) == approx(-0.10)


@pytest.mark.parametrize("length,bonus", [(1, 0.02), (99, 0.02), (100, 0.01), (149, 0.01),
                                          (150, 0.0), (400, 0.0)])
def test_brevity_bonus_thresholds(length: int, bonus: float) -> None:
    assert brevity_bonus(length, True) == bonus
    assert brevity_bonus(length, False) == 0.0
    program = "x=1#" + "a" * (length - 4) if length >= 4 else "x" * length
    assert len(program) == length
    padded = "\n" + program + "  \n\n"  # surrounding whitespace does not count
    assert sample_reward(run("ok"), padded, padded) == approx(1.0 + bonus)
    assert sample_reward(run("failed", 2, 3), padded, padded) == approx(2 / 3)  # partial: none


def test_brevity_length_is_the_completion_code_not_the_program() -> None:
    body = "    return x\n"  # a HumanEval-style continuation: program = prefix + body
    prefix = "def f(x):\n    '''" + "doc " * 50 + "'''\n"
    assert sample_reward(run("ok"), body, prefix + body, body) == approx(1.02)


# ------------------------------------------------------------------------------- group terms


def test_duplicates_penalise_every_copy() -> None:
    assert duplicate_penalties(["a", "b", "a", "c", "c", "c"]) == approx(
        [-0.02, 0.0, -0.02, -0.02, -0.02, -0.02])
    assert duplicate_penalties(["a", "a "]) == [0.0, 0.0]  # exact comparison only


def test_tiebreak_extremes_and_order() -> None:
    assert length_tiebreak([0.5, 0.5, 0.5], [30, 10, 20]) == approx([-0.015, 0.015, 0.0])
    assert length_tiebreak([-0.1, -0.1], [7, 3]) == approx([-0.015, 0.015])
    five = length_tiebreak([1.0] * 5, [50, 10, 40, 20, 30])
    assert five == approx([-0.015, 0.015, -0.0075, 0.0075, 0.0])
    assert length_tiebreak([0.2, 0.2, 0.2, 0.2], [5, 5, 9, 1]) == approx(
        [0.0, 0.0, -0.015, 0.015])  # equal lengths share their average rank
    assert length_tiebreak([0.2, 0.2], [4, 4]) == [0.0, 0.0]
    assert length_tiebreak([1.0], [3]) == [0.0]  # a group of one
    assert length_tiebreak([1.0, 0.0], [3, 9]) == [0.0, 0.0]  # not zero-variance
    assert length_tiebreak([1.0, 1.0 + 1e-12], [3, 9]) == approx([0.015, -0.015])  # float noise
    with pytest.raises(ValueError):
        length_tiebreak([1.0, 1.0], [3])


def test_shape_group_tests_variance_after_duplicates() -> None:
    # equal rewards, but a duplicate pair breaks the tie: no tie-breaker
    assert shape_group([0.5, 0.5, 0.5], ["a", "a", "b"], [1, 1, 5]) == approx([0.48, 0.48, 0.5])
    # all identical: every copy penalised, equal lengths, tie-breaker 0
    assert shape_group([0.5, 0.5], ["a", "a"], [1, 1]) == approx([0.48, 0.48])
    # all distinct and equal: shortest +0.015, longest -0.015
    assert shape_group([-0.1, -0.1], ["long", "s"], [4, 1]) == approx([-0.115, -0.085])


def test_consecutive_groups() -> None:
    assert consecutive_groups(["a", "a", "b", "b", "a"]) == [range(0, 2), range(2, 4),
                                                             range(4, 5)]
    chat = [[{"role": "user", "content": "q1"}]] * 2 + [[{"role": "user", "content": "q2"}]]
    assert consecutive_groups(chat) == [range(0, 2), range(2, 3)]
    assert consecutive_groups([]) == []


def test_batch_applies_group_terms_per_prompt_run() -> None:
    results = [run("failed", 0, 3)] * 4
    comps = ["a", "bb", "a", "a"]
    progs = ["x=1", "x=11", "x=1", "x=1"]
    no_groups = shaped_code_rewards(results, comps, progs)
    assert no_groups == approx([-0.1] * 4)
    grouped = shaped_code_rewards(results, comps, progs, prompts=["p", "p", "q", "q"])
    # group p: distinct, zero variance -> tie-breaker; group q: duplicates -> -0.02 each
    assert grouped == approx([-0.085, -0.115, -0.12, -0.12])
    with pytest.raises(ValueError):
        shaped_code_rewards(results, comps, progs, prompts=["p"])


# ---------------------------------------------------------------------------------- properties

_TEXT = st.lists(st.sampled_from(["a", " ", "\n", "```", "input(", "Example:", "é", "x=1"]),
                 max_size=12).map("".join)


@st.composite
def _runs(draw: st.DrawFn) -> RunResult:
    total = draw(st.integers(0, 5))
    return RunResult(status=draw(st.sampled_from(STATUSES)),
                     passed=draw(st.integers(0, total)), total=total)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(_runs(), _TEXT, _TEXT), min_size=1, max_size=8))
def test_shaped_reward_is_bounded(group: list[tuple[RunResult, str, str]]) -> None:
    """r_i in [-0.315 - 0.02 n_i, 1.035] (n_i = counted banned tokens); without the group
    terms in [-0.28 - 0.02 n_i, 1.02]."""
    results, comps, progs = (list(x) for x in zip(*group, strict=True))
    per_sample = shaped_code_rewards(results, comps, progs)
    shaped = shaped_code_rewards(results, comps, progs, prompts=["p"] * len(group))
    for c, r0, r in zip(comps, per_sample, shaped, strict=True):
        n = count_banned_tokens(c)
        assert -0.28 - 0.02 * n - 1e-12 <= r0 <= 1.02 + 1e-12
        assert -0.315 - 0.02 * n - 1e-12 <= r <= 1.035 + 1e-12


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 20), min_size=2, max_size=16), st.floats(-1, 2))
def test_tiebreak_preserves_the_mean_and_ranks_by_length(lengths: list[int], r: float) -> None:
    """Zero-variance group: Σ t = 0 (group mean preserved), |t| <= 0.015, shorter >= longer,
    ±0.015 reached exactly by a unique shortest / longest."""
    t = length_tiebreak([r] * len(lengths), lengths)
    assert abs(sum(t)) < 1e-12
    assert all(abs(x) <= 0.015 + 1e-15 for x in t)
    for i, li in enumerate(lengths):
        for j, lj in enumerate(lengths):
            if li < lj:
                assert t[i] > t[j]
            elif li == lj:
                assert t[i] == t[j]
    if lengths.count(min(lengths)) == 1 < len(set(lengths)):
        assert max(t) == pytest.approx(0.015)
    if lengths.count(max(lengths)) == 1 < len(set(lengths)):
        assert min(t) == pytest.approx(-0.015)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0.0, 0.5]), st.sampled_from("abc"),
                          st.integers(0, 9)), min_size=1, max_size=8), st.randoms())
def test_group_shaping_is_order_equivariant(rows: list[tuple[float, str, int]],
                                            rnd: Any) -> None:
    perm = list(range(len(rows)))
    rnd.shuffle(perm)
    r, t, n = (list(x) for x in zip(*rows, strict=True))
    out = shape_group(r, t, n)
    out_p = shape_group([r[i] for i in perm], [t[i] for i in perm], [n[i] for i in perm])
    assert out_p == approx([out[i] for i in perm])


# ---------------------------------------------------------------------------- configuration


def test_selection_by_name_and_errors() -> None:
    assert "code_shaped" in REWARDS
    assert get_reward("code_shaped").__name__ == "code_shaped"
    with pytest.raises(UnknownNameError, match="code_shaped"):
        get_reward("code_shapd")
    with pytest.raises(ValueError, match="valid: pass_fraction, all_pass, shaped"):
        make_code_reward("shapd")
    with pytest.raises(ValueError, match="valid: pass_fraction, all_pass, shaped"):
        MBPPTask(reward="shapd")
    with pytest.raises(ValueError, match="only applies"):
        MBPPTask(reward="pass_fraction", banned_tokens=["print("])
    with pytest.raises(ValueError, match="only applies"):
        make_code_reward("all_pass", banned_tokens=["print("])
    with pytest.raises(TypeError):
        validate_banned_tokens("```")
    with pytest.raises(ValueError):
        validate_banned_tokens(["```", ""])
    assert MBPPTask(reward="shaped", banned_tokens=["print("]).banned_tokens == ("print(",)
    assert MBPPTask(reward="shaped").banned_tokens == SPEC_BANNED_TOKENS
    assert MBPPTask().reward_kind == "pass_fraction"  # the default is unchanged


def test_code_reward_shaped_with_prefix_and_chat(monkeypatch: pytest.MonkeyPatch) -> None:
    """``make_code_reward("shaped")`` without a sandbox: parse check on prefix + body, length on
    the body, chat-message completions, custom banned tokens."""
    import gbmpo.rewards.code as code_mod

    monkeypatch.setattr(code_mod, "grade_code",
                        lambda comps, *a, **k: [run("ok"), run("ok"), run("failed", 0, 1)])
    fn = make_code_reward("shaped", banned_tokens=["print("])
    prefix = "def f(x):\n    '''" + "doc " * 50 + "'''\n"
    body = "    return x\n"  # parses only after the prefix; 8 characters of code
    comps = [[{"role": "assistant", "content": body}],
             [{"role": "assistant", "content": body + "print(f(1))\n"}],
             [{"role": "assistant", "content": "    return ("}]]
    out = fn(prompts=["p", "p", "p"], completions=comps, tests=[["assert f(1) == 1"]] * 3,
             prefix=[prefix] * 3, entry_point=["f"] * 3)
    assert out == approx([1.02, 1.02 - 0.02, -0.10])


def test_mbpp_task_groups_as_the_trainer_calls_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """No sandbox: the trainer's call (prompts repeated G times, ``score_completions``) on
    hand-built results; base completions get their opening fence back (not penalised)."""
    task = MBPPTask(reward="shaped")
    monkeypatch.setattr(task, "run", lambda comps, cols: [run("failed", 0, 3)] * len(comps))
    G = 2
    prompts = ["p1", "p2"]
    texts = ["def f():\n    return 1\n```", "def f():\n    return 22\n```",  # group 1
             "def f():\n    return 1\n```", "def f():\n    return 1\n```"]  # group 2: duplicates
    columns = {"tests": [["assert f() == 3"]] * 4, "entry_point": ["f"] * 4}
    scored = score_completions(task.reward, [p for p in prompts for _ in range(G)], texts,
                               columns)
    assert scored.failures == 0
    assert scored.rewards == approx([-0.085, -0.115, -0.12, -0.12])


# ------------------------------------------------------------------------- end to end (sandbox)


def test_end_to_end_on_mbpp_through_the_sandbox() -> None:
    """One batch of two groups on real MBPP problems (814, 624), as the trainer scores it."""
    if not (DATA / "mbpp" / "mbpp.jsonl").is_file() and not os.environ.get("GBMPO_DATA_DIR"):
        pytest.skip(f"MBPP data not found at {DATA / 'mbpp'}")
    try:
        get_default_sandbox()
    except SandboxError as exc:
        pytest.skip(f"sandbox cannot start here: {exc}")
    task = MBPPTask(reward="shaped", timeout_s=2.0)
    by_id = {ex["task_id"]: ex for ex in task.split("train")}
    rhombus, upper = by_id[814], by_id[624]
    ref = "def rombus_area(p,q):\n  area=(p*q)/2\n  return area\n```"  # 50 characters of code
    group1 = [
        (ref, 1.0 + 0.02 - 0.02),                                          # duplicate of ...
        (ref, 1.0 + 0.02 - 0.02),                                          # ... this one
        ("def rombus_area(p,q):\n  return p*q/2 if p > 4 else 0\n```", 2 / 3),
        ("def rombus_area(p,q):\n  return 0\n```", -0.10),                 # no test passes
        ("def rombus_area(p,q):\n  return p*q/2\nraise ValueError()\n```", -0.15),
        ("def rombus_area(p,q:\n  return 1\n```", -0.10),                  # syntax error
        ("def rombus_area(p,q):\n  while True:\n    pass\n```", -0.25),    # timeout
        (ref + "\nExample:\n```python\nprint(rombus_area(1, 2))  # → 1.0\n```",
         1.0 + 0.02 - 0.02 * 3 - 0.03),                                    # 2 fences + Example:
    ]
    group2 = [  # both fail every test: zero variance, the shorter one gets +0.015
        ("def is_upper(s):\n  return s\n```", -0.10 + 0.015),
        ("def is_upper(string):\n  return string.lower()\n```", -0.10 - 0.015),
    ]
    examples = [rhombus] * len(group1) + [upper] * len(group2)
    texts = [t for t, _ in group1 + group2]
    columns = task.columns(examples)
    scored = score_completions(task.reward, [ex["prompt"] for ex in examples], texts, columns)
    assert scored.failures == 0
    assert scored.rewards == pytest.approx([r for _, r in group1 + group2], abs=1e-9)
    # grade (evaluation): the same per-sample terms, no group terms, correct = every test passed
    graded = task.grade(texts[:2], examples[:2])
    assert [g["reward"] for g in graded] == pytest.approx([1.02, 1.02])
    assert all(g["correct"] for g in graded)
