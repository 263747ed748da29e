"""Shared helpers of the real-data tasks: locating data files and rendering prompts.

Data files are looked up, in order, in the explicit ``path`` given to a task, under
``$GBMPO_DATA_DIR``, and under ``<repo>/../shared/data`` (the offline copies of this project).
Only when a task is built with ``hub=True`` (or ``GBMPO_ALLOW_HUB=1``) does a missing file fall
back to the Hugging Face hub through :func:`datasets.load_dataset`.

Prompt templates (``template=``):

* ``"base"``: plain text for a pretrained model to continue;
* ``"chat"``: the tokenizer's chat template applied to ``[system, user]`` messages, with
  ``add_generation_prompt=True`` and ``enable_thinking=False`` (Qwen3's switch; other templates
  ignore it);
* ``"auto"``: ``"chat"`` when a tokenizer with a chat template is given, else ``"base"``.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import Any

DATA_DIR_ENV = "GBMPO_DATA_DIR"
HUB_ENV = "GBMPO_ALLOW_HUB"
TEMPLATES = ("auto", "base", "chat")


def data_dirs() -> list[Path]:
    """Directories searched for data files: ``$GBMPO_DATA_DIR``, then ``<repo>/../shared/data``."""
    dirs: list[Path] = []
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        dirs.append(Path(env))
    repo = Path(__file__).resolve().parents[3]  # src/gbmpo/tasks/_common.py -> repo root
    dirs.append(repo.parent / "shared" / "data")
    return dirs


def hub_allowed(hub: bool | None) -> bool:
    if hub is not None:
        return bool(hub)
    return os.environ.get(HUB_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def find_data_file(relpath: str, path: str | os.PathLike[str] | None = None) -> Path | None:
    """The explicit ``path`` (which must exist) or the first ``<data dir>/<relpath>`` found."""
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"data file {str(p)!r} does not exist")
        return p
    for d in data_dirs():
        cand = d / relpath
        if cand.is_file():
            return cand
    return None


def missing_data_error(relpath: str, hub_id: str | None) -> FileNotFoundError:
    tried = ", ".join(str(d / relpath) for d in data_dirs())
    hub = (f", or pass hub=True (or set {HUB_ENV}=1) to download {hub_id!r} from the "
           "Hugging Face hub") if hub_id else ""
    return FileNotFoundError(
        f"data file {relpath!r} not found (looked in: {tried}); pass path=..., set "
        f"{DATA_DIR_ENV} to a directory holding {relpath}{hub}"
    )


def load_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON Lines file; a ``.gz`` file is read through gzip."""
    opener: Any = gzip.open if Path(path).suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_json_or_jsonl(path: Path) -> list[dict[str, Any]]:
    """A JSON array file or a JSON Lines file (decided by the first non-space character)."""
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        data = json.loads(text)
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON array of records")
        return data
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def load_hub(hub_id: str, config: str | None, split: str) -> list[dict[str, Any]]:
    """Rows of a Hugging Face dataset split (needs ``datasets`` and network access)."""
    try:
        import datasets
    except ImportError as exc:  # pragma: no cover - datasets is a declared extra
        raise ImportError("loading from the hub needs `pip install datasets`") from exc
    ds = datasets.load_dataset(hub_id, config, split=split)
    return [dict(row) for row in ds]


def resolve_template(template: str, tokenizer: Any) -> str:
    if template not in TEMPLATES:
        raise ValueError(f"unknown prompt template {template!r}; valid: {', '.join(TEMPLATES)}")
    if template == "auto":
        has_chat = tokenizer is not None and getattr(tokenizer, "chat_template", None)
        return "chat" if has_chat else "base"
    if template == "chat" and (tokenizer is None or not getattr(tokenizer, "chat_template", None)):
        raise ValueError("template='chat' needs tokenizer=... with a chat template")
    return template


def render_chat(tokenizer: Any, system: str | None, user: str) -> str:
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user}
    ]
    return str(tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    ))


class TemplatedPrompts:
    """Prompt templating shared by the real-data tasks (mixed into their :class:`Task`).

    :meth:`_init_prompts` sets ``template`` (resolved by :func:`resolve_template`),
    ``tokenizer`` and ``system_prompt`` (the task's default when ``None``); :meth:`_render`
    gives the chat-templated user message or the task's base-template text.
    """

    template: str
    tokenizer: Any
    system_prompt: str

    def _init_prompts(
        self, template: str, tokenizer: Any, system_prompt: str | None, default_system: str
    ) -> None:
        self.template = resolve_template(template, tokenizer)
        self.tokenizer = tokenizer
        self.system_prompt = default_system if system_prompt is None else system_prompt

    def _render(self, user: str, base: str) -> str:
        """``user`` through the chat template when ``template == "chat"``, else ``base``."""
        if self.template == "chat":
            return render_chat(self.tokenizer, self.system_prompt, user)
        return base


def split_error(task: str, name: str, valid: list[str]) -> ValueError:
    return ValueError(f"task {task!r} has no split {name!r}; valid splits: {', '.join(valid)}")
