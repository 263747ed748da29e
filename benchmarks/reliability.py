"""Reliability suite: kill -9 and resume, damaged checkpoints, racing runs, a full
disk, bad inputs. Every scenario is counted as tried / survived / lost.

    python benchmarks/reliability.py            # 20 kill points per command (~25 min, 2 cores)
    python benchmarks/reliability.py --quick    # smoke test: 2 kills of train, a race, 3 bad inputs
    python benchmarks/reliability.py --commands trl,trl2 --trl-kills 5 --bad-inputs 0 \
        --no-damaged --no-disk-full              # TRL engine only: 1 and 2 processes

Scenarios (each a real ``gbmpo`` process, tiny configurations, ``--time-budget null`` so that a
run is reproducible step for step):

* **kill -9 + resume** (``train``, ``es``, ``compare``): an uninterrupted reference run is timed;
  then, for each of N seeded kill times drawn uniformly over the reference's wall time (process
  start-up included), the command is started in a fresh directory, its whole process group gets
  SIGKILL at that moment, every file left behind is checked, and the run is resumed the way a
  user would (``gbmpo train --resume DIR`` when ``DIR/config.yaml`` exists, else the original
  command; ``gbmpo es --resume DIR`` when ``DIR/es_state.json`` exists, else the original
  command; ``gbmpo compare`` re-run as it was). Survived = the resume exits 0 and the result is
  identical to the reference, and no corrupt file exists after the kill or after the resume, and
  nothing looked complete after the kill unless it was. "Identical": every ``metrics.jsonl``
  row equal after dropping wall-clock fields (``time/*``, ``step_seconds``,
  ``tokens_per_second``); ``summary.json`` equal but for wall/RL/drift seconds and paths; the
  sha256 of every tensor of the exported model and of the final checkpoint's weights equal. ES: the
  ``es_state.json`` document (history without ``eval_seconds``), every ``theta/*.safetensors``
  tensor and ``best_mirror.json``. compare: each grid run as for train, plus ``results.json``
  without timings, dates and the per-run actions (fresh / resume / reuse).
  A control pair (the reference run twice, uninterrupted) must be identical, else the comparison
  would prove nothing.
* **kill -9 + resume of ``--engine trl``** (``trl``: one process; ``trl2``: two, through
  ``accelerate launch``, gloo on CPU; a checkpoint every RL step): the same, with TRL's
  checkpoints, and the kill time drawn over the reference's seconds from its first metrics row
  to its end, counted from the moment ``metrics.jsonl`` appears (``--trl-kill-anytime``: over
  the whole process, whose start-up is most of a tiny TRL run). The run's process group gets
  SIGKILL (torch's launcher starts each worker in a session of its own: they must end with
  their launcher; no process naming the run directory may outlive the kill by 10 s);
  ``gbmpo train --resume DIR``
  continues from the newest checkpoint that gbmpo completed (``gbmpo_state.json``). A
  ``checkpoint-N/`` without that file is a save the kill cut short: a leftover (the resume
  removes it), not a corrupt file. "Identical" as for ``train`` (TRL's ``trl/step_time`` is a
  wall-clock field), plus the final checkpoint's ``model.safetensors``.
* **SIGTERM / SIGINT + resume** (``train``, ``trl``, ``trl2``; ``--signals N`` of each): SIGTERM to
  the process (``kill PID``, a scheduler's preemption notice), SIGINT to its process group
  (Ctrl-C), at a time drawn over the reference's training seconds. Survived = exit 143 / 130,
  one line on stderr (``note:`` lines aside) with the resume command and no traceback,
  ``status.json`` ``preempted`` / ``interrupted`` naming an existing checkpoint, no lock file,
  no corrupt file, and ``gbmpo train --resume DIR`` ends with the reference's result.
* **no corrupt file**: every ``*.json``, ``*.jsonl``, ``*.yaml``, ``*.safetensors`` and ``*.pt``
  under the directory parses / loads, every checkpoint matches its manifest. Hidden temporary
  files (``.name.XXXX.tmp``, ``.step-N.XXXX/``) are not under a real name; they are listed
  separately as leftovers.
* **damaged checkpoint**: a run is stopped (SIGKILL) after its 3rd checkpoint, one file of the
  newest checkpoint is truncated to half; the resume must say which checkpoint it skips and give
  the reference's result. With ``keep_checkpoints 1`` (nothing to fall back to) the resume must
  stop with an error naming the damaged checkpoint. For ``es`` (which keeps one state file) a
  truncated parameter file must be reported by name.
* **two runs racing for one output directory**: a second process on the same ``--output-dir``
  (another seed, started 0 ... a few seconds after the first): exactly one must finish, with the
  reference result of its own seed; the other must stop with an error saying the directory is
  in use or not empty (``compare`` may instead reuse the finished runs of the winner).
* **disk full during a checkpoint**: the run directory on a small tmpfs (``mount -t tmpfs``, root
  only; otherwise in-process fault injection: ``torch.save`` raises ENOSPC), sized to fail on
  the 1st or the 2nd checkpoint: the run must exit with one error line naming the checkpoint and
  "No space left on device", the previous checkpoint must verify and load, nothing may look
  finished; after the tmpfs is enlarged the resume must give the reference's result.
* **bad inputs** (>= 30: configuration, data, reward functions, ES and compare options): exit code
  2, one error line that names the problem, and no run directory that looks complete (no
  ``summary.json`` / finished ES state / ``results.json``).

Writes ``benchmarks/results/reliability.json`` and prints a table and a one-line summary last.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import finish_result, load_average, start_result  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
GBMPO_SCRIPT = Path(sys.executable).with_name("gbmpo")
GBMPO = [str(GBMPO_SCRIPT)] if GBMPO_SCRIPT.is_file() else [sys.executable, "-m", "gbmpo.cli"]
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
}
ENV.pop("GBMPO_PLUGINS", None)

# the tiny runs; --time-budget null: reproducible step for step
TRAIN_FAST = [
    "--rollout.prompts_per_step", "2", "--num-generations", "4", "--max-new-tokens", "24",
    "--eval.limit", "8", "--eval.max_new_tokens", "24", "--time-budget", "null",
    "--run.progress", "false", "--mu", "1", "--optim.mini_batch_size", "4", "--lr", "2e-4",
    "--run.keep_checkpoints", "2",
]
ES_YAML = """\
es: {population: 4, iterations: %(iterations)d, seed: 3, sigma0: 0.5}
fitness: {steps: 2, validation_size: 8, metric: mean_response_tokens}
train:
  rollout: {prompts_per_step: 2, num_generations: 4, max_new_tokens: 40}
  eval: {max_new_tokens: 40}
  optim: {mini_batch_size: null, lr: 0.002}
