"""The GBMPO authors' shaped MBPP training reward (docs/methods.md, section "Shaped MBPP reward").

Source: the GBMPO authors' MBPP training code, as summarised in docs/methods.md, section "Shaped
MBPP reward"; whether the paper used this shaping is unknown (docs/methods.md, "Choices" item 15).
For completion ``i`` of a group of ``G`` completions of one prompt::

    r_i = b_i + o_i + f_i + β_i + d_i + t_i

* ``b_i`` base: fraction of tests passed (:func:`pass_fraction`);
* ``o_i`` outcome penalty, **one** of −0.10 / −0.25 / −0.15 / −0.10 (:func:`outcome_penalty`);
* ``f_i`` format penalty: −0.02 per banned token, −0.03 for non-ASCII (:func:`format_penalty`);
* ``β_i`` brevity bonus: +0.02 / +0.01 for short programs passing every test
  (:func:`brevity_bonus`);
* ``d_i`` −0.02 when the completion has an exact duplicate in its group
  (:func:`duplicate_penalties`);
* ``t_i`` length-ranked tie-breaker in [−0.015, +0.015] for zero-variance groups
  (:func:`length_tiebreak`).

The first four terms depend on the completion alone (:func:`sample_reward`), the last two on its
group (:func:`shape_group`).

Ambiguities of the description, resolved here (each function's docstring repeats its own):

1. **Terms add up.** ``o_i`` is a single value chosen by priority: no tests or unparseable code
   (−0.10) > timeout (−0.25) > another execution failure (−0.15) > no test passed (−0.10) >
   none (0); a timeout with no test passed is −0.25, not −0.35. A timeout or crash after some
   tests passed keeps its base ``b_i``.
2. **"Cannot be parsed"** is decided in-process with :func:`ast.parse` on the program that is
   run (no execution); such code is still sent to the sandbox like any other.
3. **"Another execution failure"** is sandbox status ``error`` (the program raised at top level,
   exited early or the setup code raised) or ``killed`` (output limit, signal, dead worker).
4. **Banned tokens** are counted as plain substrings (non-overlapping, ``str.count``) in the
   completion's answer text (after a ``</think>`` block, as for code extraction). The fences of
   one code block are expected by our prompts (the chat system prompt asks for a single
   ```` ```python ```` block; base prompts end with an opening fence, restored before grading),
   so the first ``allowed_fences`` (2) fences are exempt and only further fences count.
   The default list is exactly the three tokens the description names,
   :data:`SPEC_BANNED_TOKENS`: ```` ``` ````, ``input(``, ``Example:``; the description's "…" (the
   rest of the authors' list) is not known and nothing is added.
5. **Non-ASCII** is a flat −0.03 when the answer text has any character above U+007F (not per
   character).
6. **"When tests pass"** (brevity) means *every* test passed (:attr:`RunResult.all_passed`), so
   a short wrong program earns nothing.
7. **Length** (brevity and tie-breaker) is the number of characters of the code extracted from
   the completion, ``len(code.strip())`` (:func:`gbmpo.rewards.code.extract_code`: the chosen
   fenced block without its fences; never the task prefix), not of the whole completion;
   "under 100" is ``< 100``: 99 characters get +0.02, 100 and 149 get +0.01, 150 get 0.
8. **Duplicates** compare the raw completion texts exactly; *every* copy is penalised (the
   order of a group is arbitrary, so there is no "first" copy).
9. **Zero variance** is tested on ``b + o + f + β + d`` (max − min ≤ 1e-9). The tie-breaker is
   linear in the length rank (average ranks for equal lengths): the shortest gets +0.015, the
   longest −0.015, equal lengths the same value; it sums to zero over the group, so it
   **preserves the group mean**. Groups of one get 0.
10. **Groups** are runs of consecutive equal prompts (:func:`consecutive_groups`): the trainer
    calls the reward with each prompt repeated ``G`` times in a row (``gbmpo.train.step``, step 3:
    ``[p for p in prompts for _ in range(G)]``) and TRL's ``RepeatSampler`` repeats each prompt
    consecutively too. Caveats: two adjacent groups of the *same* prompt (the same example drawn
    at the end of one epoch and the start of the next) are shaped as one group of ``2G``; a
    group split across processes (TRL, several GPUs) or scored one completion at a time (the
    per-sample retry of :func:`gbmpo.rewards.scoring.score_completions`) is shaped per part.

Bounds: ``r_i ∈ [−0.315 − 0.02·n_i, 1.035]`` with ``n_i`` the counted banned tokens (the
per-token penalty has no cap in the spec); without the group terms ``[−0.28 − 0.02·n_i, 1.02]``.
"""

