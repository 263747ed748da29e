"""The verdict comes from a judge process that never runs the program: forged verdicts earn
nothing, calls cross as plain data (values, exceptions, in-place changes, generators), and the
program's own objects stay in its process."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gbmpo.sandbox import Sandbox, run_program
from gbmpo.sandbox.plain_data import NotPlain, TooLarge, make_decoder, make_encoder
from gbmpo.tasks.mbpp import MBPPTask

TESTS = ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]

#: the issue's program: it reads the marker from the harness's frame and writes the verdicts
FORGE_FRAME = """import sys, os
def add(a, b):
    return 0
m = sys._getframe(1).f_locals.get("marker")
if m:
    os.write(3, f"{m} pass 0\\n{m} pass 1\\n{m} done\\n".encode())
    os._exit(0)
"""

#: every callable of every frame that looks like a reporter, fed forged verdicts
FORGE_EMIT = """import sys
def add(a, b):
    return 0
f = sys._getframe()
while f is not None:
    for k, v in list(f.f_locals.items()):
        if callable(v) and k in ("emit", "send", "send_frame", "write", "_send"):
            for text in ("pass 0", "pass 1", "done"):
                for arg in (text, text.encode()):
                    try:
                        v(arg)
                    except BaseException:
                        pass
    f = f.f_back
"""

#: any 32-hex string the garbage collector knows, written as verdicts to every descriptor
FORGE_GC = """import gc, os, re
def add(a, b):  # called by the tests: the judge holds its marker by now
    hexes = {o for o in gc.get_objects() if isinstance(o, str) and re.fullmatch('[0-9a-f]{32}', o)}
    for o in gc.get_objects():
        if isinstance(o, dict):
            hexes |= {v for v in o.values()
                      if isinstance(v, str) and re.fullmatch('[0-9a-f]{32}', v)}
    for m in hexes:
        for fd in range(3, 64):
            try:
                os.write(fd, f"{m} pass 0\\n{m} pass 1\\n{m} done\\n".encode())
            except OSError:
                pass
    return 0
"""

#: the other processes through /proc and ctypes: their memory, their result descriptor
FORGE_PROC = """import ctypes, os, re
def add(a, b):  # called by the tests: the judge holds its marker by now
    found = set()
    libc = ctypes.CDLL(None, use_errno=True)
    for pid in [p for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid()]:
        for name in ('mem', 'environ', 'cmdline'):
            try:
                with open(f'/proc/{pid}/{name}', 'rb') as fh:
                    found |= set(re.findall(rb'[0-9a-f]{32}', fh.read(1 << 20)))
            except OSError:
                pass
        buf = ctypes.create_string_buffer(4096)
        local = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 4096)
        remote = (ctypes.c_void_p * 2)(0x400000, 4096)
        libc.process_vm_readv(int(pid), local, 1, remote, 1, 0)
        for fd in range(3, 16):
            try:
                with open(f'/proc/{pid}/fd/{fd}', 'wb') as fh:
                    for m in found or {b'0' * 32}:
                        fh.write(m + b' pass 0\\n' + m + b' pass 1\\n' + m + b' done\\n')
            except OSError:
                pass
    os._exit(0)
