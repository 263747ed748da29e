"""Choosing a reward function from a string: a registered name or an import path.

``resolve_reward(spec)``:

* a registered name of :data:`gbmpo.rewards.REWARDS` (built-ins, plugins of the
  ``gbmpo.rewards`` entry-point group, modules of ``--import``), or one of the short names
  :data:`REWARD_ALIASES` (``code`` = ``code_pass_fraction``);
* ``"module:function"`` (``module`` importable, e.g. ``my_pkg.rewards:score``) or
  ``"path/to/file.py:function"``: any callable following TRL's reward-function convention
  ``fn(prompts, completions, **columns) -> list[float | None]``, as TRL's own
  ``reward_funcs`` are written;
* a callable, returned as is.

Every failure (unknown name, module not importable, no such attribute, not callable) raises
:class:`ValueError` naming the spec, so a typo fails before any training starts.

The ``exact`` reward (:func:`exact_match_reward`) is registered here: 1.0 when the completion's
final answer equals column ``answer`` as a string (after whitespace normalisation), else 0.0.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gbmpo.registry import Registry, UnknownNameError
from gbmpo.rewards.code import code_all_pass, code_pass_fraction, code_shaped
from gbmpo.rewards.math import _completion_text, math_reward_fn

__all__ = ["REWARDS", "REWARD_ALIASES", "RewardFn", "exact_match_reward", "final_answer_text",
           "resolve_reward", "reward_spec_name"]

RewardFn = Callable[..., list[float | None]]

#: ``name -> fn(prompts, completions, **columns) -> list[float | None]``
REWARDS: Registry[RewardFn] = Registry("reward", entry_point_group="gbmpo.rewards")
REWARDS.register("math", math_reward_fn)
REWARDS.register("code_pass_fraction", code_pass_fraction)
REWARDS.register("code_all_pass", code_all_pass)
REWARDS.register("code_shaped", code_shaped)

#: short names accepted where a reward is chosen by name
REWARD_ALIASES: dict[str, str] = {"code": "code_pass_fraction"}
_WS = re.compile(r"\s+")


def final_answer_text(completion: str) -> str:
    """The answer part of a completion: the text after the last ``####`` if there is one, else
    the last non-empty line; whitespace runs collapsed to one space, ends stripped."""
    if "####" in completion:
        tail = completion.rsplit("####", 1)[1]
    else:
        lines = [ln for ln in completion.splitlines() if ln.strip()]
        tail = lines[-1] if lines else ""
    return _WS.sub(" ", tail).strip()


def exact_match_reward(
    prompts: Sequence[Any], completions: Sequence[Any], answer: Sequence[Any], **_: Any
) -> list[float | None]:
    """``1.0`` iff ``final_answer_text(completion) == normalise(str(answer))``, else ``0.0``.

    Case-sensitive string equality after whitespace normalisation; for numbers use ``math``
    (which accepts ``1,200`` for ``1200`` and checks equivalence with math-verify).
    """
    if len(completions) != len(answer):
        raise ValueError(f"{len(completions)} completions but {len(answer)} answers")
    return [
        1.0 if final_answer_text(_completion_text(c)) == _WS.sub(" ", str(a)).strip() else 0.0
        for c, a in zip(completions, answer, strict=True)
    ]


#: one reward file is executed once per process: threads that score at the same time (verl's
#: reward workers run ``compute_score`` in a thread pool) would otherwise see the module in
#: ``sys.modules`` before its body has run, without its functions
_FILE_LOCK = threading.RLock()


REWARDS.register("exact", exact_match_reward)


def _load_file_module(path: Path) -> Any:
    name = f"gbmpo_user_reward_{abs(hash(str(path.resolve())))}"
    with _FILE_LOCK:
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {path} as a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        return module


def _from_import_path(spec: str) -> Callable[..., Any]:
    where, _, attr = spec.rpartition(":")
    if not where or not attr:
        raise ValueError(f"reward {spec!r}: an import path looks like module:function")
    try:
        module = (_load_file_module(Path(where)) if where.endswith(".py")
                  else importlib.import_module(where))
    except (Exception, SystemExit) as err:  # noqa: BLE001 - reported with the spec
        raise ValueError(
            f"reward {spec!r}: cannot import {where!r}: {type(err).__name__}: {err}"
        ) from err
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"reward {spec!r}: {where!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"reward {spec!r} is a {type(obj).__name__}, not a function")
    return obj  # type: ignore[no-any-return]


def resolve_reward(spec: str | Callable[..., Any]) -> Callable[..., Any]:
    """The reward function that ``spec`` names (see the module docstring)."""
    if callable(spec):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"reward must be a name or module:function, got {spec!r}")
    spec = spec.strip()
    if ":" in spec:
        return _from_import_path(spec)
    name = REWARD_ALIASES.get(spec, spec)
    try:
        return REWARDS.get(name)
    except UnknownNameError:
        valid = sorted(set(REWARDS.names()) | set(REWARD_ALIASES))
        raise ValueError(
            f"unknown reward {spec!r}; valid names: {', '.join(valid)}, or an import path "
            "module:function (a TRL-style fn(prompts, completions, **columns))"
        ) from None


def reward_spec_name(fn: Callable[..., Any]) -> str:
    """A readable name of a reward function for messages."""
    mod = getattr(fn, "__module__", "") or ""
    qual = getattr(fn, "__qualname__", None) or type(fn).__name__
    return f"{mod}:{qual}" if mod and not mod.startswith("gbmpo_user_reward_") else qual