from __future__ import annotations

import ast
import warnings
from collections import Counter
from collections.abc import Sequence
from typing import Any

from gbmpo.rewards.math import strip_thinking
from gbmpo.sandbox import RunResult

__all__ = [
    "ALLOWED_FENCES",
    "OUTCOMES",
    "SPEC_BANNED_TOKENS",
    "brevity_bonus",
    "classify_outcome",
    "code_length",
    "consecutive_groups",
    "count_banned_tokens",
    "duplicate_penalties",
    "format_penalty",
    "length_tiebreak",
    "outcome_penalty",
    "parses",
    "pass_fraction",
    "sample_reward",
    "shape_group",
    "shaped_code_rewards",
    "validate_banned_tokens",
]

#: the banned tokens the authors' code names (code fences, ``input(``, "Example:"); its "…" is
#: unknown
SPEC_BANNED_TOKENS: tuple[str, ...] = ("```", "input(", "Example:")
#: fences of the one expected code block, exempt from the banned-token count
ALLOWED_FENCES = 2
FENCE = "```"

NO_TESTS_PENALTY = -0.10
UNPARSEABLE_PENALTY = -0.10
TIMEOUT_PENALTY = -0.25
EXEC_ERROR_PENALTY = -0.15
NO_PASS_PENALTY = -0.10
BANNED_TOKEN_PENALTY = -0.02
NON_ASCII_PENALTY = -0.03
BREVITY_SHORT, BREVITY_SHORT_BONUS = 100, 0.02
BREVITY_MEDIUM, BREVITY_MEDIUM_BONUS = 150, 0.01
DUPLICATE_PENALTY = -0.02
TIEBREAK = 0.015
ZERO_VARIANCE_ATOL = 1e-9

#: outcome -> penalty ``o`` (priority order of :func:`classify_outcome`)
_OUTCOME_PENALTY: dict[str, float] = {
    "no_tests": NO_TESTS_PENALTY,
    "unparseable": UNPARSEABLE_PENALTY,
    "timeout": TIMEOUT_PENALTY,
    "exec_error": EXEC_ERROR_PENALTY,
    "no_pass": NO_PASS_PENALTY,
    "partial": 0.0,
    "all_pass": 0.0,
}
#: every outcome :func:`classify_outcome` returns
OUTCOMES: tuple[str, ...] = tuple(_OUTCOME_PENALTY)


# ------------------------------------------------------------------------ per-completion terms


def parses(program: str) -> bool:
    """True iff ``program`` is valid Python syntax (:func:`ast.parse`; nothing is executed).

    Null bytes, over-deep nesting (``RecursionError``/``MemoryError``) count as unparseable;
    ``SyntaxWarning`` s (e.g. invalid escapes) are silenced.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ast.parse(program)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return True


def classify_outcome(result: RunResult, parseable: bool = True) -> str:
    """The outcome of one run, by priority (first match), one of :data:`OUTCOMES`:

    ``no_tests`` (``total == 0``) > ``unparseable`` (``not parseable``) > ``timeout`` (sandbox
    status ``timeout``) > ``exec_error`` (status ``error`` or ``killed``) > ``no_pass``
    (``passed == 0``) > ``all_pass`` (:attr:`RunResult.all_passed`) > ``partial``.
    """
    if result.total == 0:
        return "no_tests"
    if not parseable:
        return "unparseable"
    if result.status == "timeout":
        return "timeout"
    if result.status in ("error", "killed"):
        return "exec_error"
    if result.passed == 0:
        return "no_pass"
    return "all_pass" if result.all_passed else "partial"


def pass_fraction(passed: int, total: int) -> float:
    """Base reward ``b = passed / total`` (0 without tests). docs/methods.md, section "Shaped MBPP
    reward": "Base reward = fraction of tests passed"."""
    return passed / total if total else 0.0