backend: {name: serial, threads: 1}
"""
COMPARE_FAST = [
    "--regularizers", "kl_k3,prob_l2", "--seeds", "0,1", "--no-plots",
    "--rollout.prompts_per_step", "2", "--num-generations", "2", "--max-new-tokens", "16",
    "--eval.limit", "4", "--eval.max_new_tokens", "16", "--eval-every", "0",
    "--time-budget", "null", "--mu", "1", "--optim.mini_batch_size", "null",
    "--run.checkpoint_every", "2", "--steps", "6",
]
TIMING_SUMMARY_KEYS = {"wall_seconds", "rl_seconds", "drift_seconds", "run_dir", "final_model"}
RESULTS_VOLATILE_KEYS = {
    "generated", "machine", "actions", "wall_seconds", "rl_seconds", "run_dir", "path",
}


# ------------------------------------------------------------------------------- processes


@dataclass
class Proc:
    """A finished (or killed) gbmpo process."""

    args: list[str]
    returncode: int
    seconds: float
    killed: bool
    stderr: str
    stdout: str

    def error_lines(self) -> list[str]:
        return [ln for ln in self.stderr.splitlines() if "error:" in ln]


def use_snapshot(work: Path, ref: str) -> str:
    """Run every gbmpo process from ``git archive <ref>`` of ``src/`` (first on PYTHONPATH, so it
    wins over the editable install): the working tree may change while the suite runs, and a
    resume must run the code its reference ran. Returns the commit id."""
    commit = subprocess.run(["git", "rev-parse", ref], cwd=REPO, capture_output=True, text=True,
                            check=True).stdout.strip()
    snap = work / "snapshot"
    snap.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "archive", commit, "src"], cwd=REPO, capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(snap)], input=archive, check=True)
    ENV["PYTHONPATH"] = os.pathsep.join(
        [str(snap / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])
    return commit


def start(args: list[str], log_dir: Path, cwd: Path) -> tuple[subprocess.Popen[bytes], Path, Path]:
    log_dir.mkdir(parents=True, exist_ok=True)
    n = len(list(log_dir.glob("*.out")))
    out, err = log_dir / f"{n:02d}.out", log_dir / f"{n:02d}.err"
    proc = subprocess.Popen(
        [*GBMPO, *args], stdout=out.open("wb"), stderr=err.open("wb"), env=ENV, cwd=cwd,
        start_new_session=True,  # its own process group: SIGKILL reaches pool workers too
    )
    return proc, out, err


def finish(
    proc: subprocess.Popen[bytes], out: Path, err: Path, args: list[str], t0: float,
    kill_after: float | None = None, kill_when: Callable[[], bool] | None = None,
    timeout: float = 900, send: tuple[int, bool] | None = None,
) -> Proc:
    """Wait for ``proc``; SIGKILL its process group after ``kill_after`` seconds from ``t0`` or
    as soon as ``kill_when()`` is true (polled). ``send=(signal, to_group)``: send that signal
    instead (to the process group, as Ctrl-C does, or to the process, as ``kill PID``) and wait
    for the process to end (``killed`` then means: signalled)."""
    killed = False
    deadline = t0 + timeout
    while proc.poll() is None:
        now = time.perf_counter()
        if (kill_after is not None and now - t0 >= kill_after) or (
            kill_when is not None and kill_when()
        ):
            if send is not None:
                with contextlib.suppress(ProcessLookupError):
                    (os.killpg if send[1] else os.kill)(proc.pid, send[0])
                killed, kill_after, kill_when = True, None, None
                continue
            os.killpg(proc.pid, signal.SIGKILL)
            killed = True
            break
        if now > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise TimeoutError(f"{' '.join(args)} did not finish in {timeout} s")
        time.sleep(0.01 if kill_after is not None else 0.05)
    proc.wait()
    if killed and send is None:  # the group's other members (pool workers) too
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return Proc(args, proc.returncode, time.perf_counter() - t0, killed,
                err.read_text(errors="replace"), out.read_text(errors="replace"))


def run(args: list[str], log_dir: Path, cwd: Path, **kw: Any) -> Proc:
    t0 = time.perf_counter()
    p, out, err = start(args, log_dir, cwd)
    return finish(p, out, err, args, t0, **kw)


# ------------------------------------------------------------------------------- file checks


def _is_temporary(rel: Path) -> bool:
    return any(part.startswith(".") for part in rel.parts) or rel.name.endswith(".tmp")


def scan(root: Path) -> tuple[list[str], list[str]]:
    """``(corrupt files, leftover temporary files)`` under ``root``."""
    import torch
    import yaml
    from safetensors import safe_open

    from gbmpo.engines.trl import checkpoints as trl_checkpoints
    from gbmpo.train.checkpoint import LOCK_FILE, list_checkpoints, verify_checkpoint

    corrupt: list[str] = []
    temps: list[str] = []
    if not root.exists():
        return corrupt, temps
    # TRL checkpoints the kill cut short (no gbmpo_state.json): leftovers the resume removes
    trl_partial = {c for c in root.rglob("checkpoint-*")
                   if c.is_dir() and not (c / trl_checkpoints.STATE_FILE).is_file()}
    for p in sorted(root.rglob("*")):
        if not p.is_file():
            continue
        rel = p.relative_to(root)
        if p.name == LOCK_FILE:
            continue
        if _is_temporary(rel) or any(c in p.parents for c in trl_partial):
            temps.append(str(rel))
            continue
        try:
            if p.suffix == ".json":
                json.loads(p.read_text())
            elif p.suffix == ".jsonl":
                text = p.read_text()
                if text and not text.endswith("\n"):
                    raise ValueError("last line is cut short")
                for line in text.splitlines():
                    if line.strip():
                        json.loads(line)
            elif p.suffix in (".yaml", ".yml"):
                yaml.safe_load(p.read_text())
            elif p.suffix == ".safetensors":
                with safe_open(str(p), framework="pt") as f:
                    for k in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                        f.get_tensor(k)
            elif p.suffix in (".pt", ".pth"):
                torch.load(p, weights_only=False)
        except Exception as err:  # noqa: BLE001 - any failure to load is corruption
            corrupt.append(f"{rel}: {type(err).__name__}: {str(err)[:200]}")
    for run_dir in {c.parent.parent for c in root.rglob("checkpoints/step-*")}:
        for _, ckpt in list_checkpoints(run_dir):
            problem = verify_checkpoint(ckpt)
            if problem:
                corrupt.append(f"{ckpt.relative_to(root)}: {problem}")
    for run_dir in {c.parent.parent for c in root.rglob("checkpoints/checkpoint-*")}:
        for _, ckpt in trl_checkpoints.checkpoints(run_dir):
            problem = trl_checkpoints.verify_checkpoint(ckpt)
            if problem:
                corrupt.append(f"{ckpt.relative_to(root)}: {problem}")
    return corrupt, temps


def _tensor_hashes(path: Path) -> dict[str, str]:
    """sha256 (16 hex digits) of every tensor's bytes, by name."""
    import torch
    from safetensors import safe_open

    out = {}
    with safe_open(str(path), framework="pt") as f:
        for k in sorted(f.keys()):  # noqa: SIM118
            t = f.get_tensor(k).contiguous().view(-1).view(torch.uint8)
            out[k] = hashlib.sha256(t.numpy().tobytes()).hexdigest()[:16]
    return out


def _strip(obj: Any, keys: set[str]) -> Any:
    if isinstance(obj, dict):
        return {k: _strip(v, keys) for k, v in obj.items() if k not in keys}
    if isinstance(obj, list):
        return [_strip(v, keys) for v in obj]
    return obj


def train_fingerprint(run_dir: Path) -> dict[str, Any]:
    from gbmpo.lifecycle.logging import read_metrics, without_timing
    from gbmpo.train.checkpoint import latest_checkpoint

    summary = json.loads((run_dir / "summary.json").read_text())
    ckpt = latest_checkpoint(run_dir)
    model = run_dir / "model" / "model.safetensors"
    return {
        "metrics": [without_timing(r) for r in read_metrics(run_dir)],
        "summary": {k: v for k, v in summary.items() if k not in TIMING_SUMMARY_KEYS},
        "model": _tensor_hashes(model) if model.is_file() else None,
        "checkpoint": (ckpt.name, _tensor_hashes(ckpt / "trainable.safetensors"))
        if ckpt else None,
    }


def es_fingerprint(out: Path) -> dict[str, Any]:
    doc = json.loads((out / "es_state.json").read_text())
    doc["history"] = [{k: v for k, v in h.items() if k != "eval_seconds"} for h in doc["history"]]
    return {
        "state": doc,
        "theta": {p.name: _tensor_hashes(p) for p in sorted((out / "theta").glob("*.safetensors"))},
        "mirror": json.loads((out / "best_mirror.json").read_text()),
    }


def compare_fingerprint(out: Path) -> dict[str, Any]:
    runs = sorted(p.parent for p in (out / "runs").rglob("summary.json"))
    return {
        "runs": {str(r.relative_to(out)): train_fingerprint(r) for r in runs},
        "results": _strip(json.loads((out / "results.json").read_text()),
                          RESULTS_VOLATILE_KEYS),
    }


