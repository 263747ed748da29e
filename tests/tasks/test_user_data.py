"""The ``jsonl`` task (a user's own data file and reward) and reward resolution by name/path."""

from __future__ import annotations

import csv
import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from gbmpo.rewards import resolve_reward
from gbmpo.rewards.resolve import exact_match_reward, final_answer_text
from gbmpo.tasks import _common as common
from gbmpo.tasks import get_task
from gbmpo.tasks.custom import read_records

ROWS = [{"question": f"What is {i} plus 1?", "final": str(i + 1), "source": f"s{i}"}
        for i in range(20)]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def task_of(path: Path, **kw: Any) -> Any:
    return get_task("jsonl", path=str(path), prompt_column="question", answer_column="final",
                    **kw)


# ------------------------------------------------------------------------------ formats


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.gz", "json", "json.gz", "parquet", "csv"])
def test_every_file_format_gives_the_same_rows(tmp_path: Path, fmt: str) -> None:
    path = tmp_path / f"data.{fmt}"
    if fmt.startswith("jsonl"):
        text = "".join(json.dumps(r) + "\n" for r in ROWS)
    elif fmt.startswith("json"):
        text = json.dumps(ROWS)
    if fmt.endswith(".gz"):
        path.write_bytes(gzip.compress(text.encode()))
    elif fmt in ("jsonl", "json"):
        path.write_text(text)
    elif fmt == "parquet":
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(ROWS), path)
    else:
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(ROWS[0]))
            w.writeheader()
            w.writerows(ROWS)
    assert read_records(path) == ROWS


def test_columns_template_and_pass_through(tmp_path: Path) -> None:
    task = task_of(write_jsonl(tmp_path / "d.jsonl", ROWS), prompt_template="Q: {question}\nA:",
                   columns={"origin": "source"}, test_size=5)
    train, test = task.split("train"), task.split("test")
    assert len(train) == 15 and len(test) == 5
    assert not {e["prompt"] for e in train} & {e["prompt"] for e in test}
    ex = next(e for e in train + test if e["source"] == "s3")
    assert ex == {"prompt": "Q: What is 3 plus 1?\nA:", "answer": "4", "source": "s3",
                  "origin": "s3"}
    # the held-out rows are a deterministic function of the seed
    again = task_of(tmp_path / "d.jsonl", test_size=5).split("test")
    assert [e["answer"] for e in again] == [e["answer"] for e in test]
    other = task_of(tmp_path / "d.jsonl", test_size=5, seed=1).split("test")
    assert [e["answer"] for e in other] != [e["answer"] for e in test]
    assert len(task_of(tmp_path / "d.jsonl", test_size=0.25).split("test")) == 5


def test_test_path_is_the_held_out_split(tmp_path: Path) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", ROWS[:12])
    test = write_jsonl(tmp_path / "test.jsonl", ROWS[12:])
    task = task_of(train, test_path=str(test))
    assert [e["answer"] for e in task.split("train")] == [r["final"] for r in ROWS[:12]]
    assert [e["answer"] for e in task.split("test")] == [r["final"] for r in ROWS[12:]]
    with pytest.raises(ValueError, match="valid splits: train, test"):
        task.split("validation")


def test_hub_id_goes_through_datasets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    datasets = pytest.importorskip("datasets")
    calls: list[tuple[Any, ...]] = []

    def fake_load(name: str, config: str | None = None, split: str | None = None) -> list[Any]:
        calls.append((name, config, split))
        if split == "test":
            raise ValueError('Unknown split "test". Should be one of [\'train\'].')
        return ROWS

    monkeypatch.setattr(common, "hub_unreachable_reason", lambda hub_id: None)
    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    monkeypatch.chdir(tmp_path)
    task = task_of(Path("someone/word-problems"), config="main", test_size=4)
    assert len(task.split("train")) == 16 and len(task.split("test")) == 4
    assert calls == [("someone/word-problems", "main", "train"),
                     ("someone/word-problems", "main", "test")]
    monkeypatch.setattr(common, "hub_unreachable_reason", lambda hub_id: "no network")
    with pytest.raises(FileNotFoundError, match="no network"):
        task_of(Path("someone/other")).split("train")


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("content", "kw", "match"),
    [
        ("", {}, r"d\.jsonl has no rows"),
        ('{"question": "a", "final": "1"}\n{oops\n', {}, r"d\.jsonl line 2: invalid JSON"),
        ('[1, 2]', {}, r"d\.jsonl row 0: expected an object"),
        ('{"question": "a", "final": "1"}\n{"question": "b"}\n', {},
         r"d\.jsonl row 1 has no column 'final' \(its columns: question\)"),
        ('{"question": "  ", "final": "1"}\n', {}, r"row 0: column 'question' must be non-empty"),
        ('{"question": "a", "final": "1"}\n', {"prompt_template": "{question} {lang}"},
         r"row 0: prompt_template .* names column 'lang'"),
        ('{"question": "a", "final": "1"}\n', {"columns": {"tests": "asserts"}},
         r"row 0 has no column 'asserts'"),
    ],
)
def test_bad_data_names_the_file_and_row(tmp_path: Path, content: str, kw: dict[str, Any],
                                         match: str) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=match):
        task_of(path, test_size=1, **kw).split("train")