def outcome_penalty(outcome: str) -> float:
    """Outcome penalty ``o`` (docs/methods.md, section "Shaped MBPP reward", the authors' code):
    −0.10 if no test passes, −0.25 on timeout, −0.15 on another execution failure, −0.10 if the code
    cannot be parsed or there are no tests, else 0. Exactly one applies (``outcome`` from
    :func:`classify_outcome`).
    """
    try:
        return _OUTCOME_PENALTY[outcome]
    except KeyError:
        raise ValueError(
            f"unknown outcome {outcome!r}; valid: {', '.join(OUTCOMES)}"
        ) from None


def count_banned_tokens(
    text: str,
    banned_tokens: Sequence[str] = SPEC_BANNED_TOKENS,
    allowed_fences: int = ALLOWED_FENCES,
) -> int:
    """``n = Σ_tok count(text, tok)``, non-overlapping substring counts, where the fence token
    ```` ``` ```` counts only beyond the first ``allowed_fences`` (one expected code block)."""
    n = 0
    for tok in banned_tokens:
        k = text.count(tok)
        if tok == FENCE:
            k = max(0, k - allowed_fences)
        n += k
    return n


def format_penalty(
    text: str,
    banned_tokens: Sequence[str] = SPEC_BANNED_TOKENS,
    allowed_fences: int = ALLOWED_FENCES,
) -> float:
    """Format penalty ``f = −0.02·n − 0.03·[text has a non-ASCII character]`` (docs/methods.md,
    section "Shaped MBPP reward", the authors' code: "−0.02 per banned token ... and −0.03 for
    non-ASCII characters"), with ``n`` from :func:`count_banned_tokens`. ``text`` is the answer
    (after any ``</think>``)."""
    n = count_banned_tokens(text, banned_tokens, allowed_fences)
    return BANNED_TOKEN_PENALTY * n + (NON_ASCII_PENALTY if not text.isascii() else 0.0)


def brevity_bonus(length: int, all_passed: bool) -> float:
    """Brevity bonus ``β`` (docs/methods.md, section "Shaped MBPP reward", the authors' code: "+0.02
    under 100 characters, +0.01 under 150" when tests pass): ``0.02·[L < 100] + 0.01·[100 ≤ L <
    150]`` if every test passed, else 0; ``L`` = :func:`code_length`."""
    if not all_passed:
        return 0.0
    if length < BREVITY_SHORT:
        return BREVITY_SHORT_BONUS
    if length < BREVITY_MEDIUM:
        return BREVITY_MEDIUM_BONUS
    return 0.0


def code_length(code: str) -> int:
    """``L = len(code.strip())``: characters of the completion's extracted code."""
    return len(code.strip())


def sample_reward(
    result: RunResult,
    completion: str,
    program: str,
    code: str | None = None,
    *,
    banned_tokens: Sequence[str] = SPEC_BANNED_TOKENS,
    allowed_fences: int = ALLOWED_FENCES,
) -> float:
    """Per-completion part ``b + o + f + β`` (module docstring; docs/methods.md, section "Shaped
    MBPP reward").

    ``result``: the sandbox run of ``program`` (the code that ran, task prefix included);
    ``completion``: the completion text (format terms, on the text after ``</think>``);
    ``code``: the completion's own extracted code (length; default ``program``).
    """
    outcome = classify_outcome(result, parses(program))
    length = code_length(program if code is None else code)
    return (
        pass_fraction(result.passed, result.total)
        + outcome_penalty(outcome)
        + format_penalty(strip_thinking(completion), banned_tokens, allowed_fences)
        + brevity_bonus(length, outcome == "all_pass")
    )


# ------------------------------------------------------------------------------- group terms


def duplicate_penalties(texts: Sequence[str]) -> list[float]:
    """``d_i = −0.02·[∃ j ≠ i: texts_j == texts_i]`` (docs/methods.md, section "Shaped MBPP reward",
    the authors' code: "−0.02 for an exact duplicate within the group"); every copy is penalised."""
    counts = Counter(texts)
    return [DUPLICATE_PENALTY if counts[t] > 1 else 0.0 for t in texts]


