"""``gbmpo train --engine verl`` pieces in verl's own environment: the Hydra overrides composed from
a gbmpo config pass verl's validation and select exactly the spec's objective; the reward function
verl loads (``reward.custom_reward_function``), called with verl's own signature on the data files
the engine writes, equals the gbmpo task's reward on the same completions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("verl")

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

import gbmpo.integrations.verl as gv  # noqa: E402
from gbmpo.config import dump_yaml, load_config  # noqa: E402
from gbmpo.engines.verl.args import overrides, write_data  # noqa: E402
from gbmpo.engines.verl.check import check  # noqa: E402
from gbmpo.objectives import get_regularizer, get_surrogate  # noqa: E402
from gbmpo.train.setup import build_task, load_tokenizer  # noqa: E402


@pytest.fixture(autouse=True)
def _reset_kl_params() -> Any:
    yield
    gv.configure_kl({})


def _compose(ov: list[str]) -> Any:
    import verl

    config_dir = Path(verl.__file__).parent / "trainer" / "config"
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose(config_name="ppo_trainer", overrides=ov)


@pytest.mark.parametrize(
    ("settings", "surrogate", "regularizer"),
    [
        ([], get_surrogate("clip"), get_regularizer("prob_l2")),
        ([("objective.surrogate.name", "atr"), ("objective.surrogate.params", {"delta": 0.02}),
          ("advantage", "grpo"), ("aggregation", "bnpo"), ("regularizer", "none"),
          ("coef", 0.0)], get_surrogate("atr", delta=0.02), None),
        ([("objective.surrogate.params", {"eps_low": 0.2, "eps_high": 0.28, "dual_clip_c": 3.0}),
          ("regularizer", "rpg_ufkl"), ("anchor", "old"), ("coef", 1e-4),
          ("objective.regularizer.params", {"clamp": 10.0})],
         get_surrogate("clip", eps_low=0.2, eps_high=0.28, dual_clip_c=3.0),
         get_regularizer("rpg_ufkl", clamp=10.0)),
    ],
)  # fmt: skip
def test_overrides_select_the_spec_objective(
    tmp_path: Path, settings: list[tuple[str, Any]], surrogate: Any, regularizer: Any
) -> None:
    cfg = load_config(None, [("engine", "verl"), *settings])
    ov = overrides(cfg, tmp_path / "run")
    result = check(ov)  # verl's validate_config on the composed ppo_trainer.yaml
    assert result["surrogate"] == surrogate.name
    from verl.utils.config import omega_conf_to_dataclass

    actor = omega_conf_to_dataclass(_compose(ov).actor_rollout_ref.actor)
    chosen = gv.describe(actor)
    assert chosen["surrogate"] == surrogate  # every parameter, none taken from verl's defaults
    if regularizer is None:  # no term: a KL loss of coefficient 0, for the monitors' reference
        assert chosen["regularizer"] is None
        assert actor.use_kl_loss is cfg.objective.monitor_regularizers is True
        assert actor.kl_loss_coef == 0.0
    else:
        assert chosen["regularizer"].name == regularizer.name
        assert chosen["regularizer"].params == regularizer.params
        assert chosen["anchor"] == cfg.objective.regularizer.anchor
        assert actor.kl_loss_coef == cfg.objective.regularizer.coef


def test_reward_function_with_verls_signature_equals_the_task_reward(tmp_path: Path) -> None:
    from verl.trainer.ppo.reward import get_custom_reward_fn

    run_dir = tmp_path / "run"
    cfg = load_config(None, [("engine", "verl"), ("output-dir", str(run_dir))])
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(dump_yaml(cfg))
    task = build_task(cfg, load_tokenizer(cfg))
    counts = write_data(cfg, task, run_dir / "data")
    assert counts["train"] == len(task.split(task.train_split))
    fn = get_custom_reward_fn(_compose(overrides(cfg, run_dir)))
    assert fn is not None
    rows = pd.read_parquet(run_dir / "data" / "train.parquet").head(6)
    examples = task.split(task.train_split)[:6]
    n_right = 0
    for (_, row), ex in zip(rows.iterrows(), examples, strict=True):
        assert row["prompt"][0]["content"] == ex["prompt"]  # gbmpo's rendering, unchanged
        for completion in (ex["solution"], " 12 #### 99999", ""):
            got = fn(data_source=row["data_source"], solution_str=completion,
                     ground_truth=row["reward_model"]["ground_truth"],
                     extra_info=row["extra_info"])  # fmt: skip
            cols = {k: [v] for k, v in json.loads(row["extra_info"]["columns"]).items()}
            want = task.reward([ex["prompt"]], [completion], **cols)[0] or 0.0
            assert got == {"score": want, "acc": float(want >= 1.0),  # (no failure here)
                           "gbmpo_reward_failed": 0.0}, (completion, got, want)
            n_right += got["score"] == 1.0
    assert n_right == 6  # the gold solutions score 1


def test_plugin_prints_the_overrides_of_an_objective_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The verl plugin takes the same spec: ``python -m gbmpo.integrations.verl --objective``
    (its ``main``, here in this process; tests/test_readme.py runs the command itself)."""
    import yaml

    spec = {"advantage": "grpo", "aggregation": "bnpo", "regularizer": {"name": "none", "coef": 0},
            "surrogate": {"name": "atr", "params": {"delta": 0.02}}}  # fmt: skip
    path = tmp_path / "objective.yaml"
    path.write_text(yaml.safe_dump({"objective": spec}))
    code = gv.main(["--objective", str(path)])
    out = capsys.readouterr()
    assert code == 0, out.err[-2000:]
    lines = out.out.split()
    assert lines == gv.objective_overrides(spec, max_response_length=1024)
    key = "+actor_rollout_ref.actor.policy_loss.gbmpo_objective="
    (line,) = [o for o in lines if o.startswith(key)]
    assert json.loads(line.split("=", 1)[1][1:-1])["surrogate"] == spec["surrogate"]
    from verl.utils.config import omega_conf_to_dataclass

    composed = _compose([*lines, "actor_rollout_ref.actor.use_dynamic_bsz=true"])
    actor = composed.actor_rollout_ref.actor
    chosen = gv.describe(omega_conf_to_dataclass(actor))
    assert chosen["surrogate"] == get_surrogate("atr", delta=0.02)
    assert chosen["surrogate"] is chosen["objective"].surrogate  # the one built objective


