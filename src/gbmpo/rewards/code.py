"""Code rewards: extract a program from a completion, run it against tests in the sandbox.

Reward columns (TRL convention, one value per completion):

* ``tests`` (list[str], required): test snippets, e.g. ``"assert f(1) == 2"``; each counts as
  one test and passes iff it runs to completion without raising (see
  :mod:`gbmpo.sandbox`).
* ``setup`` (str, optional): trusted code run in the sandbox's judge before the tests (MBPP's
  ``test_setup_code``, which may build the program's objects: they stay in the program's
  process, see :mod:`gbmpo.sandbox`).
* ``prefix`` (str, optional): text the completion continues (HumanEval's prompt: imports,
  signature and docstring); when it is valid Python alone the judge also runs it and keeps its
  helpers (:func:`trusted_prelude`).
* ``entry_point`` (str, optional): the function under test; it may shadow a builtin (MBPP
  task 126 defines ``sum``) and picks the right code block when there are several.

Rewards: :func:`code_pass_fraction` (passed / total), :func:`code_all_pass` (1.0 iff every
test passed) and :func:`code_shaped` (the GBMPO authors' shaped reward,
:mod:`gbmpo.rewards.code_shaping`; its group terms act on runs of consecutive equal prompts).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from typing import Any

from gbmpo.rewards.code_shaping import parses, shaped_code_rewards, validate_banned_tokens
from gbmpo.rewards.math import strip_thinking
from gbmpo.sandbox import Program, RunResult, Sandbox, run_programs

__all__ = [
    "CODE_REWARD_KINDS",
    "HUMANEVAL_STOP",
    "build_program",
    "code_all_pass",
    "code_pass_fraction",
    "code_shaped",
    "extract_code",
    "grade_code",
    "make_code_reward",
    "truncate_at_stop",
    "trusted_prelude",
]

#: stop sequences of the Codex paper for completions that continue a function (base models)
HUMANEVAL_STOP = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")

#: the ``kind`` values of :func:`make_code_reward`
CODE_REWARD_KINDS = ("pass_fraction", "all_pass", "shaped")

_PY_LANGS = ("", "python", "py", "python3")
_ANY_DEF_RE = re.compile(r"^[ \t]*def[ \t]+\w+[ \t]*\(", re.MULTILINE)


def _defines(code: str, name: str) -> bool:
    pattern = rf"^[ \t]*def[ \t]+{re.escape(name)}[ \t]*\("
    return re.search(pattern, code, re.MULTILINE) is not None


def _fenced_blocks(text: str) -> tuple[list[tuple[str, str]], str | None]:
    """Complete ```` ``` ```` blocks as (language, code), and the code after an unclosed
    opening fence at the end (linear time: one split on the fence marker)."""
    parts = text.split("```")
    blocks: list[tuple[str, str]] = []
    for i in range(1, len(parts) - 1, 2):
        head, _, body = parts[i].partition("\n")
        blocks.append((head.strip().split(" ")[0] if head.strip() else "", body))
    unclosed = None
    if len(parts) % 2 == 0:  # an odd number of fences: the last one is still open
        head, nl, body = parts[-1].partition("\n")
        if nl and not blocks and parts[0].strip() == "":
            unclosed = body
    return blocks, unclosed


def extract_code(completion: str, entry_point: str | None = None) -> str:
    """The program in ``completion``.

    Fenced blocks first: among the Python (or unlabeled) blocks, the first that defines
    ``entry_point``, else the first that defines any function, else the first block. Without a
    complete block: the text after an unclosed opening fence, or the text before a lone closing
    fence (a base model continuing a prompt that opened the fence), or the whole completion.
    Text up to the last ``</think>`` is dropped first (when text follows it).
    """
    text = strip_thinking(completion)
    blocks, unclosed = _fenced_blocks(text)
    if blocks:
        py = [code for lang, code in blocks if lang.lower() in _PY_LANGS]
        candidates = py or [code for _, code in blocks]
        if entry_point:
            for code in candidates:
                if _defines(code, entry_point):
                    return code
        for code in candidates:
            if _ANY_DEF_RE.search(code):
                return code
        return candidates[0]
    if unclosed is not None:
        return unclosed
    if "```" in text:
        return text[: text.index("```")]
    return text


def truncate_at_stop(completion: str, stops: Sequence[str] = HUMANEVAL_STOP) -> str:
    """Cut ``completion`` at the first of ``stops`` (the Codex protocol for base models)."""
    cut = len(completion)
    for s in stops:
        i = completion.find(s)
        if i != -1:
            cut = min(cut, i)
    return completion[:cut]


def build_program(completion: str, prefix: str = "", entry_point: str | None = None) -> str:
    """The program to test: the extracted code, after ``prefix`` when it continues it.

    With a ``prefix`` (a HumanEval prompt): if the code defines ``entry_point`` itself, the
    program is ``prefix + "\\n" + code`` (the prefix keeps its imports; the later definition
    wins); otherwise the code is taken as the body that continues the prefix.
    """
    code = extract_code(completion, entry_point)
    if not prefix:
        return code
    if entry_point and _defines(code, entry_point):
        return prefix + "\n" + code
    return prefix + code


