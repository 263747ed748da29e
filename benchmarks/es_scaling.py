"""ES population scaling: N members on W local workers vs the same N one after another.

Each member is, by default, a real ES fitness evaluation: a short RL run of the embedded tiny
model with that member's neural mirror map (``gbmpo.meta.fitness.TrainingFitness``, T inner
steps, greedy accuracy on a carved validation split). ``--synthetic`` uses a CPU-bound stand-in
(``gbmpo.meta.analytic.BusyFitness``) instead. The output says which.

Both sides use one torch thread per member (the pool pins ``cores // W`` threads per worker, 1
here at W=2), and both are warmed up first (imports, model load, worker start-up), so the times
compare steady-state population evaluations; the pool's cold start is reported separately.
Every measurement is repeated ``--repeats`` times, alternating serial and parallel so load
drift on a shared machine hits both; the minimum of each is used, all are recorded, each with
the members' wall/CPU ratio (about 1 when a member had a core to itself; well above 1 means
other processes took the CPU and that repeat's timing is contaminated).

    efficiency = (serial seconds / parallel seconds) / W

Writes ``benchmarks/results/es_scaling.json``; the last line printed is a one-line summary.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from gbmpo.meta.analytic import BusyFitness
from gbmpo.meta.backends import LocalPoolBackend, SerialBackend, available_cores
from gbmpo.meta.fitness import TrainingFitness, default_inner_config
from gbmpo.objectives.mirror import VECTOR_SIZE, NeuralMirrorMap

RESULTS = Path(__file__).resolve().parent / "results" / "es_scaling.json"


def _population(n: int, sigma: float, seed: int) -> list[np.ndarray]:
    theta0 = NeuralMirrorMap.random(scale=0.01, seed=42).to_unconstrained().numpy()
    rng = np.random.default_rng(seed)
    half = rng.standard_normal((n // 2 + n % 2, VECTOR_SIZE))
    eps = np.concatenate([half, -half])[:n]
    return [theta0 + sigma * e for e in eps]


class _Measured:
    """Wraps a fitness: returns ``(fitness, wall seconds, CPU seconds of the member)``."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, theta: np.ndarray) -> tuple[float, float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        value = self.fn(theta)
        return float(value), time.perf_counter() - t0, time.process_time() - c0


