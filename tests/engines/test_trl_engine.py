"""``gbmpo train --engine trl``: TRL's GRPOTrainer (GBMPOTrainer) built from a gbmpo config, on the
embedded tiny model; the same run directory as the own engine; 2 processes through accelerate
(gloo on CPU), whose first update on a fixed batch equals the 1-process update."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("trl")

from gbmpo.cli import main  # noqa: E402
from gbmpo.config import ConfigError, load_config  # noqa: E402
from gbmpo.engines.trl.args import batch_layout, grpo_args, lr_at  # noqa: E402
from gbmpo.io.metrics import STEP_METRICS, SUMMARY_KEYS, is_shared  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--rollout.prompts_per_step", "2", "--num-generations", "4", "--max-new-tokens", "16",
         "--optim.mini_batch_size", "4", "--eval.limit", "8", "--eval.max_new_tokens", "16",
         "--run.progress", "false", "--run.checkpoint_every", "0"]  # fmt: skip


def _k(run: Path) -> int:
    """Optimizer steps per RL step of the run ``run``."""
    return batch_layout(load_config(run / "config.yaml"), 1).optimizer_steps


def _checkpoints(run: Path) -> list[str]:
    """The checkpoint folders of the run ``run`` (TRL also writes a model card there)."""
    return sorted(p.name for p in (run / "checkpoints").iterdir() if p.is_dir())


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TOKENIZERS_PARALLELISM": "false"}


def test_batch_layout() -> None:
    cfg = load_config()  # 8 prompts x 8 completions, mini-batches of 16
    one, two = batch_layout(cfg, 1), batch_layout(cfg, 2)
    assert (one.per_device, one.grad_accum, one.steps_per_generation, one.optimizer_steps) == (
        16, 1, 4, 4)  # fmt: skip
    assert (two.per_device, two.grad_accum, two.steps_per_generation) == (8, 1, 4)
    cfg.optim.micro_batch_size = 4
    assert batch_layout(cfg, 2).grad_accum == 2
    cfg.optim.mini_batch_size = 8
    with pytest.raises(ConfigError, match="must be a multiple of run.num_processes=3"):
        batch_layout(cfg, 3)


def test_every_batch_layout_refusal_is_the_support_matrix_s() -> None:
    """A mini-batch, micro-batch and process count that TRL's batch layout cannot take is
    refused by the support matrix first (check_support names the key and the engine), so the
    refusal is in the matrix, not only in the engine's code."""
    from gbmpo.config.support import check_support

    seen = 0
    for world in (1, 2, 3, 4):
        for mini in (None, 4, 8, 16):
            for micro in (None, 1, 2, 3, 4, 6):
                cfg = load_config(None, [("engine", "trl"), ("run.num_processes", world),
                                         ("optim.mini_batch_size", mini),
                                         ("optim.micro_batch_size", micro)])  # fmt: skip
                try:
                    batch_layout(cfg, world)
                except ConfigError:
                    seen += 1
                    with pytest.raises(ConfigError, match="engine 'trl'"):
                        check_support(cfg, "trl")
    assert seen > 10


def test_grpo_args_follow_the_config(tmp_path: Path) -> None:
    cfg = load_config(None, [("objective.surrogate.name", "atr"),
                             ("objective.surrogate.params", {"delta": 0.02}),
                             ("advantage", "grpo"), ("aggregation", "grpo"),
                             ("optim.mu", 2), ("steps", 3)])  # fmt: skip
    args = grpo_args(cfg, tmp_path)
    assert args.objective["surrogate"] == {"name": "atr", "params": {"delta": 0.02}}
    assert (args.loss_type, args.scale_rewards, args.num_iterations) == ("grpo", "group", 2)
    assert args.generation_batch_size == 64 and args.num_generations == 8
    assert args.max_steps == 3 * 8 and args.learning_rate == cfg.optim.lr


