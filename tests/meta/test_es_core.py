"""ES core (gbmpo.meta.es): schedule, estimators, acceptance with elites, failures, convergence."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gbmpo.meta.analytic import LinearFitness, QuadraticFitness
from gbmpo.meta.es import (
    Elite,
    ESConfig,
    ESState,
    antithetic_noise,
    elite_count,
    es_step,
    estimate_gradient,
    init_state,
    sigma_at,
)
from gbmpo.registry import UnknownNameError


def _evaluator(fn):
    return lambda thetas: [fn(t) for t in thetas]


# ------------------------------------------------------------------------------ small formulas


def test_sigma_schedule_is_geometric() -> None:
    assert sigma_at(0, 0.01, 0.99) == pytest.approx(0.01)
    assert sigma_at(10, 0.01, 0.99) == pytest.approx(0.01 * 0.99**10)
    with pytest.raises(ValueError, match="iteration"):
        sigma_at(-1, 0.01, 0.99)


@pytest.mark.parametrize(("n", "k"), [(2, 2), (4, 2), (8, 2), (10, 2), (16, 4), (24, 6), (40, 10)])
def test_elite_count_matches_authors_formula(n: int, k: int) -> None:
    assert elite_count(n) == k
    assert elite_count(n) % 2 == 0


def test_antithetic_noise_pairs_cancel() -> None:
    eps = antithetic_noise(np.random.default_rng(0), 5, 7)
    assert eps.shape == (10, 7)
    np.testing.assert_array_equal(eps[0::2], -eps[1::2])
    np.testing.assert_allclose(eps.sum(0), 0.0, atol=1e-12)


def test_config_validation_names_the_problem() -> None:
    with pytest.raises(ValueError, match="even"):
        ESConfig(population=5)
    with pytest.raises(ValueError, match="fresh members"):
        ESConfig(population=2)  # 2 elites would fill the population
    ESConfig(population=2, elites=False)
    with pytest.raises(UnknownNameError, match="centered"):
        ESConfig(estimator="nope")
    with pytest.raises(ValueError, match="acceptance"):
        ESConfig(acceptance="sometimes")
    with pytest.raises(ValueError, match="sigma_decay"):
        ESConfig(sigma_decay=1.5)
    with pytest.raises(ValueError, match="unknown ES config key"):
        ESConfig.from_dict({"populaton": 4})
    assert ESConfig.from_dict(ESConfig().to_dict()) == ESConfig()


# ------------------------------------------------------------------------------- convergence


@pytest.mark.parametrize("estimator", ["centered", "rank"])
def test_es_converges_on_a_quadratic(estimator: str) -> None:
    dim = 16
    target = np.random.default_rng(1).normal(size=dim)
    fit = QuadraticFitness(target=target)
    step = 0.1 if estimator == "centered" else 0.05
    cfg = ESConfig(
        population=16, iterations=150, sigma0=0.2, sigma_decay=0.99, step_size=step,
        estimator=estimator, seed=3,
    )
    state = init_state(np.zeros(dim), cfg)
    start = np.linalg.norm(state.theta - target)
    for _ in range(cfg.iterations):
        state = es_step(state, _evaluator(fit), cfg)
    assert np.linalg.norm(state.theta - target) < 0.25 * start
    assert state.iteration == cfg.iterations
    assert len(state.history) == cfg.iterations
    accepted = sum(h["accepted"] for h in state.history)
    assert 0 < accepted < cfg.iterations  # the restart-from-best rule both accepts and rejects


def test_authors_configuration_runs_and_improves_a_positive_fitness() -> None:
    dim = 8
    target = np.full(dim, 0.5)
    fit = QuadraticFitness(target=target, offset=5.0)  # positive, as the authors' accuracies
    cfg = ESConfig.authors_code(population=8, sigma0=0.1, step_size=0.05, seed=0)
    state = init_state(np.zeros(dim), cfg)
    for _ in range(40):
        state = es_step(state, _evaluator(fit), cfg)
    assert fit(state.theta) > fit(np.zeros(dim))


# ------------------------------------------------------------------------ estimator unbiasedness

DIM = 8
C = np.linspace(-1.0, 1.0, DIM)
OFFSET = 3.0  # a fitness level far from 0, the case where raw fitness goes wrong
REPS = 3000
Z_MAX = 4.5  # per coordinate; false-alarm probability <= 8 * 6.8e-6 if unbiased


def _one_step_gradient(cfg: ESConfig, seed: int, *, with_elites: bool, fail=()) -> np.ndarray:
    """theta_1 - theta_0 of one accepted step with step_size 1 (so it is the estimate g_hat).

    ``with_elites``: the population first goes through a rejected iteration at the same theta,
    so its top members (selected by fitness) come back as elites, as in the paper's loop.
    ``fail``: fresh-member indices that crash (independent of their perturbation).
    """
    fit = LinearFitness(c=C, offset=OFFSET)

    def evaluate(thetas):
        return [RuntimeError("boom") if i in fail else fit(t) for i, t in enumerate(thetas)]

    state = init_state(np.zeros(DIM), cfg)
    state.rng_state = np.random.Generator(np.random.PCG64(seed)).bit_generator.state
    if with_elites:
        state.best_fitness = math.inf  # force a rejection -> elites stored
        state = es_step(state, evaluate, cfg)
        assert len(state.elites) == cfg.num_elites
    state.best_fitness = -math.inf  # force acceptance
    new = es_step(state, evaluate, cfg)
    assert new.history[-1]["accepted"]
    return new.theta - state.theta


def _z_scores(cfg: ESConfig, *, with_elites: bool, fail=()) -> np.ndarray:
    g = np.array(
        [_one_step_gradient(cfg, s, with_elites=with_elites, fail=fail) for s in range(REPS)]
    )
    se = g.std(axis=0, ddof=1) / math.sqrt(REPS)
    return (g.mean(axis=0) - C) / se


BASE = dict(population=8, sigma0=0.1, step_size=1.0, seed=0)


@pytest.mark.parametrize(
    ("with_elites", "fail"),
    [(False, ()), (True, ()), (False, (0, 3)), (True, (1,))],
    ids=["plain", "elites", "dropped", "elites+dropped"],
)
def test_default_estimator_is_unbiased_on_a_linear_fitness(with_elites, fail) -> None:
    """E[g_hat] = c: the mean of REPS independent estimates is within Z_MAX standard errors.

    The standard error comes from the sample itself (CLT over REPS i.i.d. replications).
    Dropped members are chosen independently of their perturbation (a crash, not a low score);
    the centered estimator's m - u/m normaliser makes it exact then.
    """
    cfg = ESConfig(**BASE)
    assert cfg.estimator == "centered" and not cfg.elites_in_gradient
    z = _z_scores(cfg, with_elites=with_elites, fail=fail)
    assert np.all(np.abs(z) < Z_MAX), z


def test_raw_estimator_is_biased_with_elites() -> None:
    """The authors' raw estimator with elites in the gradient (selected by fitness, no pairs)
    picks up OFFSET * sum(eps_elite) / (N sigma): far outside the same Z_MAX band."""
    z = _z_scores(ESConfig.authors_code(**BASE), with_elites=True)
    assert np.max(np.abs(z)) > 10 * Z_MAX, z
    # the same check passes for raw without elites (complete antithetic pairs): the test can pass
    z_plain = _z_scores(ESConfig.authors_code(**BASE), with_elites=False)
    assert np.all(np.abs(z_plain) < Z_MAX), z_plain


def test_raw_bias_grows_with_the_fitness_level_and_centered_does_not_care() -> None:
    rng = np.random.default_rng(0)
    eps = rng.normal(size=(6, DIM))  # six members that are not antithetic pairs (elites)
    f = eps @ C * 0.1
    for name in ("centered", "rank"):
        a = estimate_gradient(name, f, eps, 0.1)
        b = estimate_gradient(name, f + 100.0, eps, 0.1)
        np.testing.assert_allclose(a, b, atol=1e-9)
    raw_a = estimate_gradient("raw", f + 1.0, eps, 0.1)
    raw_b = estimate_gradient("raw", f + 100.0, eps, 0.1)
    np.testing.assert_allclose(raw_b - raw_a, 99.0 * eps.sum(0) / (6 * 0.1), rtol=1e-9)


@settings(max_examples=30, deadline=None)
@given(scale=st.floats(0.01, 100.0), shift=st.floats(-50.0, 50.0))
def test_rank_estimator_is_invariant_to_increasing_transforms(scale: float, shift: float) -> None:
    rng = np.random.default_rng(7)
    eps = antithetic_noise(rng, 4, 5)
    f = rng.normal(size=8)
    a = estimate_gradient("rank", f, eps, 0.3)
    b = estimate_gradient("rank", np.exp(scale * f / 10) + shift, eps, 0.3)
    np.testing.assert_allclose(a, b, atol=1e-12)


def test_raw_estimator_drops_non_positive_fitness_like_the_authors() -> None:
    eps = np.eye(3)
    g = estimate_gradient("raw", [2.0, 0.0, -1.0], eps, 0.5)
    np.testing.assert_allclose(g, [2.0 / (1 * 0.5), 0.0, 0.0])


# ---------------------------------------------------------------------- acceptance and elites


def test_accept_iff_mean_strictly_beats_best_and_elites_are_reused() -> None:
    cfg = ESConfig(population=8, sigma0=0.1, step_size=0.1, seed=1)
    fit = LinearFitness(c=np.ones(4), offset=1.0)
    state = init_state(np.zeros(4), cfg)
    s1 = es_step(state, _evaluator(fit), cfg)  # first iteration always accepted
    h = s1.history[-1]
    assert h["accepted"] and h["decision"] == "accepted" and h["n_elites"] == 0
    assert s1.best_fitness == pytest.approx(h["fitness_mean"])
    assert not np.array_equal(s1.theta, state.theta)

    s1.best_fitness = h["fitness_mean"] + 10.0  # unbeatable -> reject
    s2 = es_step(s1, _evaluator(fit), cfg)
    h2 = s2.history[-1]
    assert h2["decision"] == "rejected"
    np.testing.assert_array_equal(s2.theta, s1.theta)  # restart from best: theta unchanged
    assert len(s2.elites) == elite_count(8) == 2
    top = sorted((f for f in h2["fitness"] if f is not None), reverse=True)[:2]
    assert [e.fitness for e in s2.elites] == top
    for e in s2.elites:  # an elite is the point it was evaluated at
        assert fit(s2.theta + e.delta) == pytest.approx(e.fitness)

    seen: list[int] = []
    s3 = es_step(s2, lambda th: (seen.append(len(th)), [fit(t) for t in th])[1], cfg)
    h3 = s3.history[-1]
    assert seen == [6] and h3["n_elites"] == 2 and h3["n_members"] == 8
    assert h3["fitness"][:2] == top  # elites first, with their stored fitness
    assert h3["fitness_mean"] == pytest.approx(np.mean(h3["fitness"]))
    assert s3.iteration == 3


def test_equal_mean_is_rejected() -> None:
    cfg = ESConfig(population=4, sigma0=0.1, seed=0)
    state = init_state(np.zeros(3), cfg)
    state.best_fitness = 2.0
    s = es_step(state, lambda th: [2.0] * len(th), cfg)
    assert s.history[-1]["decision"] == "rejected"


def test_always_acceptance_takes_every_step_without_elites() -> None:
    cfg = ESConfig(population=4, acceptance="always", seed=0)
    state = init_state(np.zeros(3), cfg)
    state.best_fitness = 100.0
    s = es_step(state, _evaluator(LinearFitness(c=np.ones(3))), cfg)
    assert s.history[-1]["accepted"] and not s.elites


def test_es_step_does_not_mutate_its_input_or_global_rng() -> None:
    cfg = ESConfig(population=4, seed=0)
    state = init_state(np.arange(3.0), cfg)
    before = state.copy()
    np.random.seed(123)
    expected_global = np.random.random()
    np.random.seed(123)
    es_step(state, _evaluator(LinearFitness(c=np.ones(3))), cfg)
    assert np.random.random() == expected_global
    np.testing.assert_array_equal(state.theta, before.theta)
    assert state.rng_state == before.rng_state and state.iteration == 0 and not state.history


# ------------------------------------------------------------------------------------ failures


def test_crashed_and_nan_members_are_recorded_and_skipped() -> None:
    cfg = ESConfig(population=8, sigma0=0.1, step_size=1.0, seed=2)
    fit = LinearFitness(c=np.ones(5))
    bad = {1: RuntimeError("CUDA error: out of memory"), 4: float("nan"), 6: None}

    def evaluate(thetas):
        return [bad.get(i, fit(t)) for i, t in enumerate(thetas)]

    state = init_state(np.zeros(5), cfg)
    new = es_step(state, evaluate, cfg)
    h = new.history[-1]
    assert h["n_failed"] == 3
    assert [f["member"] for f in h["failures"]] == [1, 4, 6]
    assert "out of memory" in h["failures"][0]["error"]
    assert "non-finite" in h["failures"][1]["error"]
    assert h["fitness"][1] is None and h["fitness"][4] is None and h["fitness"][6] is None
    ok = [f for f in h["fitness"] if f is not None]
    assert h["fitness_mean"] == pytest.approx(np.mean(ok))
    assert h["fitness_min"] == min(ok) and h["fitness_max"] == max(ok)
    assert np.all(np.isfinite(new.theta)) and h["accepted"]
    # the step equals the centered estimate from the 5 survivors only
    eps = [(t - state.theta) / h["sigma"] for t in _replay_proposals(state, cfg)]
    keep = [i for i in range(8) if i not in bad]
    g = estimate_gradient(
        "centered", [fit(state.theta + h["sigma"] * eps[i]) for i in keep],
        np.array([eps[i] for i in keep]), h["sigma"], [i // 2 for i in keep],
    )
    np.testing.assert_allclose(new.theta - state.theta, g, rtol=1e-12, atol=1e-12)


def _replay_proposals(state: ESState, cfg: ESConfig) -> list[np.ndarray]:
    seen: list[np.ndarray] = []
    es_step(state, lambda th: (seen.extend(th), [0.0] * len(th))[1], cfg)
    return seen


def test_all_members_failing_is_a_rejection_not_an_error() -> None:
    cfg = ESConfig(population=4, seed=0)
    state = init_state(np.zeros(3), cfg)
    state.elites = []
    new = es_step(state, lambda th: [ValueError("x")] * len(th), cfg)
    h = new.history[-1]
    assert h["decision"] == "rejected" and h["reason"] == "no successful member"
    assert h["n_failed"] == 4 and h["fitness_mean"] is None
    np.testing.assert_array_equal(new.theta, state.theta)
    assert new.iteration == 1


def test_elites_alone_never_make_an_acceptance() -> None:
    cfg = ESConfig(population=4, seed=0)
    state = init_state(np.zeros(3), cfg)
    state.best_fitness = 0.0
    state.elites = [Elite(np.ones(3), 5.0), Elite(-np.ones(3), 4.0)]  # would beat best
    new = es_step(state, lambda th: [None] * len(th), cfg)
    h = new.history[-1]
    assert h["decision"] == "rejected" and h["reason"] == "no successful member"
    assert [e.fitness for e in new.elites] == [5.0, 4.0] and new.best_fitness == 0.0


def test_wrong_number_of_results_is_an_error() -> None:
    cfg = ESConfig(population=4, seed=0)
    with pytest.raises(RuntimeError, match="3 results for 4 members"):
        es_step(init_state(np.zeros(2), cfg), lambda th: [0.0] * 3, cfg)


def test_elite_dataclass_roundtrip_in_copy() -> None:
    s = ESState(iteration=1, theta=np.zeros(2), best_fitness=0.0,
                elites=[Elite(np.ones(2), 1.0)])
    c = s.copy()
    c.elites[0].delta[0] = 5.0
    assert s.elites[0].delta[0] == 1.0
