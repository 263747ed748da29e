"""Final-answer math reward: robust extraction, then equivalence checked with math-verify.

``math_reward(completion, gold)`` is 1.0 iff the final answer of ``completion`` equals ``gold``:

1. **Extract** a candidate (:func:`extract_answer`), first match wins: the last ``\\boxed{...}``
   (or ``\\fbox``); the first ``#### ...`` line (GSM8K's format); the last "answer is ..." /
   "Answer: ..." phrase that contains a digit; the last number in the text. Text up to the
   last ``</think>`` is ignored when text follows it; only the last :data:`MAX_SCAN_CHARS`
   characters are searched (every step is linear in the length).
2. **Parse numbers ourselves** (:func:`parse_number`, no ``eval``): thousands separators
   (``1,234``, ``1{,}234``, ``1\\,234``), currency (``$``, ``\\$``, €, £, ¥, ₹, "dollars"),
   units and words around a single number (``18 km``, ``\\text{ apples}``), percent
   (``50%`` is 50, as GSM8K writes it), decimals (``10.00``), fractions (``3/4``,
   ``\\frac{3}{4}``, ``\\dfrac``), signs (``-``, ``−``), and "x = 5" (the part after the last
   ``=``). Both sides become SymPy numbers and :func:`math_verify.verify` compares them (so
   ``10.00`` equals ``10`` and ``0.5`` equals ``1/2``).
3. **Otherwise** (symbolic answers such as ``\\frac{\\sqrt{2}}{2}``), math-verify parses both
   sides as LaTeX (``LatexExtractionConfig`` only: its plain-expression parser calls SymPy's
   ``parse_expr``, which evaluates code) and verifies them, in a helper subprocess.

Thread and process safety: math-verify's own timeout uses ``signal.alarm``, which only works in
the main thread. Here the numeric path calls ``verify(..., timeout_seconds=None)`` on numbers
of bounded size (at most :data:`MAX_DIGITS` digits), which cannot hang; the symbolic path runs
in a helper subprocess (in its main thread, with math-verify's timeouts on, an address-space
limit, and our own wall-clock bound: on expiry the helper is killed and the reward is 0). So
:func:`math_reward` is safe in any thread, in multiprocessing workers (daemonic or not), and
never blocks for longer than ``timeout_s``.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import re
import select
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

__all__ = [
    "MAX_DIGITS",
    "extract_answer",
    "last_number",
    "math_reward",
    "math_reward_fn",
    "parse_number",
]

#: numbers with more digits than this are not compared (they would only slow SymPy down)
MAX_DIGITS = 200
#: candidates longer than this (characters) are not given to the LaTeX parser
MAX_LATEX_CHARS = 1000
#: only the last this many characters of a completion are searched for the answer
MAX_SCAN_CHARS = 50_000

_NUM = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+"
_NUMBER_RE = re.compile(rf"(?<![\w.])(?P<sign>[-−–]?)\s?(?P<num>{_NUM})(?:\s*/\s*(?P<den>{_NUM}))?")
_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{\s*([^{}]*)\}\s*\{\s*([^{}]*)\}")
_FRAC_SHORT_RE = re.compile(r"\\[dt]?frac(\d)(\d)")
_TEXT_RE = re.compile(r"\\(?:text|textbf|mathrm|mbox|textrm|operatorname)\s*\{[^{}]*\}")
_ANSWER_PHRASE_RE = re.compile(r"answer\s*(?:is|:|=)\s*:?\s*([^\n]*)", re.IGNORECASE)
_HASH_RE = re.compile(r"####\s*([^\n]*)")
_CURRENCY = ("\\$", "$", "€", "£", "¥", "₹", "USD", "EUR", "GBP", "Rs.")


_BRACE_TOKEN_RE = re.compile(r"\\(?:boxed|fbox)\s*\{|[{}]")


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (balanced braces), if any.

    One left-to-right pass with a brace stack (linear time even for thousands of unclosed
    ``\\boxed{``); "last" is the closed box that starts last.
    """
    best_start, best = -1, None
    stack: list[int] = []  # content start of a box, or -1 for a plain brace
    for m in _BRACE_TOKEN_RE.finditer(text):
        tok = m.group(0)
        if tok == "}":
            if stack:
                start = stack.pop()
                if start > best_start:
                    best_start, best = start, text[start : m.start()]
        elif tok == "{":
            stack.append(-1)
        else:
            stack.append(m.end())
    if best is None:  # "\boxed 5" (no braces)
        plain = re.findall(r"\\boxed[ \t]+([^\s$]+)", text)
        if plain:
            best = plain[-1]
    return best


