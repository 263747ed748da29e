"""The engine registry: every engine of ``gbmpo train --engine NAME`` implements one interface
(:class:`gbmpo.engines.Engine`), is registered once (:data:`gbmpo.engines.ENGINES`) under a name
of the one engine list (the config's values, the support matrix's columns), and the command line
reaches each through the registry alone: the same methods, no per-engine branch."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path
from typing import Any

import pytest

from gbmpo.cli import main
from gbmpo.config import TRAIN_ENGINES, ConfigError, load_config
from gbmpo.config.support import ENGINES as MATRIX_ENGINES
from gbmpo.config.support import SUPPORT
from gbmpo.engines import ENGINES, Engine, engine_for, get_engine
from gbmpo.engines.base import PlainDryRun
from gbmpo.engines.checks import DryRunReport, memory_check
from gbmpo.registry import UnknownNameError

METHODS = ("check", "plan", "dry_run", "train", "resume", "resume_dry_run", "summary_lines")


def test_the_registry_holds_the_one_engine_list() -> None:
    assert ENGINES.names() == sorted(TRAIN_ENGINES)
    assert MATRIX_ENGINES is TRAIN_ENGINES
    assert tuple(SUPPORT) == TRAIN_ENGINES
    # the support tables are paired with their engine (a reordered list would mislabel them)
    assert SUPPORT["gbmpo"]["engine"].how == "the own trainer"
    assert "TRL" in SUPPORT["trl"]["engine"].how
    assert "verl" in SUPPORT["verl"]["engine"].how


@pytest.mark.parametrize("name", TRAIN_ENGINES)
def test_every_engine_implements_the_interface(name: str) -> None:
    engine = get_engine(name)
    assert isinstance(engine, Engine)
    assert engine.name == name
    for method in METHODS:
        want = inspect.signature(getattr(Engine, method))
        got = inspect.signature(getattr(type(engine), method))
        assert [(p.name, p.kind) for p in got.parameters.values()] == [
            (p.name, p.kind) for p in want.parameters.values()
        ], f"{name}.{method}{got} differs from Engine.{method}{want}"


def test_unknown_engine_names_the_valid_ones(capsys: pytest.CaptureFixture) -> None:
    valid = "gbmpo, trl, verl"
    with pytest.raises(UnknownNameError, match=f"unknown engine 'foo'; valid names: {valid}"):
        get_engine("foo")
    cfg = load_config()
    cfg.engine = "foo"
    with pytest.raises(ConfigError, match=f"'engine': unknown engine 'foo'; valid: {valid}"):
        engine_for(cfg)
    assert main(["train", "--engine", "foo", "--dry-run"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        "gbmpo train: error: 'engine': unknown engine 'foo'; valid: gbmpo, trl, verl"]


def test_the_train_command_has_no_per_engine_branch() -> None:
    """A structural check, next to the behaviour tests below: the command names no engine and
    compares no engine name; every engine goes through the registry."""
    import gbmpo.cli.train

    source = inspect.getsource(gbmpo.cli.train)
    code = "\n".join(line.split("#", 1)[0] for line in source.splitlines())
    assert not re.search(r"engine\s*(==|!=|\bin\b|\bnot in\b)", code)
    for name in TRAIN_ENGINES:
        assert not re.search(rf"[\"']{name}[\"']", code), f"cli/train.py names engine {name!r}"
    assert "Trainer" not in code and "trl_runner" not in code and "verl_runner" not in code


class Recorder:
    """An engine that records the calls the command makes."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls: list[str] = []

    def check(self, cfg: Any, *, dry: bool = False) -> list[str]:
        self.calls.append(f"check dry={dry}")
        return ["x=1 has no effect"]

    def plan(self, cfg: Any, prompt_tokens: int | None = None) -> dict[str, Any]:
        raise AssertionError("the command does not plan")

    def dry_run(self, cfg: Any) -> PlainDryRun:
        self.calls.append("dry_run")
        return PlainDryRun({"engine": self.name}, notes=["a note"], warnings=["a warning"])

    def train(self, cfg: Any, *, on_ready: Any = None) -> dict[str, Any]:
        self.calls.append("train")
        print("before ready")
        on_ready()
        print("trained")
        return {"steps": 3}

    def resume(self, run_dir: Any, overrides: Any, *, restart: bool = False) -> dict[str, Any]:
        self.calls.append(f"resume {overrides} restart={restart}")
        return {"steps": 5}

    def resume_dry_run(self, run_dir: Any, overrides: Any) -> PlainDryRun:
        self.calls.append("resume_dry_run")
        return PlainDryRun({"resume_from": None}, warnings=["w"])

    def summary_lines(self, summary: dict[str, Any]) -> list[str]:
        return [f"{self.name}: {summary['steps']} steps"]


