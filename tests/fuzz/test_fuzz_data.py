"""Fuzzed data files for the ``jsonl`` task (the user's own data): JSON Lines, JSON arrays, CSV
and Parquet, optionally gzip, with missing or mistyped fields, empty files, byte-order marks,
truncated compression, duplicate ids, huge rows and junk bytes. ``gbmpo train --dry-run`` must
exit 0 (valid data) or 2 with one line naming the file (and the row or line where one row is
at fault); never a traceback."""

from __future__ import annotations

import csv
import gzip
import io
import json
from pathlib import Path
from typing import Any

import pytest
from fuzzlib import FUZZ, check_cli, listing, sized
from hypothesis import example, given
from hypothesis import strategies as st

pytestmark = pytest.mark.filterwarnings("ignore")

_FORMATS = ("jsonl", "json", "csv", "parquet", "jsonl.gz", "json.gz", "csv.gz")

_field = st.one_of(
    st.text(max_size=20), st.just(""), st.just("   "), st.integers(-5, 10**20), st.none(),
    st.floats(allow_nan=True), st.booleans(), st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.just("x" * 200_000),
)


@st.composite
def rows(draw: st.DrawFn) -> list[Any]:
    """Rows, mostly objects with prompt/answer/id; some fields missing, mistyped or huge."""
    n = draw(st.integers(0, 12))
    out: list[Any] = []
    for i in range(n):
        if draw(st.integers(0, 19)) == 0:
            out.append(draw(st.one_of(st.integers(), st.text(max_size=5), st.lists(st.none()))))
            continue
        row: dict[str, Any] = {}
        if draw(st.integers(0, 9)):
            row["prompt"] = draw(st.one_of(st.just(f"What is {i} + 1?"), _field))
        if draw(st.integers(0, 9)):
            row["answer"] = draw(st.one_of(st.just(str(i + 1)), _field))
        row["id"] = draw(st.one_of(st.just(i), st.just(0)))  # duplicate ids are allowed
        if draw(st.booleans()):
            row[draw(st.text(min_size=1, max_size=6))] = draw(_field)
        out.append(row)
    return out


def _serialise(fmt: str, data: list[Any]) -> bytes:
    base = fmt.removesuffix(".gz")
    if base == "jsonl":
        raw = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in data).encode()
    elif base == "json":
        raw = json.dumps(data, ensure_ascii=False).encode()
    elif base == "csv":
        dicts = [r for r in data if isinstance(r, dict)]
        cols = sorted({str(k) for r in dicts for k in r})
        buf = io.StringIO()
        if cols:
            w = csv.DictWriter(buf, fieldnames=cols)
            w.writeheader()
            for r in dicts:
                w.writerow({str(k): v for k, v in r.items()})
        raw = buf.getvalue().encode("utf-8", "surrogatepass")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        dicts = [{str(k): (json.dumps(v) if isinstance(v, (list, dict)) else v)
                  for k, v in r.items()} for r in data if isinstance(r, dict)]
        sink = io.BytesIO()
        try:
            pq.write_table(pa.Table.from_pylist(dicts), sink)
        except (pa.ArrowException, OverflowError, ValueError):  # mixed column types
            pq.write_table(pa.Table.from_pylist(
                [{k: str(v) for k, v in r.items()} for r in dicts]), sink)
        raw = sink.getvalue()
    return gzip.compress(raw) if fmt.endswith(".gz") else raw


@st.composite
def data_files(draw: st.DrawFn) -> tuple[str, bytes]:
    fmt = draw(st.sampled_from(_FORMATS))
    raw = _serialise(fmt, draw(rows()))
    damage = draw(st.integers(0, 9))
    if damage == 0:
        raw = b""
    elif damage == 1:
        raw = b"\xef\xbb\xbf" + raw  # a byte-order mark (before compression: see below)
        if fmt.endswith(".gz"):
            raw = gzip.compress(b"\xef\xbb\xbf" + gzip.decompress(raw[3:]))
    elif damage == 2 and len(raw) > 4:
        raw = raw[: draw(st.integers(1, len(raw) - 1))]  # truncated
    elif damage == 3:
        raw = draw(st.binary(max_size=64))
    elif damage == 4:
        raw = raw + draw(st.binary(min_size=1, max_size=8))
    return fmt, raw