def test_same_yaml_runs_with_both_engines(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """One YAML file, --engine gbmpo and --engine trl: the same run-directory files."""
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text(yaml.safe_dump({"run": {"steps": 1, "time_budget_seconds": None}}))
    dirs = {}
    for engine in ("gbmpo", "trl"):
        out = tmp_path / engine
        assert main(["train", "--config", str(cfg_file), "--engine", engine,
                     "--output-dir", str(out), *SMALL]) == 0  # fmt: skip
        dirs[engine] = out
    shared, summaries, last = {}, {}, {}
    for engine, out in dirs.items():
        for name in ("config.yaml", "metrics.jsonl", "summary.json", "model/config.json"):
            assert (out / name).is_file(), (engine, name)
        summary = summaries[engine] = json.loads((out / "summary.json").read_text())
        assert summary["steps"] == 1 and summary["status"] == "finished"
        # run.checkpoint_every 0: the final checkpoint only, on both engines
        assert _checkpoints(out) == (
            ["step-1"] if engine == "gbmpo" else [f"checkpoint-{_k(out)}"]), engine
        assert "accuracy" in summary["eval_before"] and "accuracy" in summary["eval_after"]
        assert load_config(out / "config.yaml").engine == engine
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        train_rows = [r for r in rows if "loss" in r]
        assert len(train_rows) == 1 and train_rows[0]["step"] == 1
        last[engine] = train_rows[0]
        assert "reg/prob_l2" in train_rows[0] and "reward_mean" in train_rows[0], engine
        # the schema's names: every step metric, reg/<name> for every registered regularizer
        names = {k for k in train_rows[0] if is_shared(k) and not k.startswith("time/")}
        assert set(STEP_METRICS) <= names, (engine, set(STEP_METRICS) - names)
        shared[engine] = names
        assert not [k for k in train_rows[0] if not is_shared(k) and "/" in k
                    and not k.startswith("trl/")], engine  # fmt: skip
    assert shared["trl"] == shared["gbmpo"]
    assert type(last["trl"]["response_length_max"]) is type(last["gbmpo"]["response_length_max"])
    # the same summary keys; the host's own values under its prefix
    host_only = {k for k in summaries["trl"] if k.startswith("trl/")}
    assert set(summaries["trl"]) - host_only == set(summaries["gbmpo"])
    assert set(SUMMARY_KEYS) <= set(summaries["trl"])
    assert set(summaries["gbmpo"]) & set(SUMMARY_KEYS) <= set(summaries["trl"])
    assert summaries["trl"]["engine"] == "trl" and summaries["trl"]["dtype"] == "float32"
    assert "finished 1 steps (trl)" in capsys.readouterr().out


@pytest.mark.parametrize(("key", "value"), [("objective.regularizer.estimator", "full"),
                                          ("objective.regularizer.placement", "reward")])
def test_the_whole_knob_runs_on_trl_from_the_cli(key: str, value: str, tmp_path: Path) -> None:
    """The exact full-vocabulary divergence and the in-reward penalty train on TRL from the CLI
    (embedded model, 2 steps), with the own engine's metric names."""
    names = {}
    for engine in ("gbmpo", "trl"):
        out = tmp_path / engine
        assert main(["train", "--engine", engine, "--steps", "2", f"--{key}", value,
                     "--eval.before", "false", "--eval.after", "false",
                     "--output-dir", str(out), *SMALL]) == 0  # fmt: skip
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        train = [r for r in rows if "loss" in r]
        assert len(train) == 2 and all(math.isfinite(r["loss"]) for r in train), engine
        # (the values themselves are pinned against the own engine in test_trl_knob.py)
        assert all(math.isfinite(r["reward_penalty" if value == "reward" else "reg_value"])
                   for r in train), engine  # fmt: skip
        names[engine] = {k for k in train[0] if is_shared(k) and not k.startswith("time/")}
        summary = json.loads((out / "summary.json").read_text())
        label = load_config(out / "config.yaml").objective.regularizer_label
        assert summary["regularizer"] == label
    assert names["trl"] == names["gbmpo"], names["trl"] ^ names["gbmpo"]


def test_static_decode_step_trains_on_trl_as_the_dynamic_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rollout.decode_step static on TRL (transformers' static KV cache; on the CPU
    uncompiled) trains with the same metric names as lean (TRL's dynamic cache), and samples
    the same tokens for the same seed, so the same losses and lengths. Exact equality is
    expected: the two caches give the same logits up to float rounding (the static one attends
    over masked padding slots, weight exactly 0, which changes only the summation order), and
    a sampled token differs only if a uniform draw falls within that rounding of a
    cumulative-probability boundary; with fixed seeds and inputs the outcome is deterministic,
    so this cannot flicker between runs."""
    from transformers.generation.utils import GenerationMixin

    from gbmpo.train.setup import build_task, load_splits, load_tokenizer

    decided = GenerationMixin._valid_auto_compile_criteria
    seen: list[tuple[str, bool, int | None]] = []

    def spy(self: object, model_kwargs: dict, generation_config: object) -> bool:
        cache = model_kwargs.get("past_key_values")
        length = getattr(cache.layers[0], "max_cache_len", None)  # type: ignore[union-attr]
        seen.append((type(cache).__name__, generation_config.disable_compile,  # type: ignore[attr-defined]
                     length))  # fmt: skip
        return decided(self, model_kwargs, generation_config)

    monkeypatch.setattr(GenerationMixin, "_valid_auto_compile_criteria", spy)
    rows, caches = {}, {}
    for step in ("lean", "static"):
        out = tmp_path / step
        seen.clear()
        assert main(["train", "--engine", "trl", "--steps", "2", "--rollout.decode_step", step,
                     "--eval.before", "false", "--eval.after", "false",
                     "--output-dir", str(out), *SMALL]) == 0  # fmt: skip
        assert load_config(out / "config.yaml").rollout.decode_step == step
        lines = (out / "metrics.jsonl").read_text().splitlines()
        rows[step] = [r for r in map(json.loads, lines) if "loss" in r]
        caches[step] = set(seen)
    # TRL's generation (one process: this one): the dynamic cache uncompiled, or the static one
    # with transformers' compile allowed (which it then skips on the CPU), one length for the
    # run (the longest training prompt + 16 new tokens: no recompilation on CUDA)
    assert {(name, off) for name, off, _ in caches["lean"]} == {("DynamicCache", True)}
    (static,) = caches["static"]
    run_cfg = load_config(tmp_path / "static" / "config.yaml")
    tok = load_tokenizer(run_cfg)
    train, _, _ = load_splits(run_cfg, build_task(run_cfg, tok))
    longest = max(len(tok(ex["prompt"])["input_ids"]) for ex in train) + 16
    assert static == ("StaticCache", False, longest)
    names = {step: {k for k in train[0] if not k.startswith("time/")}
             for step, train in rows.items()}  # fmt: skip
    assert names["static"] == names["lean"], names["static"] ^ names["lean"]
    for key in ("loss", "reward_mean", "response_length_mean"):
        assert [r[key] for r in rows["static"]] == [r[key] for r in rows["lean"]], key


def test_time_budget_decays_the_rate_and_eval_every_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """--steps 100 with a time budget: the cosine decays over the RL time that runs (on TRL's
    own schedule it would stay near its peak), one rate per RL step; eval.every evaluates
    during training with the own engine's rows; the console shows RL steps, not TRL's bar."""
    out = tmp_path / "run"
    argv = ["train", "--engine", "trl", "--steps", "100", "--time-budget", "8",
            "--eval-every", "2", "--output-dir", str(out), *SMALL]  # fmt: skip
    argv[argv.index("--run.progress") + 1] = "true"
    assert main(argv) == 0
    err = capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stop_reason"] == "time_budget" and 2 <= summary["steps"] < 100
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    lrs = [r["lr"] for r in train]
    assert lrs[0] == pytest.approx(5e-5)
    assert all(a > b for a, b in zip(lrs, lrs[1:], strict=False)), lrs
    # the last rate follows the RL time used before its step (the own engine's rule)
    before_last = train[-2]["time/rl_seconds"]
    assert lrs[-1] == pytest.approx(lr_at(load_config(out / "config.yaml"), len(train) - 1,
                                          before_last))  # fmt: skip
    assert lrs[-1] < 0.75 * 5e-5  # TRL's schedule over 100 steps: still > 0.99 of the peak
    assert train[-1]["time/rl_seconds"] >= 8.0 > train[-2]["time/rl_seconds"]
    n = len(train)
    evals = [r["step"] for r in rows if "eval/accuracy" in r]
    # before, every 2 RL steps (in the step's row), after (the last one reused when it is there)
    assert evals == [0, *range(2, n + 1, 2)] + ([n] if n % 2 else [])
    assert "step " in err and "/100" in err and "/8s" in err  # gbmpo's RL-step bar
    # the budget's stop saves the run's final checkpoint (checkpoint_every 0: the only one)
    assert _checkpoints(out) == [f"checkpoint-{n * _k(out)}"]
    assert "it/s" not in err and "FutureWarning" not in err  # no TRL tqdm, no host noise


def test_bf16_trains_fp32_weights_and_prints_the_no_effect_notices(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """bfloat16: fp32 weights under bf16 autocast; eval.auto_limit: the own engine's held-out
    subset (eval.limit unset); a no-effect key: one notice at the start."""
    out = tmp_path / "run"
    assert main(["train", "--engine", "trl", "--steps", "1", "--model.dtype", "bfloat16",
                 "--rollout.batch_size", "1", "--eval.before", "false",
                 "--output-dir", str(out), *SMALL,
                 "--eval.limit", "null", "--eval.auto_limit", "6"]) == 0  # fmt: skip
    err = capsys.readouterr().err
    assert err.count("rollout.batch_size=1 has no effect") == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dtype"] == "float32" and summary["trl/mixed_precision"] == "bf16"
    assert summary["fp32_master_weights"] is True and summary["eval_before"] is None
    assert summary["eval_after"]["n"] == 6  # the first 6 of the 200 test examples


def test_vllm_maps_to_trl_vllm_in_the_dry_run(capsys: pytest.CaptureFixture) -> None:
    assert main(["train", "--engine", "trl", "--rollout.generator", "vllm", "--dry-run"]) == 0
    report = json.loads(capsys.readouterr().out.split("dry run OK: ", 1)[1])
    assert report["engine"] == "trl" and report["checks"]["GRPOConfig"].startswith("ok")
    assert "vllm_mode=colocate" in report["checks"]["vllm"]
    cfg = load_config(None, [("engine", "trl"), ("rollout.generator", "vllm")])
    assert grpo_args(cfg, "unused").use_vllm is True


def test_own_engine_refuses_vllm(capsys: pytest.CaptureFixture) -> None:
    assert main(["train", "--rollout.generator", "vllm", "--dry-run"]) == 2
    # the support matrix's refusal, naming the engine (not an unknown name)
    assert "'rollout.generator'='vllm' is not supported by engine 'gbmpo'" in \
        capsys.readouterr().err


# A 2-process run from the command line to its end (summary line, summary.json with
# trl/world_size 2, the saved model): test_trl_signals.py's stop-and-resume test, whose launch
# covers it.


def test_bnpo_update_does_not_depend_on_the_micro_batch_size(tmp_path: Path) -> None:
    """bnpo on TRL is the token mean of the optimizer step (the own engine's mini-batch): the
    first SGD update on a fixed batch of ragged completions is the same with one micro-batch of
    16 and with four of 4 (TRL's own bnpo normalises each micro-batch by its own tokens)."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location(
        "_trl_fixed_batch_update", Path(__file__).with_name("_trl_fixed_batch_update.py"))
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    deltas = []
    for micro in (None, 4):
        module.main(str(tmp_path / f"{micro}.pt"), "bnpo", micro)
        deltas.append(torch.load(tmp_path / f"{micro}.pt")["delta"])
    assert deltas[0].abs().max() > 1e-4
    assert torch.allclose(deltas[0], deltas[1], rtol=1e-4, atol=1e-7), float(
        (deltas[0] - deltas[1]).abs().max())


@pytest.mark.slow
def test_first_update_on_a_fixed_batch_is_the_same_on_two_processes(tmp_path: Path) -> None:
    """dr_grpo and bnpo, each trained in turn in the same launch (one launch of 2 processes
    instead of one per aggregation); the 1-process update in this process (as in
    test_bnpo_update_does_not_depend_on_the_micro_batch_size), not in a fresh one that would
    import torch, transformers and TRL again."""
    import importlib.util

    import torch

    script = Path(__file__).with_name("_trl_fixed_batch_update.py")
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
              "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
              "--dynamo_backend", "no"]  # fmt: skip
    aggregations = ["dr_grpo", "bnpo"]
    proc = subprocess.run([*launch, str(script), str(tmp_path / "two.pt"),
                           ",".join(aggregations)], env=_env(), capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    spec = importlib.util.spec_from_file_location("_trl_fixed_batch_update", script)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    module.main(str(tmp_path / "one.pt"), ",".join(aggregations))
    ones, twos = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert sorted(ones) == sorted(twos) == sorted(aggregations)
    measured = {}
    for aggregation in aggregations:
        one, two = ones[aggregation], twos[aggregation]
        assert (one["world"], two["world"]) == (1, 2), aggregation
        d1, d2 = one["delta"], two["delta"]
        assert d1.abs().max() > 1e-4, aggregation  # the step moved the weights
        assert torch.allclose(d1, d2, rtol=1e-4, atol=1e-7), (
            aggregation, float((d1 - d2).abs().max()))
        measured[aggregation] = {"max_abs_diff": float((d1 - d2).abs().max()),
                                 "max_abs_change": float(d1.abs().max())}  # fmt: skip
    if os.environ.get("GBMPO_RESULT_JSON"):  # scripts/engines_end_to_end.py reads the figures
        Path(os.environ["GBMPO_RESULT_JSON"]).write_text(json.dumps(measured, indent=1) + "\n")
