"""The README, run as a newcomer would run it: every ``bash`` and ``python`` block verbatim.

- Set up: each ``make`` target the README names exists (``make -n``; tests/test_makefile.py
  checks what each one installs).
- The command line and the engines: each block runs verbatim in ``bash``, after the README's
  set-up (``source .venv/bin/activate``), in a scratch directory that has the clone's
  ``configs/`` and environments; the result lines of the default run that the README shows have
  the format these runs print, with their arithmetic right.
- TRL: the snippet is executed as written (its CPU form, with the embedded model; the hub model
  is a commented line marked as needing a GPU).
- verl: the command prints exactly the overrides the README shows, and those compose with
  verl's own ``ppo_trainer.yaml`` into an actor that uses gbmpo's loss, in ``.venv-verl``;
  the mistakes a newcomer makes with it get one line and exit status 2.

Everything runs on a CPU without network and without the packed GSM8K/MBPP data.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
VERL_PYTHON = REPO / ".venv-verl" / "bin" / "python"
HAS_CONSOLE_SCRIPT = (Path(sys.executable).parent / "gbmpo").exists()
SUMMARY = re.compile(
    r"finished (\d+) steps in (\d+) s; held-out accuracy: (\d+\.\d)% -> (\d+\.\d)% "
    r"\(([+-]\d+\.\d) points\)")  # fmt: skip
# the sections whose bash/python blocks the tests below run (a new block needs a test)
TESTED = {"Set up", "Quick start: the command line", "Engines", "Quick start: TRL",
          "Quick start: verl"}  # fmt: skip


def _sections() -> dict[str, str]:
    parts = re.split(r"^## (.+)$", README, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def _blocks(title: str, lang: str) -> list[str]:
    blocks = re.findall(rf"```{lang}\n(.*?)```", _sections()[title], re.S)
    assert blocks, f"no {lang} block in README section {title!r}"
    return blocks


def _env() -> dict[str, str]:
    """This checkout's gbmpo first on the path, one thread, no network."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    pythonpath = os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PATH": path, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1"}  # fmt: skip


@pytest.fixture
def clone(tmp_path: Path) -> Path:
    """A scratch directory that looks like the clone's root to the README's commands: its
    ``configs/``, ``.venv`` (this python's environment) and ``.venv-verl`` where built; runs
    land here, not in the clone."""
    (tmp_path / "configs").symlink_to(REPO / "configs")
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    if VERL_PYTHON.exists():
        (tmp_path / ".venv-verl").symlink_to(REPO / ".venv-verl")
    return tmp_path


