"""gbmpo's hooks in verl's trainer process (:mod:`gbmpo.engines.verl.driver`), on a module
shaped like ``verl.trainer.ppo.ray_trainer``: its loop decides ``is_last_step`` at the start of a
step and reads it after the actor's update, as verl 0.9.1's ``RayPPOTrainer.fit`` does
(``tests_verl`` checks the hooks against verl itself). No verl needed."""

from __future__ import annotations

import contextlib
import json
import linecache
import types
from pathlib import Path

import pytest
import torch

from gbmpo.engines.verl import driver as verl_driver
from gbmpo.objectives import get_regularizer
from gbmpo.objectives.drift_control import proportional_coef
from gbmpo.objectives.spec import ObjectiveSpec

#: verl's loop, reduced to what the hooks touch (names as in verl 0.9.1's ray_trainer)
LOOP = '''
import contextlib

def compute_data_metrics(batch, use_critic=False):
    return {"critic/score/mean": 0.5}

@contextlib.contextmanager
def marked_timer(name, timing_raw, color=None):
    yield

def apply_kl_penalty(data, kl_ctrl, kl_penalty="kl"):
    data.penalties.append(kl_ctrl.value)  # verl: rewards = scores - kl_ctrl.value * kld
    kl_ctrl.update(current_kl=1.0, n_steps=2)
    return data, {}

class RayPPOTrainer:
    def __init__(self, steps, clock, seconds_per_step, batch, config=None, save_every=1000,
                 resume_step=0):
        self.total_training_steps, self.clock = steps, clock
        self.seconds_per_step, self.batch = seconds_per_step, batch
        self.config, self.save_every, self.resume_step = config, save_every, resume_step
        self.kl_ctrl_in_reward = None
        self.log, self.saved, self.validated = [], [], []

    def _compute_old_log_prob(self, batch):
        return types.SimpleNamespace(batch={"entropys": batch.batch["entropys"]}), 0.0

    def _save_checkpoint(self):
        self.saved.append(self.global_steps)

    def _load_checkpoint(self):
        self.global_steps = self.resume_step

    def fit(self):
        self.global_steps = 0
        self._load_checkpoint()
        self.global_steps += 1
        while True:
            is_last_step = self.global_steps >= self.total_training_steps
            with marked_timer("step", {}):
                self._compute_old_log_prob(self.batch)
                if self.kl_ctrl_in_reward is not None:
                    apply_kl_penalty(self.batch, kl_ctrl=self.kl_ctrl_in_reward, kl_penalty="k")
                self.clock[0] += self.seconds_per_step  # generation, log-probs, the update
                if is_last_step or self.global_steps % self.save_every == 0:
                    self._save_checkpoint()
            if is_last_step:
                self.validated.append(self.global_steps)
            self.log.append(compute_data_metrics(batch=self.batch, use_critic=False))
            self.global_steps += 1
            if is_last_step:
                return
'''


class Batch:
    """A verl ``DataProto`` as the hooks read it: ``batch`` (tensors), ``non_tensor_batch``."""

    def __init__(self, tensors: dict[str, torch.Tensor], failed: list[float] | None = None):
        self.batch = tensors
        self.non_tensor_batch = {} if failed is None else {verl_driver.FAILED_KEY: failed}
        self.penalties: list[float] = []  # the in-reward coefficients apply_kl_penalty used


def _batch(failed: list[float] | None = None) -> Batch:
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    return Batch({"response_mask": mask,
                  "old_log_probs": -torch.rand(2, 4, generator=g) - 0.1,
                  "ref_log_prob": -torch.rand(2, 4, generator=g) - 0.1,
                  "entropys": torch.rand(2, 4, generator=g)}, failed)  # fmt: skip