def test_data_files_give_the_longest_prompt(tmp_path: Path) -> None:
    cfg = load_config(None, [("engine", "verl")])
    tok = load_tokenizer(cfg)
    task = build_task(cfg, tok)
    counts = write_data(cfg, task, tmp_path, tok)
    longest = max(len(tok(ex["prompt"])["input_ids"]) for name in ("train", "test")
                  for ex in task.split(name))  # fmt: skip
    assert counts["max_prompt_tokens"] == longest
    ov = overrides(cfg, tmp_path, max_prompt_length=longest)
    assert f"data.max_prompt_length={longest}" in ov


def test_held_out_rows_are_graded_as_the_own_evaluation(tmp_path: Path) -> None:
    """On data/test.parquet the reward function returns the own evaluation's grading: ``acc`` is
    its ``correct`` and ``score`` its reward (:func:`gbmpo.eval.evaluation.score_samples`)."""
    from verl.trainer.ppo.reward import get_custom_reward_fn

    from gbmpo.eval.evaluation import score_samples

    run_dir = tmp_path / "run"
    cfg = load_config(None, [("engine", "verl"), ("output-dir", str(run_dir))])
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(dump_yaml(cfg))
    task = build_task(cfg, load_tokenizer(cfg))
    write_data(cfg, task, run_dir / "data")
    fn = get_custom_reward_fn(_compose(overrides(cfg, run_dir)))
    rows = pd.read_parquet(run_dir / "data" / "test.parquet").head(4)
    examples = task.split(task.eval_split)[:4]
    assert all(r["extra_info"]["split"] == "test" for _, r in rows.iterrows())
    for (_, row), ex in zip(rows.iterrows(), examples, strict=True):
        for completion in ("", ex["solution"], " 12 #### 99999"):
            got = fn(data_source=row["data_source"], solution_str=completion,
                     ground_truth=row["reward_model"]["ground_truth"],
                     extra_info=row["extra_info"])  # fmt: skip
            graded = score_samples(task, [completion], [ex])[0]
            assert got == {"score": float(graded["reward"] or 0.0),
                           "acc": float(graded["correct"])}, (completion, got, graded)