def _bash(script: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


def test_every_code_block_is_in_a_tested_section_and_looks_runnable() -> None:
    for title, body in _sections().items():
        for lang, code in re.findall(r"```(\w+)\n(.*?)```", body, re.S):
            if lang in ("bash", "python"):
                assert title in TESTED, f"README section {title!r} has an untested {lang} block"
            if lang != "bash":
                continue
            for line in code.splitlines():
                command = line.split("#", 1)[0]
                # optional flags in brackets, elided arguments and <placeholders> cannot be
                # pasted; placeholders belong in the prose
                assert not re.search(r"\[--|\.\.\.|<[^>]*>|\bDIR\b", command), line
    # a hub model appears only on a commented line that says it needs a GPU and the hub
    for line in README.splitlines():
        if '"Qwen/' in line:
            assert line.lstrip().startswith("#") and "needs a GPU and the hub" in line, line
    assert not re.search(r"METHODS\.md|FEASIBILITY\.md|issue \d", README)


@pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")
def test_setup_names_make_targets_that_exist() -> None:
    (block,) = _blocks("Set up", "bash")
    targets = re.findall(r"^make (\w+)", block, re.M)
    assert {"run", "test", "verl"} <= set(targets), block
    verl_section = _blocks("Quick start: verl", "bash")[0]
    targets += re.findall(r"^make (\w+)", verl_section, re.M)
    for target in targets:  # -n: print what it would do, change nothing
        proc = subprocess.run(["make", "-n", target], cwd=REPO, capture_output=True, text=True,
                              timeout=60)  # fmt: skip
        assert proc.returncode == 0, (target, proc.stderr)
    # where the tools are and what the install costs are stated
    setup = _sections()["Set up"]
    assert "source .venv/bin/activate" in setup and "GB" in setup and "root" in setup


@pytest.mark.slow
@pytest.mark.skipif(not HAS_CONSOLE_SCRIPT, reason="the README's commands call the gbmpo "
                    "console script of .venv (pip install)")  # fmt: skip
@pytest.mark.skipif(not (Path(sys.prefix) / "bin" / "activate").is_file(),
                    reason="this python is not a venv's: no bin/activate to source")  # fmt: skip
def test_cli_quick_start_runs_verbatim(clone: Path) -> None:
    (block,) = _blocks("Quick start: the command line", "bash")
    assert block.startswith("source .venv/bin/activate\n")
    commands = [ln for ln in block.splitlines()[1:] if ln.strip()]
    assert commands and all(c.startswith("gbmpo train ") for c in commands)
    proc = _bash(block, clone)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summaries = SUMMARY.findall(proc.stdout)
    assert len(summaries) == len(commands), proc.stdout
    assert all(s[0] == "3" for s in summaries), summaries  # the --steps 3 the block shows
    # the progress lines (stderr) the README shows above the summary, on 20 problems
    assert re.search(r"held-out accuracy \d+\.\d% \(n=20\) before training", proc.stderr)
    assert re.search(r"held-out accuracy \d+\.\d% \(n=20\) after 3 steps", proc.stderr)
    assert len(list((clone / "runs").iterdir())) == len(commands)


def test_default_run_output_shown_has_the_format_a_run_prints(
    clone: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (shown,) = _blocks("Quick start: the command line", "text")
    assert shown.startswith("$ gbmpo train\n")
    m = SUMMARY.search(shown)
    assert m, shown
    before, after, gain = float(m[3]), float(m[4]), float(m[5])
    assert abs((after - before) - gain) < 0.051
    assert f"held-out accuracy {m[3]}% (n=200) before training" in shown
    assert f"held-out accuracy {m[4]}% (n=200) after {m[1]} steps" in shown
    # the command shown is the default configuration, and it is valid (its dry run, through
    # the console script's main in this process: the quick-start tests run the script itself)
    from gbmpo.cli import main

    monkeypatch.chdir(clone)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = main(["train", "--dry-run"])
    out = capsys.readouterr()
    assert code == 0, out.err[-3000:]
    assert "dry run OK" in out.out


@pytest.mark.slow
@pytest.mark.skipif(not HAS_CONSOLE_SCRIPT, reason="the README's commands call the gbmpo "
                    "console script of .venv (pip install)")  # fmt: skip
def test_engines_block_runs_verbatim(clone: Path) -> None:
    pytest.importorskip("trl")
    (block,) = _blocks("Engines", "bash")
    commands = [ln for ln in block.splitlines() if ln.strip()]
    assert all(c.startswith("gbmpo train ") for c in commands)
    assert "--engine trl" in block and "--num-processes" in block and "configs/paper/rpg-" in block
    proc = _bash(block, clone)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"finished 3 steps \(trl\) in \d+ s; held-out accuracy", proc.stdout)
    assert proc.stdout.count("dry run OK") == sum("--dry-run" in c for c in commands)
    reports = [json.loads(ln.split("dry run OK: ", 1)[1]) for ln in proc.stdout.splitlines()
               if ln.startswith("dry run OK: ")]  # fmt: skip
    assert [r.get("engine") for r in reports] == ["trl", "verl"], reports


@pytest.mark.slow
def test_trl_quick_start_runs_verbatim(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pytest.importorskip("trl")
    import torch

    (code,) = _blocks("Quick start: TRL", "python")
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
    assert trainer.state.global_step == 2
    args = trainer.args
    reg = args.objective["regularizer"]  # the spec itself, not copied into alias fields
    assert (reg["name"], reg["coef"], args.loss_type) == ("prob_l2", 0.1, "dr_grpo")
    assert args.num_generations == 8 and args.use_cpu
    logged = [h for h in trainer.state.log_history if "reg/prob_l2" in h]
    assert logged and all(v == v for v in logged[0].values() if isinstance(v, float))


def _verl_command() -> str:
    (block,) = _blocks("Quick start: verl", "bash")
    (command,) = [ln for ln in block.splitlines() if ln.strip() and not ln.startswith("make ")]
    assert command.startswith(".venv-verl/bin/python -m gbmpo.integrations.verl --objective ")
    return command


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
                  "loss_mode": pl.loss_mode,
                  "surrogate": json.loads(pl.gbmpo_objective)["surrogate"]["params"],
                  "kl_loss_type": actor.kl_loss_type, "kl_types": list(gv.kl_loss_types()),
                  "use_kl_loss": actor.use_kl_loss, "kl_loss_coef": actor.kl_loss_coef}))
