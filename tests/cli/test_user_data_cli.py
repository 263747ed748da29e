"""A user's own data, reward and plugins through the command line, as a user meets them:
``gbmpo train`` / ``gbmpo eval`` with ``--task jsonl``, rewards by import path, ``--import``,
an installed plugin package, bad input (exit 2, nothing that looks finished), and the commands of
the documentation page ``docs/own-data.md`` run verbatim."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gbmpo.cli import main

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "own_data"
FAST = ["--rollout.prompts_per_step", "2", "--num-generations", "2", "--max-new-tokens", "8",
        "--eval.before", "false", "--eval.after", "false", "--eval-every", "0",
        "--time-budget", "null", "--run.progress", "false", "--mu", "1",
        "--optim.mini_batch_size", "null", "--steps", "2"]
OWN = ["--task", "jsonl", "--task.template", "base",
       "--task.params.path", str(EXAMPLE / "word_problems.jsonl"),
       "--task.params.prompt_column", "question", "--task.params.answer_column", "final",
       "--task.params.prompt_template", "Q: {question}\nA:"]


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    torch.set_num_threads(1)
    monkeypatch.delenv("GBMPO_PLUGINS", raising=False)


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "gbmpo.cli", *args], capture_output=True,
                          text=True, env=full, cwd=REPO, timeout=600)


def test_train_on_a_user_file_with_a_reward_file(tmp_path: Path) -> None:
    out = tmp_path / "run"
    reward = f"{EXAMPLE / 'my_reward.py'}:final_number"
    assert main(["train", *OWN, "--task.params.reward", reward, *FAST,
                 "--output-dir", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["task"] == "jsonl"
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rewards = [m["reward_mean"] for m in metrics if "reward_mean" in m]
    assert len(rewards) == 2 and all(0.0 <= r <= 1.0 for r in rewards)
    assert "final_number" in (out / "config.yaml").read_text()


def _write_reward(tmp_path: Path, body: str) -> str:
    mod = tmp_path / "bad_reward.py"
    mod.write_text(body)
    return f"{mod}:reward"


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ("def reward(prompts, completions, **kw):\n    raise RuntimeError('boom')\n",
         r"reward function \S*bad_reward.py:reward raised for every one of the 4 "
         r"completions.*boom"),
        ("def reward(prompts, completions, **kw):\n    return [1.0]\n",
         r"reward function \S*bad_reward.py:reward returned 1 values for 4 completions"),
        ("def reward(prompts, completions, **kw):\n    return 'yes'\n",
         r"reward function \S*bad_reward.py:reward returned str"),
    ],
)
def test_a_broken_reward_function_is_named_and_nothing_looks_finished(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], body: str, needle: str) -> None:
    out = tmp_path / "run"
    code = main(["train", *OWN, "--task.params.reward", _write_reward(tmp_path, body), *FAST,
                 "--output-dir", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and re.search(needle, err), err
    assert len(err.strip().splitlines()) == 1
    assert not (out / "summary.json").exists()


@pytest.mark.parametrize(
    ("rows", "extra", "needle"),
    [
        ('{"question": "1+1?", "final": "2"}\n{"question": "2+2?"}\n', [],
         r"row 1 has no column 'final' \(its columns: question\)"),
        ("", [], r"has no rows"),
        ('{"question": "1+1?", "final": "2"}\n', ["--task.params.reward", "nope"],
         r"unknown reward 'nope'; valid names"),
    ],
)
def test_bad_data_exits_2_before_any_run_directory(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], rows: str, extra: list[str],
        needle: str) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text(rows)
    out = tmp_path / "run"
    args = ["train", "--task", "jsonl", "--task.params.path", str(data),
            "--task.params.prompt_column", "question", "--task.params.answer_column", "final",
            "--task.params.test_size", "1", *extra, *FAST, "--output-dir", str(out)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert re.search(needle, err) and str(data) in err or "nope" in err, err
    assert not out.exists()


def test_eval_on_a_user_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # in this process (``main`` is what ``python -m gbmpo.cli`` runs; the fresh processes of
    # the tests below are for what must not leak between commands: a registered plugin)
    out = tmp_path / "eval.jsonl"
    code = main(["eval", "--task", "jsonl", "--template", "base",
                 "--task-param", f"path={EXAMPLE / 'word_problems_test.jsonl'}",
                 "--task-param", "prompt_column=question", "--task-param", "answer_column=final",
                 "--task-param", "prompt_template=Q: {question}\nA:",
                 "--task-param", "reward=exact", "--limit", "8", "--max-new-tokens", "48",
                 "--output", str(out)])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    summary = json.loads(out.with_suffix(".summary.json").read_text())
    assert summary["metrics"]["n"] == 8 and 0.0 <= summary["metrics"]["accuracy"] <= 1.0
    capsys.readouterr()
    bad = _write_reward(tmp_path, "def reward(prompts, completions, **kw):\n    1/0\n")
    code = main(["eval", "--task", "jsonl", "--task-param",
                 f"path={EXAMPLE / 'word_problems_test.jsonl'}", "--task-param",
                 "prompt_column=question", "--task-param", "answer_column=final",
                 "--task-param", f"reward={bad}", "--limit", "2", "--max-new-tokens", "4"])
    err = capsys.readouterr().err
    assert code == 2 and "ZeroDivisionError" in err, err


def test_import_flag_registers_a_module_for_train_and_resume(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "my_plugin.py").write_text(
        "from gbmpo.rewards import REWARDS\n"
        "def half(prompts, completions, **kw):\n    return [0.5 for _ in completions]\n"
        "REWARDS.register('always_half', half)\n")
    env = {"PYTHONPATH": str(tmp_path)}
    out = tmp_path / "run"
    proc = _cli("--import", "my_plugin", "train", *OWN, "--task.params.reward", "always_half",
                *FAST, "--output-dir", str(out), env=env)
    assert proc.returncode == 0, proc.stderr
    assert "my_plugin" in (out / "config.yaml").read_text()
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["reward_mean"] for m in metrics if "reward_mean" in m] == [0.5, 0.5]
    proc = _cli("train", *OWN, "--task.params.reward", "always_half", *FAST, env=env)
    assert proc.returncode == 2 and "unknown reward 'always_half'" in proc.stderr
    # a module that cannot be imported registers nothing: checked in this process
    assert main(["train", "--import", "no_such_plugin_xyz", *FAST]) == 2
    assert "plugin module 'no_such_plugin_xyz' cannot be imported" in capsys.readouterr().err


def test_example_plugin_package_installs_and_trains(tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(REPO / "examples" / "gbmpo-plugin-example", src)
    target = tmp_path / "site"
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
         "--no-build-isolation", "--no-index", "--target", str(target), str(src)],
        capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stderr
    env = {"PYTHONPATH": str(target)}
    out = tmp_path / "run"
    proc = _cli("train", "--task", "countdown", "--regularizer", "log_huber",
                "--objective.regularizer.params.delta", "0.5", *FAST, "--output-dir", str(out),
                env=env)
    assert proc.returncode == 0, proc.stderr
    cfg = (out / "config.yaml").read_text()
    assert "countdown" in cfg and "log_huber" in cfg
    assert json.loads((out / "summary.json").read_text())["steps"] == 2
    # the plugin's reward on the user's data; its bad parameter is reported by name
    proc = _cli("train", *OWN, "--task.params.reward", "last_integer", *FAST,
                "--output-dir", str(tmp_path / "run2"), env=env)
    assert proc.returncode == 0, proc.stderr
    proc = _cli("train", "--task", "countdown", "--regularizer", "log_huber",
                "--objective.regularizer.params.delta", "-1", *FAST, env=env)
    assert proc.returncode == 2 and "delta must be > 0" in proc.stderr


def _doc_section(page: str, title: str) -> str:
    """The bash blocks of the section ``## title`` of ``docs/page``."""
    text = (REPO / "docs" / page).read_text()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    blocks = re.findall(r"```bash\n(.*?)```", text[start:end if end > 0 else None], re.S)
    assert blocks, f"no bash block in section {title!r} of docs/{page}"
    return "\n".join(blocks)


def _console_env() -> dict[str, str]:
    """``gbmpo`` on PATH (the console script of this interpreter's environment), importing this
    checkout's sources."""
    bin_dir = str(Path(sys.executable).parent)
    path = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])
    pythonpath = os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PATH": path, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1"}


@pytest.mark.skipif(not (Path(sys.executable).parent / "gbmpo").exists(),
                    reason="the documented commands call the gbmpo console script (pip install)")
def test_own_data_page_commands_run_verbatim(tmp_path: Path) -> None:
    script = _doc_section("own-data.md", "A data file and a reward function")
    assert "gbmpo train" in script and "gbmpo eval" in script
    assert ".venv/bin/" not in script
    runs = REPO / "runs"
    before = set(runs.iterdir()) if runs.exists() else set()
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=REPO,
                          capture_output=True, text=True, timeout=900, env=_console_env())
    try:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        assert "held-out accuracy" in proc.stdout
    finally:  # the commands write under runs/own-data*; leave the checkout as it was
        for p in (set(runs.iterdir()) if runs.exists() else set()) - before:
            shutil.rmtree(p, ignore_errors=True)
