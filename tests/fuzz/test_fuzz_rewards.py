"""Fuzzed reward specs and reward functions.

* Specs (``module:function``, ``file.py:function``, names) that do not import, raise at import
  (``SystemExit`` included), name no attribute or something not callable: ``gbmpo train
  --dry-run`` exits 2 with one line naming the spec.
* Functions that raise for some or all completions, return non-numbers, ``None``, NaN, inf,
  huge integers, the wrong number of values or no list at all: scoring either gives one finite
  reward per completion with every failure counted (nothing lost: ``rewards`` has one entry per
  completion and ``failures`` counts exactly the unusable ones), or raises
  :class:`RewardError` naming the function; ``gbmpo eval`` with such a function exits 0 or 2.
"""

from __future__ import annotations

import contextlib
import json
import math
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
from fuzzlib import FUZZ, check_cli, sized
from hypothesis import example, given
from hypothesis import strategies as st

from gbmpo.rewards.scoring import RewardError, score_completions

pytestmark = pytest.mark.filterwarnings("ignore")

_MODULE_BODIES = st.sampled_from([
    "def score(prompts, completions, **kw):\n    return [1.0] * len(completions)\n",
    "def score(\n",  # syntax error
    "raise RuntimeError('broken at import')\n",
    "raise SystemExit(3)\n",
    "import gbmpo_fuzz_no_such_module\n",
    "score = 5\n",
    "",
    "def other(prompts, completions, **kw):\n    return []\n",
    "import sys\nsys.setrecursionlimit(10**6)\ndef score(*a, **k):\n    return []\n"
    "sys.setrecursionlimit(1000)\n",
    "class score:\n    pass\n",
])

_SPECS = st.one_of(
    st.sampled_from(["", " ", ":", "::", "a:", ":b", "os:path", "os:getcwd.x", "math:pi",
                     "gbmpo_fuzz_no_such_module:f", "nope", "exact", "math", "code",
                     "json:loads", "/nonexistent/r.py:f", "r.py", "1:2:3", "math:inf"]),
    st.text(max_size=20),
    st.tuples(st.text(max_size=8), st.text(max_size=8)).map(":".join),
)


def _dry_run(tmp: Path, capsys: pytest.CaptureFixture[str], spec: str) -> tuple[int, str]:
    data = tmp / "d.jsonl"
    data.write_text("".join(f'{{"prompt": "q{i}", "answer": "{i}"}}\n' for i in range(4)))
    return check_cli(
        ["train", "--dry-run", "--task.name", "jsonl", "--task.params.path", str(data),
         f"--task.params.reward={spec}", "--output-dir", str(tmp / "run")], capsys, "train")


@FUZZ
@given(spec=_SPECS)
@example(spec="os:getcwd.x")
@example(spec="math:pi")
@example(spec="/nonexistent/r.py:f")
@example(spec="1:2:3")  # YAML 1.1 read it as the number 3723
@example(spec="00")  # and this as the octal number 0
@example(spec="#")  # and this as a comment (None)
def test_reward_specs(tmp_path_factory: pytest.TempPathFactory,
                      capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                      spec: str) -> None:
    tmp = tmp_path_factory.mktemp("spec")
    monkeypatch.chdir(tmp)
    code, err = _dry_run(tmp, capsys, spec)
    if code == 2:  # the reward parameter is named (its value as read: YAML folds line breaks)
        assert "reward" in err, err


@FUZZ
@given(body=_MODULE_BODIES, attr=st.sampled_from(["score", "other", "nope", "score.x"]))
@example(body="raise SystemExit(3)\n", attr="score")
@example(body="def score(\n", attr="score")
@example(body="score = 5\n", attr="score")
def test_reward_files(tmp_path_factory: pytest.TempPathFactory,
                      capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                      body: str, attr: str) -> None:
    tmp = tmp_path_factory.mktemp("file")
    monkeypatch.chdir(tmp)
    path = tmp / "r.py"
    path.write_text(body)
    code, err = _dry_run(tmp, capsys, f"{path}:{attr}")
    if code == 2:
        assert f"{path}:{attr}" in err, err


