"""Load a causal LM and its tokenizer: the embedded tiny Qwen3, a local checkpoint or a hub id.

The embedded default (``None`` or ``"tiny"``) is a 1.86M-parameter ``Qwen3ForCausalLM`` (h192, L4,
4 heads / 2 kv, tied embeddings) with a 447-token digit-split byte-level BPE tokenizer,
warm-started by SFT on the built-in ``arithmetic`` task. It ships inside the package
(``src/gbmpo/assets/tiny-qwen3/``) and is rebuilt by ``scripts/build_tiny_model.py`` (its
``build_info.json`` records how).
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path
from typing import Any

import torch

__all__ = ["TINY_MODEL_NAMES", "TINY_MODEL_PATH", "load_model_and_tokenizer", "resolve_model_path"]

#: directory of the embedded tiny model (inside the installed package)
TINY_MODEL_PATH: Path = Path(str(resources.files("gbmpo"))) / "assets" / "tiny-qwen3"
#: names that select the embedded model
TINY_MODEL_NAMES: tuple[str, ...] = ("tiny",)

# "name" or "namespace/name" (letters, digits, "-", "_", "."; no leading "." or "-", no "..")
_HUB_ID = re.compile(r"(?!.*\.\.)[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def _looks_like_hub_id(name: str) -> bool:
    return _HUB_ID.fullmatch(name) is not None


def resolve_model_path(path_or_id: str | Path | None) -> str:
    """The local directory or hub id that ``from_pretrained`` should receive.

    ``None``/``"tiny"`` -> the embedded model. An existing directory must hold ``config.json``.
    A name that does not exist locally and does not look like a hub id (``namespace/name``)
    raises :class:`FileNotFoundError` naming it.
    """
    if path_or_id is None or (isinstance(path_or_id, str) and path_or_id in TINY_MODEL_NAMES):
        if not (TINY_MODEL_PATH / "config.json").is_file():
            raise FileNotFoundError(
                f"the embedded tiny model is missing from {TINY_MODEL_PATH}; build it with "
                "`python scripts/build_tiny_model.py`"
            )
        return str(TINY_MODEL_PATH)
    text = str(path_or_id)
    if not text.strip():
        raise FileNotFoundError("model path is empty")
    local = Path(text).expanduser()
    if local.exists():
        if not local.is_dir():
            raise FileNotFoundError(f"model path {text!r} is a file, not a model directory")
        if not (local / "config.json").is_file():
            raise FileNotFoundError(
                f"model directory {text!r} has no config.json (not a saved transformers model)"
            )
        return str(local)
    if isinstance(path_or_id, Path) or not _looks_like_hub_id(text):
        raise FileNotFoundError(
            f"model path {text!r} does not exist (and is not a Hugging Face Hub id)"
        )
    return text


def load_model_and_tokenizer(
    path_or_id: str | Path | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` for RL: tokenizer left-padded with a pad token.

    ``path_or_id``: ``None`` or ``"tiny"`` for the embedded tiny Qwen3, a local directory saved
    with ``save_pretrained``, or a Hugging Face Hub id (needs network access). The pad token
    falls back to EOS when the tokenizer has none; a tokenizer with neither raises
    ``ValueError``. The model is returned in eval mode on ``device`` with ``dtype`` weights.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = resolve_model_path(path_or_id)
    is_local = Path(source).is_dir()
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=dtype, trust_remote_code=trust_remote_code
        )
    except OSError as err:
        if is_local:
            raise
        raise FileNotFoundError(
            f"model {source!r} is not a local directory and could not be loaded from the "
            f"Hugging Face Hub ({type(err).__name__}: {err})"
        ) from err
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"tokenizer of {source!r} has neither a pad nor an EOS token")
        tokenizer.pad_token = tokenizer.eos_token
    for cfg in (model.config, getattr(model, "generation_config", None)):
        if cfg is not None and getattr(cfg, "pad_token_id", None) is None:
            cfg.pad_token_id = tokenizer.pad_token_id
    model.to(device)
    model.eval()
    return model, tokenizer