"""

FORGERIES = {"frame": FORGE_FRAME, "emit": FORGE_EMIT, "gc": FORGE_GC, "proc-ctypes": FORGE_PROC}


@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_forged_verdicts_earn_nothing(sandbox: Sandbox, name: str) -> None:
    r = sandbox.run(FORGERIES[name], TESTS)
    assert r.passed == 0 and r.status != "ok", (name, r)
    assert sandbox.run("def add(a, b):\n    return a + b\n", TESTS).status == "ok"


def test_the_issue_program_earns_nothing_through_run_program(sandbox: Sandbox) -> None:
    r = run_program(FORGE_FRAME, TESTS, timeout_s=5.0)  # the process-wide default sandbox
    assert (r.passed, r.pass_fraction, r.all_passed) == (0, 0.0, False), r


@pytest.mark.parametrize("kind", ["pass_fraction", "all_pass", "shaped"])
def test_the_issue_program_earns_nothing_through_the_mbpp_training_reward(
    sandbox: Sandbox, kind: str  # the fixture: skip where no full sandbox can start
) -> None:
    task = MBPPTask(reward=kind)  # the reward `gbmpo train --task mbpp` calls (Trainer)
    # base template: the prompt ends with an opening fence that the completion continues
    honest = "def add(a, b):\n    return a + b\n```"
    forged = f"{FORGE_FRAME}```"
    got = task.reward(["p", "p"], [forged, honest], tests=[TESTS, TESTS],
                      entry_point=["add", "add"])
    assert got[0] is not None and got[0] <= 0.0, got
    assert got[1] is not None and got[1] >= 1.0, got


def test_calls_cross_as_plain_data(sandbox: Sandbox) -> None:
    code = (
        "def kinds():\n    return (1, [2], True, None, 1.5, -0.0, float('nan'), {3}, b'x', 2j)\n"
        "def boom(x):\n    raise KeyError(x)\n"
        "class Oops(Exception):\n    pass\n"
        "def oops():\n    raise Oops('mine')\n"
        "def push(xs, d=None):\n    xs.append(len(xs))\n    if d is not None:\n"
        "        d['n'] = 1\n"
        "def gen(n):\n    yield from range(n)\n"
        "def apply(f, x):\n    return f(x)\n"
        "def twice(x):\n    return 2 * x\n"
        "def adder(k):\n    return lambda x: x + k\n"
        "TABLE = {'a': (1, 2)}\n"
    )
    tests = [
        "t = kinds()\nassert type(t) is tuple and type(t[1]) is list and t[2] is True\n"
        "assert t[3] is None and math.copysign(1, t[5]) < 0 and math.isnan(t[6])\n"
        "assert t[7] == {3} and t[8] == b'x' and t[9] == 2j",
        "try:\n    boom('k')\nexcept KeyError:\n    pass\nelse:\n    raise AssertionError",
        "try:\n    oops()\nexcept Exception as e:\n    assert 'mine' in str(e)",
        "xs, d = [], {}\npush(xs, d=d)\npush(xs)\nassert xs == [0, 1] and d == {'n': 1}",
        "g = gen(3)\nassert next(g) == 0 and list(g) == [1, 2]",
        "assert apply(twice, 4) == 8 and apply(abs, -3) == 3",
        "assert adder(2)(3) == 5",
        "assert TABLE == {'a': (1, 2)}",
    ]
    r = sandbox.run("import math\n" + code, tests)
    assert r.status == "ok", r


def test_humaneval_helpers_come_from_the_trusted_prompt(sandbox: Sandbox) -> None:
    prompt = ("def shift(s):\n    return ''.join(chr(ord(c) + 1) for c in s)\n\n"
              "def unshift(s):\n    \"\"\"Undo shift.\"\"\"\n")
    # The completion redefines the helper the test relies on: the judge keeps the prompt's.
    code = prompt + "    return s\n\ndef shift(s):\n    return s\n"
    test = "def check(candidate):\n    assert candidate(shift('abc')) == 'abc'\ncheck(unshift)\n"
    r = sandbox.run(code, [test], keep=["unshift"], prelude=prompt)
    assert r.passed == 0, r
    honest = prompt + "    return ''.join(chr(ord(c) - 1) for c in s)\n"
    assert sandbox.run(honest, [test], keep=["unshift"], prelude=prompt).status == "ok"


def test_exits_and_timeouts_inside_a_call_keep_their_statuses(sandbox: Sandbox) -> None:
    r = sandbox.run("import os\ndef add(a, b):\n    os._exit(0)\n", TESTS)
    assert (r.status, r.passed, r.exit_code) == ("error", 0, 0), r
    r = sandbox.run("def add(a, b):\n    while a:\n        pass\n    return 4\n",
                    ["assert add(0, 4) == 4", "assert add(1, 2) == 3"], timeout_s=1.0)
    assert (r.status, r.test_passed) == ("timeout", (True, False)), r
    r = sandbox.run("import ctypes\ndef add(a, b):\n    ctypes.string_at(0)\n", TESTS)
    assert (r.status, r.passed) == ("killed", 0), r


def test_oversized_and_malformed_answers_fail(sandbox: Sandbox) -> None:
    r = sandbox.run("def big():\n    return 'x' * (40 << 20)\n", ["assert len(big()) > 0"],
                    memory_mb=1024)
    assert r.passed == 0, r
    r = sandbox.run("import itertools\ndef count():\n    return itertools.count()\n",
                    ["try:\n    count()\nexcept BaseException:\n    pass"])
    assert r.passed == 0, r


# ------------------------------------------------------------------------------ the encoding

_plain = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text()
    | st.binary(),
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner)
    | st.dictionaries(st.integers() | st.text(), inner, max_size=4)
    | st.frozensets(st.integers() | st.text(), max_size=4),
    max_leaves=20,
)


def _same(a: object, b: object) -> bool:
    """Equal with the same types all the way down (nan equal to nan, -0.0 apart from 0.0)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and str(a) == str(b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return a == b


@settings(max_examples=200, deadline=None)
@given(_plain)
def test_encoding_round_trips_types_exactly(value: object) -> None:
    loads = make_decoder(lambda n: n, lambda s: s)
    assert _same(loads(make_encoder()(value)), value)


def test_encoding_refuses_what_is_not_plain_and_malformed_text() -> None:
    dumps, loads = make_encoder(max_bytes=100), make_decoder(lambda n: n, lambda s: s)
    with pytest.raises(NotPlain):
        dumps(object())
    with pytest.raises(TooLarge):
        dumps("x" * 200)
    for bad in (b'{"t": 1}', b'{"x": []}', b'{"t": [], "s": []}', b'{"s": [[1]]}',
                b'{"std": ["os", "system"]}', b'{"std": ["antigravity", ""]}', b"[",
                b'{"m": ["a", 0, "b", 0, 1, 0, 1]}'):
        with pytest.raises(NotPlain):
            loads(bad)
    assert loads(b'{"std": ["builtins", "len"]}') is len


def test_unjudged_tests_earn_nothing_and_are_counted_by_the_task(sandbox: Sandbox) -> None:
    task = MBPPTask(reward="shaped")
    code = ("class P:\n    def __init__(self, x):\n        self.x = x\n"
            "    def __eq__(self, o):\n        return True\n"
            "def mk(x):\n    return P(x)\n```")
    failing = "def mk(x):\n    return 0\n```"
    tests = ["assert mk(1) == P(1)", "assert mk(2) == P(2)"]
    got = task.reward(["p", "q"], [code, failing], tests=[tests, tests], entry_point=["mk", "mk"])
    assert task.unjudged_tests == 2
    # no better than a failing program (both: no test passed; 1e-9: float sums of equal terms)
    assert got[0] is not None and got[1] is not None and got[0] <= 0.0 and got[0] <= got[1] + 1e-9
    graded = task.grade([code], [{"tests": tests, "entry_point": "mk", "setup": ""}])
    assert (graded[0]["unjudged"], graded[0]["passed"], graded[0]["correct"]) == (2, 0, False)
