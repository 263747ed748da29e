"""Code rewards: program extraction, TRL-style reward functions on small programs."""

from __future__ import annotations

import pytest

from gbmpo.rewards import REWARDS, build_program, extract_code, make_code_reward
from gbmpo.rewards.code import HUMANEVAL_STOP, truncate_at_stop
from gbmpo.sandbox import Sandbox


def test_extract_code_from_fences() -> None:
    text = "Here:\n```python\ndef f(x):\n    return x\n```\nUsage:\n```python\nprint(f(1))\n```"
    assert extract_code(text) == "def f(x):\n    return x\n"
    two = "```python\ndef g():\n    pass\n```\n```python\ndef f():\n    return 1\n```"
    assert extract_code(two, entry_point="f") == "def f():\n    return 1\n"
    assert extract_code("```\ndef h():\n    pass\n```") == "def h():\n    pass\n"
    assert extract_code("```js\nlet x\n```\n```py\nx = 1\n```") == "x = 1\n"


def test_extract_code_without_complete_fences() -> None:
    # A base model continuing a prompt that opened the fence: stop at the closing fence.
    assert extract_code("def f():\n    return 1\n```\nText after") == "def f():\n    return 1\n"
    # A truncated reply with an unclosed opening fence.
    assert extract_code("```python\ndef f():\n    return") == "def f():\n    return"
    assert extract_code("    return x + 1\n") == "    return x + 1\n"
    thought = "<think>```python\nbad\n```</think>```python\ngood = 1\n```"
    assert extract_code(thought) == "good = 1\n"


def test_build_program_with_a_prefix() -> None:
    prefix = 'from typing import List\n\ndef inc(x: int) -> int:\n    """Add one."""\n'
    body = "    return x + 1\n"
    assert build_program(body, prefix, "inc") == prefix + body
    full = "```python\ndef inc(x):\n    return x + 1\n```"
    assert build_program(full, prefix, "inc") == prefix + "\n" + "def inc(x):\n    return x + 1\n"


def test_truncate_at_stop() -> None:
    c = "    return 1\n\ndef other():\n    pass\nprint(3)"
    assert truncate_at_stop(c, HUMANEVAL_STOP) == "    return 1\n"
    assert truncate_at_stop("    return 2", HUMANEVAL_STOP) == "    return 2"


def test_pass_fraction_and_all_pass(sandbox: Sandbox) -> None:
    frac = make_code_reward("pass_fraction", sandbox=sandbox)
    allp = make_code_reward("all_pass", sandbox=sandbox)
    tests = [["assert f(1) == 2", "assert f(2) == 3", "assert f(3) == 5"]] * 3
    comps = [
        "```python\ndef f(x):\n    return x + 1\n```",  # 2 of 3
        "def f(x):\n    return {1: 2, 2: 3, 3: 5}[x]\n",  # 3 of 3
        "def f(x):\n    raise SystemExit(0)\n",  # 0
    ]
    got = frac(prompts=["p"] * 3, completions=comps, tests=tests)
    assert got == pytest.approx([2 / 3, 1.0, 0.0])
    assert allp(prompts=["p"] * 3, completions=comps, tests=tests) == [0.0, 1.0, 0.0]
    conv = [[{"role": "assistant", "content": comps[1]}]]
    assert allp(prompts=["p"], completions=conv, tests=tests[:1]) == [1.0]


def test_columns_setup_prefix_entry_point(sandbox: Sandbox) -> None:
    frac = make_code_reward("pass_fraction", sandbox=sandbox)
    got = frac(
        prompts=["p", "p"],
        completions=["    return a * b\n", "def sum(a, b):\n    return a * b\n"],
        tests=[["check(mul)"], ["assert sum(2, 3) == 6"]],
        setup=["def check(f):\n    assert f(2, 3) == 6\n", None],
        prefix=["def mul(a, b):\n", None],
        entry_point=["mul", "sum"],
    )
    assert got == [1.0, 1.0]


def test_bad_columns() -> None:
    frac = REWARDS.get("code_pass_fraction")
    with pytest.raises(ValueError, match="tests"):
        frac(prompts=["p"], completions=["x"], tests=[])
    with pytest.raises(TypeError, match="list of test"):
        frac(prompts=["p"], completions=["x"], tests=["assert True"])
    with pytest.raises(ValueError, match="kind"):
        make_code_reward("sometimes")
    assert REWARDS.get("code_all_pass").__name__ == "code_all_pass"


def test_extraction_is_linear_on_pathological_text() -> None:
    # Thousands of unclosed fences / think tags / boxes must not take quadratic time.
    for text in ("```python\n" * 20000, "<think>" * 50000, "\n" * 200000 + "def f(", "```" * 30001):
        assert isinstance(extract_code(text, "f"), str)