def _dry_run(tmp: Path, capsys: pytest.CaptureFixture[str], fmt: str, raw: bytes,
             reward: str = "exact") -> tuple[int, str, Path]:
    data = tmp / f"data.{fmt}"
    data.write_bytes(raw)
    before = listing(tmp)
    code, err = check_cli(
        ["train", "--dry-run", "--task.name", "jsonl", "--task.params.path", str(data),
         "--task.params.reward", reward, "--task.params.test_size", "1",
         "--output-dir", str(tmp / "run")], capsys, "train")
    assert listing(tmp) == before
    return code, err, data


@FUZZ
@given(f=data_files())
@example(f=("jsonl", b""))
@example(f=("jsonl", b"\xef\xbb\xbf" + b'{"prompt": "a", "answer": "1"}\n' * 3))
@example(f=("csv", b"\xef\xbb\xbfprompt,answer\na,1\nb,2\n"))
@example(f=("jsonl.gz", gzip.compress(b'{"prompt": "a", "answer": "1"}\n' * 50)[:30]))
@example(f=("json", b"[" * 100_000))
@example(f=("csv", b"prompt,answer\n" + b"x" * 200_000 + b",1\na,2\n"))
@example(f=("csv", b"prompt,answer\na\x00b,1\nc,2\n"))
@example(f=("csv", b"\xff\xfe\x00"))
@example(f=("parquet", b"PAR1garbage"))
@example(f=("jsonl", b'{"prompt": "a", "answer": 1}\n{"prompt": 5, "answer": 2}\n'))
@example(f=("json.gz", b"\x1f\x8b\x08\x00junk"))
@example(f=("csv.gz", gzip.compress(b"prompt,answer\na,1\nb,2\n")))  # gzip, not plain text
@example(f=("csv.gz", gzip.compress(b"prompt,answer\n\xff,1\nb,2\n")))
def test_data_files(tmp_path_factory: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str],
                    monkeypatch: pytest.MonkeyPatch, f: tuple[str, bytes]) -> None:
    tmp = tmp_path_factory.mktemp("data")
    monkeypatch.chdir(tmp)
    code, err, data = _dry_run(tmp, capsys, *f)
    if code == 2:
        assert str(data) in err or data.name in err, err


@sized(3, long=300)  # 7 dry runs per example
@given(n=st.integers(3, 30), dup=st.booleans())
def test_valid_files_run_clean(tmp_path_factory: pytest.TempPathFactory,
                               capsys: pytest.CaptureFixture[str],
                               monkeypatch: pytest.MonkeyPatch, n: int, dup: bool) -> None:
    """Well-formed data (duplicate ids included) passes the dry run in every format."""
    tmp = tmp_path_factory.mktemp("valid")
    monkeypatch.chdir(tmp)
    good = [{"id": 0 if dup else i, "prompt": f"What is {i} + 1?", "answer": str(i + 1)}
            for i in range(n)]
    for fmt in _FORMATS:
        code, err, _ = _dry_run(tmp, capsys, fmt, _serialise(fmt, good))
        assert code == 0, (fmt, err)


def test_bad_row_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    raw = b'{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": "2"}\n{"answer": "3"}\n'
    code, err, data = _dry_run(tmp_path, capsys, "jsonl", raw)
    assert code == 2 and f"{data} row 2 has no column 'prompt'" in err
    raw = b'{"prompt": "a", "answer": "1"}\n{"prompt": "b"\n'
    code, err, data = _dry_run(tmp_path, capsys, "jsonl", raw)
    assert code == 2 and f"{data} line 2: invalid JSON" in err