def _timed(backend: Any, fn: Any, thetas: list[np.ndarray]) -> tuple[float, list[Any]]:
    t0 = time.perf_counter()
    out = backend.evaluate(_Measured(fn), thetas)
    elapsed = time.perf_counter() - t0
    bad = [x for x in out if isinstance(x, BaseException)]
    if bad:
        raise RuntimeError(f"{len(bad)} member(s) failed, e.g. {bad[0]!r}") from bad[0]
    return elapsed, out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--members", type=int, default=4, help="population size N")
    p.add_argument("--workers", type=int, default=2, help="pool size W")
    p.add_argument("--steps", type=int, default=4, help="inner RL steps T per member")
    p.add_argument("--validation-size", type=int, default=100)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--synthetic", action="store_true", help="CPU-bound stand-in, no training")
    p.add_argument("--synthetic-seconds", type=float, default=5.0)
    p.add_argument("--output", type=Path, default=RESULTS)
    args = p.parse_args(argv)

    if args.synthetic:
        fitness: Any = BusyFitness(seconds=args.synthetic_seconds)
        kind = f"synthetic CPU-bound fitness (~{args.synthetic_seconds:.0f} s of matmuls/member)"
    else:
        fitness = TrainingFitness(
            train_config=default_inner_config(),
            steps=args.steps,
            validation_size=args.validation_size,
        )
        kind = (
            f"real inner training: tiny model, arithmetic, T={args.steps} RL steps "
            f"(8 prompts x 8 completions), neural_mirror, greedy accuracy on "
            f"{args.validation_size} carved validation problems"
        )
    thetas = _population(args.members, 0.05, seed=0)
    load_before = os.getloadavg()
    print(f"es_scaling: N={args.members} W={args.workers} cores={available_cores()} [{kind}]")
    print(f"load average before: {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}")

    serial = SerialBackend(threads=1)
    t_warm_serial, _ = _timed(serial, fitness, thetas[:1])
    pool = LocalPoolBackend(workers=args.workers)
    serial_times: list[float] = []
    parallel_times: list[float] = []
    serial_members: list[Any] = []
    parallel_members: list[Any] = []
    repeats: list[dict[str, float]] = []
    try:
        t_cold, _ = _timed(pool, fitness, thetas[: args.workers])  # start-up + first members
        for r in range(args.repeats):
            ts, out_s = _timed(serial, fitness, thetas)
            tp, out_p = _timed(pool, fitness, thetas)
            serial_times.append(ts)
            parallel_times.append(tp)
            serial_members.extend(out_s)
            parallel_members.extend(out_p)
            # wall / CPU per member: ~1 when the member had its core, > 1 when it waited
            wait_s = sum(m[1] for m in out_s) / sum(m[2] for m in out_s)
            wait_p = sum(m[1] for m in out_p) / sum(m[2] for m in out_p)
            repeats.append(
                {"serial_seconds": ts, "parallel_seconds": tp, "speedup": ts / tp,
                 "efficiency": ts / tp / args.workers,
                 "member_wall_over_cpu_serial": wait_s, "member_wall_over_cpu_parallel": wait_p}
            )
            print(f"repeat {r}: serial {ts:.1f} s, {args.workers} workers {tp:.1f} s "
                  f"(speedup {ts / tp:.2f}; member wall/CPU {wait_s:.2f} serial, "
                  f"{wait_p:.2f} parallel)", flush=True)
    finally:
        pool.close()
    load_after = os.getloadavg()

    fit_serial = [m[0] for m in serial_members[: args.members]]
    fit_parallel = [m[0] for m in parallel_members[: args.members]]
    cpu_serial = float(np.mean([m[2] for m in serial_members]))
    cpu_parallel = float(np.mean([m[2] for m in parallel_members]))
    wall_serial = float(np.mean([m[1] for m in serial_members]))
    wall_parallel = float(np.mean([m[1] for m in parallel_members]))
    t_serial, t_parallel = min(serial_times), min(parallel_times)
    speedup = t_serial / t_parallel
    efficiency = speedup / args.workers
    result = {
        "benchmark": "es_scaling",
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "fitness": kind,
        "synthetic": bool(args.synthetic),
        "members": args.members,
        "workers": args.workers,
        "inner_steps": None if args.synthetic else args.steps,
        "threads_per_member": 1,
        "cores": available_cores(),
        "machine": platform.platform(),
        "serial_seconds": serial_times,
        "parallel_seconds": parallel_times,
        "repeats": repeats,
        "serial_seconds_min": t_serial,
        "parallel_seconds_min": t_parallel,
        "speedup": speedup,
        "efficiency": efficiency,
        "pool_cold_start_seconds": t_cold,
        # per member: CPU seconds measure the work, wall/CPU > 1 means waiting for a core
        "member_cpu_seconds_serial": cpu_serial,
        "member_cpu_seconds_parallel": cpu_parallel,
        "member_wall_seconds_serial": wall_serial,
        "member_wall_seconds_parallel": wall_parallel,
        "serial_warmup_seconds": t_warm_serial,
        "fitness_serial": fit_serial,
        "fitness_parallel": fit_parallel,
        "same_fitness_serial_and_parallel": fit_serial == fit_parallel,
        "load_average_before": list(load_before),
        "load_average_after": list(load_after),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    print(f"fitness serial {fit_serial} / parallel {fit_parallel}")
    print(
        f"per member: CPU {cpu_serial:.2f} s serial vs {cpu_parallel:.2f} s parallel; wall "
        f"{wall_serial:.2f} s vs {wall_parallel:.2f} s (wall > CPU: waiting for a core)"
    )
    print(f"load average after: {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}")
    print(f"wrote {args.output}")
    print(
        f"es_scaling: N={args.members} W={args.workers}: serial {t_serial:.1f} s, parallel "
        f"{t_parallel:.1f} s, speedup {speedup:.2f}, efficiency {100 * efficiency:.0f}% "
        f"({'synthetic' if args.synthetic else 'real training'}; load {load_before[0]:.1f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