def first_difference(a: Any, b: Any, where: str = "") -> str | None:
    """Where two JSON-like values first differ (for the report), ``None`` if equal."""
    if type(a) is not type(b):
        return f"{where or '.'}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, dict):
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                return f"{where}.{k}: only in {'reference' if k in a else 'resumed run'}"
            d = first_difference(a[k], b[k], f"{where}.{k}")
            if d:
                return d
        return None
    if isinstance(a, list):
        if len(a) != len(b):
            return f"{where}: {len(a)} vs {len(b)} items"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            d = first_difference(x, y, f"{where}[{i}]")
            if d:
                return d
        return None
    return None if a == b else f"{where}: {a!r} vs {b!r}"


# ------------------------------------------------------------------------------- commands


@dataclass
class Command:
    """How to start, resume, recognise as finished and fingerprint one gbmpo command."""

    name: str
    fresh: Callable[[Path], list[str]]
    resume: Callable[[Path], list[str]]
    complete: Callable[[Path], bool]
    fingerprint: Callable[[Path], dict[str, Any]]
    progress: Callable[[Path], str]


def has_checkpoint(d: Path) -> bool:
    """Whether the run directory ``d`` holds a complete checkpoint (own engine or TRL)."""
    from gbmpo.engines.trl import checkpoints as trl_checkpoints
    from gbmpo.train.checkpoint import list_checkpoints

    return bool(list_checkpoints(d) or trl_checkpoints.checkpoints(d))