def strip_thinking(text: str) -> str:
    """The text after the last ``</think>`` when there is any, else ``text``."""
    if "</think>" in text:
        after = text.rsplit("</think>", 1)[1]
        if after.strip():
            return after
    return text


def last_number(text: str) -> str | None:
    """The last number-like token of ``text`` (with sign, separators and ``/den``), or None."""
    matches = [m.group(0) for m in _NUMBER_RE.finditer(text)]
    return matches[-1] if matches else None


def extract_answer(completion: str) -> str | None:
    """The candidate final answer of ``completion`` (see the module docstring), or None."""
    text = strip_thinking(completion[-MAX_SCAN_CHARS:])
    text = text.replace("{,}", ",").replace("\\,", "")
    boxed = _last_boxed(text)
    if boxed is not None and boxed.strip():
        return boxed.strip()
    m = _HASH_RE.search(text)
    if m and m.group(1).strip():
        return m.group(1).strip()
    phrase = None
    for pm in _ANSWER_PHRASE_RE.finditer(text):
        if any(c.isdigit() for c in pm.group(1)):
            phrase = _phrase_answer(pm.group(1))
    if phrase:
        return phrase.strip()
    return last_number(text)


def _frac(m: re.Match[str]) -> str:
    a, b = m.group(1).strip(), m.group(2).strip()
    if re.fullmatch(_NUM, a) and re.fullmatch(_NUM, b):
        return f"{a}/{b}"
    return f"({a})/({b})"


def _phrase_answer(phrase: str) -> str | None:
    """What follows "the answer is": a leading ``$...$`` span, else its first number."""
    p = phrase.strip()
    m = re.match(r"\$([^$]+)\$", p) or re.match(r"\\\((.+?)\\\)", p)
    if m:
        return m.group(1)
    m = _NUMBER_RE.search(_clean(p))
    return m.group(0) if m else None


def _clean(s: str) -> str:
    s = s.strip()
    s = _TEXT_RE.sub(" ", s)
    for old, new in (
        ("\\left", ""), ("\\right", ""), ("{,}", ""), ("\\,", ""), ("\\!", ""), ("\\ ", " "),
        ("\\%", "%"), ("\\cdot", "*"), ("\\times", "*"), ("−", "-"), ("–", "-"), ("\u00a0", " "),
        ("\\displaystyle", ""),
    ):
        s = s.replace(old, new)
    for cur in _CURRENCY:
        s = s.replace(cur, " ")
    s = _FRAC_RE.sub(_frac, s)
    s = _FRAC_SHORT_RE.sub(_frac, s)
    return s.strip().strip("$").strip()


def _to_fraction_parts(num: str) -> tuple[str, bool]:
    """Normalise ``1,234.50`` to ``1234.50``; returns (digits, is_decimal)."""
    clean = num.replace(",", "")
    return clean, "." in clean


def _sympy_number(num: str, den: str | None, negative: bool) -> Any:
    # deferred: sympy is heavy; gbmpo.rewards imports without it
    import sympy

    n, n_dec = _to_fraction_parts(num)
    if len(n.replace(".", "")) > MAX_DIGITS:
        return None
    # Float/Integer parse digit strings directly (sympy.Number(str) would go through sympify,
    # i.e. parse_expr and eval, even though the string is already known to be digits).
    value = sympy.Float(n) if n_dec else sympy.Integer(n)
    if den is not None:
        d, _ = _to_fraction_parts(den)
        if len(d.replace(".", "")) > MAX_DIGITS:
            return None
        dv = sympy.Float(d) if "." in d else sympy.Integer(d)
        if dv == 0:
            return None
        value = value / dv
    return -value if negative else value