@pytest.mark.parametrize("name", TRAIN_ENGINES)
def test_the_command_calls_the_same_methods_on_every_engine(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    rec = Recorder(name)
    assert isinstance(rec, Engine)
    monkeypatch.setitem(ENGINES._items, name, rec)

    assert main(["train", "--engine", name, "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert rec.calls == ["check dry=True", "dry_run"]
    assert err.splitlines() == ["note: x=1 has no effect", "warning: a warning"]
    assert f"engine: {name}" in out
    assert out.splitlines()[-2:] == ["a note", "dry run OK: " + json.dumps({"engine": name})]

    rec.calls.clear()
    assert main(["train", "--engine", name, "--output-dir", str(tmp_path / "run")]) == 0
    out, err = capsys.readouterr()
    assert rec.calls == ["check dry=False", "train"]
    assert out.splitlines() == ["before ready", "trained", f"{name}: 3 steps"]
    assert err.splitlines() == ["note: x=1 has no effect"]

    run_dir = tmp_path / "unfinished"
    run_dir.mkdir()
    cfg = load_config(None, [("engine", name)])
    from gbmpo.config import dump_yaml

    (run_dir / "config.yaml").write_text(dump_yaml(cfg))
    rec.calls.clear()
    assert main(["train", "--resume", str(run_dir), "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert rec.calls == ["resume_dry_run"]
    assert (out, err) == ('dry run OK: {"resume_from": null}\n', "warning: w\n")
    rec.calls.clear()
    assert main(["train", "--resume", str(run_dir), "--restart", "--optim.lr", "0.5"]) == 0
    assert rec.calls == ["resume [('optim.lr', '0.5')] restart=True"]
    assert capsys.readouterr().out == f"{name}: 5 steps\n"


@pytest.mark.parametrize("name", TRAIN_ENGINES)
def test_the_default_config_dry_runs_on_every_engine(name: str, capsys: pytest.CaptureFixture
                                                     ) -> None:  # fmt: skip
    """``gbmpo train --engine NAME --dry-run`` and nothing else: the default config is one
    experiment on every engine (on verl, in .venv-verl where it exists, verl validates the
    composed config and gbmpo's driver hooks find what they wrap)."""
    if name == "trl":
        pytest.importorskip("trl")
    assert main(["train", "--engine", name, "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert not [line for line in err.splitlines() if line.startswith(("note:", "warning:"))]
    report = json.loads(out.split("dry run OK: ", 1)[1])
    assert report.get("engine", "gbmpo") == name  # (the own engine's report has no name)
    if name == "verl":
        from gbmpo.engines.verl.runner import verl_python

        assert "trainer.device=cpu" in report["overrides"]
        assert "actor_rollout_ref.actor.kl_loss_type=gbmpo_prob_l2" in report["overrides"]
        if verl_python() is not None:
            assert report["checks"]["verl config"].startswith("ok: verl 0.9")


def test_a_refused_value_prints_no_note(capsys: pytest.CaptureFixture) -> None:
    """The no-effect notes print once every check has passed: a refusal is the only line."""
    argv = ["train", "--engine", "verl", "--rollout.batch_size", "4", "--model.dtype", "float16",
            "--dry-run"]  # fmt: skip
    assert main(argv) == 2  # verl refuses float16 (no loss scaling)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("gbmpo train: error: ") and "verl" in err[0]


@pytest.mark.parametrize("name", TRAIN_ENGINES)
def test_plan_is_the_memory_plan_of_the_engine(name: str) -> None:
    cfg = load_config(None, [("engine", name)])
    plan = get_engine(name).plan(cfg, prompt_tokens=40)
    assert plan["engine"] == name and plan["peak"] > 0
    report = DryRunReport(name, info={"longest_prompt_tokens": 40})
    memory_check(cfg, report)  # the dry runs' memory check reports this plan
    assert report.info["memory_plan"] == {k: v for k, v in plan.items() if k != "notes"}
    own = load_config()  # planning another engine's config leaves that config alone
    assert get_engine(name).plan(own, prompt_tokens=40) == plan and own.engine == "gbmpo"


def test_an_engine_refuses_a_config_for_another(tmp_path: Path) -> None:
    cfg = load_config(None, [("run.output_dir", str(tmp_path / "run"))])
    with pytest.raises(ValueError, match="engine 'trl' was given a config for engine 'gbmpo'"):
        get_engine("trl").train(cfg)
    assert not (tmp_path / "run").exists()


def test_summary_lines() -> None:
    summary = {"steps": 4, "wall_seconds": 12.4, "run_dir": "runs/x",
               "eval_before": {"accuracy": 0.25}, "eval_after": {"accuracy": 0.5}}  # fmt: skip
    assert get_engine("gbmpo").summary_lines(summary) == [
        "finished 4 steps in 12 s; held-out accuracy: 25.0% -> 50.0% (+25.0 points)",
        "run directory: runs/x"]  # fmt: skip
    assert get_engine("trl").summary_lines(summary) == [
        "finished 4 steps (trl) in 12 s; held-out accuracy: 25.0% -> 50.0%",
        "run directory: runs/x"]  # fmt: skip