"""


@pytest.mark.skipif(not VERL_PYTHON.exists(), reason="no .venv-verl (make verl)")
def test_verl_quick_start_prints_the_overrides_shown_and_they_compose(clone: Path) -> None:
    proc = _bash(_verl_command(), clone, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (shown,) = _blocks("Quick start: verl", "text")
    assert proc.stdout == shown
    overrides = shown.splitlines()
    # the data, model and batch settings are the user's: the one batch setting verl requires
    extra = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"]
    proc = subprocess.run([str(VERL_PYTHON), "-c", _VERL_SCRIPT, json.dumps(extra + overrides)],
                          cwd=clone, capture_output=True, text=True, timeout=300,
                          env=_env())  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # the target gbmpo.integrations.verl.GBMPOPolicyLossConfig is the plugin module's class
    assert out["policy_loss"] == "gbmpo.engines.verl.plugin.GBMPOPolicyLossConfig"
    assert out["loss_mode"] == "gbmpo_clip" and out["surrogate"]["eps_low"] == 0.2
    assert out["use_kl_loss"] and out["kl_loss_type"] == "gbmpo_prob_l2"
    assert out["kl_loss_type"] in out["kl_types"] and out["kl_loss_coef"] == 0.1


def _one_line_exit_2(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


def _without_verl() -> None:
    try:
        import verl  # noqa: F401
    except ImportError:
        return
    pytest.skip("this python has verl")


def test_verl_command_in_venv_names_the_verl_interpreter(clone: Path) -> None:
    _without_verl()
    (clone / "my.yaml").write_text("objective: {}\n")
    command = _verl_command().replace(".venv-verl/bin/python", "python")
    command = re.sub(r"--objective \S+", "--objective my.yaml", command)
    (clone / ".venv-verl").unlink(missing_ok=True)
    (clone / ".venv-verl" / "bin").mkdir(parents=True)
    (clone / ".venv-verl" / "bin" / "python").symlink_to(sys.executable)
    line = _one_line_exit_2(_bash(command, clone, timeout=120))
    assert "verl is not installed" in line
    assert line.endswith(": .venv-verl/bin/python -m gbmpo.integrations.verl --objective my.yaml")


def test_verl_command_without_any_verl_environment_says_how_to_build_one(tmp_path: Path) -> None:
    _without_verl()
    # a copy of the package outside any clone with a .venv-verl
    shutil.copytree(REPO / "src" / "gbmpo", tmp_path / "src" / "gbmpo",
                    ignore=shutil.ignore_patterns("assets", "data", "__pycache__"))  # fmt: skip
    env = {**_env(), "PYTHONPATH": str(tmp_path / "src")}
    proc = subprocess.run([sys.executable, "-m", "gbmpo.integrations.verl"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    line = _one_line_exit_2(proc)
    assert "verl is not installed" in line and "make verl" in line


@pytest.mark.skipif(not VERL_PYTHON.exists(), reason="no .venv-verl (make verl)")
@pytest.mark.parametrize(("content", "says"), [
    (None, "does not exist"),
    ("[\n", "not valid YAML"),
    ("objective: {regularizer: {name: bogus}}\n", "bogus"),
])  # fmt: skip
def test_verl_command_bad_objective_file_is_one_line(
    clone: Path, content: str | None, says: str
) -> None:
    if content is not None:
        (clone / "my.yaml").write_text(content)
    command = re.sub(r"--objective \S+", "--objective my.yaml", _verl_command())
    line = _one_line_exit_2(_bash(command, clone, timeout=300))
    assert line.startswith("python -m gbmpo.integrations.verl: error: ") and says in line


def test_objective_names_are_the_registries() -> None:
    from gbmpo.objectives.advantages import ADVANTAGES
    from gbmpo.objectives.aggregate import AGGREGATIONS
    from gbmpo.objectives.regularizers import REGULARIZERS
    from gbmpo.objectives.surrogates import SURROGATES

    rows = dict(re.findall(r"^\| ([a-z]+)[^|]*\| (.*) \|$", _sections()["Objectives"], re.M))

    def names(kind: str) -> set[str]:
        # the names of the row, less the clip measures listed in parentheses
        return set(re.findall(r"`(\w+)`", re.sub(r"\([^)]*\)", "", rows[kind])))

    assert names("advantage") == set(ADVANTAGES)
    assert names("surrogate") == set(SURROGATES)
    assert names("regularizer") == set(REGULARIZERS)
    assert names("aggregation") == set(AGGREGATIONS)


def test_links_reach_existing_files_and_anchors() -> None:
    links = re.findall(r"\]\(([^)\s]+)\)", README)
    assert any(link.startswith("docs/methods.md#") for link in links)
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        path, _, anchor = link.partition("#")
        target = REPO / path
        assert target.exists(), link
        if anchor:
            text = target.read_text()
            assert f"{{#{anchor}}}" in text or re.search(
                rf"^#+ .*\b{'[- ]'.join(map(re.escape, anchor.split('-')))}\s*$", text, re.M | re.I
            ), link


def test_engine_verl_without_its_environment_says_make_verl(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import gbmpo.engines.verl.runner as engine_verl
    from gbmpo.cli import main
    from gbmpo.config.support import VERL_REQUIRED

    out = tmp_path / "run"
    monkeypatch.setattr(engine_verl, "verl_python", lambda: None)
    # the values verl needs where it refuses the own engine's defaults (a GPU, no time budget)
    required = [a for k, v in VERL_REQUIRED.items() for a in (f"--{k}", str(v).lower())]
    assert main(["train", "--engine", "verl", *required, "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "make verl" in err[0] and "GBMPO_VERL_PYTHON" in err[0], err
    assert not out.exists()


def test_engine_verl_python_naming_no_file_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gbmpo.cli import main
    from gbmpo.config.support import VERL_REQUIRED

    missing = tmp_path / "no-python"
    monkeypatch.setenv("GBMPO_VERL_PYTHON", str(missing))
    required = [a for k, v in VERL_REQUIRED.items() for a in (f"--{k}", str(v).lower())]
    for extra in (["--dry-run"], ["--output-dir", str(tmp_path / "run")]):
        assert main(["train", "--engine", "verl", *required, *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"GBMPO_VERL_PYTHON={str(missing)!r}" in err[0], err
    assert not (tmp_path / "run").exists()