_SINGLE_RE = re.compile(
    rf"^\(?(?P<sign>[-+]?)\s*\(?(?P<num>{_NUM})\)?(?:\s*/\s*\(?(?P<den>{_NUM})\)?)?\)?\s*(?P<pct>%?)$"
)


def parse_number(candidate: str) -> Any:
    """Parse a candidate answer into a SymPy number, or None if it is not a plain number.

    Accepts one number with optional sign, thousands separators, decimal part, fraction bar or
    ``\\frac``, percent sign, currency and unit words around it, or ``lhs = number``. Never
    evaluates code.
    """
    s = _clean(candidate)
    if "=" in s:
        s = s.rsplit("=", 1)[1].strip()
    s = s.rstrip(".").strip()
    m = _SINGLE_RE.match(s.replace(" ", "")) if re.fullmatch(r"[\d\s.,/()%+-]+", s) else None
    if m is None:
        # Words or units around exactly one number: "18 dollars", "5 km/h" -> take the number.
        nums = list(_NUMBER_RE.finditer(s))
        letters = re.sub(r"[\d\s.,/()%+\-*^]", "", s)
        if len(nums) != 1 or not letters or "\\" in s or "^" in s:
            return None
        m = nums[0]
        sign = m.group("sign")
        return _sympy_number(m.group("num"), m.group("den"), sign in ("-", "−", "–"))
    # GSM8K-style percent: "50%" is the number 50.
    return _sympy_number(m.group("num"), m.group("den"), m.group("sign") == "-")


class _DropTimeoutWarning(logging.Filter):
    """math-verify warns once that its timeout is off; here that is by design (see module)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


_mv_lock = threading.Lock()
_mv_verify: Any = None


def _verify_numbers(gold: Any, pred: Any) -> bool:
    global _mv_verify
    if _mv_verify is None:
        with _mv_lock:
            if _mv_verify is None:
                # deferred: math_verify is heavy; loaded only in the verification helper process
                from math_verify import verify

                for name in ("math_verify.grader", "math_verify.parser"):
                    logging.getLogger(name).addFilter(_DropTimeoutWarning())
                _mv_verify = verify
    # Bounded: both sides are numbers of at most MAX_DIGITS digits, so no timeout is needed
    # (and signal-based timeouts would fail outside the main thread).
    return bool(_mv_verify([gold], [pred], timeout_seconds=None))


# ---------------------------------------------------------------------------------------------
# symbolic path: math-verify's LaTeX parser in a helper subprocess with a hard deadline

#: extra wait for the helper's first answer (it imports math-verify and SymPy first)
_IMPORT_GRACE_S = 15.0

_HELPER_SRC = r"""
import json, sys
from math_verify import LatexExtractionConfig, parse, verify
cfg = [LatexExtractionConfig()]
out = sys.stdout
for line in sys.stdin:
    req = json.loads(line)
    t = int(req["t"])
    try:
        g = parse(req["gold"], extraction_config=cfg, parsing_timeout=t)
        p = parse(req["pred"], extraction_config=cfg, parsing_timeout=t)
        ok = bool(g) and bool(p) and bool(verify(g, p, timeout_seconds=t))
    except BaseException:
        ok = False
    out.write(json.dumps({"ok": ok}) + "\n")
    out.flush()
