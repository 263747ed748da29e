"""MBPP (Austin et al., 2021): short Python problems graded by three ``assert`` tests each.

Two registered tasks:

* ``mbpp``: the full set, ``mbpp/mbpp.jsonl`` (974 problems; hub ``google-research-datasets/
  mbpp``, config ``full``);
* ``mbpp_sanitized``: the hand-verified subset, ``mbpp/sanitized-mbpp.json`` (427 problems;
  config ``sanitized``).

Splits follow the official split by ``task_id`` (MBPP README): ``prompt`` 1-10, ``test``
11-510, ``validation`` 511-600, ``train`` 601-974 (sanitized: 7 / 257 / 43 / 120).

Each example: ``prompt``, ``answer`` (the reference solution), ``tests`` (the asserts; plus
``challenge_test_list`` with ``challenge_tests=True``), ``setup`` (``test_setup_code``, or the
sanitized ``test_imports``), ``entry_point`` (the function the tests call), ``task_id``.

Prompt (GBMPO's MBPP prompt, docs/methods.md, section "Paper settings"): the problem text, then
``"Your code should pass these tests:"``, then the asserts (:data:`USER_TEMPLATE`).

* base: that text followed by an opening ````` ```python ````` fence, so a pretrained model
  continues with code (a closing fence ends the program);
* chat: system prompt :data:`CHAT_SYSTEM`, user message = that text; the program is taken from
  the reply's ```` ```python ```` block.

Reward (``reward=``): ``"pass_fraction"`` (default; tests passed / tests), ``"all_pass"`` or
``"shaped"`` (the GBMPO authors' shaped training reward, docs/methods.md, section "Shaped MBPP
reward": pass fraction plus outcome and format penalties, a brevity bonus and the group terms;
``banned_tokens=`` overrides its banned-token list; see :mod:`gbmpo.rewards.code_shaping`), from the
hardened sandbox (:mod:`gbmpo.sandbox`, ``timeout_s`` 5 s as in the GBMPO evaluator). The shaped
group terms take a group to be a run of consecutive equal prompts, which is how the trainer calls
the reward (each prompt repeated ``G`` times). A problem counts as solved (pass@k) only when every
test passes; :meth:`MBPPTask.grade` reports the shaped reward without the group terms.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from gbmpo.rewards.code import extract_code, grade_code
from gbmpo.rewards.code_shaping import shaped_code_rewards, validate_banned_tokens
from gbmpo.sandbox import RunResult
from gbmpo.tasks import _common as common
from gbmpo.tasks.base import TASKS, Example, Task

__all__ = [
    "CHAT_SYSTEM",
    "SPLIT_RANGES",
    "USER_TEMPLATE",
    "MBPPSanitizedTask",
    "MBPPTask",
    "entry_point_of",
    "split_of",
]

HUB_ID = "google-research-datasets/mbpp"
#: official split by task id (inclusive ranges)
SPLIT_RANGES: dict[str, tuple[int, int]] = {
    "prompt": (1, 10),
    "test": (11, 510),
    "validation": (511, 600),
    "train": (601, 974),
}
USER_TEMPLATE = "{text}\nYour code should pass these tests:\n\n{tests}\n"
CHAT_SYSTEM = (
    "You are an expert Python programmer. Answer with the complete solution in a single "
    "```python code block, without example usage or explanations."
)
REWARD_KINDS = ("pass_fraction", "all_pass", "shaped")


def split_of(task_id: int) -> str:
    """The official split of an MBPP ``task_id``."""
    for name, (lo, hi) in SPLIT_RANGES.items():
        if lo <= task_id <= hi:
            return name
    raise ValueError(f"MBPP task_id {task_id} is outside 1-974")


def entry_point_of(code: str, tests: Sequence[str]) -> str | None:
    """The function under test: a top-level ``def`` of ``code`` that the tests call."""
    defined = re.findall(r"^def\s+(\w+)\s*\(", code, re.MULTILINE)
    joined = "\n".join(tests)
    for name in defined:
        if re.search(rf"\b{re.escape(name)}\s*\(", joined):
            return name
    m = re.search(r"\b([A-Za-z_]\w*)\s*\(", tests[0]) if tests else None
    return m.group(1) if m else None


class MBPPTask(common.TemplatedPrompts, Task):
    """MBPP (full set) with sandboxed test execution. See the module docstring."""

    name = "mbpp"
    kind = "code"
    train_split = "train"
    eval_split = "test"
    _relpath = "mbpp/mbpp.jsonl"
    _hub_config = "full"

    def __init__(
        self,
        *,
        path: str | None = None,
        template: str = "base",
        tokenizer: Any = None,
        system_prompt: str | None = None,
        reward: str = "pass_fraction",
        banned_tokens: Sequence[str] | None = None,
        challenge_tests: bool = False,
        timeout_s: float = 5.0,
        memory_mb: int = 1024,
        hub: bool | None = None,
    ) -> None:
        if reward not in REWARD_KINDS:
            raise ValueError(f"unknown MBPP reward {reward!r}; valid: {', '.join(REWARD_KINDS)}")
        if banned_tokens is not None and reward != "shaped":
            raise ValueError("banned_tokens only applies to reward='shaped'")
        self.path = path
        self._init_prompts(template, tokenizer, system_prompt, CHAT_SYSTEM)
        self.reward_kind = reward
        self.banned_tokens = validate_banned_tokens(banned_tokens)
        self.challenge_tests = challenge_tests
        self.timeout_s = float(timeout_s)
        self.memory_mb = int(memory_mb)
        self.hub = common.hub_allowed(hub)
        self._by_split: dict[str, list[Example]] | None = None

    # -- data ---------------------------------------------------------------------------------
    def _records(self) -> list[dict[str, Any]]:
        return common.load_rows(self._relpath, self.path, self.hub, HUB_ID, self._hub_config,
                                list(SPLIT_RANGES))

    def _text(self, rec: dict[str, Any]) -> str:
        return str(rec["text"])

    def _setup(self, rec: dict[str, Any]) -> str:
        return str(rec.get("test_setup_code") or "")

    def _tests(self, rec: dict[str, Any]) -> list[str]:
        tests = list(rec["test_list"])
        if self.challenge_tests:
            tests += list(rec.get("challenge_test_list") or [])
        return tests

    def prompt(self, text: str, tests: Sequence[str]) -> str:
        user = USER_TEMPLATE.format(text=text.strip(), tests="\n".join(tests))
        return self._render(user, user + "```python\n")

    def _load(self) -> dict[str, list[Example]]:
        if self._by_split is None:
            by: dict[str, list[Example]] = {name: [] for name in SPLIT_RANGES}
            for rec in sorted(self._records(), key=lambda r: int(r["task_id"])):
                code = str(rec["code"]).replace("\r\n", "\n")
                shown = list(rec["test_list"])
                by[split_of(int(rec["task_id"]))].append({
                    "prompt": self.prompt(self._text(rec), shown),
                    "answer": code,
                    "tests": self._tests(rec),
                    "setup": self._setup(rec),
                    "entry_point": entry_point_of(code, shown),
                    "task_id": int(rec["task_id"]),
                })
            self._by_split = by
        return self._by_split

    def split(self, name: str) -> list[Example]:
        if name not in SPLIT_RANGES:
            raise common.split_error(self.name, name, list(SPLIT_RANGES))
        return [dict(ex) for ex in self._load()[name]]

    # -- reward -------------------------------------------------------------------------------
    def _prepare(self, completions: Sequence[str]) -> list[str]:
        """Base prompts end with an opening fence: restore it so the reply is one block."""
        if self.template == "base":
            return ["```python\n" + c for c in completions]
        return list(completions)

    #: tests graded so far whose verdict needed the program's own objects (never passed; the
    #: trainer logs it as ``code_unjudged_tests_total``)
    unjudged_tests = 0

    def run(self, completions: Sequence[str], columns: dict[str, Any]) -> list[RunResult]:
        """Run every completion's program against its tests in the sandbox."""
        if "tests" not in columns:
            raise ValueError(f"{self.name} reward needs the 'tests' column")
        results = grade_code(
            self._prepare(completions), columns["tests"], columns.get("setup"), None,
            columns.get("entry_point"), timeout_s=self.timeout_s, memory_mb=self.memory_mb,
        )
        self.unjudged_tests += sum(r.unjudged for r in results)
        return results

    def reward(
        self, prompts: Sequence[str], completions: Sequence[str], **columns: Any
    ) -> list[float | None]:
        results = self.run(completions, columns)
        return list(self.reward_values(
            results, self._prepare(completions), columns.get("entry_point"), prompts=prompts
        ))

    def grade(
        self, completions: Sequence[str], examples: Sequence[Example]
    ) -> list[dict[str, Any]]:
        """Per-completion record for evaluation (correct = every test passed)."""
        cols = self.columns(examples)
        results = self.run(completions, cols)
        rewards = self.reward_values(results, self._prepare(completions), cols.get("entry_point"))
        return [
            {
                "reward": rw, "correct": r.all_passed, "status": r.status, "passed": r.passed,
                "total": r.total, "unjudged": r.unjudged, "detail": r.detail,
                "program": extract_code(c, ex.get("entry_point")),
            }
            for c, ex, r, rw in zip(self._prepare(completions), examples, results, rewards,
                                    strict=True)
        ]

    def reward_values(
        self,
        results: Sequence[RunResult],
        completions: Sequence[str] | None = None,
        entry_points: Sequence[str | None] | None = None,
        *,
        prompts: Sequence[Any] | None = None,
    ) -> list[float]:
        """Rewards of sandbox results under this task's ``reward`` kind.

        ``"shaped"`` also needs the (prepared) ``completions`` and their ``entry_points``; its
        group terms act on runs of consecutive equal ``prompts`` (none without ``prompts``).
        """
        if self.reward_kind == "all_pass":
            return [1.0 if r.all_passed else 0.0 for r in results]
        if self.reward_kind == "shaped":
            if completions is None:
                raise ValueError("the shaped MBPP reward needs the completions")
            entries = [None] * len(completions) if entry_points is None else entry_points
            programs = [extract_code(c, e) for c, e in zip(completions, entries, strict=True)]
            return shaped_code_rewards(results, completions, programs, prompts=prompts,
                                       banned_tokens=self.banned_tokens)
        return [r.pass_fraction for r in results]


@TASKS.register("mbpp_sanitized")
class MBPPSanitizedTask(MBPPTask):
    """MBPP sanitized (427 hand-verified problems); same splits, prompt and reward."""

    name = "mbpp_sanitized"
    _relpath = "mbpp/sanitized-mbpp.json"
    _hub_config = "sanitized"

    def _text(self, rec: dict[str, Any]) -> str:
        return str(rec["prompt"])

    def _setup(self, rec: dict[str, Any]) -> str:
        return "\n".join(rec.get("test_imports") or [])


TASKS.register("mbpp", MBPPTask)
