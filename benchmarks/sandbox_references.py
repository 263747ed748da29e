"""Reference solutions through the code sandbox: how many pass, fail and cannot be judged.

Runs every MBPP reference solution (the full set, 974 problems, and the sanitized set, 427) and
HumanEval's 164 canonical solutions with the tasks' own graders, and prints, per set, the count
that pass every test, the failing task ids with their details, and the count of runs with a test
that needs the program's own objects (``unjudged``). Too slow for the quick test suite (about a
minute on 2 busy cores); run once after a change to the sandbox and compare with the numbers in
``docs/sandbox.md``.

    python benchmarks/sandbox_references.py [--sets mbpp,mbpp_sanitized,humaneval]
"""

from __future__ import annotations

import argparse
import json
import time

from gbmpo.tasks.humaneval import HumanEvalTask
from gbmpo.tasks.mbpp import MBPPSanitizedTask, MBPPTask

SETS = {"mbpp": MBPPTask, "mbpp_sanitized": MBPPSanitizedTask, "humaneval": HumanEvalTask}


def examples_of(task: object) -> list[dict]:
    if isinstance(task, HumanEvalTask):
        return task.split("test")
    return [ex for s in ("prompt", "test", "validation", "train") for ex in task.split(s)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", default=",".join(SETS))
    ap.add_argument("--timeout", type=float, default=60.0,
                    help="per program (task 123's reference needs seconds on a loaded machine)")
    args = ap.parse_args()
    summary = {}
    for name in args.sets.split(","):
        task = SETS[name](timeout_s=args.timeout)
        exs = examples_of(task)
        t0 = time.perf_counter()
        graded = task.grade([ex["answer"] for ex in exs], exs)
        dt = time.perf_counter() - t0
        failing = [(ex["task_id"], g["status"], g["detail"])
                   for ex, g in zip(exs, graded, strict=True) if not g["correct"]]
        unjudged = [ex["task_id"] for ex, g in zip(exs, graded, strict=True)
                    if g.get("unjudged")]
        summary[name] = {"problems": len(exs), "passed": len(exs) - len(failing),
                         "failing": failing, "unjudged": unjudged, "seconds": round(dt, 1)}
        print(f"{name}: {len(exs) - len(failing)}/{len(exs)} pass; failing {failing}; "
              f"unjudged {unjudged} ({dt:.1f} s)", flush=True)
    print(json.dumps({k: (v["passed"], v["problems"], len(v["unjudged"]))
                      for k, v in summary.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
