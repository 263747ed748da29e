"""Checkpointing: kill-and-resume continues the same trajectory; the exported map is usable."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gbmpo.meta.analytic import QuadraticFitness
from gbmpo.meta.backends import SerialBackend
from gbmpo.meta.checkpoint import STATE_FILE, load_state
from gbmpo.meta.es import ESConfig
from gbmpo.meta.runner import MIRROR_FILE, export_mirror_map, run_es_loop
from gbmpo.objectives.mirror import VECTOR_SIZE, NeuralMirrorMap

K = 8


def _strip_times(history):
    return [{k: v for k, v in h.items() if k != "eval_seconds"} for h in history]


def test_kill_and_resume_continues_the_same_trajectory(tmp_path) -> None:
    # elites, rejections and failures all occur in this run, so every part of the state matters
    target = np.linspace(-1, 1, 6)
    fit = QuadraticFitness(target=target, offset=10.0)

    def noisy(theta: np.ndarray) -> float:
        if theta[0] > 0.15:  # some members fail
            raise RuntimeError("crash")
        return fit(theta)

    cfg = ESConfig(population=8, iterations=K, sigma0=0.2, step_size=0.05, seed=11)
    straight = run_es_loop(noisy, SerialBackend(), cfg, tmp_path / "a", theta0=np.zeros(6))
    assert any(not h["accepted"] for h in straight.history)
    assert any(h["n_elites"] for h in straight.history)
    assert any(h["n_failed"] for h in straight.history)

    half = run_es_loop(
        noisy, SerialBackend(), cfg, tmp_path / "b", theta0=np.zeros(6), stop_after=K // 2
    )
    assert half.iteration == K // 2
    saved, doc = load_state(tmp_path / "b")
    assert doc["iteration"] == K // 2 and len(doc["history"]) == K // 2
    resumed = run_es_loop(noisy, SerialBackend(), cfg, tmp_path / "b", resume=True)

    np.testing.assert_array_equal(resumed.theta, straight.theta)
    assert resumed.best_fitness == straight.best_fitness
    assert resumed.rng_state == straight.rng_state
    assert [e.fitness for e in resumed.elites] == [e.fitness for e in straight.elites]
    for x, y in zip(resumed.elites, straight.elites, strict=True):
        np.testing.assert_array_equal(x.delta, y.delta)
    assert _strip_times(resumed.history) == _strip_times(straight.history)
    # and the files on disk agree too
    on_disk, _ = load_state(tmp_path / "b")
    np.testing.assert_array_equal(on_disk.theta, straight.theta)


def test_state_file_has_the_documented_fields(tmp_path) -> None:
    cfg = ESConfig(population=4, iterations=2, sigma0=0.1, seed=0)
    run_es_loop(QuadraticFitness(target=np.ones(3)), SerialBackend(), cfg, tmp_path,
                theta0=np.zeros(3), metadata={"fitness": "quadratic"})
    doc = json.loads((tmp_path / STATE_FILE).read_text())
    assert doc["iteration"] == 2 and isinstance(doc["best_fitness"], float)
    assert doc["es_config"] == cfg.to_dict() and doc["run"] == {"fitness": "quadratic"}
    assert (tmp_path / doc["theta_file"]).is_file()
    assert len(doc["history"]) == 2
    for h in doc["history"]:
        for key in ("fitness_mean", "fitness_std", "fitness_min", "fitness_max", "n_failed",
                    "sigma", "decision", "accepted"):
            assert key in h
        assert h["decision"] in ("accepted", "rejected")


def test_resume_refuses_a_different_config_and_new_run_refuses_to_overwrite(tmp_path) -> None:
    cfg = ESConfig(population=4, iterations=1, seed=0)
    fit = QuadraticFitness(target=np.ones(3))
    run_es_loop(fit, SerialBackend(), cfg, tmp_path, theta0=np.zeros(3))
    with pytest.raises(FileExistsError, match="resume"):
        run_es_loop(fit, SerialBackend(), cfg, tmp_path, theta0=np.zeros(3))
    with pytest.raises(ValueError, match="sigma0"):
        run_es_loop(fit, SerialBackend(), ESConfig(population=4, iterations=2, sigma0=0.5, seed=0),
                    tmp_path, resume=True)
    # more iterations on the same trajectory is allowed
    more = run_es_loop(fit, SerialBackend(), ESConfig(population=4, iterations=2, seed=0),
                       tmp_path, resume=True)
    assert more.iteration == 2
    with pytest.raises(FileNotFoundError, match="es_state.json"):
        run_es_loop(fit, SerialBackend(), cfg, tmp_path / "nothing", resume=True)


def test_exported_mirror_map_is_the_projected_theta(tmp_path) -> None:
    theta0 = NeuralMirrorMap.random(scale=0.01, seed=42).to_unconstrained().numpy()
    cfg = ESConfig(population=4, iterations=2, sigma0=0.01, seed=0)
    fit = QuadraticFitness(target=np.full(VECTOR_SIZE, 0.02))
    state = run_es_loop(fit, SerialBackend(), cfg, tmp_path, theta0=theta0,
                        export=lambda s, out: export_mirror_map(s, out / MIRROR_FILE))
    loaded = NeuralMirrorMap.load(tmp_path / MIRROR_FILE)
    np.testing.assert_array_equal(loaded.to_vector().numpy(), np.maximum(state.theta, 0.0))
