"""What the fuzz targets share: the profile settings, value strategies built from the real
configuration keys, and running ``gbmpo`` in-process with its verdict checked.

The contract every target checks (:func:`check_cli`): exit code 0, or exit code 2 with the
problem on stderr as ``gbmpo COMMAND: error: ...`` in one line (argparse's own usage errors
print their usage block first), never a traceback, never an exception out of ``main``.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import typing
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from transformers.utils import logging as hf_logging

from gbmpo.cli import main
from gbmpo.config import annotation_at, leaf_keys

#: the settings of every fuzz target (the profile chosen in conftest.py)
FUZZ = settings.get_profile(os.environ.get("GBMPO_FUZZ_PROFILE", "fuzz-ci"))
#: the long profile (``HYPOTHESIS_PROFILE=long``) is running
LONG = FUZZ.max_examples >= 2000


def sized(ci: int, long: int | None = None) -> settings:
    """:data:`FUZZ` with ``ci`` examples (slow targets) or, in the long profile, ``long``
    (default: the profile's own count)."""
    return settings(FUZZ, max_examples=(long or FUZZ.max_examples) if LONG else ci)

#: every dotted configuration key (from the dataclasses of gbmpo.config)
KEYS: list[str] = leaf_keys()

# Keys whose arbitrary values would leave the sandbox of a unit test (import a module by name,
# pick a device or a remote engine): they get their defaults or a value that is refused.
_PINNED: dict[str, list[Any]] = {
    "run.plugins": [[], ["gbmpo_fuzz_no_such_plugin"]],
    "model.path": ["tiny", "/nonexistent/gbmpo-fuzz-model", "", "x" * 5000],
    "model.device": ["cpu", "cuda:99", "", "tpu"],
    "run.output_dir": [None],
    "engine": ["gbmpo", "trl ", "nope", ""],
    "run.num_processes": [1, 0, -3, 10**12],
    "run.num_nodes": [1, 0, 10**12],
    "run.report_to": [[], ["nope"], ["tensorboard", "tensorboard"]],
    "rollout.generator": ["hf", "nope", ""],
    "task.name": ["arithmetic", "nope", "", "jsonl"],
}

_JUNK_TEXT = st.one_of(
    st.text(max_size=30),
    st.text(alphabet=st.characters(min_codepoint=0x80, max_codepoint=0x10FFFF,
                                   exclude_categories=("Cs",)), max_size=20),
    st.just("x" * 100_000),
    st.sampled_from(["", " ", "null", "~", "None", "[1, 2", "{a: [}", "\x00", "\ufeff",
                     "1e400", "-1e400", "nan", "inf", "-inf", "0x10", "1_000", "true"]),
)
_NUMBERS = st.one_of(
    st.integers(min_value=-(10**30), max_value=10**30),
    st.sampled_from([0, -1, 1, 2**31, 2**63, -(2**63), 10**400]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, 1e-320, -0.0, 1e308]),
)


def _typed(tp: Any, default: Any) -> st.SearchStrategy[Any]:
    """Plausible values of annotation ``tp``: in range, out of range, non-finite."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return st.one_of(*[_typed(a, default) for a in typing.get_args(tp)])
    if tp is type(None):
        return st.none()
    if tp is bool:
        return st.booleans()
    if tp is int:
        return st.one_of(st.integers(-3, 300), st.sampled_from([0, -1, 2**40, 10**30]))
    if tp is float:
        return st.one_of(st.floats(-10, 10), _NUMBERS)
    if tp is str:
        return st.one_of(st.just(default) if isinstance(default, str) else st.nothing(),
                         _JUNK_TEXT)
    if origin is list:
        return st.lists(_JUNK_TEXT, max_size=3)
    if origin is tuple:
        return st.lists(_NUMBERS, min_size=0, max_size=3)
    if origin is dict:
        return st.dictionaries(st.text(max_size=8), _junk_values(), max_size=3)
    return _junk_values()


def _junk_values() -> st.SearchStrategy[Any]:
    """Values of the wrong type, nested junk included."""
    leaf = st.one_of(st.none(), st.booleans(), _NUMBERS, _JUNK_TEXT)
    return st.recursive(
        leaf,
        lambda inner: st.one_of(st.lists(inner, max_size=3),
                                st.dictionaries(st.text(max_size=6), inner, max_size=3)),
        max_leaves=6,
    )


def _defaults() -> dict[str, Any]:
    from gbmpo.config import TrainConfig, config_to_dict

    flat: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        for k, v in node.items():
            key = f"{prefix}{k}"
            if key in KEYS:
                flat[key] = v
            elif isinstance(v, dict):
                walk(v, f"{key}.")

    walk(config_to_dict(TrainConfig()), "")
    return flat


DEFAULTS = _defaults()


def value_for(key: str) -> st.SearchStrategy[Any]:
    """A value for config ``key``: usually of its type (in or out of range), sometimes junk."""
    if key in _PINNED:
        return st.sampled_from(_PINNED[key])
    return st.one_of(_typed(annotation_at(key.split(".")), DEFAULTS.get(key)),
                     _junk_values())


def misspell(key: str) -> st.SearchStrategy[str]:
    """``key`` with one edit (or an unknown key altogether)."""
    def edit(data: tuple[int, int, str]) -> str:
        kind, pos, ch = data
        pos %= len(key) + 1
        if kind == 0:
            return key[:pos] + ch + key[pos:]
        if kind == 1 and pos < len(key):
            return key[:pos] + key[pos + 1:]
        return key[:pos] + ch + key[pos + 1:]

    edited = st.tuples(st.integers(0, 2), st.integers(0, 200),
                       st.characters(min_codepoint=0x20, max_codepoint=0x2FF)).map(edit)
    return st.one_of(edited, st.text(min_size=1, max_size=12), st.just("no.such.key"))


#: config keys known to be slow to honour in a unit test (they stay at their defaults)
_SLOW_KEYS = ("lora.enabled",)
FUZZ_KEYS = [k for k in KEYS if k not in _SLOW_KEYS]


def to_text(value: Any) -> str:
    """A value as a user would type it on the command line."""
    if isinstance(value, str):
        return value
    import yaml

    return yaml.safe_dump(value, default_flow_style=True, allow_unicode=True,
                          width=10**9).strip().removesuffix("...").strip()


def check_cli(argv: list[str], capsys: pytest.CaptureFixture[str], command: str) -> tuple[int, str]:
    """Run ``gbmpo`` in-process; check the exit-code contract; return ``(code, stderr)``."""
    # transformers' log handler keeps the stderr of the test that imported it first (closed by
    # now): point it at this test's captured stderr while the command runs
    handlers = [(h, h.stream) for h in hf_logging.get_logger().handlers
                if type(h) is logging.StreamHandler]
    for h, _ in handlers:
        h.stream = sys.stderr
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code if isinstance(exc.code, int) else 2
    finally:
        for h, old in handlers:
            h.stream = old
    captured = capsys.readouterr()
    err = captured.err
    assert "Traceback" not in err, err[-3000:]
    assert code in (0, 2), (code, argv, err[-2000:])
    if code == 2:
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert lines, f"exit 2 without a message: {argv}"
        if err.startswith("usage:"):  # argparse: usage block, then one error line
            assert lines[-1].startswith(f"gbmpo {command}: error: "), err
        else:
            assert len(lines) == 1 and lines[0].startswith(f"gbmpo {command}: error: "), err
    return code, err


def listing(path: Path) -> set[str]:
    """Every path under ``path`` (to check that a failed command left nothing behind)."""
    return {str(p.relative_to(path)) for p in path.rglob("*")}
