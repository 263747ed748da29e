"""Evolution strategies over the neural-mirror-map parameters (NM-GRPO-ES, GBMPO arXiv 2602.04380).

The search runs in the *unconstrained* parameterization of
:class:`gbmpo.objectives.mirror.NeuralMirrorMap` (``from_unconstrained`` maps any real vector to a
convex potential), so every proposal is a valid Bregman geometry. The authors' code perturbs the
constrained parameters directly and can produce D_h < 0 (docs/methods.md, "Choices" item 4).

One iteration, :func:`es_step` (docs/methods.md, section "Evolution strategies", with the fixes
listed below):

1. sigma_k = sigma0 * gamma^k.
2. Reuse the stored elites (if any) as m members with their stored fitness.
3. Draw n = N - m fresh antithetic perturbations +eps, -eps with eps ~ N(0, I), from the
   state's own seeded generator.
4. Evaluate theta_i = theta + sigma_k eps_i through the backend. Members that raise, return
   ``None`` or a non-finite value are recorded in the history and left out.
5. f_bar = mean fitness over the successful fresh members and the elites.
6. Accept iff f_bar > ``best_fitness`` (strict; the first iteration always accepts):
   theta <- theta + alpha g_hat, ``best_fitness`` <- f_bar, elites cleared. Otherwise keep
   theta and store the top k_e = max(2, 2 floor((N/4)/2)) members as elites ("restart from
   best").

Gradient estimators (registry :data:`ESTIMATORS`, chosen by ``ESConfig.estimator``):

* ``centered`` (default): fitness minus the mean of the members used,
  g_hat = sum_i (f_i - f_bar) eps_i / (sigma (m - u/m)), with m the members used and u those
  whose antithetic partner is absent. For a linear fitness, and members that fail independently
  of their perturbation, E[g_hat] = grad f exactly (m - u/m is a Bessel-type correction: m for
  complete antithetic pairs, m - 1 for i.i.d. draws). Adding a constant to f changes nothing.
* ``rank``: centered ranks u_i = (rank_i - 1)/(m - 1) - 1/2 (ties averaged) in place of
  f_i - f_bar (Salimans et al. 2017). Invariant to any increasing transform of the fitness and
  robust to outliers, but it estimates the gradient of a rank-shaped objective, not of the
  smoothed fitness itself; useful when the fitness scale drifts.
* ``raw``: the authors' estimator, g_hat = sum_{i: f_i > 0} f_i eps_i / (N_succ sigma) (raw
  fitness; failed and zero-fitness members dropped). With complete antithetic pairs the
  constant part of f cancels. With elites (chosen by fitness, not in pairs) or dropped members
  it does not: g_hat carries f_bar * sum_i eps_i / (N_succ sigma), a term that grows with the
  fitness *level* (docs/methods.md, "Choices" item 8). Dropping f_i <= 0 is itself selection on
  fitness.

By default (``elites_in_gradient=False``) only the fresh members enter the gradient. Elites are
selected *by fitness*, so their eps are not Gaussian draws and every estimator that uses them is
biased (the mean-subtracted one too, though not by the fitness level). Elites still enter the
acceptance mean, as in the authors' code (the meta-ES trainer of Lexsi-Labs/aligntune averages
the new members' and the elites' fitness; the paper's text was not available).
``elites_in_gradient=True`` with ``estimator="raw"`` reproduces the authors' update
(:meth:`ESConfig.authors_code`). An elite is stored as the displacement it was actually
evaluated at, delta = sigma_k' eps, and enters the gradient as delta / sigma_k; the authors reuse
eps with the new sigma_k although the fitness was measured at sigma_k' (a factor gamma per
reuse).

Randomness comes from a ``numpy.random.Generator`` (PCG64) whose state lives in :class:`ESState`,
so a checkpointed run resumes on exactly the same trajectory. The global RNGs are never touched.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gbmpo.registry import Registry

__all__ = [
    "ACCEPTANCE_RULES",
    "ESTIMATORS",
    "ESConfig",
    "ESState",
    "Elite",
    "EvaluatePopulation",
    "MemberResult",
    "antithetic_noise",
    "centered_estimator",
    "elite_count",
    "es_step",
    "estimate_gradient",
    "init_state",
    "rank_estimator",
    "raw_estimator",
    "sigma_at",
]

#: what a backend returns for one member: a fitness, ``None`` (failed) or the exception raised
MemberResult = float | None | BaseException
#: ``evaluate_population(list of parameter vectors) -> one MemberResult per vector, same order``
EvaluatePopulation = Callable[[list[np.ndarray]], Sequence[MemberResult]]

#: ``name -> estimator(fitness[m], eps[m, d], sigma, pair_ids[m]) -> gradient[d]``
ESTIMATORS: Registry[Callable[..., np.ndarray]] = Registry("ES gradient estimator")

#: accept/reject rules, selected by ``ESConfig.acceptance``
ACCEPTANCE_RULES: tuple[str, ...] = ("best", "always")


# ------------------------------------------------------------------------------------ formulas


def sigma_at(iteration: int, sigma0: float, decay: float) -> float:
    """Noise scale of iteration k: sigma_k = sigma0 * gamma^k (docs/methods.md, section "Evolution
    strategies" step 1)."""
    if iteration < 0:
        raise ValueError(f"iteration must be >= 0, got {iteration}")
    return float(sigma0 * decay**iteration)


def elite_count(population: int) -> int:
    """Elites kept after a rejection: k_e = max(2, 2 floor((N/4)/2)).

    About a quarter of the population, always even (GBMPO authors' code, docs/methods.md, section
    "Evolution strategies" step 6).
    """
    if population < 1:
        raise ValueError(f"population must be >= 1, got {population}")
    return max(2, 2 * int(math.floor((population / 4) / 2)))


def antithetic_noise(rng: np.random.Generator, n_pairs: int, dim: int) -> np.ndarray:
    """``[2*n_pairs, dim]`` rows ``+e_1, -e_1, +e_2, -e_2, ...`` with e_j ~ N(0, I).

    Antithetic (mirrored) sampling: with both signs, sum_i f_i eps_i is a sum of central
    differences (f+ - f-) eps (docs/methods.md, section "Evolution strategies" step 3).
    """
    if n_pairs < 0 or dim < 1:
        raise ValueError(f"need n_pairs >= 0 and dim >= 1, got n_pairs={n_pairs}, dim={dim}")
    half = rng.standard_normal((n_pairs, dim))
    out = np.empty((2 * n_pairs, dim), dtype=np.float64)
    out[0::2] = half
    out[1::2] = -half
    return out


def _check_inputs(fitness: np.ndarray, eps: np.ndarray, sigma: float, pair_ids: np.ndarray) -> None:
    if fitness.ndim != 1 or eps.ndim != 2 or eps.shape[0] != fitness.shape[0]:
        raise ValueError(
            f"estimator needs fitness [m] and eps [m, d]; got {fitness.shape} and {eps.shape}"
        )
    if pair_ids.shape != fitness.shape:
        raise ValueError(f"pair_ids must have shape {fitness.shape}, got {pair_ids.shape}")
    if not np.all(np.isfinite(fitness)):
        raise ValueError("estimator got a non-finite fitness; failed members must be left out")
    if not sigma > 0:
        raise ValueError(f"sigma must be > 0, got {sigma}")


def _unpaired_count(pair_ids: np.ndarray) -> int:
    """Members whose antithetic partner is absent (``pair_id < 0`` marks a member with no pair)."""
    ids, counts = np.unique(pair_ids[pair_ids >= 0], return_counts=True)
    if np.any(counts > 2):
        raise ValueError("a pair id appears more than twice; antithetic pairs have two members")
    return int(np.sum(pair_ids < 0) + np.sum(counts == 1))


@ESTIMATORS.register("centered")
def centered_estimator(
    fitness: np.ndarray, eps: np.ndarray, sigma: float, pair_ids: np.ndarray
) -> np.ndarray:
    """Mean-subtracted ES gradient (unbiased on linear fitness; module docstring).

    g_hat = sum_{i=1..m} (f_i - f_bar) eps_i / (sigma (m - u/m)), with u the members without
    their antithetic partner. For f(theta + sigma eps) = b + sigma c.eps, the pairs cancel in
    eps_bar = mean(eps), so E[eps_bar eps_bar^T] = (u/m^2) I and
    E[sum_i (f_i - f_bar) eps_i] = sigma (m I - m E[eps_bar eps_bar^T]) c = sigma (m - u/m) c,
    hence E[g_hat] = c. Salimans et al. 2017 (arXiv 1703.03864), baseline as in NES
    (Wierstra et al. 2014).
    """
    _check_inputs(fitness, eps, sigma, pair_ids)
    m = fitness.shape[0]
    if m < 2:
        return np.zeros(eps.shape[1], dtype=np.float64)
    u = _unpaired_count(pair_ids)
    centred = fitness - fitness.mean()
    return (centred @ eps) / (sigma * (m - u / m))


@ESTIMATORS.register("rank")
def rank_estimator(
    fitness: np.ndarray, eps: np.ndarray, sigma: float, pair_ids: np.ndarray
) -> np.ndarray:
    """Centered-rank ES gradient (Salimans et al. 2017, arXiv 1703.03864).

    u_i = (rank(f_i) - 1)/(m - 1) - 1/2 in [-1/2, 1/2] (ties share their average rank),
    g_hat = sum_i u_i eps_i / (m sigma). Invariant to increasing transforms of the fitness; an
    ascent direction for the rank-shaped objective.
    """
    _check_inputs(fitness, eps, sigma, pair_ids)
    m = fitness.shape[0]
    if m < 2:
        return np.zeros(eps.shape[1], dtype=np.float64)
    # deferred: scipy.stats takes seconds to import; keeps worker start-up light
    from scipy.stats import rankdata

    ranks = rankdata(fitness, method="average")
    shaped = (ranks - 1.0) / (m - 1) - 0.5
    return (shaped @ eps) / (m * sigma)


@ESTIMATORS.register("raw")
def raw_estimator(
    fitness: np.ndarray, eps: np.ndarray, sigma: float, pair_ids: np.ndarray
) -> np.ndarray:
    """The GBMPO authors' raw-fitness ES gradient (docs/methods.md, section "Evolution strategies"
    step 6; biased, see module doc).

    g_hat = sum_{i: f_i > 0} f_i eps_i / (N_succ sigma), N_succ = |{i : f_i > 0}|. No baseline,
    no rank shaping.
    """
    _check_inputs(fitness, eps, sigma, pair_ids)
    keep = fitness > 0
    n_succ = int(keep.sum())
    if n_succ == 0:
        return np.zeros(eps.shape[1], dtype=np.float64)
    return (fitness[keep] @ eps[keep]) / (n_succ * sigma)


def estimate_gradient(
    name: str,
    fitness: Sequence[float] | np.ndarray,
    eps: np.ndarray,
    sigma: float,
    pair_ids: Sequence[int] | np.ndarray | None = None,
) -> np.ndarray:
    """Apply the estimator registered as ``name`` (``pair_ids=None``: every member unpaired)."""
    f = np.asarray(fitness, dtype=np.float64)
    e = np.asarray(eps, dtype=np.float64)
    p = np.full(f.shape, -1, dtype=np.int64) if pair_ids is None else np.asarray(pair_ids)
    return ESTIMATORS.get(name)(f, e, float(sigma), p.astype(np.int64))


# ------------------------------------------------------------------------------- config, state


@dataclass(frozen=True)
class ESConfig:
    """ES hyper-parameters. Defaults: the authors' code defaults (docs/methods.md, section
    "Evolution strategies" table) with the unbiased ``centered`` estimator; :meth:`authors_code`
    gives their estimator settings too."""

    #: population size N (even; new members come in antithetic pairs)
    population: int = 10
    #: meta-iterations K
    iterations: int = 15
    #: initial noise scale sigma_0 (in the unconstrained parameterization)
    sigma0: float = 0.01
    #: sigma decay gamma: sigma_k = sigma0 * gamma**k
    sigma_decay: float = 0.99
    #: step size alpha: theta <- theta + alpha * g_hat
    step_size: float = 0.01
    #: gradient estimator: "centered" (default, unbiased), "rank" or "raw" (authors)
    estimator: str = "centered"
    #: "best": accept iff the population mean beats best_fitness (restart from best, with
    #: elites); "always": plain ES, every step is taken
    acceptance: str = "best"
    #: keep the top k_e members as elites after a rejection (only with acceptance="best")
    elites: bool = True
    #: let reused elites enter the gradient (authors: yes; biased, see the module docstring)
    elites_in_gradient: bool = False
    #: seed of the perturbation generator
    seed: int = 42

    def __post_init__(self) -> None:
        n = self.population
        if not isinstance(n, int) or isinstance(n, bool) or n < 2 or n % 2:
            raise ValueError(f"ES population must be an even integer >= 2, got {n!r}")
        if self.uses_elites and n - elite_count(n) < 2:
            raise ValueError(
                f"ES population {n} leaves no room for fresh members next to "
                f"{elite_count(n)} elites; use population >= 4 or elites=False"
            )
        if not isinstance(self.iterations, int) or self.iterations < 0:
            raise ValueError(f"ES iterations must be an integer >= 0, got {self.iterations!r}")
        if not (math.isfinite(self.sigma0) and self.sigma0 > 0):
            raise ValueError(f"ES sigma0 must be finite and > 0, got {self.sigma0!r}")
        if not (math.isfinite(self.sigma_decay) and 0 < self.sigma_decay <= 1):
            raise ValueError(f"ES sigma_decay must be in (0, 1], got {self.sigma_decay!r}")
        if not (math.isfinite(self.step_size) and self.step_size > 0):
            raise ValueError(f"ES step_size must be finite and > 0, got {self.step_size!r}")
        ESTIMATORS.get(self.estimator)  # raises UnknownNameError listing valid names
        if self.acceptance not in ACCEPTANCE_RULES:
            raise ValueError(
                f"unknown ES acceptance rule {self.acceptance!r}; valid: "
                f"{', '.join(ACCEPTANCE_RULES)}"
            )
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"ES seed must be an integer, got {self.seed!r}")

    @property
    def uses_elites(self) -> bool:
        return self.elites and self.acceptance == "best"

    @property
    def num_elites(self) -> int:
        return elite_count(self.population) if self.uses_elites else 0

    @classmethod
    def authors_code(cls, **overrides: Any) -> ESConfig:
        """The GBMPO authors' ES: raw estimator, elites in the gradient, restart from best."""
        params: dict[str, Any] = dict(
            estimator="raw", elites_in_gradient=True, acceptance="best", elites=True
        )
        params.update(overrides)
        return cls(**params)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ESConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"unknown ES config key(s) {', '.join(unknown)}; valid: {', '.join(sorted(known))}"
            )
        values = dict(data)
        for f in dataclasses.fields(cls):
            v = values.get(f.name)
            if f.type == "float" and isinstance(v, str):  # YAML reads "5e-2" as a string
                try:
                    values[f.name] = float(v)
                except ValueError:
                    raise ValueError(f"ES config {f.name!r} must be a number, got {v!r}") from None
            elif f.type == "float" and isinstance(v, int) and not isinstance(v, bool):
                values[f.name] = float(v)
            elif f.name in values and f.type in ("float", "int", "bool", "str"):
                expected = {"float": float, "int": int, "bool": bool, "str": str}[f.type]
                ok = isinstance(v, expected) and (f.type == "bool" or not isinstance(v, bool))
                if not ok:
                    raise ValueError(
                        f"ES config {f.name!r} must be {f.type}, got {type(v).__name__} {v!r}"
                    )
        return cls(**values)