def _verls_val_metrics_update() -> Any:
    """``RayPPOTrainer._val_metrics_update`` (it does not use ``self``): imported, or, where the
    trainer module's optional imports (cachetools, ...) are missing, verl's own source of that
    method run on ``process_validation_metrics``."""
    try:
        from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    except ImportError:
        import ast
        import importlib.util

        from verl.trainer.ppo.metric_utils import process_validation_metrics

        spec = importlib.util.find_spec("verl.trainer.ppo.ray_trainer")
        assert spec is not None and spec.origin is not None
        source = Path(spec.origin).read_text()
        cls = next(n for n in ast.parse(source).body
                   if isinstance(n, ast.ClassDef) and n.name == "RayPPOTrainer")  # fmt: skip
        name = "_val_metrics_update"
        fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name)
        namespace: dict[str, Any] = {"np": np, "process_validation_metrics":
                                     process_validation_metrics}  # fmt: skip
        exec(compile(ast.Module([fn], []), spec.origin, "exec"), namespace)  # noqa: S102
        return namespace["_val_metrics_update"]
    return RayPPOTrainer._val_metrics_update


def test_summary_from_verls_own_logger_and_validation_metrics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """verl's FileLogger and RayPPOTrainer's validation-metric code, fed with the reward
    function's results as ``_validate`` feeds them, give the summary the own evaluation's
    accuracy of the same completions, before and after training."""
    from verl.trainer.ppo.reward import get_custom_reward_fn
    from verl.utils.tracking import FileLogger

    from gbmpo.engines.verl.args import data_source
    from gbmpo.engines.verl.metrics import VERL_METRICS_FILE, summarize_run
    from gbmpo.eval.evaluation import score_samples, summarize

    run_dir = tmp_path / "run"
    cfg = load_config(None, [("engine", "verl"), ("output-dir", str(run_dir)),
                             ("model.device", "cuda"), ("run.time_budget_seconds", None),
                             ("objective.monitor_regularizers", False), ("eval.every", 0),
                             ("eval.drift", False), ("run.steps", 2)])  # fmt: skip
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(dump_yaml(cfg))
    task = build_task(cfg, load_tokenizer(cfg))
    counts = write_data(cfg, task, run_dir / "data")
    fn = get_custom_reward_fn(_compose(overrides(cfg, run_dir)))
    rows = pd.read_parquet(run_dir / "data" / "test.parquet")
    examples = task.split(task.eval_split)[: len(rows)]

    def validate(n_right: int) -> tuple[dict[str, Any], float]:
        """verl's validation metrics for completions of which the first n_right are gold."""
        completions = [ex["solution"] if i < n_right else "no answer"
                       for i, ex in enumerate(examples)]  # fmt: skip
        results = [fn(data_source=r["data_source"], solution_str=c,
                      ground_truth=r["reward_model"]["ground_truth"], extra_info=r["extra_info"])
                   for (_, r), c in zip(rows.iterrows(), completions, strict=True)]  # fmt: skip
        infos: dict[str, list[Any]] = {"reward": [r["score"] for r in results]}
        for key in results[0]:
            infos[key] = [r[key] for r in results]
        sources = np.array([data_source(cfg)] * len(rows), dtype=object)
        uids = [str(i) for i in range(len(rows))]
        metrics = _val_metrics_update(None, sources, uids, infos, [])
        graded = score_samples(task, completions, examples)
        records = [{"num_correct": int(g["correct"]), "num_tokens": [1], "rewards": [g["reward"]]}
                   for g in graded]  # fmt: skip
        return metrics, summarize(records, kind=task.kind, samples=1)["accuracy"]

    _val_metrics_update = _verls_val_metrics_update()
    before, acc_before = validate(1)
    after, acc_after = validate(3)
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(run_dir / VERL_METRICS_FILE))
    logger = FileLogger("gbmpo", run_dir.name)
    logger.log(data=before, step=0)
    train = {"training/global_step": 1, "actor/pg_loss": np.float32(0.5),
             "critic/score/mean": 0.25, "timing_s/step": 1.0}  # fmt: skip
    logger.log(data=train, step=1)
    logger.log(data={**train, "training/global_step": 2, **after}, step=2)
    logger.finish()

    summary = summarize_run(cfg, run_dir, kind=task.kind, wall_seconds=1.0, n_eval=counts["test"])
    assert acc_before != acc_after
    assert summary["eval_before"]["accuracy"] == pytest.approx(acc_before)
    assert summary["eval_after"]["accuracy"] == pytest.approx(acc_after)
    assert summary["steps"] == 2
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    last = json.loads(lines[-1])
    assert last["eval/accuracy"] == pytest.approx(acc_after) and last["pg_loss"] == 0.5


