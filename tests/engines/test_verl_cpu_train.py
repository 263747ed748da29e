"""``gbmpo train --engine verl`` trains on the CPU: verl 0.9.1's own trainer (``main_ppo``, Ray,
FSDP2) with gbmpo's CPU platform and transformers rollout (``gbmpo.engines.verl.cpu``), the
embedded tiny model, with the own engine's defaults of the keys verl once refused (a time budget,
every regularizer monitored, the drift at the end). One run, stopped with SIGTERM once verl logged
its first step (a scheduler's preemption notice), then ``gbmpo train --resume DIR --time-budget T``
from its newest checkpoint K, T just above the RL seconds up to K: the resumed step spends the
budget, so it is verl's last (its checkpoint, its validation), then the drift of the merged final
model: two verl launches for the stop, the resume and the trained run directory (each launch starts
Ray and verl's processes, about a minute of the test's time). K is 1 unless verl's processes take a
while to end (under load they were seen to finish 2 more steps after the signal).

What the stop must show: exit 143, verl's whole process group ended (no ``main_ppo`` left behind),
one line naming verl's newest checkpoint and the resume command, ``status.json`` preempted. What
the resumed run must show: exit 0; each step logged once, the steps before the checkpoint it
continued from as the first part logged them; the run directory every engine writes
(``summary.json`` with the shared keys, ``metrics.jsonl`` with the shared names, verl's own under
``verl/``); a gradient (``grad_norm > 0``, the task's reward varies within the groups); the
rollout's log-probs equal to the FSDP actor's (``training/rollout_probs_diff_mean``: the weights
handed to the rollout after each step are the trained ones); and the first step's loss equal to the
own engine's ``compute_policy_loss`` on the very tensors verl trained on (its log-probs, reference
log-probs, advantages and mask, saved by the gbmpo verl plugin under ``GBMPO_VERL_DUMP_DIR``), to
1e-6. The own engine cannot sample the same completions (another sampler and RNG), so the loss is
compared on verl's batch; that the log-probs themselves are the model's is what the rollout/actor
agreement shows (the rollout is a plain ``transformers`` forward of the same weights).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gbmpo.cli import main
from gbmpo.io.metrics import SUMMARY_KEYS, is_shared

ROOT = Path(__file__).resolve().parents[2]
VERL_PYTHON = ROOT / ".venv-verl" / "bin" / "python"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.ray,
    pytest.mark.skipif(not VERL_PYTHON.exists() and not os.environ.get("GBMPO_VERL_PYTHON"),
                       reason=".venv-verl not built (make verl)"),
]  # fmt: skip

#: a reward that varies within a group whatever the tiny model writes: the share of digits
REWARD = '''
def digits(prompts, completions, **kwargs):
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]
'''
MAX_NEW = 16
STEPS = 50  # the first part's: still running when the signal comes


def _argv(tmp: Path, out: Path) -> list[str]:
    (tmp / "digits_share.py").write_text(REWARD)
    with (tmp / "data.jsonl").open("w") as f:
        for i in range(40):
            f.write(json.dumps({"prompt": f"{i} + {i + 1} =", "answer": str(2 * i + 1)}) + "\n")
    params = {"path": str(tmp / "data.jsonl"), "reward": f"{tmp / 'digits_share.py'}:digits"}
    return ["train", "--engine", "verl", "--model.device", "cpu", "--steps", str(STEPS),
            "--task.name", "jsonl", "--task.params", json.dumps(params),
            "--rollout.prompts_per_step", "2", "--rollout.num_generations", "4",
            "--optim.mini_batch_size", "8", "--optim.micro_batch_size", "8",
            "--rollout.max_new_tokens", str(MAX_NEW), "--eval.max_new_tokens", str(MAX_NEW),
            "--eval.limit", "4", "--eval.every", "0", "--run.checkpoint_every", "1",
            "--run.keep_checkpoints", "2", "--output-dir", str(out)]  # fmt: skip


@dataclass
class StoppedAndResumed:
    """The run directory after the resume, and what the stopped first part left behind."""

    run: Path
    returncode: int
    stderr: str
    status: dict[str, Any]
    verl_rows: list[dict[str, Any]]
    processes_left: list[str]
    steps: int  # one more than the newest checkpoint at the stop: the resume's last step
    resumed: int | None  # the resume's exit code (None: not tried, the stop failed)
    budget: float | None = None  # the resume's time budget

    def finished(self) -> Path:
        """The run directory, once the resume finished."""
        assert self.resumed == 0, (self.returncode, self.resumed, self.stderr[-3000:])
        return self.run


def _main_ppo_of(run: Path) -> list[str]:
    """The command lines of verl ``main_ppo`` processes of this run still alive."""
    left = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "verl.trainer.main_ppo" in text and str(run) in text:
            left.append(text[:200])
    return left


@pytest.fixture(scope="module")
def verl_run(tmp_path_factory: pytest.TempPathFactory) -> StoppedAndResumed:
    """SIGTERM to ``gbmpo train`` alone once verl logged step 1 (the plugin's tensors under
    ``dump/``), then ``gbmpo train --resume`` of the same directory for one more step."""
    tmp = tmp_path_factory.mktemp("verl_cpu")
    out = tmp / "run"
    argv = _argv(tmp, out)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "GBMPO_VERL_DUMP_DIR": str(tmp / "dump")}
    cli = "import sys; from gbmpo.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen([sys.executable, "-c", cli, *argv], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    log, deadline = out / "verl_metrics.jsonl", time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        if log.is_file() and any('"grad_norm"' in ln or "actor/" in ln
                                 for ln in log.read_text().splitlines()):  # fmt: skip
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before the signal"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    time.sleep(2)
    status_file = out / "status.json"
    status = json.loads(status_file.read_text()) if status_file.is_file() else {}
    stopped = StoppedAndResumed(
        run=out, returncode=proc.returncode, stderr=err, status=status,
        verl_rows=[json.loads(line) for line in log.read_text().splitlines() if line.strip()],
        processes_left=_main_ppo_of(out), steps=int(status.get("step") or 0) + 1,
        resumed=None)  # fmt: skip
    if proc.returncode == 143 and stopped.steps >= 2 and not (out / "summary.json").exists():
        # a time budget just above the RL seconds of the checkpoint's step: the resumed step
        # spends it, so it is verl's last (run.steps stays 50)
        before = max(r["data"]["gbmpo/rl_seconds"] for r in stopped.verl_rows
                     if r["step"] == stopped.steps - 1 and "gbmpo/rl_seconds" in r["data"])
        stopped.budget = before + 0.5
        stopped.resumed = main(["train", "--resume", str(out), "--time-budget",
                                str(stopped.budget)])  # fmt: skip
    return stopped


def _rows(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_cpu_run_writes_the_shared_run_directory(verl_run: StoppedAndResumed) -> None:
    run, steps = verl_run.finished(), verl_run.steps
    summary = json.loads((run / "summary.json").read_text())
    assert set(SUMMARY_KEYS) <= set(summary), set(SUMMARY_KEYS) - set(summary)
    assert summary["engine"] == "verl" and summary["device"] == "cpu"
    assert summary["status"] == "finished" and summary["steps"] == steps
    assert summary["eval_before"] is not None and summary["eval_after"] is not None
    # the time budget ended the run after the step that spent it (run.steps is 50)
    assert summary["stop_reason"] == "time_budget"
    assert summary["rl_seconds"] >= verl_run.budget  # type: ignore[operator]
    assert summary["reward_failures"] == 0 and summary["peak_memory_gib"] is None
    # the drift of the final checkpoint, merged into a Hugging Face model
    assert summary["final_model"] == str(run / "model")
    assert (run / "model" / "config.json").is_file()
    assert summary["drift"]["n_prompts"] == 4 and summary["drift"]["kl"] >= 0
    assert summary["drift_seconds"] > 0
    rows = _rows(run)
    train = [r for r in rows if "grad_norm" in r]
    assert [r["step"] for r in train] == list(range(1, steps + 1))  # each step once
    for row in rows:
        assert all(is_shared(k) or k == "step" or k.startswith("verl/") for k in row), row
    for row in train:
        for name in ("pg_loss", "grad_norm", "reward_mean", "response_length_mean", "entropy",
                     "reg/prob_l2", "reg/kl_k3", "time/rl_seconds"):  # fmt: skip
            assert name in row, name
        assert row["grad_norm"] > 0, row  # it trains
        # the rollout's log-probs against the FSDP actor's, per token: the same weights
        assert row["verl/training/rollout_probs_diff_mean"] < 1e-4, row
    assert (run / "checkpoints" / f"global_step_{steps}" / "actor").is_dir()


def test_first_step_loss_equals_the_own_engines_on_verls_batch(
        verl_run: StoppedAndResumed) -> None:
    import torch

    from gbmpo.config import load_config
    from gbmpo.objectives import LossTerm, compute_policy_loss, get_regularizer, get_surrogate

    run = verl_run.finished()
    cfg = load_config(run / "config.yaml")
    dump = run.parent / "dump"  # the first part's (the resume dumps nothing)
    # one micro-batch per step (micro = mini = the step's 8 rows): call 1 is step 1
    pl = torch.load(sorted(dump.glob("policy_loss_*_0001.pt"))[0])
    kl = torch.load(sorted(dump.glob("kl_*_0001.pt"))[0])
    assert torch.equal(pl["log_prob"], kl["log_prob"])  # the KL call of the same micro-batch
    o = cfg.objective
    reg = o.regularizer
    own_loss, own = compute_policy_loss(
        logp=pl["log_prob"].double(),
        old_logp=pl["old_log_prob"].double(),
        advantages=pl["advantages"].double(),
        mask=pl["response_mask"],
        surrogate=get_surrogate(o.surrogate.name, **o.surrogate.params),
        terms=[LossTerm(reg.name, get_regularizer(reg.name, **reg.params), reg.coef,
                        kl["ref_log_prob"].double())],
        aggregation=o.aggregation,
        max_len=MAX_NEW,
    )  # fmt: skip
    step1 = next(r for r in _rows(run) if r["step"] == 1)
    assert own["pg_loss"] == pytest.approx(step1["verl/actor/pg_loss"], abs=1e-6)
    assert own["reg_loss"] == pytest.approx(reg.coef * step1["verl/actor/kl_loss"], abs=1e-6)
    assert float(own_loss) == pytest.approx(step1["verl/actor/loss"], abs=1e-6)
    assert float(own_loss) == pytest.approx(float(pl["loss"]) + own["reg_loss"], abs=1e-6)
    # dr_grpo advantages: reward minus its group's mean, so they sum to 0 over the batch
    adv = pl["advantages"][:, 0].double()
    assert abs(float(adv.sum())) < 1e-5 and float(adv.abs().max()) > 0


def test_sigterm_stops_verl_and_says_where_it_goes_on(verl_run: StoppedAndResumed) -> None:
    """SIGTERM to ``gbmpo train`` alone (a scheduler's notice) ends verl's whole process group
    (no ``main_ppo`` left behind), one line names verl's newest checkpoint and the resume
    command, status.json says preempted, the exit code is 143."""
    out, err = verl_run.run, verl_run.stderr
    assert verl_run.returncode == 143, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("gbmpo train: stopped (preempted, SIGTERM); verl writes no "
                           "checkpoint on a signal"), last
    assert f"resume with: gbmpo train --resume {out}" in last
    status = verl_run.status
    assert f"its newest is step {status['step']} (" in last  # a checkpoint every step
    assert status["status"] == "preempted" and status["signal"] == "SIGTERM"
    assert status["engine"] == "verl"
    assert not verl_run.processes_left, verl_run.processes_left


def test_resume_after_the_signal_continues(verl_run: StoppedAndResumed) -> None:
    """``--resume --time-budget T`` continues from verl's newest checkpoint K for one step: the
    steps up to K are the first part's rows, step K+1 is trained once, and the run ends."""
    run, steps = verl_run.finished(), verl_run.steps
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == steps and summary["status"] == "finished"
    first = {r["step"]: r["data"] for r in verl_run.verl_rows if "actor/grad_norm" in r["data"]}
    assert set(range(1, steps)) <= set(first)  # the checkpoint's step was logged
    train = {r["step"]: r for r in _rows(run) if "grad_norm" in r}
    assert sorted(train) == list(range(1, steps + 1))
    for step in range(1, steps):  # the first part's rows, kept
        assert train[step]["grad_norm"] == first[step]["actor/grad_norm"]
    assert train[steps]["grad_norm"] > 0  # the resume's step
    assert (run / "checkpoints" / f"global_step_{steps}" / "actor").is_dir()
