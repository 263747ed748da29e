r"""Hooks in verl's trainer process (the driver of ``python -m verl.trainer.main_ppo``) for
``gbmpo train --engine verl``: what the own engine measures per step and its time budget.

Loaded through ``VERL_USE_EXTERNAL_MODULES`` (:data:`MODULE`) in every verl process with
:data:`DRIVER_ENV` set (:func:`activate`); it patches ``verl.trainer.ppo.ray_trainer`` once that
module is imported (the trainer process imports it), so the workers pay nothing. The patches:

* ``compute_data_metrics`` (called once per step with the step's batch) adds, from tensors the
  driver already holds:

  - ``reg/<name>`` = :math:`D(\pi_{old}\,\|\,\pi_{ref})`, the token mean over the batch of
    every monitored regularizer of the built objective (the optimised ones and, with
    ``objective.monitor_regularizers``, every registered one) from the batch's
    ``old_log_probs`` and ``ref_log_prob`` (the own engine's and TRL's definition);
  - :data:`ENTROPY_METRIC`: the token mean of the policy's entropy at :math:`\pi_{old}` over
    the batch (verl's ``actor/entropy`` is that entropy aggregated with ``loss_agg_mode``);
  - :data:`FAILURES_METRIC`: the step's reward failures (the reward function's
    :data:`FAILED_KEY`, :mod:`gbmpo.engines.verl.reward`); a step whose every completion
    failed stops the run, as on the own engine;
  - :data:`RL_SECONDS_METRIC`: the RL time so far (the time budget's clock);

* a controlled in-reward coefficient (``objective.regularizer.control`` with ``placement:
  reward``, :mod:`gbmpo.objectives.drift_control`): ``fit`` puts a :class:`ControlledKL` in
  place of verl's ``kl_ctrl_in_reward``; ``apply_kl_penalty`` penalises with its value, then
  moves it by the term's control from the measure the other engines read (the token mean of
  ``reg/kl_k3`` or of the term over the batch; verl's own ``update`` and its mean of
  per-sequence means are not used); the step logs ``drift_coef/<term>`` and
  ``drift_measure/<term>``; ``_save_checkpoint`` / ``_load_checkpoint`` keep the next step's
  value in :data:`DRIFT_STATE_FILE` beside verl's checkpoint;
* ``marked_timer("step")`` (verl's timer of one step, validation excluded) feeds that clock;
* ``RayPPOTrainer.fit`` makes ``total_training_steps`` a :class:`StepLimit`: verl decides at the
  start of a step whether it is the last (``is_last_step = global_steps >=
  total_training_steps``) and reads that decision after the actor's update (the final
  checkpoint, the final validation, the end of the loop); :class:`LastStep` makes the decision
  there, so that with ``GBMPO_VERL_TIME_BUDGET`` the step in which the RL time reaches the
  budget is the last, as on the other engines (:meth:`gbmpo.train.Trainer.train`: stop before a step
  once ``rl_seconds >= budget``).

:func:`check` verifies that the names patched here exist (``gbmpo train --engine verl
--dry-run`` runs it in verl's environment).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import inspect
import json
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

from gbmpo.io.metrics import DRIFT_COEF_PREFIX, DRIFT_MEASURE_PREFIX

__all__ = [
    "BUDGET_ENV",
    "DRIFT_STATE_FILE",
    "DRIVER_ENV",
    "ENTROPY_METRIC",
    "FAILED_KEY",
    "FAILURES_METRIC",
    "MODULE",
    "RL_SECONDS_ENV",
    "RL_SECONDS_METRIC",
    "ControlledKL",
    "LastStep",
    "StepLimit",
    "activate",
    "check",
    "install",
]

#: this module, for ``VERL_USE_EXTERNAL_MODULES``
MODULE = "gbmpo.engines.verl.driver"
#: set (to 1) in the environment of verl's processes of a gbmpo run: importing this module
#: there patches verl's trainer (:func:`activate`); importing it elsewhere does nothing
DRIVER_ENV = "GBMPO_VERL_DRIVER"
#: the time budget in seconds of RL (``run.time_budget_seconds``); unset: none
BUDGET_ENV = "GBMPO_VERL_TIME_BUDGET"
#: the RL seconds of the parts before a resume
RL_SECONDS_ENV = "GBMPO_VERL_RL_SECONDS"
RL_SECONDS_METRIC = "gbmpo/rl_seconds"
ENTROPY_METRIC = "gbmpo/entropy"
FAILURES_METRIC = "gbmpo/reward_failures"
#: the key of the reward function's result that marks a failed reward (1.0) per sample
FAILED_KEY = "gbmpo_reward_failed"

#: the controlled in-reward coefficient of the next step, beside each verl checkpoint
#: (``global_step_<n>/``; the name of TRL's, ``{term: coef}``)
DRIFT_STATE_FILE = "gbmpo_drift_state.json"

_TARGET = "verl.trainer.ppo.ray_trainer"
#: the names of verl's trainer module patched here
PATCHED = ("compute_data_metrics", "marked_timer", "apply_kl_penalty", "RayPPOTrainer.fit",
           "RayPPOTrainer._compute_old_log_prob", "RayPPOTrainer._save_checkpoint",
           "RayPPOTrainer._load_checkpoint")  # fmt: skip


class _Clock:
    """The RL time: the seconds of the finished steps (and of the parts before a resume) plus
    the running step's so far."""

    def __init__(self) -> None:
        self.done = float(os.environ.get(RL_SECONDS_ENV) or 0.0)
        self.step_start: float | None = None

    def seconds(self) -> float:
        running = 0.0 if self.step_start is None else time.perf_counter() - self.step_start
        return self.done + running