@dataclass
class Elite:
    """A member kept after a rejection: evaluated at ``theta + delta`` with fitness ``fitness``."""

    delta: np.ndarray
    fitness: float


@dataclass
class ESState:
    """Everything the ES needs to continue: pure data, saved after every iteration."""

    #: number of completed iterations (the next one is ``iteration``)
    iteration: int
    #: current (last accepted) unconstrained parameters, float64 [d]
    theta: np.ndarray
    #: best accepted population mean (``-inf`` before the first iteration)
    best_fitness: float
    #: members carried over after a rejection
    elites: list[Elite] = field(default_factory=list)
    #: one dict per completed iteration (see :func:`es_step`)
    history: list[dict[str, Any]] = field(default_factory=list)
    #: ``numpy`` PCG64 bit-generator state (JSON-serialisable)
    rng_state: dict[str, Any] = field(default_factory=dict)

    @property
    def dim(self) -> int:
        return int(self.theta.shape[0])

    def copy(self) -> ESState:
        return ESState(
            iteration=self.iteration,
            theta=self.theta.copy(),
            best_fitness=self.best_fitness,
            elites=[Elite(e.delta.copy(), e.fitness) for e in self.elites],
            history=copy.deepcopy(self.history),
            rng_state=copy.deepcopy(self.rng_state),
        )


