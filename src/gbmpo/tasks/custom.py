"""``jsonl``: a task from the user's own data file (or hub data set) and reward.

    gbmpo train --task.name jsonl --task.params.path problems.jsonl --task.params.reward math
    gbmpo eval  --task jsonl --task-param path=problems.jsonl --task-param reward=exact

Data (``path``): a ``.jsonl`` / ``.json`` (array of objects) or ``.csv`` file (optionally
``.gz``; a UTF-8 byte-order mark is skipped), a ``.parquet`` file, or a Hugging Face hub data
set id (``namespace/name``, read through :func:`datasets.load_dataset` with ``config`` and the
splits ``hub_train_split`` / ``hub_test_split``; the hub is probed first, so an offline machine
fails within seconds).

Columns: ``prompt_column`` (default ``prompt``) holds the question and ``answer_column``
(default ``answer``; ``None`` for rewards that need none) what the reward checks against; they
reach the reward as ``prompt`` and ``answer``. ``columns`` renames further columns for the
reward, ``{"tests": "test_list"}`` giving the source column ``test_list`` to the reward as
``tests``. Every other column of a row is passed through unchanged (TRL's convention: the reward
is called as ``fn(prompts=..., completions=..., **columns)``).

Splits: ``train`` and ``test``. The test split is ``test_path`` when given (same format and
columns), the hub's ``hub_test_split`` for a hub id that has it, and otherwise ``test_size``
rows held out of ``path`` (a fraction in (0, 1) or a count; default 0.1, at least one row, at
most 500) chosen by a seeded shuffle (``seed``), disjoint from ``train``.

Prompt: ``prompt_template`` (default ``"{prompt}"``; any row column may appear, e.g.
``"Q: {question}\\nA:"``) is formatted with the row; with the chat template (``template:
chat``, or ``auto`` with a tokenizer that has one) the formatted text is the user message after
``system_prompt``.

Reward (``reward``): ``math`` (default; final answer checked with math-verify), ``exact``
(string equality of the final answer), ``code`` (fraction of the ``tests`` asserts passed, in the
hardened sandbox; also ``code_all_pass`` / ``code_shaped``), any name a plugin registered, or an
import path ``module:function`` / ``file.py:function`` to a TRL-style reward function. The task
is a ``code`` task (pass@k in evaluation) for the ``code*`` rewards, else a ``math`` task
(accuracy = share of rewards >= 1); ``kind`` overrides that.

Errors name the file and the row: an empty file, a row that is not an object, a missing column
(with the columns the row has), an empty prompt, a template naming a column a row lacks.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import random
import re
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from gbmpo.rewards.resolve import resolve_reward, reward_spec_name
from gbmpo.rewards.scoring import score_completions
from gbmpo.tasks import _common as common
from gbmpo.tasks.base import TASKS, Example, Task

__all__ = ["DatasetTask", "read_records"]

_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
_CODE_REWARDS = ("code", "code_pass_fraction", "code_all_pass", "code_shaped")
MAX_HELD_OUT = 500


def _base_suffix(path: Path) -> str:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes = suffixes[:-1]
    return suffixes[-1] if suffixes else ""


def _read_text(p: Path) -> str:
    """The whole file as text: gunzipped for ``.gz``, UTF-8 with an optional byte-order mark."""
    opener: Any = gzip.open if p.suffix.lower() == ".gz" else open
    try:
        with opener(p, "rb") as f:
            raw = f.read()
    except (OSError, EOFError, zlib.error) as err:  # bad or truncated gzip data
        raise ValueError(f"{p}: cannot be read: {type(err).__name__}: {err}") from err
    try:
        return str(raw.decode("utf-8-sig"))
    except UnicodeDecodeError as err:
        raise ValueError(f"{p}: cannot be read as UTF-8 text: {err}") from err


def _csv_rows(p: Path, text: str) -> list[Any]:
    reader = csv.DictReader(io.StringIO(text, newline=""))
    limit = csv.field_size_limit()
    csv.field_size_limit(max(limit, 1 << 30))  # a long field (a whole program) is fine
    try:
        return list(reader)
    except csv.Error as err:
        raise ValueError(f"{p} line {reader.line_num}: unreadable CSV: {err}") from err
    finally:
        csv.field_size_limit(limit)


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a ``.jsonl``/``.json``/``.csv`` file (optionally ``.gz``) or a ``.parquet``
    file.

    Raises ``ValueError`` naming the file (and the line or row) for unreadable data (bad gzip,
    not UTF-8, invalid JSON or CSV), a row that is not an object, or a file without rows. A
    UTF-8 byte-order mark is skipped.
    """
    p = Path(path)
    suffix = _base_suffix(p)
    if suffix not in _SUFFIXES:
        raise ValueError(
            f"{p}: unknown data format {suffix or '(no suffix)'!r}; use one of "
            f"{', '.join(_SUFFIXES)} (JSON and CSV optionally .gz)"
        )
    rows: list[Any]
    if suffix == ".parquet":
        if p.suffix.lower() == ".gz":
            raise ValueError(f"{p}: Parquet compresses itself; give the .parquet file")
        # deferred: pyarrow is optional (it comes with datasets)
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(p).to_pylist()
        except Exception as err:  # noqa: BLE001 - pyarrow raises several kinds
            raise ValueError(f"{p}: not a readable Parquet file: {err}") from err
    elif suffix == ".csv":
        rows = _csv_rows(p, _read_text(p))
    else:
        text = _read_text(p)
        if text.lstrip().startswith("["):
            try:
                rows = json.loads(text)
            except json.JSONDecodeError as err:
                raise ValueError(f"{p}: invalid JSON: {err}") from err
            except RecursionError:
                raise ValueError(f"{p}: invalid JSON: nested too deeply") from None
        else:
            rows = []
            for lineno, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{p} line {lineno}: invalid JSON: {err.msg}") from err
                except RecursionError:
                    raise ValueError(f"{p} line {lineno}: invalid JSON: nested too deeply"
                                     ) from None
    if not rows:
        raise ValueError(f"{p} has no rows")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"{p} row {i}: expected an object with named columns, got "
                             f"{type(row).__name__}")
    return rows


