"""Fuzzed command lines and YAML documents for ``gbmpo train --dry-run``, ``gbmpo eval``,
``gbmpo es --print-config`` and ``gbmpo compare --arms ... --dry-run``: built from the real
configuration keys with wrong types, out-of-range and non-finite numbers, unknown and
misspelled keys, nested junk, unicode and huge strings. Each must exit 0, or 2 with one line
naming the problem; never a traceback, and never a file left in the working or output
directory (dry runs and failed commands write nothing)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from fuzzlib import (
    FUZZ,
    FUZZ_KEYS,
    _junk_values,
    check_cli,
    listing,
    misspell,
    sized,
    to_text,
    value_for,
)
from hypothesis import example, given
from hypothesis import strategies as st

pytestmark = pytest.mark.filterwarnings("ignore")


@st.composite
def overrides(draw: st.DrawFn) -> list[tuple[str, Any]]:
    """0-4 settings: real keys with fuzzed values, now and then a misspelled or unknown key."""
    out = []
    for _ in range(draw(st.integers(0, 4))):
        key = draw(st.sampled_from(FUZZ_KEYS))
        value = draw(value_for(key))
        if draw(st.integers(0, 9)) == 0:
            key = draw(misspell(key))
        out.append((key, value))
    return out


def _argv(pairs: list[tuple[str, Any]]) -> list[str]:
    argv: list[str] = []
    for key, value in pairs:
        argv += [f"--{key}={to_text(value)}"]
    return argv


def _nest(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    for key, value in pairs:
        node = doc
        parts = key.split(".")
        for part in parts[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                break
            node = nxt
        else:
            node[parts[-1]] = value
    return doc


@st.composite
def yaml_documents(draw: st.DrawFn) -> str:
    """A YAML document: a nested config with fuzzed values, or junk at the top."""
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return draw(st.text(max_size=200))
    if kind == 1:
        return yaml.safe_dump(draw(_junk_values()), allow_unicode=True)
    doc = _nest(draw(overrides()))
    if draw(st.booleans()):  # junk somewhere in the tree
        section = draw(st.sampled_from(["optim", "objective", "rollout", "run", "task",
                                        "objective.regularizer", "lora"]))
        node = doc
        for part in section.split("."):
            node = node.setdefault(part, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node[draw(st.text(min_size=1, max_size=10))] = draw(_junk_values())
    return yaml.safe_dump(doc, allow_unicode=True, sort_keys=False)


def _dry_run(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]) -> int:
    run = tmp_path / "run"
    before = listing(tmp_path)
    code, _ = check_cli(["train", "--dry-run", *argv, "--output-dir", str(run)], capsys, "train")
    assert listing(tmp_path) == before, "train --dry-run left files behind"
    return code


@FUZZ
@given(pairs=overrides())
@example(pairs=[("optim.lr", float("nan"))])
@example(pairs=[("regulariser", "kl_k3")])
@example(pairs=[("optim.betas", [0.9])])
@example(pairs=[("objective.regularizer.params", {"mirror": [[]]})])
@example(pairs=[("run.num_threads", 10**12)])
@example(pairs=[("eval.split", "x"), ("run.num_threads", None)])  # a note, then an error
@example(pairs=[("run.time_budget_seconds", float("inf"))])
@example(pairs=[("rollout.temperature", 1e308)])
@example(pairs=[("model.path", "x" * 5000)])  # longer than a file name may be
@example(pairs=[("task.params", {"path": "y" * 5000})])
def test_train_dry_run_overrides(tmp_path_factory: pytest.TempPathFactory,
                                 capsys: pytest.CaptureFixture[str],
                                 monkeypatch: pytest.MonkeyPatch,
                                 pairs: list[tuple[str, Any]]) -> None:
    tmp = tmp_path_factory.mktemp("train")
    monkeypatch.chdir(tmp)
    _dry_run(tmp, capsys, _argv(pairs))


@FUZZ
@given(doc=yaml_documents())
@example(doc="optim: {lr: .nan}\n")
@example(doc="\ufeffoptim: {lr: 0.1}\n")
@example(doc="objective: [1, 2]\n")
@example(doc="- a\n- b\n")
@example(doc="optim:\n  betas: [1e400, 0.9]\n")
@example(doc="run: {steps: 1e3}\n")
@example(doc="a: &x [*x]\n")
@example(doc="engine: 'trl '\n")
@example(doc="rollout:\n  temperature: 1" + "0" * 400 + "\n")  # int beyond float range
@example(doc="model:\n  path: " + "x" * 100_000 + "\n")  # the message stays short
@example(doc="optim: [1\n")  # PyYAML's message spans several lines
def test_train_dry_run_yaml(tmp_path_factory: pytest.TempPathFactory,
                            capsys: pytest.CaptureFixture[str],
                            monkeypatch: pytest.MonkeyPatch, doc: str) -> None:
    tmp = tmp_path_factory.mktemp("yaml")
    monkeypatch.chdir(tmp)
    cfg = tmp / "c.yaml"
    cfg.write_text(doc, encoding="utf-8")
    _dry_run(tmp, capsys, ["--config", str(cfg)])


_EVAL_FLAGS: dict[str, st.SearchStrategy[Any]] = {
    "--split": st.one_of(st.sampled_from(["test", "train", "nope"]), st.text(max_size=10)),
    "--limit": st.one_of(st.just("1"), st.integers(-2, 2).map(str), st.text(max_size=5)),
    "--samples": st.one_of(st.just("1"), st.integers(-1, 2).map(str), st.text(max_size=5)),
    "--temperature": st.one_of(st.floats(allow_nan=True).map(str), st.text(max_size=5)),
    "--top-p": st.one_of(st.floats(allow_nan=True).map(str), st.just("0"), st.just("2")),
    "--max-new-tokens": st.one_of(st.integers(-1, 8).map(str), st.just("10000000000")),
    "--batch-size": st.one_of(st.integers(-1, 4).map(str), st.text(max_size=4)),
    "--seed": st.one_of(st.integers(-(2**70), 2**70).map(str), st.text(max_size=4)),
    "--template": st.sampled_from(["auto", "base", "chat", "nope"]),
    "--dtype": st.sampled_from(["float32", "bfloat16", "int8"]),
    "--device": st.sampled_from(["cpu", "cuda:99", "nope", ""]),
    "--task-param": st.tuples(st.text(max_size=8), st.text(max_size=8)).map("=".join),
    "--model": st.sampled_from(["tiny", "/nonexistent/model", ""]),
}


@st.composite
def eval_argv(draw: st.DrawFn) -> list[str]:
    task = draw(st.sampled_from(["arithmetic", "arithmetic", "nope", "jsonl", ""]))
    argv = ["eval", "--task", task, "--limit", "1", "--max-new-tokens", "4"]
    for flag in draw(st.lists(st.sampled_from(sorted(_EVAL_FLAGS)), max_size=3, unique=True)):
        argv += [f"{flag}={draw(_EVAL_FLAGS[flag])}"]
    return argv


@sized(4)  # each example loads the model and generates
@given(argv=eval_argv())
@example(argv=["eval", "--task", "arithmetic", "--limit", "1", "--temperature=nan"])
@example(argv=["eval", "--task", "arithmetic", "--limit", "1", "--seed=-1"])
@example(argv=["eval", "--task", "arithmetic", "--limit", "1", "--task-param=="])
@example(argv=["eval", "--task", "arithmetic", "--limit", "1", "--top-p=0"])
@example(argv=["eval", "--task", "arithmetic", "--limit", "1", "--max-new-tokens=10000000000"])
@example(argv=["eval", "--task", "arithmetic", "--limit", "1", "--seed=1180591620717411303424"])
@example(argv=["eval", "--task", "arithmetic", "--limit", "1", "--task-param=0\r0="])
def test_eval_flags(tmp_path_factory: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str],
                    monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> None:
    tmp = tmp_path_factory.mktemp("eval")
    monkeypatch.chdir(tmp)
    out = tmp / "eval.json"
    code, _ = check_cli([*argv, "--output", str(out)], capsys, "eval")
    assert out.exists() == (code == 0), "eval wrote its output although it failed"
    if code:
        assert listing(tmp) == set()


_ES_SECTIONS = {
    "es": ["population", "iterations", "sigma0", "sigma_decay", "step_size", "estimator",
           "acceptance", "elites", "elites_in_gradient", "seed"],
    "init": ["scale", "seed"],
    "fitness": ["steps", "validation_size", "validation_seed", "metric", "device"],
    "backend": ["name", "workers", "threads", "address"],
}


@st.composite
def es_documents(draw: st.DrawFn) -> str:
    doc: dict[str, Any] = {}
    for _ in range(draw(st.integers(0, 4))):
        section = draw(st.sampled_from([*_ES_SECTIONS, "train", "nope"]))
        if section == "train":
            doc["train"] = _nest(draw(overrides()))
            continue
        keys = _ES_SECTIONS.get(section, ["x"])
        key = draw(st.sampled_from(keys))
        if draw(st.integers(0, 7)) == 0:
            key = draw(misspell(key))
        node = doc.setdefault(section, {})
        if isinstance(node, dict):
            node[key] = draw(st.one_of(st.integers(-3, 10), st.floats(allow_nan=True),
                                       _junk_values()))
    if draw(st.integers(0, 9)) == 0:
        return draw(st.text(max_size=100))
    return yaml.safe_dump(doc, allow_unicode=True, sort_keys=False)


@FUZZ
@given(doc=es_documents())
@example(doc="es: {population: 0}\n")
@example(doc="es: {sigma0: .nan}\n")
@example(doc="fitness: {steps: 1.5}\n")
@example(doc="init: {scale: .inf}\n")
@example(doc="es: [1]\n")
@example(doc="train: {optim: {lr: .nan}}\n")
def test_es_config(tmp_path_factory: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str],
                   monkeypatch: pytest.MonkeyPatch, doc: str) -> None:
    tmp = tmp_path_factory.mktemp("es")
    monkeypatch.chdir(tmp)
    cfg = tmp / "es.yaml"
    cfg.write_text(doc, encoding="utf-8")
    check_cli(["es", "--config", str(cfg), "--print-config", "--output-dir", str(tmp / "out")],
              capsys, "es")
    assert listing(tmp) == {"es.yaml"}


@st.composite
def arms(draw: st.DrawFn) -> list[str]:
    out = []
    for i in range(draw(st.integers(1, 3))):
        label = draw(st.one_of(st.just(f"arm{i}"), st.text(max_size=6)))
        pairs = draw(overrides())
        body = ",".join(f"{k}={to_text(v)}" for k, v in pairs)
        out.append(f"{label}:{body}" if draw(st.integers(0, 9)) else draw(st.text(max_size=12)))
    return out


@FUZZ
@given(spec=arms())
@example(spec=["a:objective.regularizer.coef=nan", "b:lr=1e-4"])
@example(spec=["a:lr=1", "a:lr=2"])
@example(spec=[":"])
@example(spec=["a:regulariser=kl_k3"])
def test_compare_arms(tmp_path_factory: pytest.TempPathFactory,
                      capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                      spec: list[str]) -> None:
    tmp = tmp_path_factory.mktemp("compare")
    monkeypatch.chdir(tmp)
    check_cli(["compare", "--arms", *spec, "--seeds", "1", "--output-dir", str(tmp / "out"),
               "--dry-run"], capsys, "compare")
    assert listing(tmp) == set()


@st.composite
def arms_documents(draw: st.DrawFn) -> str:
    """An arms file: ``label -> settings`` (dotted or nested), or junk."""
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return draw(st.text(max_size=100))
    if kind == 1:
        return yaml.safe_dump(draw(_junk_values()), allow_unicode=True)
    arms_doc: dict[Any, Any] = {}
    for i in range(draw(st.integers(0, 3))):
        label = draw(st.one_of(st.just(f"arm{i}"), st.text(max_size=6), st.integers()))
        pairs = draw(overrides())
        arms_doc[label] = dict(pairs) if draw(st.booleans()) else _nest(pairs)
    if draw(st.booleans()):
        arms_doc = {"arms": arms_doc}
    return yaml.safe_dump(arms_doc, allow_unicode=True, sort_keys=False)


@FUZZ
@given(doc=arms_documents())
@example(doc="arms: {}\n")
@example(doc="a: [1]\n")
@example(doc="a: {objective: {regulariser: {name: kl}}}\n")
@example(doc="1: {optim.lr: .nan}\n")
def test_compare_arms_file(tmp_path_factory: pytest.TempPathFactory,
                           capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                           doc: str) -> None:
    tmp = tmp_path_factory.mktemp("arms")
    monkeypatch.chdir(tmp)
    (tmp / "arms.yaml").write_text(doc, encoding="utf-8")
    check_cli(["compare", "--arms", str(tmp / "arms.yaml"), "--seeds", "1", "--output-dir",
               str(tmp / "out"), "--dry-run"], capsys, "compare")
    assert listing(tmp) == {"arms.yaml"}