def train_command(steps: int, extra: list[str] | None = None) -> Command:
    base = [*TRAIN_FAST, "--steps", str(steps), "--eval-every", str(max(2, steps // 2)),
            "--run.checkpoint_every", "2", *(extra or [])]

    def fresh(d: Path) -> list[str]:
        return ["train", *base, "--output-dir", str(d)]

    def resume(d: Path) -> list[str]:
        # a run killed before its first checkpoint: the resume says to add --restart
        if (d / "config.yaml").is_file():
            return ["train", "--resume", str(d), *([] if has_checkpoint(d) else ["--restart"])]
        return fresh(d)

    def progress(d: Path) -> str:
        from gbmpo.train.checkpoint import latest_checkpoint

        if not d.exists():
            return "no run directory yet"
        if (d / "summary.json").exists():
            return "finished"
        ckpt = latest_checkpoint(d)
        n = len((d / "metrics.jsonl").read_text().splitlines()) if (
            d / "metrics.jsonl").exists() else 0
        return f"{ckpt.name if ckpt else 'no checkpoint'}, {n} metrics rows"

    return Command("train", fresh, resume, lambda d: (d / "summary.json").is_file(),
                   train_fingerprint, progress)


#: TRL's wall-clock metric (seconds of the step), besides the schema's timing fields
TRL_TIMING = {"trl/step_time"}
TRL_SUMMARY_VOLATILE = TIMING_SUMMARY_KEYS | {"finished"}


def trl_fingerprint(run_dir: Path) -> dict[str, Any]:
    from gbmpo.engines.trl import checkpoints as trl_checkpoints
    from gbmpo.lifecycle.logging import read_metrics, without_timing

    summary = json.loads((run_dir / "summary.json").read_text())
    found = trl_checkpoints.checkpoints(run_dir)
    model = run_dir / "model" / "model.safetensors"
    return {
        "metrics": [{k: v for k, v in without_timing(r).items() if k not in TRL_TIMING}
                    for r in read_metrics(run_dir)],
        "summary": {k: v for k, v in summary.items() if k not in TRL_SUMMARY_VOLATILE},
        "model": _tensor_hashes(model) if model.is_file() else None,
        "checkpoint": (found[-1][1].name, _tensor_hashes(found[-1][1] / "model.safetensors"))
        if found else None,
    }


def trl_command(steps: int, processes: int) -> Command:
    """``gbmpo train --engine trl`` on ``processes`` processes, a checkpoint every RL step."""
    cmd = train_command(steps, ["--engine", "trl", "--num-processes", str(processes),
                                "--run.checkpoint_every", "1"])

    def progress(d: Path) -> str:
        from gbmpo.engines.trl import checkpoints as trl_checkpoints

        if not d.exists():
            return "no run directory yet"
        if (d / "summary.json").exists():
            return "finished"
        done = trl_checkpoints.checkpoints(d)
        started = trl_checkpoints.checkpoints(d, complete=False)
        rows = d / "metrics.jsonl"
        n = len(rows.read_text().splitlines()) if rows.exists() else 0
        complete = {p for _, p in done}
        cut = [p.name for _, p in started if p not in complete]
        return (f"{done[-1][1].name if done else 'no checkpoint'}"
                + (f" (cut short: {', '.join(cut)})" if cut else "") + f", {n} metrics rows")

    name = "trl" if processes == 1 else f"trl ({processes} processes)"
    return Command(name, cmd.fresh, cmd.resume, cmd.complete, trl_fingerprint, progress)


def survivors(d: Path, wait: float = 10.0) -> list[str]:
    """Processes whose command line names ``d`` still running ``wait`` seconds after a kill."""
    deadline = time.perf_counter() + wait
    while True:
        alive = []
        for proc in Path("/proc").glob("[0-9]*"):
            with contextlib.suppress(OSError):
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(
                    errors="replace")
                if str(d) in cmdline and int(proc.name) != os.getpid():
                    stat = (proc / "stat").read_text()
                    if stat.rsplit(")", 1)[1].split()[0] != "Z":  # zombies are gone
                        alive.append(f"{proc.name}: {cmdline[:120]}")
        if not alive or time.perf_counter() > deadline:
            return alive
        time.sleep(0.1)


def es_command(config: Path, iterations: int) -> Command:
    def fresh(d: Path) -> list[str]:
        return ["es", "--config", str(config), "--output-dir", str(d)]

    def resume(d: Path) -> list[str]:
        return ["es", "--resume", str(d)] if (d / "es_state.json").is_file() else fresh(d)

    def complete(d: Path) -> bool:
        p = d / "es_state.json"
        return p.is_file() and json.loads(p.read_text())["iteration"] >= iterations

    def progress(d: Path) -> str:
        p = d / "es_state.json"
        if not p.is_file():
            return "no ES state yet"
        return f"iteration {json.loads(p.read_text())['iteration']}/{iterations}"

    return Command("es", fresh, resume, complete, es_fingerprint, progress)


def compare_command() -> Command:
    def fresh(d: Path) -> list[str]:
        return ["compare", *COMPARE_FAST, "--output-dir", str(d)]

    def progress(d: Path) -> str:
        done = len(list((d / "runs").rglob("summary.json"))) if d.exists() else 0
        return f"{done}/4 runs finished" + (", report written" if (d / "results.json").exists()
                                            else "")

    return Command("compare", fresh, fresh, lambda d: (d / "results.json").is_file(),
                   compare_fingerprint, progress)


# ------------------------------------------------------------------------------- bookkeeping


@dataclass
class Category:
    tried: int = 0
    survived: int = 0
    lost: int = 0
    details: list[dict[str, Any]] = field(default_factory=list)

    def add(self, ok: bool, **detail: Any) -> None:
        self.tried += 1
        self.survived += int(ok)
        self.lost += int(not ok)
        self.details.append({"ok": ok, **detail})
        mark = "ok  " if ok else "LOST"
        short = {k: v for k, v in detail.items()
                 if k in ("case", "kill_at", "killed", "at_kill", "why")}
        print(f"    {mark} {json.dumps(short, default=str)[:260]}", flush=True)


class Suite:
    def __init__(self, work: Path) -> None:
        self.work = work
        self.categories: dict[str, Category] = {}
        self.references: dict[str, dict[str, Any]] = {}
        self.ref_seconds: dict[str, float] = {}
        self.train_seconds: dict[str, float] = {}

    def cat(self, name: str) -> Category:
        return self.categories.setdefault(name, Category())

    def dir(self, *parts: str) -> Path:
        p = self.work.joinpath(*parts)
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    # -------------------------------------------------------------- references

    def reference(self, key: str, cmd: Command, control: bool) -> None:
        d = self.dir("ref", key)
        seen = _watch_metrics(d)
        proc = run(cmd.fresh(d), self.dir("logs", "ref", key), self.work, kill_when=seen)
        # seconds from the first metrics row (after start-up and model loading) to the end
        self.train_seconds[key] = proc.seconds - (seen.at - seen.t0) if seen.at else proc.seconds
        if proc.returncode != 0:
            raise RuntimeError(f"reference {key} failed:\n{proc.stderr[-3000:]}")
        self.ref_seconds[key] = proc.seconds
        self.references[key] = cmd.fingerprint(d)
        corrupt, _ = scan(d)
        if corrupt:
            raise RuntimeError(f"reference {key} has unreadable files: {corrupt}")
        print(f"  reference {key}: {proc.seconds:.1f} s", flush=True)
        if control:
            d2 = self.dir("ref", key + "-control")
            seen2 = _watch_metrics(d2)
            proc2 = run(cmd.fresh(d2), self.dir("logs", "ref", key + "-control"), self.work,
                        kill_when=seen2)
            if seen2.at:
                self.train_seconds[key] = min(self.train_seconds[key],
                                              proc2.seconds - (seen2.at - seen2.t0))
            diff = first_difference(self.references[key], cmd.fingerprint(d2))
            self.cat("control").add(proc2.returncode == 0 and diff is None, case=key, why=diff)
            # the kill times are drawn over the shorter of the two (the load changes)
            self.ref_seconds[key] = min(proc.seconds, proc2.seconds)

    # -------------------------------------------------------------- resume helper

    def resume_to_end(self, cmd: Command, d: Path, logs: Path, attempts: int = 2) -> Proc:
        proc = None
        for _ in range(attempts):
            proc = run(cmd.resume(d), logs, self.work)
            if proc.returncode == 0 and cmd.complete(d):
                break
        assert proc is not None
        return proc

    def check_against(self, key: str, cmd: Command, d: Path) -> str | None:
        try:
            return first_difference(self.references[key], cmd.fingerprint(d))
        except Exception as err:  # noqa: BLE001 - a missing or unreadable file is a loss
            return f"cannot read the result: {type(err).__name__}: {err}"

    # -------------------------------------------------------------- kill -9 + resume

    def kills(self, key: str, cmd: Command, n: int, rng: random.Random,
              during_training: bool = False) -> None:
        """``during_training``: the kill time is drawn over the reference's seconds from its
        first metrics row to its end (the shorter of the pair) and counted from the moment the
        run's metrics.jsonl appears, instead of over the whole process (whose imports and
        start-up take most of a tiny TRL run)."""
        cat = self.cat(f"kill -9 + resume: {cmd.name}")
        total = self.ref_seconds[key]
        if during_training:
            total = self.train_seconds[key]
        for i in range(n):
            d = self.dir("kill", cmd.name, f"{i:02d}")
            logs = self.dir("logs", "kill", cmd.name, f"{i:02d}")
            # a run that finished before its kill time (the machine's load varies) is not a kill
            # point: draw another time, at most 3 draws
            for draw in range(3):
                at = rng.uniform(0.0, total)
                if during_training:
                    first = run(cmd.fresh(d), logs, self.work,
                                kill_when=_after_metrics_appear(d, at))
                else:
                    first = run(cmd.fresh(d), logs, self.work, kill_after=at)
                if first.killed or draw == 2:
                    break
                shutil.rmtree(d)
            left = survivors(d) if first.killed else []
            at_kill = cmd.progress(d)
            corrupt, temps = scan(d)
            looked_complete = cmd.complete(d)
            why = []
            if left:
                why.append(f"processes outlived the kill: {left}")
            if corrupt:
                why.append(f"corrupt after the kill: {corrupt}")
            if looked_complete and self.check_against(key, cmd, d) is not None:
                why.append("looked complete after the kill but was not")
            # a run that finished before its kill time needs no resume
            res = self.resume_to_end(cmd, d, logs) if not looked_complete else first
            if res.returncode != 0 and not looked_complete:
                why.append(f"resume exit {res.returncode}: {res.stderr.strip()[-600:]}")
            else:
                diff = self.check_against(key, cmd, d)
                if diff:
                    why.append(f"differs from the reference: {diff}")
                corrupt2, temps2 = scan(d)
                if corrupt2:
                    why.append(f"corrupt after the resume: {corrupt2}")
                temps = sorted(set(temps) | set(temps2))
            cat.add(not why, case=i, kill_at=round(at, 2), killed=first.killed, draws=draw + 1,
                    at_kill=at_kill, temp_leftovers=temps, why="; ".join(why) or None)

    # -------------------------------------------------------------- SIGTERM / SIGINT

    def signals(self, key: str, cmd: Command, n: int, rng: random.Random) -> None:
        """SIGTERM to the process (``kill PID``, a scheduler's notice) and SIGINT to its process
        group (Ctrl-C), each ``n`` times, at a time drawn over the reference's training seconds
        (counted from the moment metrics.jsonl appears). Survived = exit 143 / 130, one line
        on stderr (besides ``note:`` lines) naming the checkpoint and the resume command, no
        traceback, status.json ``preempted`` / ``interrupted`` naming an intact checkpoint, no
        lock file and no corrupt file; then ``gbmpo train --resume DIR`` gives the reference's
        result."""
        from gbmpo.io import LOCK_FILE

        cat = self.cat(f"signal + resume: {cmd.name}")
        expect = {signal.SIGTERM: (143, "preempted", False), signal.SIGINT: (130, "interrupted",
                                                                             True)}  # fmt: skip
        for sig, (code, state, group) in expect.items():
            for i in range(n):
                d = self.dir("signal", cmd.name, f"{sig.name}-{i:02d}")
                logs = self.dir("logs", "signal", cmd.name, f"{sig.name}-{i:02d}")
                for draw in range(3):
                    at = rng.uniform(0.0, 0.8 * self.train_seconds[key])
                    first = run(cmd.fresh(d), logs, self.work, send=(sig, group),
                                kill_when=_after_metrics_appear(d, at))
                    if not cmd.complete(d) or draw == 2:
                        break
                    shutil.rmtree(d)  # it finished before the signal: draw another time
                why = []
                lines = [ln for ln in first.stderr.strip().splitlines()
                         if not ln.startswith("note: ")]  # fmt: skip
                if first.returncode != code:
                    why.append(f"exit {first.returncode}, not {code}: {first.stderr[-600:]}")
                if "Traceback" in first.stderr or len(lines) != 1:
                    why.append(f"stderr is not one line: {lines[-5:]}")
                elif "resume with: gbmpo train --resume" not in lines[0]:
                    why.append(f"the line names no resume command: {lines[0]}")
                status = {}
                with contextlib.suppress(OSError, ValueError):
                    status = json.loads((d / "status.json").read_text())
                if status.get("status") != state or not status.get("checkpoint"):
                    why.append(f"status.json: {status}")
                elif not Path(status["checkpoint"]).is_dir():
                    why.append(f"the checkpoint it names is missing: {status['checkpoint']}")
                if (d / LOCK_FILE).exists():
                    why.append("the lock file is left")
                corrupt, temps = scan(d)
                if corrupt:
                    why.append(f"corrupt after the signal: {corrupt}")
                at_signal = cmd.progress(d)
                res = self.resume_to_end(cmd, d, logs, attempts=1)
                if res.returncode != 0:
                    why.append(f"resume exit {res.returncode}: {res.stderr.strip()[-600:]}")
                else:
                    diff = self.check_against(key, cmd, d)
                    if diff:
                        why.append(f"differs from the reference: {diff}")
                cat.add(not why, case=f"{sig.name} {i}", signal_at=round(at, 2),
                        step=status.get("step"), at_signal=at_signal, temp_leftovers=temps,
                        why="; ".join(why) or None)

    # -------------------------------------------------------------- damaged checkpoints

    def damaged_checkpoints(self, key: str, steps: int, victims: list[str]) -> None:
        cat = self.cat("damaged checkpoint")
        cmd = train_command(steps)
        for victim in victims:
            d = self.dir("damaged", victim)
            logs = self.dir("logs", "damaged", victim)
            first = run(cmd.fresh(d), logs, self.work,
                        kill_when=lambda d=d: (d / "checkpoints" / "step-6").is_dir())
            from gbmpo.train.checkpoint import latest_checkpoint

            latest = latest_checkpoint(d)
            why = []
            if latest is None or not first.killed:
                why.append(f"setup: run not stopped after its 3rd checkpoint ({latest})")
            else:
                f = latest / victim
                f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
                res = self.resume_to_end(cmd, d, logs, attempts=1)
                said = re.search(rf"checkpoint \S*{latest.name} is damaged \({re.escape(victim)}",
                                 res.stderr)
                if res.returncode != 0:
                    why.append(f"resume exit {res.returncode}: {res.stderr.strip()[-600:]}")
                elif not said:
                    why.append("the resume did not report the damaged checkpoint")
                else:
                    diff = self.check_against(key, cmd, d)
                    if diff:
                        why.append(f"differs from the reference: {diff}")
            cat.add(not why, case=f"train: truncated {victim} of the newest checkpoint",
                    why="; ".join(why) or None)
        # nothing to fall back to: a clear error naming the checkpoint
        cmd1 = train_command(steps, ["--run.keep_checkpoints", "1"])
        d = self.dir("damaged", "only-one")
        logs = self.dir("logs", "damaged", "only-one")
        run(cmd1.fresh(d), logs, self.work,
            kill_when=lambda: (d / "checkpoints" / "step-4").is_dir())
        from gbmpo.train.checkpoint import latest_checkpoint

        latest = latest_checkpoint(d)
        why = []
        if latest is None:
            why.append("setup: no checkpoint")
        else:
            f = latest / "trainable.safetensors"
            f.write_bytes(f.read_bytes()[:1000])
            res = run(cmd1.resume(d), logs, self.work)
            errs = res.error_lines()
            if res.returncode == 0 or len(errs) != 1 or latest.name not in errs[0] or (
                "trainable.safetensors" not in errs[0]
            ):
                why.append(f"exit {res.returncode}, error lines {errs}")
            if (d / "summary.json").exists():
                why.append("summary.json written")
        cat.add(not why, case="train: the only checkpoint truncated -> clear error",
                why="; ".join(why) or None)

    def damaged_es(self, es_cmd: Command, iterations: int) -> None:
        cat = self.cat("damaged checkpoint")
        d = self.dir("damaged", "es")
        logs = self.dir("logs", "damaged", "es")
        state = d / "es_state.json"

        def two_iterations_saved() -> bool:
            try:
                return int(json.loads(state.read_text())["iteration"]) >= 2
            except (OSError, ValueError, KeyError):
                return False

        run(es_cmd.fresh(d), logs, self.work, kill_when=two_iterations_saved)
        why = []
        try:
            theta = d / json.loads(state.read_text())["theta_file"]
            theta.write_bytes(theta.read_bytes()[:100])
            res = run(es_cmd.resume(d), logs, self.work)
            warned = [line for line in res.stderr.splitlines()
                      if theta.name in line and "previous state" in line]
            if res.returncode != 0 or not warned:
                why.append(f"exit {res.returncode}, stderr {res.stderr[-400:]!r}")
            elif int(json.loads(state.read_text())["iteration"]) != iterations:
                why.append("the resumed run did not finish every iteration")
        except (OSError, ValueError, KeyError) as err:
            why.append(f"setup: {err}")
        cat.add(not why, why="; ".join(why) or None,
                case="es: truncated parameter file of the saved state -> warning naming it, "
                     "resumed from the previous state to the end")

    # -------------------------------------------------------------- races

    def races(self, key_a: str, key_b: str, cmd_a: Command, cmd_b: Command,
              offsets: list[float]) -> None:
        cat = self.cat(f"race for one output dir: {cmd_a.name}")
        for i, offset in enumerate(offsets):
            d = self.dir("race", cmd_a.name, f"{i:02d}")
            logs = self.dir("logs", "race", cmd_a.name, f"{i:02d}")
            t0 = time.perf_counter()
            pa, oa, ea = start(cmd_a.fresh(d), logs, self.work)
            time.sleep(offset)
            tb = time.perf_counter()
            pb, ob, eb = start(cmd_b.fresh(d), logs, self.work)
            a = finish(pa, oa, ea, cmd_a.fresh(d), t0)
            b = finish(pb, ob, eb, cmd_b.fresh(d), tb)
            why = []
            winners = [(k, p) for k, p in ((key_a, a), (key_b, b)) if p.returncode == 0]
            conflict = re.compile(r"in use by another gbmpo process|already exists and is not "
                                  r"empty|exists: resume it")
            losers = [p for p in (a, b) if p.returncode != 0]
            for p in losers:
                errs = p.error_lines()
                if len(errs) != 1 or not conflict.search(errs[0]):
                    why.append(f"loser exit {p.returncode} without a clear error: "
                               f"{p.stderr.strip()[-400:]}")
            if cmd_a.name == "compare" and len(winners) == 2:
                winners = winners[:1]  # the second compare may reuse the finished runs
            if len(winners) != 1:
                why.append(f"{len(winners)} processes finished")
            else:
                diff = self.check_against(winners[0][0], cmd_a, d)
                if diff:
                    why.append(f"the winner's result differs from its reference: {diff}")
            corrupt, _ = scan(d)
            if corrupt:
                why.append(f"corrupt: {corrupt}")
            cat.add(not why, case=f"second start +{offset:g} s",
                    outcome=[(k, p.returncode) for k, p in ((key_a, a), (key_b, b))],
                    loser_error=[p.error_lines() for p in losers], why="; ".join(why) or None)

    # -------------------------------------------------------------- disk full

    def disk_full(self, key: str, steps: int, sizes: list[tuple[str, int]]) -> None:
        cat = self.cat("disk full during a checkpoint")
        cmd = train_command(steps, ["--run.keep_checkpoints", "1", "--run.checkpoint_every", "4"])
        for label, size_mb in sizes:
            mnt = self.dir("diskfull", label.replace(" ", "-"))
            mnt.mkdir(parents=True, exist_ok=True)
            logs = self.dir("logs", "diskfull", label.replace(" ", "-"))
            mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}M", "tmpfs",
                                      str(mnt)], capture_output=True).returncode == 0
            d = mnt / "run"
            why = []
            try:
                if mounted:
                    first = run(cmd.fresh(d), logs, self.work)
                    method = f"tmpfs of {size_mb} MB"
                else:
                    first = self._injected_enospc(cmd, d, logs, label)
                    method = "in-process fault injection (torch.save raises ENOSPC)"
                errs = first.error_lines()
                if first.returncode == 0:
                    why.append("the run did not fail")
                elif len(errs) != 1 or not re.search(
                        r"could not write checkpoint \S+step-\d+: .*No space left on device",
                        errs[0]):
                    why.append(f"exit {first.returncode} without one clear error line: "
                               f"{first.stderr.strip()[-600:]}")
                if (d / "summary.json").exists():
                    why.append("summary.json written")
                from gbmpo.train.checkpoint import list_checkpoints, verify_checkpoint

                kept = list_checkpoints(d)
                for _, ckpt in kept:
                    problem = verify_checkpoint(ckpt)
                    if problem:
                        why.append(f"{ckpt.name} damaged: {problem}")
                corrupt, temps = scan(d)
                if corrupt:
                    why.append(f"corrupt: {corrupt}")
                if mounted:
                    subprocess.run(["mount", "-o", "remount,size=512M", str(mnt)], check=True)
                res = self.resume_to_end(cmd, d, logs, attempts=1)
                if res.returncode != 0:
                    why.append(f"resume exit {res.returncode}: {res.stderr.strip()[-600:]}")
                else:
                    diff = self.check_against(key, cmd, d)
                    if diff:
                        why.append(f"differs from the reference: {diff}")
                cat.add(not why, case=f"{label}: {method}", error=errs,
                        checkpoints_after_failure=[p.name for _, p in kept],
                        temp_leftovers=temps, why="; ".join(why) or None)
            finally:
                if mounted:
                    subprocess.run(["umount", str(mnt)], capture_output=True)

    def _injected_enospc(self, cmd: Command, d: Path, logs: Path, label: str) -> Proc:
        nth = 1 if label.startswith("first") else 3  # torch.save calls: 2 per checkpoint
        code = (
            "import errno, sys, torch\n"
            "real = torch.save\ncalls = [0]\n"
            "def save(*a, **k):\n"
            "    calls[0] += 1\n"
            f"    if calls[0] == {nth}:\n"
            "        raise OSError(errno.ENOSPC, 'No space left on device')\n"
            "    return real(*a, **k)\n"
            "torch.save = save\n"
            "from gbmpo.cli import main\nsys.exit(main(sys.argv[1:]))\n"
        )
        t0 = time.perf_counter()
        logs.mkdir(parents=True, exist_ok=True)
        p = subprocess.run([sys.executable, "-c", code, *cmd.fresh(d)], capture_output=True,
                           text=True, env=ENV, cwd=self.work, timeout=900)
        return Proc(cmd.fresh(d), p.returncode, time.perf_counter() - t0, False, p.stderr,
                    p.stdout)

    # -------------------------------------------------------------- bad inputs

    def bad_inputs(self, cases: list[BadInput]) -> None:
        for case in cases:
            cat = self.cat(f"bad input: {case.category}")
            base = self.dir("bad", re.sub(r"\W+", "_", case.name))
            base.mkdir(parents=True, exist_ok=True)
            for name, text in case.files.items():
                (base / name).write_text(text)
            out = base / "out"
            for setup in case.setup:
                if setup == [UNFINISH]:  # as if killed after its last checkpoint
                    (out / "summary.json").unlink()
                    continue
                proc0 = run([a.format(dir=base, out=out) for a in setup],
                            self.dir("logs", "bad", base.name), self.work)
                if proc0.returncode != 0:
                    raise RuntimeError(f"setup of {case.name} failed: {proc0.stderr[-2000:]}")
            before = _finished_markers(out)
            args = [a.format(dir=base, out=out) for a in case.args]
            proc = run(args, self.dir("logs", "bad", base.name), self.work, timeout=300)
            errs = proc.error_lines()
            why = []
            if proc.returncode != 2:
                why.append(f"exit {proc.returncode}")
            if len(errs) != 1:
                why.append(f"{len(errs)} error lines: {proc.stderr.strip()[-500:]}")
            elif not re.search(case.expect.format(dir=re.escape(str(base))), errs[0]):
                why.append(f"message does not name the problem ({case.expect!r})")
            new_markers = _finished_markers(out) - before
            if new_markers:
                why.append(f"looks complete: {sorted(new_markers)}")
            corrupt, _ = scan(out)
            if corrupt:
                why.append(f"corrupt: {corrupt}")
            cat.add(not why, case=case.name, error=errs[0] if errs else proc.stderr[-300:],
                    why="; ".join(why) or None)