@pytest.fixture
def verl_like(monkeypatch: pytest.MonkeyPatch) -> tuple[types.ModuleType, list[float]]:
    """A fresh verl-like trainer module with the hooks installed, on a fake clock."""
    module = types.ModuleType("fake_ray_trainer")
    module.types = types  # type: ignore[attr-defined]
    name = "<fake_ray_trainer>"
    linecache.cache[name] = (len(LOOP), None, LOOP.splitlines(True), name)  # for check's source
    exec(compile(LOOP, name, "exec"), module.__dict__)
    clock = [0.0]
    monkeypatch.setattr(verl_driver.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(verl_driver, "_CLOCK", verl_driver._Clock())
    monkeypatch.setattr(verl_driver, "_STATE", {"monitors": None, "entropy": None, "drift": None})
    monkeypatch.setattr(verl_driver, "_objective", lambda config: None)
    verl_driver.install(module)
    return module, clock


@pytest.mark.parametrize(("budget", "steps"), [(2.5, 3), (3.0, 3), (None, 10), (100.0, 10)])
def test_the_budget_ends_the_run_after_the_step_that_spends_it(
    verl_like: tuple[types.ModuleType, list[float]], monkeypatch: pytest.MonkeyPatch,
    budget: float | None, steps: int,
) -> None:  # fmt: skip
    """1 s per step, a budget of 2.5 s: steps 1-3 run (the own engine starts step 3 with 2 s
    spent), step 3 is verl's last: its checkpoint, its validation, then the loop ends."""
    module, clock = verl_like
    if budget is not None:
        monkeypatch.setenv(verl_driver.BUDGET_ENV, str(budget))
    else:
        monkeypatch.delenv(verl_driver.BUDGET_ENV, raising=False)
    trainer = module.RayPPOTrainer(10, clock, 1.0, _batch())
    trainer.fit()
    assert trainer.global_steps - 1 == steps
    assert trainer.saved == [steps] and trainer.validated == [steps]
    assert [row[verl_driver.RL_SECONDS_METRIC] for row in trainer.log] == [
        float(s) for s in range(1, steps + 1)]  # fmt: skip
    assert all(row["critic/score/mean"] == 0.5 for row in trainer.log)  # verl's own kept


def test_the_clock_continues_from_the_parts_before_a_resume(
    verl_like: tuple[types.ModuleType, list[float]], monkeypatch: pytest.MonkeyPatch
) -> None:
    module, clock = verl_like
    monkeypatch.setenv(verl_driver.BUDGET_ENV, "5")
    monkeypatch.setenv(verl_driver.RL_SECONDS_ENV, "3.5")
    monkeypatch.setattr(verl_driver, "_CLOCK", verl_driver._Clock())
    trainer = module.RayPPOTrainer(10, clock, 1.0, _batch())
    trainer.fit()
    assert trainer.global_steps - 1 == 2  # 4.5 s after one step, 5.5 s after two


def test_step_limit_is_an_int_elsewhere() -> None:
    limit = verl_driver.StepLimit(7)
    assert limit == 7 and int(limit) + 1 == 8 and f"{limit}" == "7"
    assert bool(7 >= limit) and not bool(6 >= limit)  # noqa: SIM300 - verl's own form


def test_step_metrics_monitor_entropy_and_failures(
    verl_like: tuple[types.ModuleType, list[float]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """reg/<name> = the token mean of D(pi_old || pi_ref) (the own engine's formula),
    ``entropy`` the token mean at pi_old, the step's reward failures counted."""
    module, clock = verl_like
    batch = _batch(failed=[0.0, 1.0, 1.0, 0.0])
    built = ObjectiveSpec.load({"regularizer": {"name": "prob_l2", "coef": 0.1}}).build()
    monkeypatch.setattr(verl_driver, "_objective", lambda config: built)
    trainer = module.RayPPOTrainer(1, clock, 1.0, batch)
    trainer.fit()
    row = trainer.log[0]
    t = batch.batch
    mask = t["response_mask"].double()
    old, ref = t["old_log_probs"].double(), t["ref_log_prob"].double()
    for name in ("prob_l2", "kl_k3", "kl_k1"):
        values = get_regularizer(name)(logp=old, old_logp=old, anchor_logp=ref, mask=mask)
        # float32 in the hook against float64 here: a few float32 ulps on values of order 1
        assert row[f"reg/{name}"] == pytest.approx(float((values * mask).sum() / mask.sum()),
                                                   rel=1e-5, abs=1e-7), name  # fmt: skip
    assert set(built.monitors) == {k.removeprefix("reg/") for k in row if k.startswith("reg/")}
    entropy = float((t["entropys"].double() * mask).sum() / mask.sum())
    assert row[verl_driver.ENTROPY_METRIC] == pytest.approx(entropy, rel=1e-6)
    assert row[verl_driver.FAILURES_METRIC] == 2.0


def test_a_step_without_one_usable_reward_stops_the_run(
    verl_like: tuple[types.ModuleType, list[float]]
) -> None:
    module, clock = verl_like
    trainer = module.RayPPOTrainer(3, clock, 1.0, _batch(failed=[1.0, 1.0, 1.0, 1.0]))
    with pytest.raises(RuntimeError, match="no usable reward for any of the 4 completions"):
        trainer.fit()


def test_no_reference_no_monitor(verl_like: tuple[types.ModuleType, list[float]],
                                 monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    module, clock = verl_like
    batch = _batch()
    del batch.batch["ref_log_prob"]
    built = types.SimpleNamespace(monitors={"prob_l2": get_regularizer("prob_l2")}, controlled=())
    monkeypatch.setattr(verl_driver, "_objective", lambda config: built)
    trainer = module.RayPPOTrainer(1, clock, 1.0, batch)
    trainer.fit()
    assert not any(k.startswith("reg/") for k in trainer.log[0])


def test_a_controlled_in_reward_coefficient_moves_is_logged_and_resumes(
    verl_like: tuple[types.ModuleType, list[float]], monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:  # fmt: skip
    """The driver's controller replaces verl's: apply_kl_penalty penalises with the step's
    coefficient, which then moves by Ziegler's update from the step's reg/kl_k3 (verl's own
    update call is ignored); both are logged under the shared names; the next step's value is
    saved beside each checkpoint and a resume continues it bit for bit."""
    module, clock = verl_like
    built = ObjectiveSpec.load({"monitor_regularizers": False, "regularizer": {
        "name": "kl_k3", "coef": 0.5, "placement": "reward",
        "control": {"target": 0.02, "horizon": 4}}}).build()  # fmt: skip
    monkeypatch.setattr(verl_driver, "_objective", lambda config: built)
    config = types.SimpleNamespace(trainer=types.SimpleNamespace(default_local_dir=str(tmp_path)))
    batch = _batch()
    full = module.RayPPOTrainer(3, clock, 1.0, batch, config=config, save_every=1)
    full.fit()
    coefs = [row["drift_coef/kl_k3"] for row in full.log]
    measures = [row["drift_measure/kl_k3"] for row in full.log]
    assert measures == [row["reg/kl_k3"] for row in full.log]  # the measure the others read
    expected = [0.5]
    for m in measures[:-1]:
        expected.append(proportional_coef(expected[-1], m, target=0.02, horizon=4.0))
    assert coefs == expected and batch.penalties == coefs and len(set(coefs)) == 3
    # written before verl's own save (which marks the checkpoint complete), folder and all
    saved = json.loads((tmp_path / "global_step_2" / verl_driver.DRIFT_STATE_FILE).read_text())
    assert saved == {"kl_k3": coefs[2]}  # the next step's
    assert not list(tmp_path.glob("global_step_*/*.tmp"))
    again = _batch()
    resumed = module.RayPPOTrainer(3, clock, 1.0, again, config=config, resume_step=2)
    resumed.fit()
    assert [row["drift_coef/kl_k3"] for row in resumed.log] == coefs[2:] == again.penalties
    (tmp_path / "global_step_2" / verl_driver.DRIFT_STATE_FILE).unlink()
    with pytest.raises(ValueError, match="written without the controlled coefficient"):
        module.RayPPOTrainer(3, clock, 1.0, _batch(), config=config, resume_step=2).fit()


def test_a_verl_without_the_hooked_names_is_named() -> None:
    module = types.ModuleType("old_verl")
    module.compute_data_metrics = lambda batch: {}  # type: ignore[attr-defined]
    module.marked_timer = contextlib.nullcontext  # type: ignore[attr-defined]
    module.apply_kl_penalty = lambda data, kl_ctrl: None  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="RayPPOTrainer.fit"):
        verl_driver.check(module)


def test_a_fit_whose_last_step_is_decided_elsewhere_is_named(
    verl_like: tuple[types.ModuleType, list[float]]
) -> None:
    module, _ = verl_like
    module.RayPPOTrainer.fit.__wrapped__ = lambda self: None  # a loop without the decision
    with pytest.raises(RuntimeError, match="is_last_step = self.global_steps"):
        verl_driver.check(module)


def test_importing_it_outside_verl_changes_nothing() -> None:
    import sys

    assert not any(isinstance(f, verl_driver._AfterImport) for f in sys.meta_path)


def test_a_failed_reward_is_marked_for_the_count(tmp_path: Path) -> None:
    """verl's reward function (gbmpo.engines.verl.reward) marks a failed reward (scored 0, as on
    the own engine) with FAILED_KEY on training rows, which the driver hooks sum per step."""
    from gbmpo.config import dump_yaml, load_config
    from gbmpo.engines.verl.reward import compute_score

    (tmp_path / "r.py").write_text(
        "def reward(prompts, completions, **kw):\n"
        "    return [1.0 if 'ok' in c else float('nan') for c in completions]\n")  # fmt: skip
    (tmp_path / "d.jsonl").write_text('{"prompt": "1 + 1 =", "answer": "2"}\n' * 4)
    params = {"path": str(tmp_path / "d.jsonl"), "reward": f"{tmp_path / 'r.py'}:reward"}
    cfg = load_config(None, [("task.name", "jsonl"), ("task.params", params)])
    (tmp_path / "config.yaml").write_text(dump_yaml(cfg))
    info = {"split": "train", "prompt": "1 + 1 =", "columns": json.dumps({"answer": "2"})}
    kw = {"data_source": "gbmpo/jsonl", "ground_truth": "2", "extra_info": info,
          "gbmpo_config": str(tmp_path / "config.yaml")}  # fmt: skip
    assert compute_score(solution_str=" ok", **kw) == {
        "score": 1.0, "acc": 1.0, verl_driver.FAILED_KEY: 0.0}
    assert compute_score(solution_str=" no", **kw) == {
        "score": 0.0, "acc": 0.0, verl_driver.FAILED_KEY: 1.0}
