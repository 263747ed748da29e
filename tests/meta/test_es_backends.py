"""ES backends: serial, local process pool (spawn) and Ray give the same results; crashes are
recorded per member and do not stop the population."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from gbmpo.meta.analytic import QuadraticFitness
from gbmpo.meta.backends import (
    LocalPoolBackend,
    SerialBackend,
    get_backend,
)
from gbmpo.meta.es import ESConfig
from gbmpo.meta.runner import run_es_loop
from gbmpo.registry import UnknownNameError

TARGET = np.array([0.5, -0.25, 1.0])


def flaky_fitness(theta: np.ndarray) -> float:
    """Module-level (picklable by spawn workers): crashes, NaNs or kills by the first entry."""
    x = float(theta[0])
    if x > 10:
        os._exit(3)  # the worker process dies
    if x > 5:
        raise RuntimeError(f"member crashed at {x}")
    if x > 1:
        return float("nan")
    return -float(np.sum((theta - TARGET) ** 2))


def omp_threads(theta: np.ndarray) -> float:
    """The thread count a worker's torch starts with (torch reads OMP_NUM_THREADS at import)."""
    return float(os.environ["OMP_NUM_THREADS"])


def _thetas() -> list[np.ndarray]:
    return [np.array([v, 0.0, 0.0]) for v in (0.0, 2.0, 0.5, 7.0)]


def test_unknown_backend_lists_the_valid_names() -> None:
    with pytest.raises(UnknownNameError, match="local, ray, serial"):
        get_backend("slurm")


def test_serial_backend_returns_results_and_exceptions_in_order() -> None:
    out = SerialBackend().evaluate(flaky_fitness, _thetas())
    assert out[0] == flaky_fitness(_thetas()[0])
    assert np.isnan(out[1]) and out[2] == flaky_fitness(_thetas()[2])
    assert isinstance(out[3], RuntimeError) and "crashed" in str(out[3])


@pytest.fixture(scope="module")
def pool():
    """One spawn pool for the module: worker start-up dominates these tests."""
    with LocalPoolBackend(workers=2) as backend:
        yield backend


def test_local_pool_matches_serial_and_pins_threads(pool: LocalPoolBackend) -> None:
    assert pool.threads_per_worker == max(1, len(os.sched_getaffinity(0)) // 2)
    out = pool.evaluate(flaky_fitness, _thetas())
    serial = SerialBackend().evaluate(flaky_fitness, _thetas())
    assert out[0] == serial[0] and out[2] == serial[2] and np.isnan(out[1])
    assert isinstance(out[3], RuntimeError) and "crashed" in str(out[3])
    # workers are pinned to their share of the cores
    assert pool.evaluate(omp_threads, _thetas()[:2]) == [pool.threads_per_worker] * 2


def test_es_on_the_local_pool_equals_es_in_process(pool: LocalPoolBackend, tmp_path) -> None:
    cfg = ESConfig(population=4, iterations=3, sigma0=0.1, step_size=0.1, seed=5)
    fit = QuadraticFitness(target=TARGET)
    a = run_es_loop(fit, pool, cfg, tmp_path / "pool", theta0=np.zeros(3))
    b = run_es_loop(fit, SerialBackend(), cfg, tmp_path / "serial", theta0=np.zeros(3))
    np.testing.assert_array_equal(a.theta, b.theta)
    assert [h["fitness"] for h in a.history] == [h["fitness"] for h in b.history]


def test_local_pool_survives_a_dead_worker(pool: LocalPoolBackend) -> None:
    """A member that kills its process is a failed member; the pool is rebuilt afterwards."""
    dead = pool.evaluate(flaky_fitness, [np.array([11.0, 0, 0]), np.zeros(3), np.ones(3)])
    assert isinstance(dead[0], Exception)
    # members that shared the broken pool are rerun, not failed
    assert dead[1:] == [flaky_fitness(np.zeros(3)), flaky_fitness(np.ones(3))]
    again = pool.evaluate(flaky_fitness, [np.zeros(3)])
    assert again == [flaky_fitness(np.zeros(3))]


@pytest.mark.ray
def test_ray_backend_runs_locally_with_two_cpus(tmp_path) -> None:
    ray = pytest.importorskip("ray")
    from gbmpo.meta.backends import RayBackend

    # Ray workers do not see the tests directory: ship this module's functions by value
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

    cfg = ESConfig(population=4, iterations=2, sigma0=0.1, step_size=0.1, seed=5)
    fit = QuadraticFitness(target=TARGET)
    backend = RayBackend(num_cpus=2)
    try:
        assert backend.gpus_per_member == 0.0  # no GPU here: members ask for CPUs
        out = backend.evaluate(flaky_fitness, _thetas())
        assert out[0] == flaky_fitness(_thetas()[0]) and np.isnan(out[1])
        assert isinstance(out[3], Exception) and "crashed" in str(out[3])
        state = run_es_loop(fit, backend, cfg, tmp_path / "ray", theta0=np.zeros(3))
    finally:
        backend.close()
    ref = run_es_loop(fit, SerialBackend(), cfg, tmp_path / "serial", theta0=np.zeros(3))
    np.testing.assert_array_equal(state.theta, ref.theta)
    assert state.iteration == 2