class _watch_metrics:  # noqa: N801 - used as a function
    """A ``kill_when`` that never kills: it notes when ``d/metrics.jsonl`` first appears."""

    def __init__(self, d: Path) -> None:
        self.d, self.t0 = d, time.perf_counter()
        self.at: float | None = None

    def __call__(self) -> bool:
        if self.at is None and (self.d / "metrics.jsonl").exists():
            self.at = time.perf_counter()
        return False


def _after_metrics_appear(d: Path, delay: float) -> Callable[[], bool]:
    """True ``delay`` seconds after ``d/metrics.jsonl`` is first seen (polled)."""
    seen: list[float] = []

    def ready() -> bool:
        if not seen:
            if (d / "metrics.jsonl").exists():
                seen.append(time.perf_counter())
            return False
        return time.perf_counter() - seen[0] >= delay

    return ready


def _finished_markers(out: Path) -> set[str]:
    if not out.exists():
        return set()
    marks = {str(p) for p in out.rglob("summary.json")} | {str(p) for p in
                                                           out.rglob("results.json")}
    for p in out.rglob("es_state.json"):
        marks.add(f"{p}@{json.loads(p.read_text()).get('iteration')}")
    return marks


# ------------------------------------------------------------------------------- bad inputs


@dataclass
class BadInput:
    category: str
    name: str
    args: list[str]
    #: regular expression the single error line must match ({dir}: the case's directory)
    expect: str
    files: dict[str, str] = field(default_factory=dict)
    #: commands run first (must succeed), e.g. a finished run to resume
    setup: list[list[str]] = field(default_factory=list)