def _restore_after(rt: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """verl's trainer module as it is now, restored after the test (the hooks patch it)."""
    for name in ("compute_data_metrics", "marked_timer", "apply_kl_penalty"):
        monkeypatch.setattr(rt, name, getattr(rt, name))
    monkeypatch.setattr(rt, "_gbmpo_driver", False, raising=False)
    for name in ("fit", "_compute_old_log_prob", "_save_checkpoint", "_load_checkpoint"):
        monkeypatch.setattr(rt.RayPPOTrainer, name, getattr(rt.RayPPOTrainer, name))


def test_the_driver_hooks_fit_verls_trainer(monkeypatch: pytest.MonkeyPatch) -> None:
    """gbmpo's driver hooks (gbmpo.engines.verl.driver) against verl's own trainer module:
    the names they wrap and the facts of ``RayPPOTrainer.fit`` they rely on are there; installed,
    verl's step timer still times the step and feeds the RL clock."""
    import verl.trainer.ppo.ray_trainer as rt
    from tqdm import tqdm

    from gbmpo.engines.verl import driver as verl_driver

    _restore_after(rt, monkeypatch)
    monkeypatch.setattr(verl_driver, "_CLOCK", verl_driver._Clock())
    verl_driver.check(rt)
    verl_driver.install(rt)
    verl_driver.check(rt)  # through the wrapper too
    timing: dict[str, float] = {}
    with rt.marked_timer("step", timing):
        pass
    assert timing["step"] >= 0 and verl_driver._CLOCK.seconds() > 0
    assert tqdm(total=verl_driver.StepLimit(3), disable=True).total == 3


def test_verls_in_reward_penalty_uses_the_controlled_coefficient(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """verl's own apply_kl_penalty with the driver's controller in place of its kl_ctrl: the
    rewards are penalised with the controller's value, which then moves by Ziegler's update from
    the batch's reg/kl_k3 (verl's own update call does nothing)."""
    import torch
    import verl.trainer.ppo.ray_trainer as rt
    from verl import DataProto
    from verl.trainer.ppo import core_algos

    from gbmpo.engines.verl import driver as verl_driver
    from gbmpo.objectives.drift_control import proportional_coef
    from gbmpo.objectives.spec import ObjectiveSpec

    _restore_after(rt, monkeypatch)
    built = ObjectiveSpec.load({"monitor_regularizers": False, "regularizer": {
        "name": "kl_k3", "coef": 0.5, "placement": "reward",
        "control": {"target": 0.02, "horizon": 4}}}).build()  # fmt: skip
    monkeypatch.setattr(verl_driver, "_STATE",
                        {"monitors": dict(built.monitors), "entropy": None, "drift": None})
    verl_driver.install(rt)
    ctrl = verl_driver.ControlledKL(built.controlled[0])
    g = torch.Generator().manual_seed(0)
    old, ref = -torch.rand(2, 4, generator=g) - 0.1, -torch.rand(2, 4, generator=g) - 0.1
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.float32)
    scores = torch.zeros(2, 4)
    scores[0, 2], scores[1, 1] = 1.0, 0.0
    data = DataProto.from_dict(tensors={"response_mask": mask, "token_level_scores": scores,
                                        "old_log_probs": old, "ref_log_prob": ref})  # fmt: skip
    out, metrics = rt.apply_kl_penalty(data, kl_ctrl=ctrl, kl_penalty="low_var_kl")
    kld = core_algos.kl_penalty(old, ref, kl_penalty="low_var_kl") * mask
    assert torch.equal(out.batch["token_level_rewards"], scores - 0.5 * kld)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.5
    drift = verl_driver._STATE["drift"]
    assert drift["drift_coef/kl_k3"] == 0.5
    assert ctrl.value == proportional_coef(0.5, drift["drift_measure/kl_k3"], target=0.02,
                                           horizon=4.0)  # fmt: skip
