"""examples/trl_gsm8k.py: --help works, and a dry run builds the config and the GSM8K dataset.

The real run needs a GPU, vLLM and Qwen3 weights, none of which exist here.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "trl_gsm8k.py"
GSM8K = REPO.parent / "shared" / "data" / "gsm8k"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("trl_gsm8k_example", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_help() -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    for flag in ("--model", "--data-dir", "--regularizer", "--clip-mode", "--no-vllm",
                 "--dry-run"):
        assert flag in out.stdout


def test_parser_defaults_are_probl2_with_vllm() -> None:
    args = _load().build_parser().parse_args([])
    assert (args.model, args.regularizer, args.vllm, args.loss_type) == (
        "Qwen/Qwen3-1.7B", "prob_l2", True, "dr_grpo")


@pytest.mark.skipif(not (GSM8K / "train.jsonl").is_file(), reason="GSM8K data not present")
def test_dry_run_builds_config_and_dataset(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("trl")
    mod = _load()
    argv = ["--dry-run", "--no-bf16", "--limit", "8", "--data-dir", str(GSM8K),
            "--output-dir", "unused"]
    assert mod.main(argv) is None
    out = capsys.readouterr().out
    assert "8 training problems" in out and "regularizer=prob_l2" in out
    config = mod.build_config(mod.build_parser().parse_args(argv))
    assert config.use_vllm and config.vllm_mode == "colocate"
    assert config.regularizer == "prob_l2" and config.beta == config.regularizer_coef == 0.1
    ds = mod.build_dataset(str(GSM8K), 2)
    row: dict[str, Any] = ds[0]
    assert [m["role"] for m in row["prompt"]] == ["system", "user"] and row["answer"] == "72"

    from gbmpo.rewards.math import math_reward_fn

    completions = [[{"role": "assistant", "content": "48 + 24 = 72\n#### 72"}],
                   [{"role": "assistant", "content": "#### 71"}]]
    assert math_reward_fn(prompts=[row["prompt"]] * 2, completions=completions,
                          answer=["72", "72"]) == [1.0, 0.0]