UNFINISH = "<delete summary.json>"
MINI = ["--rollout.prompts_per_step", "2", "--num-generations", "2", "--max-new-tokens", "8",
        "--eval.before", "false", "--eval.after", "false", "--eval-every", "0",
        "--time-budget", "null", "--run.progress", "false", "--mu", "1",
        "--optim.mini_batch_size", "null", "--steps", "2"]
OUT = ["--output-dir", "{out}"]
DATA = ["--task", "jsonl", "--task.template", "base", "--task.params.prompt_column",
        "question", "--task.params.answer_column", "final", "--task.params.test_size", "1"]
ROWS = "".join(json.dumps({"question": f"What is {i} + {i}?", "final": str(2 * i)}) + "\n"
               for i in range(1, 7))
REWARD_OK = "--task.params.path={dir}/d.jsonl"


def _reward_case(name: str, body: str, expect: str) -> BadInput:
    return BadInput("rewards", name, ["train", *DATA, REWARD_OK, "--task.params.reward",
                                      "{dir}/r.py:reward", *MINI, *OUT], expect,
                    {"d.jsonl": ROWS, "r.py": body})


def bad_input_cases() -> list[BadInput]:
    reg = r"valid( names)?: .*kl_k3"
    cases = [
        # ---------------------------------------------------------------- configuration
        BadInput("config", "unknown key", ["train", "--optim.learning_rate", "1e-4", *MINI, *OUT],
                 r"unknown key 'optim.learning_rate'.*valid keys under 'optim': lr"),
        BadInput("config", "wrong type", ["train", "--rollout.num_generations", "eight", *MINI,
                                          *OUT], r"'rollout.num_generations' must be int.*eight"),
        BadInput("config", "negative steps", ["train", *MINI, "--steps", "-5", *OUT],
                 r"'run.steps'.*-5"),
        BadInput("config", "zero steps", ["train", *MINI, "--steps", "0", *OUT], r"'run.steps'"),
        BadInput("config", "unknown regularizer", ["train", "--regularizer", "kl_k9", *MINI, *OUT],
                 r"kl_k9.*" + reg),
        BadInput("config", "unknown surrogate", ["train", "--surrogate", "clipp", *MINI, *OUT],
                 r"clipp.*clip"),
        BadInput("config", "unknown advantage", ["train", "--advantage", "gae", *MINI, *OUT],
                 r"gae.*dr_grpo"),
        BadInput("config", "unknown aggregation", ["train", "--aggregation", "mean", *MINI, *OUT],
                 r"'mean'.*bnpo"),
        BadInput("config", "negative learning rate", ["train", *MINI, "--lr", "-1", *OUT],
                 r"'optim.lr'"),
        BadInput("config", "non-number coefficient", ["train", *MINI, "--coef", "abc", *OUT],
                 r"'objective.regularizer.coef' must be float.*abc"),
        BadInput("config", "mini-batch does not divide the batch",
                 ["train", *MINI, "--optim.mini_batch_size", "3", *OUT],
                 r"'optim.mini_batch_size'=3 must divide"),
        BadInput("config", "unknown schedule", ["train", *MINI, "--optim.schedule", "linear",
                                                *OUT], r"'optim.schedule'.*linear"),
        BadInput("config", "unknown rollout generator", ["train", *MINI, "--rollout.generator",
                                                         "vllm2", *OUT],
                 r"'rollout.generator'.*vllm2"),
        BadInput("config", "unknown reporter", ["train", *MINI, "--report-to", "mlflow", *OUT],
                 r"mlflow.*tensorboard"),
        BadInput("config", "unknown task", ["train", "--task", "gsm9k", *MINI, *OUT],
                 r"gsm9k.*arithmetic"),
        BadInput("config", "missing model", ["train", "--model", "{dir}/no-model", *MINI, *OUT],
                 r"no-model"),
        BadInput("config", "missing mirror map file",
                 ["train", "--regularizer", "neural_mirror", "--mirror", "{dir}/nm.json", *MINI,
                  *OUT], r"nm\.json"),
        BadInput("config", "YAML syntax error", ["train", "--config", "{dir}/c.yaml", *MINI, *OUT],
                 r"c\.yaml' is not valid YAML", {"c.yaml": "optim:\n  lr: [1e-4\n"}),
        BadInput("config", "YAML unknown section", ["train", "--config", "{dir}/c.yaml", *MINI,
                                                    *OUT], r"unknown key 'optimizer'",
                 {"c.yaml": "optimizer:\n  lr: 1e-4\n"}),
        BadInput("config", "YAML not a mapping", ["train", "--config", "{dir}/c.yaml", *MINI,
                                                  *OUT], r"c\.yaml' must hold a mapping",
                 {"c.yaml": "- 1\n- 2\n"}),
        BadInput("config", "YAML wrong type", ["train", "--config", "{dir}/c.yaml", *MINI, *OUT],
                 r"'rollout.temperature' must be float.*hot",
                 {"c.yaml": "rollout:\n  temperature: hot\n"}),
        BadInput("config", "missing config file", ["train", "--config", "{dir}/none.yaml", *MINI,
                                                   *OUT], r"none\.yaml' does not exist"),
        BadInput("config", "output dir not empty", ["train", *MINI, *OUT],
                 r"already exists and is not empty", setup=[["train", *MINI, *OUT]]),
        BadInput("config", "resume a finished run", ["train", "--resume", "{out}"],
                 r"already finished", setup=[["train", *MINI, *OUT]]),
        BadInput("config", "resume a directory that is no run", ["train", "--resume", "{dir}"],
                 r"no config.yaml"),
        BadInput("config", "resume with a changed objective",
                 ["train", "--resume", "{out}", "--lr", "1"],
                 r"cannot change 'optim.lr' when resuming",
                 setup=[["train", *MINI, *OUT], [UNFINISH]]),
        BadInput("config", "es: unknown config section", ["es", "--config", "{dir}/es.yaml",
                                                          "--output-dir", "{out}"],
                 r"unknown ES config section.*evolution", {"es.yaml": "evolution: {}\n"}),
        BadInput("config", "es: population too small", ["es", "--population", "1",
                                                        "--output-dir", "{out}"],
                 r"population"),
        BadInput("config", "es: inner regularizer is not a mirror map",
                 ["es", "--config", "{dir}/es.yaml", "--output-dir", "{out}"],
                 r"must be 'neural_mirror', got 'kl_k3'",
                 {"es.yaml": "train: {objective: {regularizer: {name: kl_k3}}}\n"}),
        BadInput("config", "es: resume without a state", ["es", "--resume", "{dir}"],
                 r"no ES state to resume"),
        BadInput("config", "compare: unknown regularizer",
                 ["compare", "--regularizers", "kl_k3,l2prob", "--seeds", "0", *MINI[:-2], *OUT],
                 r"unknown regularizer 'l2prob'; valid names: .*prob_l2"),
        BadInput("config", "compare: bad seeds", ["compare", "--regularizers", "kl_k3",
                                                  "--seeds", "0,x", *OUT], r"--seeds: 'x'"),
        BadInput("config", "compare: a key the grid sets", ["compare", "--regularizers", "kl_k3",
                                                            "--seed", "3", *OUT],
                 r"--seed is set by the grid; use --seeds"),
        # ---------------------------------------------------------------- data
        BadInput("data", "missing column", ["train", *DATA, "--task.params.path",
                                            "{dir}/d.jsonl", *MINI, *OUT],
                 r"d\.jsonl row \d+ has no column 'final'",
                 {"d.jsonl": ROWS + json.dumps({"question": "1+1?"}) + "\n"}),
        BadInput("data", "empty file", ["train", *DATA, "--task.params.path", "{dir}/d.jsonl",
                                        *MINI, *OUT], r"d\.jsonl has no rows", {"d.jsonl": ""}),
        BadInput("data", "invalid JSON line", ["train", *DATA, "--task.params.path",
                                               "{dir}/d.jsonl", *MINI, *OUT],
                 r"d\.jsonl line 3: invalid JSON",
                 {"d.jsonl": "".join(ROWS.splitlines(keepends=True)[:2])
                  + '{"question": "2+2?", "final": \n'}),
        BadInput("data", "missing data file", ["train", *DATA, "--task.params.path",
                                               "{dir}/none.jsonl", *MINI, *OUT],
                 r"none\.jsonl' does not exist"),
        BadInput("data", "row is not an object", ["train", *DATA, "--task.params.path",
                                                  "{dir}/d.jsonl", *MINI, *OUT],
                 r"d\.jsonl row \d+: expected an object", {"d.jsonl": ROWS + "[1, 2]\n"}),
        BadInput("data", "empty prompt", ["train", *DATA, "--task.params.path", "{dir}/d.jsonl",
                                          *MINI, *OUT], r"column 'question' must be non-empty",
                 {"d.jsonl": ROWS + json.dumps({"question": "", "final": "1"}) + "\n"}),
        BadInput("data", "nothing left for training", ["train", *DATA[:-2],
                                                       "--task.params.test_size", "6",
                                                       "--task.params.path", "{dir}/d.jsonl",
                                                       *MINI, *OUT],
                 r"no rows left for training", {"d.jsonl": ROWS}),
        BadInput("data", "template names a missing column",
                 ["train", *DATA, "--task.params.path", "{dir}/d.jsonl",
                  "--task.params.prompt_template", "Q: {{question}} {{topic}}", *MINI, *OUT],
                 r"names column 'topic'", {"d.jsonl": ROWS}),
        # ---------------------------------------------------------------- rewards
        _reward_case("reward raises", "def reward(prompts, completions, **kw):\n"
                     "    raise RuntimeError('boom')\n",
                     r"r\.py:reward raised for every one of the 4 completions.*boom"),
        _reward_case("reward returns the wrong length", "def reward(prompts, completions, **kw):"
                     "\n    return [1.0]\n", r"r\.py:reward returned 1 values for 4 completions"),
        _reward_case("reward returns a string", "def reward(prompts, completions, **kw):\n"
                     "    return 'yes'\n", r"r\.py:reward returned str"),
        _reward_case("reward returns non-numbers", "def reward(prompts, completions, **kw):\n"
                     "    return ['good'] * len(completions)\n",
                     r"r\.py:reward gave no usable reward"),
        _reward_case("reward returns NaN", "def reward(prompts, completions, **kw):\n"
                     "    return [float('nan')] * len(completions)\n",
                     r"r\.py:reward gave no usable reward"),
        BadInput("rewards", "unknown reward name", ["train", *DATA, REWARD_OK,
                                                    "--task.params.reward", "exact_matchh",
                                                    *MINI, *OUT],
                 r"unknown reward 'exact_matchh'; valid names", {"d.jsonl": ROWS}),
        BadInput("rewards", "reward file missing", ["train", *DATA, REWARD_OK,
                                                    "--task.params.reward", "{dir}/none.py:f",
                                                    *MINI, *OUT], r"none\.py", {"d.jsonl": ROWS}),
        BadInput("rewards", "reward function missing from its module",
                 ["train", *DATA, REWARD_OK, "--task.params.reward", "{dir}/r.py:score", *MINI,
                  *OUT], r"has no attribute 'score'",
                 {"d.jsonl": ROWS, "r.py": "def reward(prompts, completions, **kw):\n"
                  "    return [0.0] * len(completions)\n"}),
        BadInput("rewards", "reward is not a function",
                 ["train", *DATA, REWARD_OK, "--task.params.reward", "{dir}/r.py:reward", *MINI,
                  *OUT], r"is a int, not a function",
                 {"d.jsonl": ROWS, "r.py": "reward = 3\n"}),
        BadInput("rewards", "reward module does not import",
                 ["train", *DATA, REWARD_OK, "--task.params.reward", "{dir}/r.py:reward", *MINI,
                  *OUT], r"r\.py.*(SyntaxError|invalid syntax)",
                 {"d.jsonl": ROWS, "r.py": "def reward(:\n"}),
    ]
    return cases


