"""Reward-hacking defences of the code sandbox: the tests run in a judge process that never loads
the program, and compare with type-strict rules.

Each hack below would earn full credit if the tests ran beside the program under Python's own
``==``; here it earns nothing, with the strict comparisons (the default) and without them
(``strict_compare=False``): the judge receives plain data or handles, never the program's objects.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gbmpo.sandbox import Sandbox, SandboxError, SandboxUnavailableError

ADD = "def add(a, b):\n    return a + b\n"

ALWAYS_EQUAL = (
    "class E:\n"
    "    def __eq__(self, other):\n        return True\n"
    "    def __ne__(self, other):\n        return False\n"
    "    __hash__ = None\n"
    "def add(a, b):\n    return E()\n"
)

# (program, tests) pairs that pass every test with Python's ==, and must pass none strictly
HACKS = {
    "always-equal": (ALWAYS_EQUAL, ["assert add(1, 2) == 3", "assert 3 == add(1, 2)",
                                    "assert add(1, 2) in [3]", "assert not add(1, 2) != 3"]),
    "always-equal-in-check": (
        ALWAYS_EQUAL,
        ["def check(candidate):\n    assert candidate(1, 2) == 3\n"
         "    assert candidate(2, 2) == 4\ncheck(add)"]),
    "int-subclass": ("class I(int):\n    def __eq__(self, o):\n        return True\n"
                     "    __hash__ = int.__hash__\n"
                     "def add(a, b):\n    return I(0)\n", ["assert add(1, 2) == 3"]),
    "str-subclass": ("class S(str):\n    def __eq__(self, o):\n        return True\n"
                     "    __hash__ = str.__hash__\n"
                     "def add(a, b):\n    return S('?')\n", ["assert add('a', 'b') == 'ab'"]),
    "bool-for-int": ("def add(a, b):\n    return True\n", ["assert add(0, 1) == 1"]),
    "int-for-bool": ("def is_even(n):\n    return 1\n", ["assert is_even(2) == True"]),
    "always-truthy": ("class T:\n    def __bool__(self):\n        return True\n"
                      "def is_prime(n):\n    return T()\n", ["assert is_prime(7)"]),
    "always-less": ("class L:\n    def __lt__(self, o):\n        return True\n"
                    "    def __sub__(self, o):\n        return self\n"
                    "    def __abs__(self):\n        return self\n"
                    "def add(a, b):\n    return L()\n", ["assert abs(add(1, 2) - 3) < 1e-9"]),
    "contains-everything": ("class C:\n    def __contains__(self, x):\n        return True\n"
                            "def evens(n):\n    return C()\n",
                            ["assert 4 in evens(5)", "assert 3 in evens(3)"]),
    "equal-key-dict": ("class K(str):\n    def __eq__(self, o):\n        return True\n"
                       "    def __hash__(self):\n        return hash('a')\n"
                       "def f():\n    return {K('z'): 1}\n", ["assert f() == {'a': 1}"]),
    "patch-builtins-at-call": (
        "import builtins\n"
        "def add(a, b):\n    builtins.abs = lambda x: 0\n"
        "    globals()['__builtins__'] = {'abs': lambda x: 0}\n    return a - b\n",
        ["x = add(1, 2)\nassert abs(x - 3) < 1e-9", "assert abs(add(2, 2) - 4) < 1e-9"]),
    "patch-math-at-call": (
        "import math\ndef add(a, b):\n    math.isclose = lambda *a, **k: True\n    return a - b\n",
        ["x = add(1, 2)\nimport math\nassert math.isclose(x, 3)",
         "y = add(2, 2)\nimport math\nassert math.isclose(y, 4)"]),
}

#: hacks that Python's == lets through on plain data (bool and int equal by coercion)
COERCIONS = ("bool-for-int", "int-for-bool")


@pytest.fixture(scope="module")
def lax() -> Iterator[Sandbox]:
    """Python's own == (to show that each hack works without the defence)."""
    try:
        box = Sandbox(workers=1, strict=True, strict_compare=False)
    except (SandboxUnavailableError, SandboxError) as exc:
        pytest.skip(f"full sandbox unavailable here: {exc}")
    yield box
    box.close()


@pytest.mark.parametrize("name", sorted(HACKS))
def test_hack_earns_nothing_with_or_without_strict_comparisons(
    sandbox: Sandbox, lax: Sandbox, name: str
) -> None:
    code, tests = HACKS[name]
    # True == 1 is Python's own rule: only the strict comparisons refuse it
    assert lax.run(code, tests).passed == (len(tests) if name in COERCIONS else 0), name
    r = sandbox.run(code, tests)
    assert r.passed == 0 and r.status == "failed", (name, r)