@functools.lru_cache(maxsize=1024)
def trusted_prelude(prefix: str) -> str:
    """The part of a task's ``prefix`` the judge runs itself: the whole prefix when it is valid
    Python on its own (a HumanEval prompt: imports, helpers such as ``poly``, and the entry
    point's signature and docstring), else nothing (the program's own definitions are then
    reached through its process, as answers)."""
    return prefix if prefix and parses(prefix) else ""


def _text(completion: Any) -> str:
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Sequence) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    raise TypeError(f"cannot read a completion of type {type(completion).__name__}")


def _column(values: Sequence[Any] | None, n: int, name: str, default: Any) -> list[Any]:
    if values is None:
        return [default] * n
    if len(values) != n:
        raise ValueError(f"column {name!r} has {len(values)} values for {n} completions")
    return [default if v is None else v for v in values]


def grade_code(
    completions: Sequence[Any],
    tests: Sequence[Sequence[str]],
    setup: Sequence[str | None] | None = None,
    prefix: Sequence[str | None] | None = None,
    entry_point: Sequence[str | None] | None = None,
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 1024,
    sandbox: Sandbox | None = None,
) -> list[RunResult]:
    """Build and run one program per completion (in parallel on the sandbox's workers)."""
    n = len(completions)
    tests_l = _column(tests, n, "tests", None)
    setup_l = _column(setup, n, "setup", "")
    prefix_l = _column(prefix, n, "prefix", "")
    entry_l = _column(entry_point, n, "entry_point", None)
    programs = []
    for c, t, s, p, e in zip(completions, tests_l, setup_l, prefix_l, entry_l, strict=True):
        if t is None or isinstance(t, str):
            raise TypeError("column 'tests' must hold a list of test snippets per completion")
        programs.append(Program(
            code=build_program(_text(c), p, e), tests=tuple(t), setup=s,
            keep=(e,) if e else (), prelude=trusted_prelude(p),
        ))
    return run_programs(programs, timeout_s=timeout_s, memory_mb=memory_mb, sandbox=sandbox)


def make_code_reward(
    kind: str = "pass_fraction",
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 1024,
    sandbox: Sandbox | None = None,
    banned_tokens: Sequence[str] | None = None,
) -> Callable[..., list[float | None]]:
    """A TRL-style code reward: ``kind`` is ``"pass_fraction"``, ``"all_pass"`` or ``"shaped"``.

    ``"shaped"``: :func:`gbmpo.rewards.code_shaping.shaped_code_rewards`, with groups = runs of
    consecutive equal prompts and ``banned_tokens`` (default: the three the authors name).
    """
    if kind not in CODE_REWARD_KINDS:
        raise ValueError(
            f"unknown code reward kind {kind!r}; valid: {', '.join(CODE_REWARD_KINDS)}"
        )
    if banned_tokens is not None and kind != "shaped":
        raise ValueError("banned_tokens only applies to the 'shaped' code reward")
    banned = validate_banned_tokens(banned_tokens)

    def reward(
        prompts: Sequence[Any],
        completions: Sequence[Any],
        tests: Sequence[Sequence[str]],
        setup: Sequence[str | None] | None = None,
        prefix: Sequence[str | None] | None = None,
        entry_point: Sequence[str | None] | None = None,
        **_: Any,
    ) -> list[float | None]:
        results = grade_code(completions, tests, setup, prefix, entry_point,
                             timeout_s=timeout_s, memory_mb=memory_mb, sandbox=sandbox)
        if kind == "all_pass":
            return [1.0 if r.all_passed else 0.0 for r in results]
        if kind == "shaped":
            n = len(completions)
            texts = [_text(c) for c in completions]
            prefixes = _column(prefix, n, "prefix", "")
            entries = _column(entry_point, n, "entry_point", None)
            return list(shaped_code_rewards(
                results, texts,
                [build_program(t, p, e) for t, p, e in zip(texts, prefixes, entries, strict=True)],
                [extract_code(t, e) for t, e in zip(texts, entries, strict=True)],
                prompts=prompts, banned_tokens=banned,
            ))
        return [r.pass_fraction for r in results]

    reward.__name__ = f"code_{kind}"
    reward.__qualname__ = reward.__name__
    return reward


#: fraction of tests passed (default sandbox, 5 s, 1 GiB)
code_pass_fraction = make_code_reward("pass_fraction")
#: 1.0 iff every test passed (default sandbox, 5 s, 1 GiB)
code_all_pass = make_code_reward("all_pass")
#: the GBMPO authors' shaped reward (default sandbox, 5 s, 1 GiB; its three banned tokens)
code_shaped = make_code_reward("shaped")