"""


class _Helper:
    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None
        self.pid_owner = os.getpid()
        self.lock = threading.Lock()
        self.warm = False  # has the running helper finished importing math-verify?

    def _start(self) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-c", _HELPER_SRC],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True, bufsize=1, close_fds=True,
        )
        try:
            # deferred: resource is POSIX-only (elsewhere the helper runs without the memory cap)
            import resource

            limit = 4 << 30
            resource.prlimit(proc.pid, resource.RLIMIT_AS, (limit, limit))
        except (ImportError, OSError, ValueError):
            pass
        return proc

    def _kill(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=5)
            for f in (self.proc.stdin, self.proc.stdout):
                if f is not None:
                    with contextlib.suppress(OSError):
                        f.close()
            self.proc = None

    def verify(self, gold: str, pred: str, timeout_s: float) -> bool:
        with self.lock:
            if self.pid_owner != os.getpid():  # forked: the helper belongs to the parent
                self.proc, self.pid_owner = None, os.getpid()
            if self.proc is None or self.proc.poll() is not None:
                self.proc, self.warm = self._start(), False
            proc = self.proc
            assert proc.stdin is not None and proc.stdout is not None
            # The first call also pays for importing math-verify in the helper.
            deadline = time.monotonic() + timeout_s + (0.0 if self.warm else _IMPORT_GRACE_S)
            try:
                proc.stdin.write(json.dumps({"gold": gold, "pred": pred,
                                             "t": max(1, int(timeout_s))}) + "\n")
                proc.stdin.flush()
                while True:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise TimeoutError
                    ready, _, _ = select.select([proc.stdout], [], [], remaining)
                    if ready:
                        line = proc.stdout.readline()
                        if not line:
                            raise OSError("helper exited")
                        self.warm = True
                        return bool(json.loads(line)["ok"])
            except (OSError, TimeoutError, ValueError):
                self._kill()
                return False


    def close(self) -> None:
        with self.lock:
            if self.pid_owner == os.getpid():
                self._kill()


_helper = _Helper()
atexit.register(_helper.close)


def _latex(s: str) -> str:
    s = s.strip().strip("$").strip()
    return f"${s}$"


def math_reward(completion: str, gold: str | int | float, *, timeout_s: float = 5.0) -> float:
    """1.0 if the final answer of ``completion`` equals ``gold``, else 0.0 (see module doc).

    ``gold`` is trusted (a dataset answer such as ``"72"``, ``"1,234"`` or ``"\\frac{1}{2}"``);
    ``completion`` is untrusted model output and is never evaluated as code.
    """
    if not isinstance(completion, str):
        raise TypeError(f"completion must be a str, got {type(completion).__name__}")
    gold_s = str(gold).strip()
    if not gold_s:
        raise ValueError("gold answer is empty")
    candidate = extract_answer(completion)
    if candidate is None:
        return 0.0
    gold_num = parse_number(gold_s)
    pred_num = parse_number(candidate)
    if gold_num is not None and pred_num is not None:
        return 1.0 if _verify_numbers(gold_num, pred_num) else 0.0
    if gold_num is not None and not re.search(r"\\|\^|\{|[a-zA-Z]{2}|pi|sqrt", _clean(candidate)):
        # A numeric gold and a candidate with no math notation that is not a plain number
        # (e.g. "3, 4" or "about 7 or 8"): nothing for the LaTeX parser to do.
        return 0.0
    if len(candidate) > MAX_LATEX_CHARS:
        return 0.0
    return 1.0 if _helper.verify(_latex(gold_s), _latex(candidate), timeout_s) else 0.0


def _completion_text(completion: Any) -> str:
    """TRL passes plain strings or conversations (lists of ``{"role", "content"}``)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Sequence) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    if isinstance(completion, dict):
        return str(completion.get("content", ""))
    raise TypeError(f"cannot read a completion of type {type(completion).__name__}")


def math_reward_fn(
    prompts: Sequence[Any], completions: Sequence[Any], answer: Sequence[Any], **_: Any
) -> list[float | None]:
    """TRL-style reward: :func:`math_reward` of each completion against column ``answer``."""
    if len(completions) != len(answer):
        raise ValueError(f"{len(completions)} completions but {len(answer)} answers")
    return [math_reward(_completion_text(c), a) for c, a in zip(completions, answer, strict=True)]
