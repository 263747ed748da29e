"""The order and grouping ``make test`` (pytest-xdist, ``tests/conftest.py``) gives the suite:
``xdist_schedule``'s pure functions, its duration table against the suite, and a real 2-worker
run of a small suite with the suite's conftest."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import xdist_schedule as xs

ROOT = Path(__file__).resolve().parents[1]

SOURCE = '''
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.ray]


@pytest.mark.exclusive  # a time limit
@pytest.mark.parametrize("x", [1, 2])
def test_alone(x):
    pass


def test_plain():
    pass


@pytest.mark.exclusive
class TestAlone:
    def test_a(self):
        pass


class TestMixed:
    @pytest.mark.exclusive()
    def test_b(self):
        pass

    def test_c(self):
        pass
'''


def test_marks_are_read_from_decorators_classes_and_pytestmark() -> None:
    marks = xs.marks_by_name(SOURCE)
    assert marks == {"": {"ray"}, "test_alone": {"exclusive"}, "TestAlone": {"exclusive"},
                     "TestMixed::test_b": {"exclusive"}}  # fmt: skip
    f = "t.py::"
    assert xs.marks_of(f + "test_alone[1]", marks) == {"ray", "exclusive"}
    assert xs.marks_of(f + "test_plain", marks) == {"ray"}
    assert xs.marks_of(f + "TestAlone::test_a", marks) == {"ray", "exclusive"}
    assert xs.marks_of(f + "TestMixed::test_c", marks) == {"ray"}
    assert xs.marks_by_name("def test_x():\n    pass\n") == {}


def _group(files: dict[str, str]) -> dict[str, list[str]]:
    ids = [f"{path}::{name}" for path, text in files.items()
           for name in re.findall(r"^def (test_\w+)", text, re.M)]  # fmt: skip
    return xs.group(ids, files.get)


def test_units_exclusive_together_ray_together_shared_files_together() -> None:
    plain = "def test_1():\n    pass\n\ndef test_2():\n    pass\n"
    shared = ("import pytest\n\n@pytest.fixture(scope='module')\ndef run():\n    return 1\n\n"
              "def test_3(run):\n    pass\n\n@pytest.mark.ray\ndef test_4(run):\n    pass\n")
    shared_plain = shared.replace("@pytest.mark.ray\n", "")
    lone = "import pytest\n\n@pytest.mark.exclusive\ndef test_5():\n    pass\n\ndef test_6():\n" \
           "    pass\n"  # fmt: skip
    units = _group({"a.py": plain, "b.py": shared, "c.py": lone, "d.py": shared_plain})
    assert units == {
        "a.py::test_1": ["a.py::test_1"],
        "a.py::test_2": ["a.py::test_2"],
        xs.RAY_UNIT: ["b.py::test_3", "b.py::test_4"],  # the file joins its ray test's unit
        xs.EXCLUSIVE_UNIT: ["c.py::test_5"],
        "c.py::test_6": ["c.py::test_6"],
        "d.py": ["d.py::test_3", "d.py::test_4"],
    }


def test_order_longest_first_exclusive_last(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(xs, "KNOWN_SECONDS", {"long.py": 100.0, "mid.py::test_m": 10.0,
                                              "mid.py::test_p": 7.0})  # fmt: skip
    units = {
        xs.EXCLUSIVE_UNIT: ["e.py::test_e"],
        **{f"s.py::test_{i}": [f"s.py::test_{i}"] for i in range(3)},
        "mid.py::test_m": ["mid.py::test_m"],
        "long.py": ["long.py::test_a", "long.py::test_b"],
        xs.RAY_UNIT: ["mid.py::test_p[1]", "mid.py::test_p[2]", "r.py::test_r"],
    }
    assert xs.estimate(xs.RAY_UNIT, units[xs.RAY_UNIT]) == 7.0 + 7.0 + xs.DEFAULT_SECONDS
    assert xs.estimate("long.py", units["long.py"]) == 100.0  # a file's entry: all its tests
    assert xs.order_units(units) == [
        "long.py", xs.RAY_UNIT, "mid.py::test_m",  # 100, 14.5, 10
        "s.py::test_0", "s.py::test_1", "s.py::test_2",  # the default: collection order
        xs.EXCLUSIVE_UNIT,
    ]  # fmt: skip
    assert xs.order_units({"x.py::test_1": ["x.py::test_1"]}) == ["x.py::test_1"]


def test_every_known_duration_names_a_test_of_the_suite() -> None:
    for key in xs.KNOWN_SECONDS:
        path, _, name = key.partition("::")
        source = (ROOT / path).read_text(encoding="utf-8")
        assert path.startswith("tests/") and "[" not in key, key
        if name:
            assert re.search(rf"^def {re.escape(name)}\(", source, re.M), key
        else:
            assert xs.SHARED_FIXTURE.search(source), f"{key}: a file entry needs a shared fixture"


def test_grouped_marks_agree_with_pytests_own(request: pytest.FixtureRequest) -> None:
    """For every test of this session (the whole suite under ``make test``), the markers the
    scheduler reads from the source are the ones pytest gives the test."""
    sources: dict[str, dict[str, set[str]]] = {}
    checked = 0
    for item in request.session.items:
        path = item.nodeid.split("::", 1)[0]
        if path not in sources:
            sources[path] = xs.marks_by_name((ROOT / path).read_text(encoding="utf-8"))
        ours = xs.marks_of(item.nodeid, sources[path])
        theirs = {m for m in xs.GROUPED_MARKS if item.get_closest_marker(m) is not None}
        assert ours == theirs, item.nodeid
        checked += 1
    assert checked >= 1
    # and the suite's known ones, whatever this session collected
    models = xs.marks_by_name((ROOT / "tests/test_models.py").read_text(encoding="utf-8"))
    assert models.get("test_hung_hub_probe_is_bounded") == {"exclusive"}
    verl = xs.marks_by_name((ROOT / "tests/engines/test_verl_cpu_train.py").read_text())
    assert verl.get("") == {"ray"}


_PROBE = '''
import json, os, time
from pathlib import Path
import pytest


def _record(name, seconds):
    start = time.monotonic()
    time.sleep(seconds)
    line = {"name": name, "worker": os.environ["PYTEST_XDIST_WORKER"], "start": start,
            "end": time.monotonic()}
    with open(os.environ["SCHEDULE_LOG"], "a") as f:
        f.write(json.dumps(line) + "\\n")
'''


@pytest.mark.skipif(not shutil.which("true"), reason="needs a POSIX system")
def test_two_workers_run_the_units_as_scheduled(tmp_path: Path) -> None:
    """A small suite under ``pytest -n 2`` with this suite's conftest: the exclusive tests run
    last and alone, the ray tests on one worker one after the other, a shared-fixture file on
    one worker, every test once."""
    suite = tmp_path / "tests"
    suite.mkdir()
    for name in ("conftest.py", "xdist_schedule.py"):
        shutil.copy(ROOT / "tests" / name, suite / name)
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\naddopts = -q --strict-markers\n"
        "markers =\n    ray: r\n    exclusive: e\n    slow: s\n")  # fmt: skip
    (suite / "test_short.py").write_text(_PROBE + "".join(
        f"\ndef test_s{i}():\n    _record('s{i}', 0.05)\n" for i in range(30)))  # fmt: skip
    (suite / "test_alone.py").write_text(_PROBE + "".join(
        f"\n@pytest.mark.exclusive\ndef test_e{i}():\n    _record('e{i}', 0.3)\n"
        for i in range(3)))  # fmt: skip
    (suite / "test_ray.py").write_text(_PROBE + "".join(
        f"\n@pytest.mark.ray\ndef test_r{i}():\n    _record('r{i}', 0.3)\n" for i in range(3)))
    (suite / "test_shared.py").write_text(_PROBE + (
        "\n@pytest.fixture(scope='module')\ndef built():\n    return 1\n") + "".join(
        f"\ndef test_m{i}(built):\n    _record('m{i}', 0.1)\n" for i in range(4)))  # fmt: skip
    log = tmp_path / "schedule.jsonl"
    env = {**os.environ, "SCHEDULE_LOG": str(log)}
    env.pop("PYTEST_ADDOPTS", None)
    env.pop("PYTEST_XDIST_WORKER", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-p", "no:cacheprovider",
                           f"--basetemp={tmp_path / 'basetemp'}", str(suite)],
                          cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = [json.loads(line) for line in log.read_text().splitlines()]
    assert sorted(r["name"] for r in runs) == sorted(
        [f"s{i}" for i in range(30)] + [f"e{i}" for i in range(3)] + [f"r{i}" for i in range(3)]
        + [f"m{i}" for i in range(4)])  # fmt: skip
    by = {r["name"]: r for r in runs}
    for e in (r for r in runs if r["name"].startswith("e")):  # alone: overlaps no other test
        assert not [o["name"] for o in runs if o is not e and o["start"] < e["end"]
                    and e["start"] < o["end"]], e  # fmt: skip
    # exclusive last: after the longer units (ray, shared file) and most short tests
    first_e = min(by[f"e{i}"]["start"] for i in range(3))
    assert all(r["end"] < first_e for r in runs if r["name"][0] in "rm"), runs
    assert sum(r["start"] > first_e for r in runs if r["name"][0] == "s") <= 4, runs
    assert len({by[f"r{i}"]["worker"] for i in range(3)}) == 1
    assert len({by[f"m{i}"]["worker"] for i in range(4)}) == 1
    assert len({r["worker"] for r in runs}) == 2