# ------------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=20, help="kill points per command (default 20)")
    ap.add_argument("--trl-kills", type=int, default=5,
                    help="kill points of the trl and trl2 commands (default 5)")
    ap.add_argument("--trl-steps", type=int, default=4, help="RL steps of the TRL runs")
    ap.add_argument("--trl-kill-anytime", action="store_true",
                    help="draw TRL kill times over the whole process (start-up included) "
                    "instead of over its training")
    ap.add_argument("--commands", default="train,es,compare,trl,trl2",
                    help="train, es, compare, trl (TRL engine, 1 process), trl2 (2 processes)")
    ap.add_argument("--steps", type=int, default=16, help="RL steps of the train runs")
    ap.add_argument("--signals", type=int, default=2,
                    help="SIGTERM and SIGINT points per command: train, trl, trl2 (default 2)")
    ap.add_argument("--es-iterations", type=int, default=4)
    ap.add_argument("--races", default="0,0.5,2,5", help="start offsets (s) of the second run")
    ap.add_argument("--bad-inputs", type=int, default=None, help="only the first N (default all)")
    ap.add_argument("--no-disk-full", action="store_true")
    ap.add_argument("--no-damaged", action="store_true")
    ap.add_argument("--no-control", action="store_true", help="skip the reference-twice check")
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: train only (4 steps), 2 kills, 1 race, 3 bad inputs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default=None, help="default: a temporary directory")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--out", default=None)
    ap.add_argument("--code", default="HEAD", metavar="REF",
                    help="git commit whose src/ every gbmpo process runs (default HEAD; "
                    "'worktree': the working tree as it is, even while it changes)")
    a = ap.parse_args()
    if a.quick:
        a.kills, a.commands, a.steps, a.races, a.signals = 2, "train", 4, "0", 0
        a.bad_inputs = 3 if a.bad_inputs is None else a.bad_inputs
        a.no_disk_full = a.no_damaged = a.no_control = True

    work = Path(a.workdir or tempfile.mkdtemp(prefix="gbmpo-reliability-"))
    work.mkdir(parents=True, exist_ok=True)
    result = start_result("reliability")
    result["settings"] = {k: v for k, v in vars(a).items() if k not in ("out", "workdir")}
    result["uptime_start"] = subprocess.run(["uptime"], capture_output=True,
                                            text=True).stdout.strip()
    if a.code != "worktree":
        result["code"] = use_snapshot(work, a.code)
        print(f"code: git archive {result['code']} src (PYTHONPATH)", flush=True)
    else:
        result["code"] = "worktree"
    suite = Suite(work)
    rng = random.Random(a.seed)
    commands = [c.strip() for c in a.commands.split(",") if c.strip()]
    t_start = time.perf_counter()
    try:
        train_cmd = train_command(a.steps)
        if "train" in commands or not a.no_damaged or not a.no_disk_full:
            print("train", flush=True)
            suite.reference("train", train_cmd, control=not a.no_control)
        if "train" in commands and a.signals:
            suite.signals("train", train_cmd, a.signals, rng)
        if "train" in commands:
            suite.kills("train", train_cmd, a.kills, rng)
            if a.quick:  # the second run has the same seed: no second reference to compute
                suite.races("train", "train", train_cmd, train_cmd, [0.0])
            else:  # another seed: a result mixed from both runs cannot pass for either
                train_b = train_command(a.steps, ["--seed", "1"])
                suite.reference("train-seed1", train_b, control=False)
                suite.races("train", "train-seed1", train_cmd, train_b,
                            [float(x) for x in a.races.split(",")])
        if not a.no_damaged:
            print("damaged checkpoints", flush=True)
            suite.damaged_checkpoints(
                "train", a.steps,
                ["trainable.safetensors", "optimizer.pt", "rng.pt", "state.json",
                 "manifest.json"])
        if not a.no_disk_full:
            print("disk full", flush=True)
            suite.disk_full("train", a.steps, [("first checkpoint", 16), ("second checkpoint",
                                                                          36)])
        if "es" in commands:
            print("es", flush=True)
            cfg = work / "es.yaml"
            cfg.write_text(ES_YAML % {"iterations": a.es_iterations})
            es_cmd = es_command(cfg, a.es_iterations)
            suite.reference("es", es_cmd, control=not a.no_control)
            suite.kills("es", es_cmd, a.kills, rng)
            suite.races("es", "es", es_cmd, es_cmd, [float(x) for x in a.races.split(",")])
            if not a.no_damaged:
                suite.damaged_es(es_cmd, a.es_iterations)
        if "compare" in commands:
            print("compare", flush=True)
            cmp_cmd = compare_command()
            suite.reference("compare", cmp_cmd, control=not a.no_control)
            suite.kills("compare", cmp_cmd, a.kills, rng)
            suite.races("compare", "compare", cmp_cmd, cmp_cmd,
                        [float(x) for x in a.races.split(",")])
        for name, processes in (("trl", 1), ("trl2", 2)):
            if name in commands:
                print(name, flush=True)
                trl_cmd = trl_command(a.trl_steps, processes)
                suite.reference(name, trl_cmd, control=not a.no_control)
                suite.kills(name, trl_cmd, a.trl_kills, rng,
                            during_training=not a.trl_kill_anytime)
                if a.signals:
                    suite.signals(name, trl_cmd, a.signals, rng)
        print("bad inputs", flush=True)
        cases = bad_input_cases()
        if a.bad_inputs == 0:
            cases = []
        elif a.bad_inputs is not None:  # a few of each category
            per = max(1, a.bad_inputs // 3)
            cases = [c for cat in ("config", "data", "rewards")
                     for c in [x for x in cases if x.category == cat][:per]]
        suite.bad_inputs(cases)
    finally:
        if not a.keep and a.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    seconds = time.perf_counter() - t_start
    result["reference_seconds"] = suite.ref_seconds
    result["categories"] = {k: vars(v) for k, v in suite.categories.items()}
    totals = {k: sum(getattr(c, k) for c in suite.categories.values())
              for k in ("tried", "survived", "lost")}
    result["totals"] = totals
    result["seconds"] = seconds
    result["uptime_end"] = subprocess.run(["uptime"], capture_output=True,
                                          text=True).stdout.strip()
    result["loadavg_end"] = load_average()
    path = finish_result(result, a.out)

    print(f"\n{'category':<44} {'tried':>5} {'survived':>8} {'lost':>5}")
    for name, c in suite.categories.items():
        print(f"{name:<44} {c.tried:>5} {c.survived:>8} {c.lost:>5}")
    print(f"{'total':<44} {totals['tried']:>5} {totals['survived']:>8} {totals['lost']:>5}")
    print(f"reliability: {totals['tried']} tried, {totals['survived']} survived, "
          f"{totals['lost']} lost in {seconds:.0f} s -> {path}")


if __name__ == "__main__":
    main()