def test_bad_parameters_fail_at_construction(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(ValueError, match="unknown data format '.txt'"):
        read_records(tmp_path / "d.txt")
    with pytest.raises(ValueError, match="test_size"):
        task_of(path, test_size=0)
    with pytest.raises(ValueError, match="names no column"):
        task_of(path, prompt_template="plain")
    with pytest.raises(ValueError, match="unknown reward 'mth'; valid names: .*exact.*math"):
        task_of(path, reward="mth")
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        get_task("jsonl", path=str(tmp_path / "nope.jsonl")).split("train")
    one = write_jsonl(tmp_path / "one.jsonl", ROWS[:1])
    with pytest.raises(ValueError, match="no rows left for training"):
        task_of(one).split("train")


def test_reward_by_import_path(tmp_path: Path) -> None:
    mod = tmp_path / "my_rewards.py"
    mod.write_text("def score(prompts, completions, answer, **kw):\n"
                   "    return [float(c.strip() == a) for c, a in zip(completions, answer)]\n"
                   "NOT_A_FUNCTION = 3\n")
    fn = resolve_reward(f"{mod}:score")
    assert fn(["p", "p"], ["4", "5"], answer=["4", "4"]) == [1.0, 0.0]
    assert resolve_reward("gbmpo.rewards.math:math_reward_fn").__name__ == "math_reward_fn"
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        resolve_reward(f"{mod}:nope")
    with pytest.raises(ValueError, match="is a int, not a function"):
        resolve_reward(f"{mod}:NOT_A_FUNCTION")
    with pytest.raises(ValueError, match="cannot import 'no_such_module_xyz'"):
        resolve_reward("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="cannot import"):
        resolve_reward(f"{tmp_path / 'absent.py'}:f")


def test_named_rewards_on_the_task(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    for name in ("math", "exact"):
        task = task_of(path, reward=name)
        assert task.kind == "math"
        assert task.reward(["p"] * 3, ["so 2 #### 2", "#### 3", "2"], answer=["2", "2", "2"]
                           ) == [1.0, 0.0, 1.0]
    assert task_of(path, reward="code").kind == "code"
    assert task_of(path, reward="code", kind="math").kind == "math"


def test_exact_reward_definition() -> None:
    assert final_answer_text("work\n####  the  answer \n") == "the answer"
    assert final_answer_text("a\nlast line  \n\n") == "last line"
    assert exact_match_reward([""] * 3, ["#### Paris", "paris", "x #### Paris"],
                              answer=["Paris"] * 3) == [1.0, 0.0, 1.0]


def test_code_reward_on_a_user_file(tmp_path: Path) -> None:
    rows = [{"prompt": "Write add(a, b).", "test_list": ["assert add(1, 2) == 3"]}] * 4
    task = get_task("jsonl", path=str(write_jsonl(tmp_path / "c.jsonl", rows)), reward="code",
                    answer_column=None, columns={"tests": "test_list"}, test_size=1)
    ex = task.split("train")
    cols = task.columns(ex[:2])
    good = "```python\ndef add(a, b):\n    return a + b\n```"
    bad = "```python\ndef add(a, b):\n    return a - b\n```"
    assert task.reward([e["prompt"] for e in ex[:2]], [good, bad], **cols) == [1.0, 0.0]