@TASKS.register("jsonl")
class DatasetTask(common.TemplatedPrompts, Task):
    """A task from the user's data and reward. See the module docstring."""

    name = "jsonl"
    train_split = "train"
    eval_split = "test"

    def __init__(
        self,
        *,
        path: str,
        reward: str | Callable[..., Any] = "math",
        prompt_column: str = "prompt",
        answer_column: str | None = "answer",
        columns: Mapping[str, str] | None = None,
        test_path: str | None = None,
        test_size: float = 0.1,
        seed: int = 0,
        prompt_template: str = "{prompt}",
        template: str = "base",
        tokenizer: Any = None,
        system_prompt: str | None = None,
        kind: str | None = None,
        config: str | None = None,
        hub_train_split: str = "train",
        hub_test_split: str = "test",
        hub: bool | None = None,
    ) -> None:
        if not isinstance(path, str) or not path.strip():
            raise ValueError("task 'jsonl' needs path=FILE (a data file or a hub data set id)")
        self.path = path
        self.reward_spec = reward if isinstance(reward, str) else getattr(reward, "__name__", "")
        self.reward_fn = resolve_reward(reward)
        #: how error messages name the reward function (the spec as given)
        self.reward_name = self.reward_spec or reward_spec_name(self.reward_fn)
        self.prompt_column = prompt_column
        self.answer_column = answer_column
        self.column_map = dict(columns or {})
        for target in self.column_map:
            if target in ("prompt", "answer"):
                raise ValueError(
                    f"columns: {target!r} is set by prompt_column / answer_column, not columns"
                )
        self.test_path = test_path
        if not (0 < test_size < 1 or (float(test_size).is_integer() and test_size >= 1)):
            raise ValueError(f"test_size must be a fraction in (0, 1) or a count >= 1, "
                             f"got {test_size!r}")
        self.test_size = test_size
        self.seed = int(seed)
        if "{" not in prompt_template:
            raise ValueError(f"prompt_template {prompt_template!r} names no column, e.g. "
                             "'{prompt}'")
        self.prompt_template = prompt_template
        if kind is None:
            kind = "code" if self.reward_spec in _CODE_REWARDS else "math"
        if kind not in ("math", "code"):
            raise ValueError(f"kind must be 'math' or 'code', got {kind!r}")
        self.kind = kind
        self.config = config
        self.hub_splits = (hub_train_split, hub_test_split)
        self.hub = common.hub_allowed(hub)
        self._init_prompts(template, tokenizer, system_prompt, "")
        self._splits: dict[str, list[Example]] | None = None

    # -- data ---------------------------------------------------------------------------------
    def _is_hub_id(self, path: str) -> bool:
        if _HUB_ID.match(path) is None:
            return False
        try:
            return not Path(path).exists()
        except OSError:  # not a usable local path (e.g. too long)
            return True

    def _hub_rows(self, split: str) -> list[dict[str, Any]]:
        if not self.hub:
            raise FileNotFoundError(
                f"data {self.path!r} is no local file and the hub is turned off (hub=False or "
                f"{common.HUB_ENV}=0)"
            )
        reason = common.hub_unreachable_reason(self.path)
        if reason is not None:
            raise FileNotFoundError(
                f"data {self.path!r} is no local file and the Hugging Face hub cannot be used: "
                f"{reason}"
            )
        return common.load_hub(self.path, self.config, split)

    def _file_rows(self, path: str) -> list[dict[str, Any]]:
        try:
            found = Path(path).is_file()
        except OSError as err:  # a name longer than the file system allows, ...
            shown = path if len(path) <= 200 else f"{path[:200]}... ({len(path)} characters)"
            raise ValueError(f"data file {shown!r} cannot be read: {err.strerror}") from None
        if not found:
            raise FileNotFoundError(f"data file {path!r} does not exist")
        return read_records(path)

    def _example(self, row: dict[str, Any], where: str) -> Example:
        have = ", ".join(sorted(map(str, row))) or "none"
        needed = [self.prompt_column] + ([self.answer_column] if self.answer_column else [])
        needed += list(self.column_map.values())
        for col in needed:
            if col not in row:
                raise ValueError(f"{where} has no column {col!r} (its columns: {have}); set "
                                 "prompt_column / answer_column / columns to map yours")
        question = row[self.prompt_column]
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"{where}: column {self.prompt_column!r} must be non-empty text, "
                             f"got {question!r}")
        try:
            text = self.prompt_template.format(**{**row, "prompt": question})
        except KeyError as err:
            raise ValueError(f"{where}: prompt_template {self.prompt_template!r} names column "
                             f"{err.args[0]!r}, which the row lacks (its columns: {have})"
                             ) from None
        ex: Example = {k: v for k, v in row.items()
                       if k not in (self.prompt_column, self.answer_column)}
        for target, source in self.column_map.items():
            ex[target] = row[source]
        ex["prompt"] = self._render(text, text)
        if self.answer_column:
            ex["answer"] = row[self.answer_column]
        return ex

    def _examples(self, rows: list[dict[str, Any]], source: str) -> list[Example]:
        return [self._example(row, f"{source} row {i}") for i, row in enumerate(rows)]

    def _load(self) -> dict[str, list[Example]]:
        if self._splits is not None:
            return self._splits
        test: list[Example] | None = None
        if self._is_hub_id(self.path):
            train_split, test_split = self.hub_splits
            train = self._examples(self._hub_rows(train_split), f"{self.path}[{train_split}]")
            if self.test_path is None:
                try:
                    test = self._examples(self._hub_rows(test_split),
                                          f"{self.path}[{test_split}]")
                except ValueError:  # the data set has no such split: hold rows out below
                    test = None
        else:
            train = self._examples(self._file_rows(self.path), self.path)
        if self.test_path is not None:
            test = self._examples(self._file_rows(self.test_path), self.test_path)
        if test is None:
            train, test = self._hold_out(train)
        if not train:
            raise ValueError(f"{self.path}: no rows left for training after holding out "
                             f"{len(test)} for the test split; pass test_path=... or a smaller "
                             "test_size")
        self._splits = {"train": train, "test": test}
        return self._splits

    def _hold_out(self, rows: list[Example]) -> tuple[list[Example], list[Example]]:
        n = len(rows)
        k = int(round(self.test_size * n)) if self.test_size < 1 else int(self.test_size)
        k = min(max(k, 1), MAX_HELD_OUT, n)
        order = list(range(n))
        random.Random(self.seed).shuffle(order)
        held = set(order[:k])
        return ([r for i, r in enumerate(rows) if i not in held],
                [r for i, r in enumerate(rows) if i in held])

    def split(self, name: str) -> list[Example]:
        if name not in ("train", "test"):
            raise common.split_error(self.name, name, ["train", "test"])
        return [dict(ex) for ex in self._load()[name]]

    # -- reward -------------------------------------------------------------------------------
    def reward(
        self, prompts: Sequence[str], completions: Sequence[str], **columns: Any
    ) -> list[float | None]:
        # returned as is: the trainer checks type and length and names this function
        return self.reward_fn(  # type: ignore[no-any-return]
            prompts=list(prompts), completions=list(completions), **columns
        )

    def grade(
        self, completions: Sequence[str], examples: Sequence[Example]
    ) -> list[dict[str, Any]]:
        """Per-completion records for evaluation, scored with the trainer's failure rules
        (a value that is None/NaN/inf/not a number or a per-sample exception scores 0 and is
        named in ``reward_failure``; a function that fails for every completion raises
        :class:`gbmpo.rewards.scoring.RewardError`)."""
        prompts = [ex["prompt"] for ex in examples]
        scored = score_completions(self.reward_fn, prompts, list(completions),
                                   self.columns(list(examples)))
        return [{"reward": r, "correct": r >= 1.0 - 1e-9, "reward_failure": why}
                for r, why in zip(scored.rewards, scored.failed, strict=True)]
