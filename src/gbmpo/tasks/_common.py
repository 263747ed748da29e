"""Shared helpers of the real-data tasks: locating data files and rendering prompts.

Data files (``relpath`` such as ``gsm8k/test.jsonl``) are looked up, in order:

1. the explicit ``path`` given to a task (it must exist);
2. ``$GBMPO_DATA_DIR/<relpath>`` (or ``<relpath>.gz``);
3. the package data ``gbmpo/data/<relpath>.gz`` (GSM8K and MBPP, packed at install time by
   ``scripts/pack_data.py``, with their licences beside them);
4. the Hugging Face hub through :func:`datasets.load_dataset`, unless turned off (``hub=False``
   or ``GBMPO_ALLOW_HUB=0``). The hub is asked once first (at most
   :data:`gbmpo.models.HUB_PROBE_TIMEOUT` seconds, ``HF_HUB_OFFLINE=1`` short-cuts it): with no
   answer the task fails within seconds with a message that names every place looked in.

No code path reads the project's development data folder at run time.

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
from importlib import resources
from pathlib import Path
from typing import Any

DATA_DIR_ENV = "GBMPO_DATA_DIR"
HUB_ENV = "GBMPO_ALLOW_HUB"
TEMPLATES = ("auto", "base", "chat")
_FALSE = ("0", "false", "no", "off")


def package_data_dir() -> Path:
    """The package's own data directory (``gbmpo/data``)."""
    return Path(str(resources.files("gbmpo") / "data"))


def data_dirs() -> list[Path]:
    """Directories searched for data files: ``$GBMPO_DATA_DIR``, then the package data."""
    dirs: list[Path] = []
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        dirs.append(Path(env))
    dirs.append(package_data_dir())
    return dirs


def hub_allowed(hub: bool | None) -> bool:
    """``hub`` if given, else ``$GBMPO_ALLOW_HUB`` (default on; ``0``/``false`` turns it off)."""
    if hub is not None:
        return bool(hub)
    return os.environ.get(HUB_ENV, "1").strip().lower() not in _FALSE


def find_data_file(relpath: str, path: str | os.PathLike[str] | None = None) -> Path | None:
    """The explicit ``path`` (which must exist) or the first ``<data dir>/<relpath>[.gz]``."""
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"data file {str(p)!r} does not exist")
        return p
    for d in data_dirs():
        for cand in (d / relpath, d / (relpath + ".gz")):
            if cand.is_file():
                return cand
    return None


class DataUnavailable(FileNotFoundError):
    """A task's data set is found nowhere here (no data file, no package data, no hub): the
    message names every place looked in. A dry run of a config meant for another machine
    reports it as a warning, like a model it cannot find."""


def missing_data_error(relpath: str, hub_id: str | None, hub_reason: str | None = None
                       ) -> DataUnavailable:
    """The error for a data file found nowhere; ``hub_reason`` says why the hub was not used."""
    tried = ", ".join(str(d / relpath) + "[.gz]" for d in data_dirs())
    if hub_id is None:
        hub = ""
    elif hub_reason is None:
        hub = (f"; the Hugging Face hub ({hub_id!r}) is turned off (hub=False or {HUB_ENV}=0)")
    else:
        hub = f"; the Hugging Face hub ({hub_id!r}) cannot be used: {hub_reason}"
    return DataUnavailable(
        f"data file {relpath!r} not found (looked in: {tried}){hub}. Pass path=... "
        f"(--task.params.path), set {DATA_DIR_ENV} to a directory holding {relpath}, or reinstall "
        "gbmpo from a checkout with the data beside it (scripts/pack_data.py)"
    )


def hub_unreachable_reason(hub_id: str) -> str | None:
    """``None`` if the hub answers for data set ``hub_id`` within the probe time; else why not.

    One request, bounded by :data:`gbmpo.models.HUB_PROBE_TIMEOUT`; a 4xx answer (no such data
    set, gated) is reported as a reason too.
    """
    # deferred: huggingface_hub and gbmpo.models (torch) are heavy; gbmpo.tasks imports without them
    from huggingface_hub import HfApi, constants

    from gbmpo.models import HUB_PROBE_TIMEOUT, bounded_hub_call

    if constants.HF_HUB_OFFLINE:
        return "offline mode is on: HF_HUB_OFFLINE=1"
    outcome = bounded_hub_call(
        lambda: HfApi().dataset_info(hub_id, timeout=HUB_PROBE_TIMEOUT)
    )
    if not outcome:
        return f"no answer from {constants.ENDPOINT} within {HUB_PROBE_TIMEOUT:g} s"
    err = outcome[0]
    if err is None:
        return None
    first = str(err).splitlines()[0] if str(err) else ""
    return f"{type(err).__name__}: {first}"


def load_rows(relpath: str, path: str | os.PathLike[str] | None, hub: bool,
              hub_id: str, hub_config: str | None, hub_splits: list[str]) -> list[dict[str, Any]]:
    """Rows of a task's data file found by :func:`find_data_file`, else of the hub splits
    ``hub_splits`` of ``hub_id`` (concatenated), else :func:`missing_data_error`."""
    found = find_data_file(relpath, path)
    if found is not None:
        return load_json_or_jsonl(found)
    if not hub:
        raise missing_data_error(relpath, hub_id)
    reason = hub_unreachable_reason(hub_id)
    if reason is not None:
        raise missing_data_error(relpath, hub_id, reason)
    rows: list[dict[str, Any]] = []
    for split in hub_splits:
        rows += load_hub(hub_id, hub_config, split)
    return rows


def load_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON Lines file; a ``.gz`` file is read through gzip."""
    opener: Any = gzip.open if Path(path).suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_json_or_jsonl(path: Path) -> list[dict[str, Any]]:
    """A JSON array file or a JSON Lines file (decided by the first non-space character; a
    ``.gz`` file is read through gzip)."""
    opener: Any = gzip.open if Path(path).suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        text = f.read()
    if text.lstrip().startswith("["):
        data = json.loads(text)
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON array of records")
        return data
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def load_hub(hub_id: str, config: str | None, split: str) -> list[dict[str, Any]]:
    """Rows of a Hugging Face dataset split (needs ``datasets`` and network access)."""
    try:
        # deferred: datasets is optional (the trl extra)
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