_CLOCK = _Clock()
_STATE: dict[str, Any] = {"monitors": None, "entropy": None, "drift": None}


class ControlledKL:
    """verl's in-reward KL controller (``value``, ``update``) for a controlled term: ``value``
    is the coefficient of the running step; :meth:`step` moves it by the term's control;
    verl's own ``update`` call does nothing."""

    def __init__(self, term: Any) -> None:
        self.name, self.control, self.value = term.name, term.control, float(term.coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """verl's call after each penalty: ignored (:meth:`step` moves the value)."""

    def step(self, measure: float) -> dict[str, float]:
        """Move the value by the control from this step's ``measure``; the step's metrics."""
        used, self.value = self.value, self.control.step(self.value, measure)
        return {DRIFT_COEF_PREFIX + self.name: used, DRIFT_MEASURE_PREFIX + self.name: measure}


def _budget() -> float | None:
    value = os.environ.get(BUDGET_ENV)
    return float(value) if value else None


class LastStep:
    """verl's ``is_last_step`` of one step, decided when first read: the step limit reached, or
    the RL time at that moment (after the step's actor update) at or past the time budget.
    Every later read gives the same answer."""

    def __init__(self, step: int, limit: int) -> None:
        self.step, self.limit = step, limit
        self._value: bool | None = None

    def __bool__(self) -> bool:
        if self._value is None:
            budget = _budget()
            self._value = self.step >= self.limit or (
                budget is not None and _CLOCK.seconds() >= budget
            )
        return self._value


class StepLimit(int):
    """``trainer.total_training_steps`` whose comparison ``global_steps >= limit`` gives a
    :class:`LastStep` (Python tries an ``int`` subclass's reflected ``__le__`` first); an
    ``int`` everywhere else (verl's progress bar)."""

    def __le__(self, other: Any) -> Any:
        if isinstance(other, int) and not isinstance(other, bool):
            return LastStep(other, int(self))
        return int(self) <= other


def _masked_mean(values: Any, mask: Any) -> float:
    m = mask.to(values.dtype)
    return float((values * m).sum() / m.sum().clamp(min=1.0))


def _monitor(name: str, tensors: Any) -> float:
    """``reg/<name>``: the token mean over the batch of the monitored regularizer ``name`` at
    the batch's ``old_log_probs`` against its ``ref_log_prob``."""
    # deferred: torch is heavy; gbmpo's own processes read this module's names without it
    import torch

    old, ref = tensors["old_log_probs"].float(), tensors["ref_log_prob"].float()
    mask = tensors["response_mask"]
    with torch.no_grad():
        values = _STATE["monitors"][name](logp=old, old_logp=old, anchor_logp=ref, mask=mask)
    return _masked_mean(values.float(), mask)


def step_metrics(batch: Any) -> dict[str, float]:
    """This module's additions to one step's metrics (module doc) from verl's batch."""
    out: dict[str, float] = {RL_SECONDS_METRIC: _CLOCK.seconds()}
    tensors = batch.batch
    monitors = _STATE["monitors"] or {}
    keys = set(tensors.keys())  # a TensorDict: membership through its keys
    if monitors and {"ref_log_prob", "old_log_probs"} <= keys:
        for name in monitors:
            out[f"reg/{name}"] = _monitor(name, tensors)
    if _STATE["entropy"] is not None:
        out[ENTROPY_METRIC] = _STATE["entropy"]
        _STATE["entropy"] = None
    if _STATE["drift"] is not None:
        out.update(_STATE["drift"])
        _STATE["drift"] = None
    failed = batch.non_tensor_batch.get(FAILED_KEY)
    if failed is not None:
        out[FAILURES_METRIC] = float(sum(float(f) for f in failed))
        if len(failed) and out[FAILURES_METRIC] == len(failed):
            # the own engine's rule (gbmpo.rewards.scoring.score_completions): a step without
            # one usable reward stops the run
            raise RuntimeError(
                f"the reward function gave no usable reward for any of the {len(failed)} "
                "completions of this step (NaN, None or an exception each time): check the "
                "function and the data columns"
            )
    return out


def _objective(config: Any) -> Any:
    """The built objective of ``policy_loss.gbmpo_objective`` (``None`` without one)."""
    spec = config.actor_rollout_ref.actor.policy_loss.get("gbmpo_objective")
    if not spec:
        return None
    # deferred: the plugin imports verl (this module is imported by verl's __init__)
    from gbmpo.engines.verl.build import build_objective

    return build_objective(spec)


def _drift_file(trainer: Any) -> str:
    """:data:`DRIFT_STATE_FILE` in the checkpoint folder of ``trainer``'s current step (verl's
    ``default_local_dir``, relative to the working directory as verl reads it)."""
    folder = os.path.join(trainer.config.trainer.default_local_dir,
                          f"global_step_{trainer.global_steps}")  # fmt: skip
    return os.path.join(os.path.abspath(folder), DRIFT_STATE_FILE)


def install(module: Any) -> None:
    """Patch verl's trainer module ``module`` (``verl.trainer.ppo.ray_trainer``) once."""
    if getattr(module, "_gbmpo_driver", False):
        return
    check(module)
    data_metrics = module.compute_data_metrics
    timer = module.marked_timer
    kl_penalty = module.apply_kl_penalty
    trainer = module.RayPPOTrainer
    fit, old_log_prob = trainer.fit, trainer._compute_old_log_prob
    save, load = trainer._save_checkpoint, trainer._load_checkpoint

    def compute_data_metrics(batch: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return {**data_metrics(batch, *args, **kwargs), **step_metrics(batch)}

    @contextlib.contextmanager
    def marked_timer(name: str, timing_raw: dict[str, float], *args: Any,
                     **kwargs: Any) -> Iterator[None]:  # fmt: skip
        if name != "step":
            with timer(name, timing_raw, *args, **kwargs):
                yield
            return
        _CLOCK.step_start = time.perf_counter()
        try:
            with timer(name, timing_raw, *args, **kwargs):
                yield
        finally:
            _CLOCK.done += time.perf_counter() - _CLOCK.step_start
            _CLOCK.step_start = None

    def apply_kl_penalty(data: Any, kl_ctrl: Any, *args: Any, **kwargs: Any) -> Any:
        out = kl_penalty(data, kl_ctrl, *args, **kwargs)
        if isinstance(kl_ctrl, ControlledKL):
            _STATE["drift"] = kl_ctrl.step(_monitor(kl_ctrl.control.monitor(kl_ctrl.name),
                                                    data.batch))  # fmt: skip
        return out

    def fit_(self: Any) -> Any:
        self.total_training_steps = StepLimit(int(self.total_training_steps))
        objective = _objective(self.config)
        _STATE["monitors"] = {} if objective is None else dict(objective.monitors)
        if objective is not None and objective.controlled:
            (term,) = objective.controlled  # one in-reward term (verl_objective_overrides)
            self.kl_ctrl_in_reward = ControlledKL(term)
        return fit(self)

    def save_checkpoint(self: Any, *args: Any, **kwargs: Any) -> Any:
        ctrl = getattr(self, "kl_ctrl_in_reward", None)
        if isinstance(ctrl, ControlledKL):
            # before verl's save: verl marks the checkpoint complete (its
            # latest_checkpointed_iteration.txt) at the end of it, so a kill in between
            # leaves no complete checkpoint without the value; atomic (rename)
            path = _drift_file(self)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path + ".tmp", "w") as f:
                json.dump({ctrl.name: ctrl.value}, f)
            os.replace(path + ".tmp", path)
        return save(self, *args, **kwargs)

    def load_checkpoint(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = load(self, *args, **kwargs)
        ctrl = getattr(self, "kl_ctrl_in_reward", None)
        if isinstance(ctrl, ControlledKL) and self.global_steps > 0:
            path = _drift_file(self)
            if not os.path.isfile(path):
                raise ValueError(f"{path} is missing: the checkpoint was written without the "
                                 "controlled coefficient, so its continuation would not be "
                                 "the run's")  # fmt: skip
            with open(path) as f:
                ctrl.value = float(json.load(f)[ctrl.name])
        return out

    fit_.__wrapped__ = fit  # type: ignore[attr-defined]

    def compute_old_log_prob(self: Any, batch: Any) -> Any:
        out = old_log_prob(self, batch)
        entropys = out[0].batch["entropys"] if isinstance(out, tuple) else None
        if entropys is not None:
            _STATE["entropy"] = _masked_mean(entropys.float(), batch.batch["response_mask"])
        return out

    module.compute_data_metrics = compute_data_metrics
    module.marked_timer = marked_timer
    module.apply_kl_penalty = apply_kl_penalty
    trainer.fit = fit_
    trainer._compute_old_log_prob = compute_old_log_prob
    trainer._save_checkpoint = save_checkpoint
    trainer._load_checkpoint = load_checkpoint
    module._gbmpo_driver = True


#: what the hooks rely on in ``RayPPOTrainer.fit``'s source: the last-step decision at the start
#: of a step (read after the update: :class:`LastStep`) and the step's timer
FIT_FACTS = ("is_last_step = self.global_steps >= self.total_training_steps",
             'marked_timer("step"')  # fmt: skip


def check(module: Any = None) -> None:
    """``RuntimeError`` naming the first of :data:`PATCHED` that verl's trainer module lacks,
    or the first of :data:`FIT_FACTS` its ``RayPPOTrainer.fit`` no longer holds."""
    if module is None:
        module = importlib.import_module(_TARGET)
    for name in PATCHED:
        owner: Any = module
        for part in name.split("."):
            owner = getattr(owner, part, None)
        if owner is None:
            raise RuntimeError(
                f"gbmpo's verl driver hooks need {_TARGET}.{name}, which this verl lacks "
                "(written for verl 0.9.1)"
            )
    fit = inspect.getsource(inspect.unwrap(module.RayPPOTrainer.fit))
    for fact in FIT_FACTS:
        if fact not in fit:
            raise RuntimeError(
                f"gbmpo's verl driver hooks need {_TARGET}.RayPPOTrainer.fit to hold {fact!r}, "
                "which this verl's does not (written for verl 0.9.1)"
            )


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls :func:`install` on verl's trainer module right after it is first imported."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_install(module: Any) -> None:
            exec_module(module)
            install(module)

        loader.exec_module = exec_and_install  # type: ignore[method-assign]
        return spec


def activate() -> None:
    """Patch verl's trainer module now if it is imported, else right after its import."""
    if _TARGET in sys.modules:
        install(sys.modules[_TARGET])
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


if os.environ.get(DRIVER_ENV):  # verl's processes of a gbmpo run (never gbmpo's own)
    activate()