def init_state(theta0: np.ndarray | Sequence[float], config: ESConfig) -> ESState:
    """Start state at ``theta0`` (unconstrained parameters) with a generator seeded by
    ``config.seed``."""
    theta = np.array(theta0, dtype=np.float64).reshape(-1)
    if theta.size == 0 or not np.all(np.isfinite(theta)):
        raise ValueError("ES initial parameters must be a non-empty finite vector")
    rng = np.random.Generator(np.random.PCG64(config.seed))
    return ESState(
        iteration=0,
        theta=theta,
        best_fitness=-math.inf,
        rng_state=rng.bit_generator.state,
    )


# ----------------------------------------------------------------------------------- the step


def _classify(result: Any) -> tuple[float | None, str | None]:
    """``(fitness, None)`` for a usable result, ``(None, reason)`` for a failed member."""
    if isinstance(result, BaseException):
        return None, f"{type(result).__name__}: {result}"
    if result is None:
        return None, "no fitness (None)"
    if isinstance(result, bool) or not isinstance(result, (int, float, np.floating, np.integer)):
        return None, f"fitness of unsupported type {type(result).__name__}"
    value = float(result)
    if not math.isfinite(value):
        return None, f"non-finite fitness {value}"
    return value, None


def es_step(state: ESState, evaluate_population: EvaluatePopulation, config: ESConfig) -> ESState:
    """One ES iteration (module docstring, steps 1-6); returns a new state, ``state`` is unchanged.

    The history entry appended for the iteration holds ``iteration``, ``sigma``, ``n_members``,
    ``n_fresh``, ``n_elites``, ``n_failed``, ``failures`` (member index and reason), ``fitness``
    (one value per member, ``None`` for failures; elites first), ``fitness_mean/std/min/max`` over
    the successful members, ``decision`` (``"accepted"``/``"rejected"``), ``reason``,
    ``best_fitness`` after the step, ``grad_norm``, ``step_norm``, ``theta_norm``, ``estimator``
    and ``eval_seconds``.
    """
    new = state.copy()
    k = new.iteration
    sigma = sigma_at(k, config.sigma0, config.sigma_decay)
    rng = np.random.Generator(np.random.PCG64())
    rng.bit_generator.state = new.rng_state

    elites = new.elites if config.uses_elites else []
    n_fresh = config.population - len(elites)
    if n_fresh < 2 or n_fresh % 2:
        raise ValueError(
            f"{len(elites)} elites leave {n_fresh} fresh members; need an even number >= 2"
        )
    eps = antithetic_noise(rng, n_fresh // 2, new.dim)
    deltas = sigma * eps
    proposals = [new.theta + d for d in deltas]

    t0 = time.perf_counter()
    results = list(evaluate_population(proposals))
    eval_seconds = time.perf_counter() - t0
    if len(results) != n_fresh:
        raise RuntimeError(
            f"evaluate_population returned {len(results)} results for {n_fresh} members"
        )

    # members: elites first (reused fitness), then the fresh ones
    all_deltas = [e.delta for e in elites] + list(deltas)
    all_pairs = [-1] * len(elites) + [len(elites) + i // 2 for i in range(n_fresh)]
    is_fresh = [False] * len(elites) + [True] * n_fresh
    fitness: list[float | None] = [e.fitness for e in elites]
    failures: list[dict[str, Any]] = []
    for i, res in enumerate(results):
        value, why = _classify(res)
        fitness.append(value)
        if why is not None:
            failures.append({"member": len(elites) + i, "error": why})

    ok = [i for i, f in enumerate(fitness) if f is not None]
    values = np.array([fitness[i] for i in ok], dtype=np.float64)
    entry: dict[str, Any] = {
        "iteration": k,
        "sigma": sigma,
        "n_members": len(fitness),
        "n_fresh": n_fresh,
        "n_elites": len(elites),
        "n_failed": len(failures),
        "failures": failures,
        "fitness": fitness,
        "fitness_mean": float(values.mean()) if values.size else None,
        "fitness_std": float(values.std()) if values.size else None,
        "fitness_min": float(values.min()) if values.size else None,
        "fitness_max": float(values.max()) if values.size else None,
        "estimator": config.estimator,
        "eval_seconds": eval_seconds,
    }

    grad_norm: float | None = None
    step_norm = 0.0
    if not values.size or all(fitness[i] is None for i in range(len(elites), len(fitness))):
        # nothing new was learned this iteration (elites alone carry no new information)
        decision, reason = "rejected", "no successful member"
    else:
        mean = float(values.mean())
        if config.acceptance == "always" or mean > new.best_fitness:
            decision = "accepted"
            reason = "always" if config.acceptance == "always" else "mean beats best_fitness"
        else:
            decision, reason = "rejected", "mean does not beat best_fitness"

    if decision == "accepted":
        use = [
            i for i in ok if is_fresh[i] or (config.elites_in_gradient and config.uses_elites)
        ]
        g = estimate_gradient(
            config.estimator,
            [fitness[i] for i in use],
            np.array([all_deltas[i] / sigma for i in use]).reshape(len(use), new.dim),
            sigma,
            [all_pairs[i] for i in use],
        )
        step = config.step_size * g
        new.theta = new.theta + step
        grad_norm = float(np.linalg.norm(g))
        step_norm = float(np.linalg.norm(step))
        if config.acceptance == "best":
            new.best_fitness = float(values.mean())
        else:
            new.best_fitness = max(new.best_fitness, float(values.mean()))
        new.elites = []
    elif values.size and config.uses_elites and reason != "no successful member":
        order = sorted(ok, key=lambda i: fitness[i], reverse=True)[: config.num_elites]
        keep = order[: len(order) - len(order) % 2]  # even, so fresh members stay in pairs
        new.elites = [Elite(all_deltas[i].copy(), float(fitness[i])) for i in keep]  # type: ignore[arg-type]

    entry.update(
        decision=decision,
        reason=reason,
        accepted=decision == "accepted",
        best_fitness=new.best_fitness if math.isfinite(new.best_fitness) else None,
        grad_norm=grad_norm,
        step_norm=step_norm,
        theta_norm=float(np.linalg.norm(new.theta)),
    )
    new.history.append(entry)
    new.iteration = k + 1
    new.rng_state = rng.bit_generator.state
    return new
