"""The README's quick starts, as far as this machine can run them.

- The command line: each command of the block runs verbatim through the ``gbmpo`` console
  script with ``--dry-run`` appended (the full run is the 4-minute embedded default; the test
  suite trains it elsewhere), and the result lines the README shows have the format a real (one
  step) run prints, with their arithmetic right.
- TRL: the snippet is executed as written, with two changes a CPU without network needs: the
  hub model id becomes the embedded tiny model, and ``GBMPOConfig`` gets CPU settings and one
  short step.
- verl: the README's overrides (with the one batch-size setting the ``...`` stands for) compose
  with verl's own ``ppo_trainer.yaml`` and build verl's actor configuration with gbmpo's policy
  loss, in ``.venv-verl``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
VERL_PYTHON = REPO / ".venv-verl" / "bin" / "python"
SUMMARY = re.compile(
    r"finished (\d+) steps in (\d+) s; held-out accuracy: (\d+\.\d)% -> (\d+\.\d)% "
    r"\(([+-]\d+\.\d) points\)")


def _section(title: str, lang: str) -> list[str]:
    start = README.index(f"## {title}")
    end = README.find("\n## ", start + 1)
    blocks = re.findall(rf"```{lang}\n(.*?)```", README[start:end if end > 0 else None], re.S)
    assert blocks, f"no {lang} block in README section {title!r}"
    return blocks


def _console_env() -> dict[str, str]:
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    pythonpath = os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PATH": path, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1"}


def test_readme_names_the_two_setup_commands_and_no_venv_paths() -> None:
    setup = "\n".join(_section("Set up", "bash"))
    assert re.search(r"^make run\b", setup, re.M) and re.search(r"^make test\b", setup, re.M)
    assert ".venv/bin/" not in README
    assert not re.search(r"METHODS\.md|FEASIBILITY\.md|issue \d", README)


@pytest.mark.skipif(not (Path(sys.executable).parent / "gbmpo").exists(),
                    reason="the README's commands call the gbmpo console script (pip install)")
def test_cli_quick_start_commands_parse_and_validate(tmp_path: Path) -> None:
    commands = [ln.strip() for ln in _section("Quick start: the command line", "bash")[0]
                .splitlines() if ln.strip()]
    assert commands and all(c.startswith("gbmpo train") for c in commands)
    for command in commands:
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", command + " --dry-run"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=300,
                              env=_console_env())
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "dry run OK" in proc.stdout


@pytest.mark.skipif(not (Path(sys.executable).parent / "gbmpo").exists(),
                    reason="the README's commands call the gbmpo console script (pip install)")
def test_cli_quick_start_output_has_the_format_a_run_prints(tmp_path: Path) -> None:
    shown = _section("Quick start: the command line", "text")[0]
    m = SUMMARY.search(shown)
    assert m, shown
    before, after, gain = float(m[3]), float(m[4]), float(m[5])
    assert abs((after - before) - gain) < 0.051
    assert f"held-out accuracy {m[3]}% (n=200) before training" in shown
    assert f"held-out accuracy {m[4]}% (n=200) after {m[1]} steps" in shown
    proc = subprocess.run(
        ["gbmpo", "train", "--steps", "1", "--time-budget", "null", "--eval.limit", "4",
         "--rollout.prompts_per_step", "2", "--num-generations", "2", "--optim.mini_batch_size",
         "null", "--output-dir", str(tmp_path / "run")],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env=_console_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert SUMMARY.search(proc.stdout), proc.stdout
    # the progress lines (stderr) that the README shows above the summary
    assert re.search(r"held-out accuracy \d+\.\d% \(n=4\) before training", proc.stderr)
    assert re.search(r"held-out accuracy \d+\.\d% \(n=4\) after 1 steps", proc.stderr)


def test_engine_commands_are_the_ones_docs_engines_runs() -> None:
    """The README's "Engines" block, optional ``[...]`` parts dropped, is a subset of the
    ``gbmpo train`` commands of docs/engines.md, which tests/test_docs_engines.py runs verbatim
    (as dry runs); the block names all three engines."""
    block = _section("Engines", "bash")[0]
    commands = [re.sub(r"\s*\[[^]]*\]", "", ln.split("#", 1)[0]).strip()
                for ln in block.splitlines() if ln.strip()]
    assert commands and all(c.startswith("gbmpo train") for c in commands)
    engines_doc = (REPO / "docs" / "engines.md").read_text()
    documented = {ln.split("#", 1)[0].strip()
                  for block in re.findall(r"```bash\n(.*?)```", engines_doc, re.S)
                  for ln in block.splitlines()}
    assert [c for c in commands if c not in documented] == []
    assert "--engine trl" in block and "--num-processes" in block and "engine: verl" in block


def test_trl_quick_start_runs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pytest.importorskip("trl")
    import torch

    import gbmpo.integrations.trl as gtrl
    from gbmpo.models import resolve_model_path

    (code,) = _section("Quick start: TRL", "python")
    hub_id = re.search(r'GBMPOTrainer\(model="([^"]+)"', code)
    assert hub_id, code
    code = code.replace(f'"{hub_id[1]}"', repr(str(resolve_model_path("tiny"))))

    class CPUConfig(gtrl.GBMPOConfig):
        def __init__(self, **kwargs: Any) -> None:
            kwargs.update(use_cpu=True, bf16=False, max_steps=1, max_completion_length=8,
                          report_to="none", save_strategy="no", disable_tqdm=True)
            super().__init__(**kwargs)

    monkeypatch.setattr(gtrl, "GBMPOConfig", CPUConfig)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        namespace: dict[str, Any] = {}
        exec(compile(code, "README.md", "exec"), namespace)
    finally:
        torch.set_num_threads(threads)
    trainer = namespace["trainer"]
    assert trainer.state.global_step == 1
    args = trainer.args
    assert (args.regularizer, args.regularizer_coef, args.loss_type) == ("prob_l2", 0.1, "dr_grpo")
    assert args.num_generations == 8
    logged = [h for h in trainer.state.log_history if "regularizer/prob_l2" in h]
    assert logged and all(v == v for v in logged[0].values() if isinstance(v, float))


_VERL_SCRIPT = r"""
import json, sys
from pathlib import Path
import verl
from hydra import compose, initialize_config_dir
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.utils.config import omega_conf_to_dataclass
import gbmpo.integrations.verl as gv
config_dir = Path(verl.__file__).parent / "trainer" / "config"
with initialize_config_dir(config_dir=str(config_dir), version_base=None):
    cfg = compose(config_name="ppo_trainer", overrides=json.loads(sys.argv[1]))
actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
pl = actor.policy_loss
get_policy_loss_fn(pl.loss_mode)
print(json.dumps({"policy_loss": type(pl).__module__ + "." + type(pl).__name__,
                  "loss_mode": pl.loss_mode, "surrogate": dict(pl.gbmpo_surrogate),
                  "kl": dict(pl.gbmpo_kl), "kl_loss_type": actor.kl_loss_type,
                  "kl_types": list(gv.kl_loss_types()), "use_kl_loss": actor.use_kl_loss}))
"""


@pytest.mark.skipif(not VERL_PYTHON.exists(), reason="no .venv-verl (scripts/install_verl_env.sh)")
def test_verl_quick_start_overrides_compose_with_verl(tmp_path: Path) -> None:
    (block,) = _section("Quick start: verl", "bash")
    lines = [ln.strip().rstrip("\\").strip() for ln in block.splitlines()]
    assert lines[0].startswith("python -m verl.trainer.main_ppo ...")
    overrides = [ln for ln in lines[1:] if ln]
    # what the README's "..." stands for: the batch settings every verl run sets
    extra = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run([str(VERL_PYTHON), "-c", _VERL_SCRIPT, json.dumps(extra + overrides)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["policy_loss"] == "gbmpo.integrations.verl.GBMPOPolicyLossConfig"
    assert out["loss_mode"] == "gbmpo_atr" and out["surrogate"] == {"delta": 0.02}
    assert out["use_kl_loss"] and out["kl_loss_type"] == "gbmpo_neural_mirror"
    assert out["kl_loss_type"] in out["kl_types"] and "mirror" in out["kl"]