def length_tiebreak(
    rewards: Sequence[float], lengths: Sequence[int], magnitude: float = TIEBREAK
) -> list[float]:
    """Tie-breaker for a zero-variance group (docs/methods.md, section "Shaped MBPP reward", the
    authors' code: "length-ranked tie-breaker between +0.015 and −0.015").

    If ``max(r) − min(r) ≤ 1e-9`` and ``G ≥ 2``: ``t_i = m·(1 − 2·ρ_i/(G − 1))`` with ``ρ_i``
    the ascending rank of ``lengths_i`` in 0..G−1 (average rank for ties) and ``m = 0.015``:
    shortest +m, longest −m, ``Σ_i t_i = 0`` (the group mean is preserved); otherwise all 0.
    """
    g = len(rewards)
    if len(lengths) != g:
        raise ValueError(f"{len(lengths)} lengths for {g} rewards")
    if g < 2 or max(rewards) - min(rewards) > ZERO_VARIANCE_ATOL:
        return [0.0] * g
    order = sorted(range(g), key=lambda i: lengths[i])
    ranks = [0.0] * g
    start = 0
    while start < g:  # average ranks over runs of equal lengths
        end = start
        while end + 1 < g and lengths[order[end + 1]] == lengths[order[start]]:
            end += 1
        for k in range(start, end + 1):
            ranks[order[k]] = (start + end) / 2
        start = end + 1
    return [magnitude * (1.0 - 2.0 * rank / (g - 1)) for rank in ranks]


def shape_group(
    rewards: Sequence[float], texts: Sequence[str], lengths: Sequence[int]
) -> list[float]:
    """Group terms on the per-completion rewards of one group: ``r' = r + d`` (duplicates),
    then ``r'' = r' + t(r', lengths)`` (tie-breaker tested on ``r'``)."""
    if not len(rewards) == len(texts) == len(lengths):
        raise ValueError("rewards, texts and lengths must have the same length")
    with_dups = [r + d for r, d in zip(rewards, duplicate_penalties(texts), strict=True)]
    ties = length_tiebreak(with_dups, lengths)
    return [r + t for r, t in zip(with_dups, ties, strict=True)]


def consecutive_groups(keys: Sequence[Any]) -> list[range]:
    """Index ranges of the runs of consecutive equal ``keys`` (prompts; compared with ``==``,
    so chat message lists work too): ``[a, a, b, b, a] -> [0:2, 2:4, 4:5]``."""
    groups: list[range] = []
    start = 0
    for i in range(1, len(keys) + 1):
        if i == len(keys) or keys[i] != keys[start]:
            groups.append(range(start, i))
            start = i
    return groups if keys else []


# ---------------------------------------------------------------------------------- the batch


def validate_banned_tokens(banned_tokens: Sequence[str] | None) -> tuple[str, ...]:
    """``banned_tokens`` as a tuple (``None``: :data:`SPEC_BANNED_TOKENS`); rejects a bare string
    and empty tokens (``str.count("")`` would count every position)."""
    if banned_tokens is None:
        return SPEC_BANNED_TOKENS
    if isinstance(banned_tokens, str):
        raise TypeError("banned_tokens must be a list of strings, not a string")
    out = tuple(banned_tokens)
    for tok in out:
        if not isinstance(tok, str) or not tok:
            raise ValueError(f"banned_tokens must be non-empty strings, got {tok!r}")
    return out


def shaped_code_rewards(
    results: Sequence[RunResult],
    completions: Sequence[str],
    programs: Sequence[str],
    codes: Sequence[str] | None = None,
    *,
    prompts: Sequence[Any] | None = None,
    banned_tokens: Sequence[str] = SPEC_BANNED_TOKENS,
    allowed_fences: int = ALLOWED_FENCES,
) -> list[float]:
    """Shaped rewards of a batch: :func:`sample_reward` per completion, then :func:`shape_group`
    on every run of consecutive equal ``prompts`` (module docstring, item 10); ``prompts=None``
    skips the group terms (evaluation)."""
    n = len(results)
    codes = programs if codes is None else codes
    if not len(completions) == len(programs) == len(codes) == n:
        raise ValueError("results, completions, programs and codes must have the same length")
    rewards = [
        sample_reward(r, c, p, k, banned_tokens=banned_tokens, allowed_fences=allowed_fences)
        for r, c, p, k in zip(results, completions, programs, codes, strict=True)
    ]
    if prompts is None:
        return rewards
    if len(prompts) != n:
        raise ValueError(f"{len(prompts)} prompts for {n} completions")
    lengths = [code_length(k) for k in codes]
    for grp in consecutive_groups(prompts):
        rewards[grp.start:grp.stop] = shape_group(
            rewards[grp.start:grp.stop], completions[grp.start:grp.stop],
            lengths[grp.start:grp.stop],
        )
    return rewards