_VALUES = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.integers(-(10**400), 10**400),
    st.none(), st.booleans(), st.text(max_size=4), st.just(Fraction(1, 3)),
    st.just(complex(1, 1)), st.lists(st.floats(), max_size=2), st.just(object()),
)


class _Weird:
    """An object whose ``float()`` fails in an unusual way."""

    def __float__(self) -> float:
        raise ZeroDivisionError("no float here")


@st.composite
def behaviours(draw: st.DrawFn) -> tuple[str, Any]:
    n = 5
    kind = draw(st.sampled_from(["values", "values", "raise_some", "raise_all", "length",
                                 "not_a_list"]))
    if kind == "values":
        return kind, draw(st.lists(st.one_of(_VALUES, st.just(_Weird())), min_size=n,
                                   max_size=n))
    if kind == "raise_some":
        return kind, draw(st.sets(st.integers(0, n - 1), max_size=n))
    if kind == "length":
        return kind, draw(st.integers(0, 2 * n).filter(lambda k: k != n))
    if kind == "not_a_list":
        return kind, draw(st.sampled_from([None, "11111", 3.0, b"xxxxx", iter([1.0] * n),
                                           {"a": 1.0}]))
    return kind, None


def _function(kind: str, arg: Any) -> Any:
    def score(prompts: list[str], completions: list[str], answer: list[str], **_: Any) -> Any:
        if kind == "values":
            return [arg[int(a)] for a in answer]
        if kind == "raise_all":
            raise KeyError("always")
        if kind == "raise_some":
            if len(completions) > 1 or any(int(a) in arg for a in answer):
                raise ValueError("some")
            return [0.5 for _ in completions]
        if kind == "length":
            return [1.0] * arg
        return arg

    return score


@sized(120, long=20_000)  # no model: cheap
@given(b=behaviours())
@example(b=("values", [10**400, 1.0, 1.0, 1.0, 1.0]))
@example(b=("values", [_Weird(), 1.0, 1.0, 1.0, 1.0]))
@example(b=("values", [math.nan] * 5))
@example(b=("not_a_list", {"a": 1.0}))
def test_reward_functions_lose_nothing(b: tuple[str, Any]) -> None:
    n = 5
    fn = _function(*b)
    prompts = [f"q{i}" for i in range(n)]
    try:
        scored = score_completions(fn, prompts, [f"c{i}" for i in range(n)],
                                   {"answer": [str(i) for i in range(n)]})
    except RewardError as err:
        assert "score" in str(err), err
        return
    assert len(scored.rewards) == n
    assert all(isinstance(r, float) and math.isfinite(r) for r in scored.rewards)
    if b[0] == "values":
        usable = 0
        for v in b[1]:
            with contextlib.suppress(TypeError, ValueError, OverflowError, ZeroDivisionError):
                usable += math.isfinite(float(v)) and not isinstance(v, bool)
        assert scored.failures == n - usable
    assert scored.failures == 0 or scored.failure_kinds


def test_eval_with_a_junk_reward_says_which(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end: a reward returning NaN, inf, text and a huge int for different rows."""
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(f'{{"prompt": "q{i}", "answer": "{i}"}}\n' for i in range(8)))
    rf = tmp_path / "junk.py"
    rf.write_text("def score(prompts, completions, answer, **kw):\n"
                  "    table = [float('nan'), float('inf'), 'x', 10**400, 1.0, None, 0.5, 2]\n"
                  "    return [table[int(a)] for a in answer]\n")
    out = tmp_path / "e.jsonl"
    code, err = check_cli(
        ["eval", "--task", "jsonl", "--task-param", f"path={data}", "--task-param",
         f"reward={rf}:score", "--task-param", f"test_path={data}", "--limit", "8",
         "--max-new-tokens", "2", "--output", str(out)], capsys, "eval")
    assert code == 0, err
    summary = json.loads(out.with_suffix(".summary.json").read_text())
    assert summary["metrics"]["reward_failures"] == 5
    assert summary["metrics"]["reward_failure_kinds"] == ["NaN", "None", "inf",
                                                          "non-numeric str"]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["details"][0]["reward_failure"] for r in records] == [
        "NaN", "inf", "non-numeric str", "inf", None, "None", None, None]