HONEST = {
    "numbers": (ADD, ["assert add(1, 2) == 3", "assert add(0.5, 1) == 1.5",
                      "assert add(1, 1) == 2.0", "assert add(1, 2) != 4",
                      "assert abs(add(0.1, 0.2) - 0.3) < 1e-9", "assert 0 <= add(1, 2) < 10"]),
    "containers": ("def f(n):\n    return [(i, str(i)) for i in range(n)]\n",
                   ["assert f(2) == [(0, '0'), (1, '1')]", "assert (1, '1') in f(3)",
                    "assert (5, '5') not in f(3)", "assert f(0) == []", "assert not f(0)",
                    "assert sorted(f(2)) == f(2)", "assert f(2) < f(3)",
                    "assert {x for x, _ in f(2)} <= {0, 1, 2}"]),
    "dates": ("import datetime\ndef day(n):\n    return datetime.date(2024, 1, n)\n",
              ["assert day(2) > day(1)", "assert day(1) == datetime.date(2024, 1, 1)"]),
    "dict-like": ("from collections import Counter, OrderedDict, defaultdict\n"
                  "def count(s):\n    return Counter(s)\n"
                  "def od():\n    return OrderedDict(a=1)\n"
                  "def dd():\n    d = defaultdict(list)\n    d['k'].append(1)\n    return d\n",
                  ["assert count('aab') == {'a': 2, 'b': 1}", "assert od() == {'a': 1}",
                   "assert dd() == {'k': [1]}", "assert 'a' in count('ab')"]),
    "sets-and-strings": ("def s(x):\n    return set(x)\ndef up(t):\n    return t.upper()\n",
                         ["assert s('aba') == {'a', 'b'}", "assert s('ab') == frozenset('ba')",
                          "assert up('ab') == 'AB'", "assert 'B' in up('ab')"]),
    "bools-and-none": ("def is_even(n):\n    return n % 2 == 0\ndef nothing():\n    return None\n",
                       ["assert is_even(2) == True", "assert is_even(3) is False",
                        "assert is_even(4)", "assert not is_even(5)",
                        "assert nothing() == None", "assert nothing() is None"]),
    "regex-match": ("import re\ndef starts(t):\n    return re.match('a', t)\n",
                    ["assert starts('ab')", "assert not starts('ba')"]),
    "own-class-through-calls": (  # the program's objects stay in its process (handles)
        "class Node:\n    def __init__(self, v):\n        self.v, self.left = v, None\n"
        "    def depth(self):\n        return 1 + (self.left.depth() if self.left else 0)\n"
        "def depth(n):\n    return n.depth()\n",
        ["root = Node(1)\nroot.left = Node(2)\nassert depth(root) == 2",
         "r = Node(3)\nassert r.v == 3 and r.depth() == 1 and r.left is None"]),
}


@pytest.mark.parametrize("name", sorted(HONEST))
def test_honest_programs_keep_full_credit(sandbox: Sandbox, name: str) -> None:
    code, tests = HONEST[name]
    r = sandbox.run(code, tests)
    assert r.status == "ok" and r.passed == len(tests), (name, r)


def test_comparing_the_programs_own_objects_is_unjudged(sandbox: Sandbox) -> None:
    code = ("class P:\n    def __init__(self, x):\n        self.x = x\n"
            "    def __eq__(self, o):\n        return isinstance(o, P) and o.x == self.x\n"
            "    def __len__(self):\n        return 1\n"
            "def mk(x):\n    return P(x)\n")
    r = sandbox.run(code, ["assert mk(1) == P(1)", "assert mk(1) != P(2)", "assert len(mk(1))",
                           "assert mk(1).x == 1"])
    assert (r.status, r.test_passed, r.unjudged) == ("failed", (False,) * 3 + (True,), 3), r
    assert "unjudged" in r.detail
    # a task whose setup needs them: every test is unjudged
    r = sandbox.run(code, ["assert mk(1).x == 1"], setup="p = P(1)\nassert p == p\nbool(p)")
    assert (r.status, r.passed, r.unjudged) == ("failed", 0, 1), r


def test_python_semantics_where_strictness_is_not_needed(sandbox: Sandbox) -> None:
    # nan is unequal to itself but a list holding the same nan object equals itself (identity)
    code = "nan = float('nan')\ndef f():\n    return [nan]\n"
    r = sandbox.run(code, ["x = f()\nassert x == x", "assert float('nan') != float('nan')",
                           "assert f() != [float('nan')]"])
    assert r.test_passed == (True, True, True), r
    # a syntax error in one test fails that test only
    r = sandbox.run(ADD, ["assert add(1, 2) == 3", "assert ((", "assert add(2, 2) == 4"])
    assert r.test_passed == (True, False, True), r
