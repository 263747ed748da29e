"""The benchmark scripts run end to end at toy sizes and write their JSON results.

No timing is asserted (the machine is shared); what is asserted is that every script finishes,
writes the documented keys and prints its one-line summary last, and that the correctness checks
the scripts run (gbmpo's full-vocabulary divergence and selected-token log-probs against the
naive autograd versions, values and gradients; TRL's and gbmpo's loss on one injected batch)
agree to float32 rounding.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"


def _run(script: str, out: Path, *args: str) -> tuple[dict[str, Any], str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), "--out", str(out), *args],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    last = proc.stdout.strip().splitlines()[-1]
    return json.loads(out.read_text()), last


def test_full_vocab_benchmark_toy(tmp_path: Path) -> None:
    data, last = _run(
        "full_vocab.py", tmp_path / "fv.json", "--batch", "1", "--seq", "8", "--vocab", "300",
        "--hidden", "8", "--repeats", "1", "--check-rows", "6", "--chunk-logits", "3",
        "--chunk-hidden", "4", "--modes", "logits", "--variants", "naive,gbmpo",
        "--extra-hidden-chunks", "",
    )
    assert last.startswith("full_vocab:") and str(tmp_path / "fv.json") in last
    entry = data["modes"]["logits"]
    for variant in ("naive", "gbmpo"):
        assert entry[variant]["seconds_min"] > 0
        assert entry[variant]["gradient_gb"] == pytest.approx(8 * 300 * 4 / 1e9)
    assert {"time_ratio_vs_naive", "extra_in_logits_tensors", "goal_met"} <= set(entry)
    # both gbmpo paths (from logits, from hidden states) against naive autograd
    for key in ("logits/gbmpo", "hidden/gbmpo", "logits/before", "hidden/before"):
        assert data["check"][key]["value_max_rel_diff"] < 1e-4, key
        assert data["check"][key]["grad_max_rel_diff"] < 1e-4, key


def test_logprobs_benchmark_toy(tmp_path: Path) -> None:
    data, last = _run(
        "logprobs.py", tmp_path / "lp.json", "--batch", "2", "--seq", "5", "--vocab", "300",
        "--repeats", "1", "--check-rows", "6", "--modes", "grad", "--layouts", "sliced",
        "--variants", "naive,gbmpo",
    )
    assert last.startswith("logprobs:")
    entry = data["results"]["grad/sliced"]
    assert entry["gbmpo"]["seconds_min"] > 0 and "speedup_vs_naive" in entry
    for layout in ("contiguous", "sliced"):
        check = data["check"][f"{layout}/gbmpo"]
        assert check["value_max_abs_diff"] < 1e-5 and check["grad_max_abs_diff"] < 1e-6


def test_trainer_phases_toy(tmp_path: Path) -> None:
    data, last = _run("trainer_phases.py", tmp_path / "ph.json", "--size", "toy", "--steps", "3",
                      "--warmup", "1")
    assert last.startswith("trainer_phases: toy step")
    assert data["steps_kept"] == 2 and data["step_cpu_ms"] > 0
    phases = ("sample_completions", "no_grad_logprobs", "policy_forward", "backward", "adamw")
    for phase in phases:
        assert data[f"{phase}_cpu_ms"] > 0, phase
    # the timed phases are parts of the step
    assert sum(data[f"{phase}_cpu_ms"] for phase in phases) < 1.5 * data["step_cpu_ms"]


def test_trainer_vs_trl_benchmark_toy(tmp_path: Path) -> None:
    pytest.importorskip("trl")
    data, last = _run(
        "trainer_vs_trl.py", tmp_path / "tv.json", "--sizes", "toy", "--steps", "2",
        "--warmup", "1", "--rounds", "1", "--prompts", "2", "--generations", "2",
        "--max-new-tokens", "4", "--num-train", "32", "--baseline", "--no-lean-forward",
        "--peak-repeats", "1", "--gbmpo-src", str(ROOT / "src"),
    )
    assert last.startswith("trainer_vs_trl:")
    entry = data["sizes"]["toy"]
    assert entry["matmul_peak_gflops"] > 0
    # the "before" side imports gbmpo from --gbmpo-src (here the same tree)
    assert entry["runs"]["gbmpo-before"][0]["gbmpo_module"] == str(ROOT / "src" / "gbmpo")
    for side in ("gbmpo", "trl", "gbmpo-hf", "gbmpo-noleanfwd", "gbmpo-before"):
        assert entry[side]["steps_per_second"] > 0 and entry[side]["tokens_per_step"] > 0
        # MFU from the same model-FLOPs formula on every side; prompts measured, not assumed
        assert entry[side]["prompt_tokens_per_step"] > 0
        assert 0 < entry[side]["mfu"] < 1 and 0 < entry[side]["hfu"] <= entry[side]["mfu"]
    # gbmpo forwards each prompt once per group of 2 rows, TRL and gbmpo-hf once per row
    assert entry["gbmpo"]["executed_prompt_tokens_per_step"] == pytest.approx(
        entry["gbmpo"]["prompt_tokens_per_step"] / 2)
    assert entry["trl"]["hfu"] == entry["trl"]["mfu"]
    assert entry["speedup_steps"] > 0 and len(entry["speedup_steps_rounds"]) == 1
    loss = entry["loss_check"]
    assert loss["abs_diff"] < 1e-6, loss  # the same loss on one injected batch
    assert loss["loss_gbmpo"] != 0.0


def test_reliability_suite_quick(tmp_path: Path) -> None:
    """Real ``gbmpo train`` processes killed with SIGKILL and resumed, a race for one output
    directory and a few bad inputs: everything must survive (``lost`` counts a resumed run that
    differs from the uninterrupted one, a corrupt file, an unclear error...)."""
    data, last = _run("reliability.py", tmp_path / "rel.json", "--quick")
    assert last.startswith("reliability:")
    cats = data["categories"]
    assert cats["kill -9 + resume: train"]["tried"] == 2
    assert cats["race for one output dir: train"]["tried"] == 1
    assert {"bad input: config", "bad input: data", "bad input: rewards"} <= set(cats)
    lost = {k: [d for d in c["details"] if not d["ok"]] for k, c in cats.items() if c["lost"]}
    assert data["totals"]["lost"] == 0, lost
    assert data["totals"]["survived"] == data["totals"]["tried"] == 6


def test_estimator_cost_benchmark_toy(tmp_path: Path) -> None:
    data, last = _run(
        "estimator_cost.py", tmp_path / "ec.json", "--batch", "2", "--completion", "6",
        "--prompt", "3", "--vocab", "300", "--hidden", "16", "--repeats", "1",
    )
    assert last.startswith("estimator_cost:") and str(tmp_path / "ec.json") in last
    for variant in ("sample", "full"):
        assert data[variant]["seconds_min"] > 0 and data[variant]["reg_value"] > 0
    assert {"time_ratio", "extra_logits_tensors"} <= set(data["full_vs_sample"])


def test_scale_rehearsal_tiny(tmp_path: Path) -> None:
    """The rehearsal's CPU form: a tiny random Qwen3, both settings (the rehearsal's with a
    planned micro-batch, the paper config's with LoRA), own engine and TRL in one run: the own
    engine's phases with tokens/s, the decode bound and the MFU columns, TRL's seconds per
    step (and with decode_step lean, one step: ``trl (lean)``), the memory plans."""
    data, last = _run("scale_rehearsal.py", tmp_path / "sr.json", "--size", "tiny",
                      "--micro", "planned", "--new-tokens", "6", "--trl-decoders", "auto,lean",
                      "--trl-extra-steps", "1")  # fmt: skip
    assert last.startswith("scale_rehearsal (tiny, cpu") and str(tmp_path / "sr.json") in last
    assert data["device"] == "cpu" and data["parameters"] > 0 and data["new_tokens"] == 6
    limits = data["limits"]
    assert limits["copy_bytes_per_second"] > 0 and limits["matmul_flops"] > 0
    assert limits["datasheet_flops"] is None  # no GPU
    assert set(data["settings"]) == {"rehearsal", "paper"}
    for setting, own_name in (("rehearsal", "gbmpo (micro planned)"), ("paper", "gbmpo")):
        runs = data["settings"][setting]
        own, trl = runs[own_name], runs["trl"]
        assert own["steps_timed"] == 1 and trl["steps_timed"] == 1
        assert own["step_seconds_mean"] > 0 and trl["step_seconds_mean"] > 0
        assert own["plan_peak_gib"] > 0 and own["peak_memory_gib"] is None
        phases = own["phases"]
        assert set(phases) >= {"prefill", "decode", "old policy", "policy fwd+bwd", "optimizer"}
        for name in ("prefill", "decode", "old policy", "policy fwd+bwd"):
            assert phases[name]["tokens_per_second"] > 0 and phases[name]["flops"] > 0
            assert phases[name]["mfu_measured"] > 0 and phases[name]["mfu_datasheet"] is None
        assert phases["decode"]["bound_tokens_per_second"] > 0
        assert trl["phases"] is None
        lean = runs["trl (lean)"]  # its one step, timed
        assert lean["steps_timed"] == 1 and lean["step_seconds_mean"] > 0
    assert data["trl_decoders"] == ["auto", "lean"] and "trl (lean)/trl" in last
    assert data["settings"]["rehearsal"]["gbmpo (micro planned)"]["plan"]["micro_batch_rows"]
    assert "reference" in data["settings"]["paper"]["gbmpo"]["phases"]  # ProbL2 to the ref


def test_decode_step_benchmark_toy(tmp_path: Path) -> None:
    """The decode steps side by side (the static step, the lean decoder, the model's forward),
    plain and with LoRA: every step decodes, the static step's tokens equal the others'."""
    data, last = _run("decode_step.py", tmp_path / "ds.json", "--rows", "8", "--new-tokens",
                      "6", "--lora", "0,4", "--reps", "1")  # fmt: skip
    assert last.startswith("decode_step (tiny, cpu)") and str(tmp_path / "ds.json") in last
    plain, lora = data["cases"]
    assert set(plain["steps"]) == {"static", "lean", "model"} and plain["lora"] == 0
    assert set(lora["steps"]) == {"static", "model"} and lora["lora"] == 4
    assert plain["static_vs_lean_tokens_differing"] == 0
    assert lora["static_vs_model_tokens_differing"] == 0
    assert all(r["tokens_per_second"] > 0 for c in data["cases"] for r in c["steps"].values())


def test_lora_update_profile_counts_the_update_s_ops(tmp_path: Path) -> None:
    """The LoRA update's profile at 2 layers: gradient checkpointing off, one dropout per
    adapted projection and forward (7 projections x 2 layers x 2 forwards, the prompt's and the
    completions', x 4 micro-batches of 2 rows), the backward's ops counted apart."""
    data, last = _run("lora_update_profile.py", tmp_path / "lp.json", "--layers", "2",
                      "--new-tokens", "4")
    assert last.startswith("lora_update_profile (lora r 64, dropout 0.1, checkpointing False")
    assert data["gradient_checkpointing"] is False and data["micro_batches"] == 4
    policy = data["phases"]["policy fwd+bwd"]
    split = policy["split"]
    assert split["forward dropout"]["ops"] == 7 * 2 * 2 * 4
    assert split["forward"]["ops"] + split["backward"]["ops"] == policy["ops"]
    assert split["backward"]["ops"] > split["forward"]["ops"] > 0
    assert {"old policy", "reference", "optimizer"} <= set(data["phases"])
