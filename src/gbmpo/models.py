"""Load a causal LM and its tokenizer: the embedded tiny Qwen3, a local checkpoint or a hub id.

The embedded default (``None`` or ``"tiny"``) is a 1.86M-parameter ``Qwen3ForCausalLM`` (h192, L4,
4 heads / 2 kv, tied embeddings) with a 447-token digit-split byte-level BPE tokenizer,
warm-started by SFT on the built-in ``arithmetic`` task. It ships inside the package
(``src/gbmpo/assets/tiny-qwen3/``) and is rebuilt by ``scripts/build_tiny_model.py`` (its
``build_info.json`` records how).

A directory holding a peft adapter (``adapter_config.json``, what a LoRA run exports as
``RUN/model``) loads as its base model with the adapter merged in, so ``gbmpo eval --model
RUN/model`` works the same for LoRA and full fine-tuning runs.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "ADAPTER_CONFIG",
    "HUB_PROBE_TIMEOUT",
    "TINY_MODEL_NAMES",
    "TINY_MODEL_PATH",
    "adapter_base",
    "load_model_and_tokenizer",
    "resolve_model_path",
]

#: directory of the embedded tiny model (inside the installed package)
TINY_MODEL_PATH: Path = Path(str(resources.files("gbmpo"))) / "assets" / "tiny-qwen3"
#: names that select the embedded model
TINY_MODEL_NAMES: tuple[str, ...] = ("tiny",)
#: seconds to wait for the Hugging Face Hub to answer before calling it unreachable
HUB_PROBE_TIMEOUT: float = 3.0
#: the file that marks a peft adapter directory (``save_pretrained`` of a ``PeftModel``)
ADAPTER_CONFIG: str = "adapter_config.json"
#: adapters on adapters (a LoRA run started from another LoRA run's model) nest at most this deep
_MAX_ADAPTER_DEPTH = 8

# "name" or "namespace/name": ASCII letters, digits, "-", "_", "."; each part 1-96 characters,
# starting and ending with a letter, digit or "_" (the Hub's rules; see validate_repo_id)
_HUB_NAME = r"[A-Za-z0-9_](?:[\w.-]{0,94}[A-Za-z0-9_])?"
_HUB_ID = re.compile(rf"(?:{_HUB_NAME}/)?{_HUB_NAME}", re.ASCII)
_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def looks_like_hub_id(name: str) -> bool:
    """Whether ``name`` is a valid Hugging Face Hub model id (``name`` or ``namespace/name``)."""
    if _HUB_ID.fullmatch(name) is None or "--" in name or ".." in name:
        return False
    return not name.endswith(".git")


_looks_like_hub_id = looks_like_hub_id  # the former private name

def _offline() -> bool:
    # deferred: huggingface_hub is heavy; `gbmpo --help` imports this module without it
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _hub_cache_dir() -> str:
    # deferred: huggingface_hub is heavy; `gbmpo --help` imports this module without it
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def _missing_model_files(directory: Path) -> list[str]:
    """Files a ``from_pretrained`` load of ``directory`` needs but that are absent (the config,
    the weights or every shard of a sharded checkpoint, a tokenizer)."""
    missing = [] if (directory / "config.json").is_file() else ["config.json"]
    if not any((directory / name).is_file() for name in _WEIGHT_FILES):
        index = next((directory / n for n in _WEIGHT_INDEXES if (directory / n).is_file()), None)
        if index is None:
            missing.append("model weights (" + " or ".join(_WEIGHT_FILES) + ")")
        else:
            try:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                missing.append(f"a readable {index.name}")
            else:
                missing += [s for s in shards if not (directory / s).is_file()]
    if not any((directory / name).is_file() for name in _TOKENIZER_FILES):
        missing.append("tokenizer files")
    return missing


def _cached_snapshot(repo_id: str) -> tuple[Path | None, list[str]]:
    """``(snapshot directory, missing files)`` of ``repo_id`` (revision ``main``) in the local
    Hugging Face cache, without any network access; ``(None, [])`` if it is not cached."""
    # deferred: huggingface_hub is heavy; `gbmpo --help` imports this module without it
    from huggingface_hub import try_to_load_from_cache

    config = try_to_load_from_cache(repo_id, "config.json")
    if not isinstance(config, str):
        return None, []
    snapshot = Path(config).parent
    return snapshot, _missing_model_files(snapshot)


def bounded_hub_call(call: Callable[[], object]) -> list[Exception | None]:
    """Run one Hub request ``call`` for at most :data:`HUB_PROBE_TIMEOUT` (+0.5) seconds.

    Returns ``[]`` if it did not finish in time, ``[None]`` if it succeeded, ``[err]`` if it
    raised. A daemon thread bounds the wait even when name resolution itself hangs.
    """
    outcome: list[Exception | None] = []

    def probe() -> None:
        try:
            call()
        except Exception as err:  # any failure is reported to the caller
            outcome.append(err)
        else:
            outcome.append(None)

    thread = threading.Thread(target=probe, name="gbmpo-hub-probe", daemon=True)
    thread.start()
    thread.join(HUB_PROBE_TIMEOUT + 0.5)
    return outcome


def _probe_hub(repo_id: str) -> str | None:
    """Ask the Hub (one HEAD request, at most :data:`HUB_PROBE_TIMEOUT` seconds, no retries)
    whether ``repo_id`` has a ``config.json``. ``None`` if it has (or the Hub asks to slow down);
    the reason as text if the Hub cannot be reached (offline mode, network error, no answer in
    time, a 5xx error); :class:`FileNotFoundError` if the Hub answers that the model does not
    exist, is gated, is not a transformers model or is otherwise refused (4xx)."""
    # deferred: huggingface_hub is heavy; `gbmpo --help` imports this module without it
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
    )

    if _offline():
        return "offline mode is on: HF_HUB_OFFLINE=1"
    outcome = bounded_hub_call(
        lambda: get_hf_file_metadata(
            hf_hub_url(repo_id, "config.json"), timeout=HUB_PROBE_TIMEOUT
        )
    )
    endpoint = constants.ENDPOINT
    if not outcome:
        return f"no answer from {endpoint} within {HUB_PROBE_TIMEOUT:g} s"
    err = outcome[0]
    if err is None:
        return None
    if isinstance(err, GatedRepoError):
        raise FileNotFoundError(
            f"model {repo_id!r} is gated on the Hugging Face Hub: accept its terms on "
            f"{endpoint}/{repo_id} and log in (`hf auth login` or HF_TOKEN)"
        ) from err
    if isinstance(err, RepositoryNotFoundError):
        raise FileNotFoundError(
            f"model {repo_id!r} is not a local directory and does not exist on the Hugging Face "
            "Hub (or it is private and you are not logged in: `hf auth login` or HF_TOKEN)"
        ) from err
    if isinstance(err, EntryNotFoundError):
        raise FileNotFoundError(
            f"Hugging Face Hub repository {repo_id!r} has no config.json (not a transformers model)"
        ) from err
    if isinstance(err, HfHubHTTPError):
        status = getattr(getattr(err, "response", None), "status_code", None)
        first_line = str(err).splitlines()[0] if str(err) else type(err).__name__
        if status == 429 or status is None:  # rate-limited: from_pretrained retries
            return None
        if status < 500:
            raise FileNotFoundError(
                f"model {repo_id!r} is not a local directory and the Hugging Face Hub "
                f"({endpoint}) refused it: {first_line}"
            ) from err
        return f"{endpoint}: {first_line}"
    return f"{endpoint}: {type(err).__name__}: {err}"


def _resolve_hub_id(repo_id: str) -> str:
    """A fully cached hub model -> its snapshot directory (no network access); otherwise the id,
    if the Hub answers; otherwise :class:`FileNotFoundError` saying how to get the model."""
    snapshot, missing = _cached_snapshot(repo_id)
    if snapshot is not None and not missing:
        return str(snapshot)
    reason = _probe_hub(repo_id)
    if reason is None:
        return repo_id
    cache = _hub_cache_dir()
    if snapshot is None:
        where = f"is not in the local Hugging Face cache ({cache})"
    else:
        where = (
            f"is only partly in the local Hugging Face cache ({snapshot}; missing "
            + ", ".join(missing[:3])
            + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            + ")"
        )
    raise FileNotFoundError(
        f"model {repo_id!r} is not a local directory, {where} and the Hugging Face Hub cannot be "
        f"reached ({reason}). To use it, download it where there is internet access "
        f"(`hf download {repo_id}`) and copy the cache here (or point HF_HOME at it), or set the "
        "model path (--model / model.path) to a local directory saved with save_pretrained, or "
        "use the embedded model `tiny`"
    )


def resolve_model_path(path_or_id: str | Path | None) -> str:
    """The local directory or hub id that ``from_pretrained`` should receive.

    ``None``/``"tiny"`` -> the embedded model. An existing directory must hold ``config.json``,
    or be a peft adapter directory (``adapter_config.json``): that resolves to its base model
    (:func:`adapter_base`), whose config and tokenizer the adapter shares;
    :func:`load_model_and_tokenizer` then merges the adapter in.
    A name that does not exist locally and does not look like a hub id (``namespace/name``)
    raises :class:`FileNotFoundError` naming it.

    A hub id whose files (config, weights, tokenizer) are all in the local Hugging Face cache
    resolves to the cached snapshot directory, without network access. Otherwise the Hub is
    asked once (at most :data:`HUB_PROBE_TIMEOUT` seconds, no retries): the id is returned if
    it has the model; :class:`FileNotFoundError` is raised at once if the Hub says the model does
    not exist, or if it cannot be reached (``HF_HUB_OFFLINE=1``, no network), with a message
    naming the model and how to get it.
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
    try:
        exists = local.exists()
    except OSError as err:  # a name longer than the file system allows, ...
        shown = text if len(text) <= 200 else f"{text[:200]}... ({len(text)} characters)"
        raise FileNotFoundError(f"model path {shown!r} cannot be read: {err.strerror}") from None
    if exists:
        if not local.is_dir():
            raise FileNotFoundError(f"model path {text!r} is a file, not a model directory")
        if not (local / "config.json").is_file():
            if (local / ADAPTER_CONFIG).is_file():
                return resolve_model_path(_adapter_stack(local)[1])
            raise FileNotFoundError(
                f"model directory {text!r} has no config.json (not a saved transformers model, "
                f"nor a peft adapter with {ADAPTER_CONFIG})"
            )
        return str(local)
    if isinstance(path_or_id, Path) or not looks_like_hub_id(text):
        raise FileNotFoundError(
            f"model path {text!r} does not exist (and is not a Hugging Face Hub id)"
        )
    return _resolve_hub_id(text)


def _is_adapter_dir(path_or_id: str | Path | None) -> bool:
    """Whether ``path_or_id`` is an existing directory holding a peft adapter and no full model."""
    if path_or_id is None or (isinstance(path_or_id, str) and path_or_id in TINY_MODEL_NAMES):
        return False
    local = Path(str(path_or_id)).expanduser()
    return (
        local.is_dir()
        and (local / ADAPTER_CONFIG).is_file()
        and not (local / "config.json").is_file()
    )


def adapter_base(directory: str | Path) -> str:
    """The base model of the peft adapter in ``directory``: ``base_model_name_or_path`` of its
    ``adapter_config.json`` (a local directory or a hub id).

    An adapter trained on the embedded tiny model records the absolute path of the package that
    trained it (``.../gbmpo/assets/tiny-qwen3``); when that path no longer exists (another
    install, another machine), it names the embedded model of this install instead.
    Raises :class:`FileNotFoundError` when the file is unreadable or names no base model.
    """
    config_file = Path(directory).expanduser() / ADAPTER_CONFIG
    try:
        base = json.loads(config_file.read_text(encoding="utf-8"))["base_model_name_or_path"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise FileNotFoundError(
            f"adapter {str(directory)!r}: {ADAPTER_CONFIG} is unreadable or names no base model "
            f"(base_model_name_or_path): {type(err).__name__}: {err}"
        ) from err
    if not isinstance(base, str) or not base.strip():
        raise FileNotFoundError(
            f"adapter {str(directory)!r}: {ADAPTER_CONFIG} names no base model "
            "(base_model_name_or_path)"
        )
    recorded = Path(base).expanduser()
    if (
        recorded.is_absolute()
        and not recorded.exists()
        and recorded.parts[-3:] == ("gbmpo", "assets", TINY_MODEL_PATH.name)
    ):
        return str(TINY_MODEL_PATH)
    return base


def _adapter_stack(directory: Path) -> tuple[list[Path], str]:
    """``(adapter directories, innermost first, base model)`` of the peft adapter in
    ``directory``: an adapter's base may itself be an adapter directory (a LoRA run started from
    a LoRA run's model)."""
    stack = [directory]
    base = adapter_base(directory)
    while _is_adapter_dir(base):
        if len(stack) >= _MAX_ADAPTER_DEPTH:
            raise FileNotFoundError(
                f"adapter {str(directory)!r}: more than {_MAX_ADAPTER_DEPTH} adapters stacked on "
                "each other (does an adapter name itself as its base?)"
            )
        stack.append(Path(base).expanduser())
        base = adapter_base(stack[-1])
    return stack[::-1], base


def _load_adapter(
    directory: Path, *, dtype: torch.dtype, trust_remote_code: bool
) -> tuple[Any, Any]:
    """``(base model with the adapters of :func:`_adapter_stack` merged in, tokenizer)``."""
    try:
        # deferred: peft is optional (the trl extra)
        from peft import PeftModel
    except ImportError as err:
        raise FileNotFoundError(
            f"model directory {str(directory)!r} is a peft adapter ({ADAPTER_CONFIG}); loading "
            "it needs the peft package: pip install peft"
        ) from err
    # deferred: transformers is heavy; `gbmpo --help` imports this module without it
    from transformers import AutoTokenizer

    adapters, base = _adapter_stack(directory)
    try:
        model, tokenizer = _load_full(base, dtype=dtype, trust_remote_code=trust_remote_code)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"base model of adapter {str(directory)!r}: {err}") from err
    for adapter in adapters:
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
        if any((adapter / name).is_file() for name in _TOKENIZER_FILES):
            tokenizer = AutoTokenizer.from_pretrained(
                adapter, trust_remote_code=trust_remote_code
            )
    # named after the adapter: a LoRA run started from this model records it as its base (peft
    # reads the model's name_or_path)
    model.config._name_or_path = model.name_or_path = str(directory)
    return model, tokenizer


def _from_pretrained(auto: Any, source: str, dtype: torch.dtype, trust_remote_code: bool) -> Any:
    """``auto.from_pretrained`` with PyTorch's fused attention (``attn_implementation="sdpa"``:
    flash or memory-efficient kernels on a GPU, no ``[T, T]`` score matrix kept for the
    backward); a model whose code does not support it loads with its own default."""
    try:
        return auto.from_pretrained(source, dtype=dtype, trust_remote_code=trust_remote_code,
                                    attn_implementation="sdpa")
    except ValueError as err:
        if "sdpa" not in str(err).lower() and "attn_implementation" not in str(err):
            raise
        return auto.from_pretrained(source, dtype=dtype, trust_remote_code=trust_remote_code)


def _load_full(
    path_or_id: str | Path | None, *, dtype: torch.dtype, trust_remote_code: bool
) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of a saved transformers model (no adapter), as ``from_pretrained``
    returns them; errors name the model."""
    # deferred: transformers is heavy; `gbmpo --help` imports this module without it
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = resolve_model_path(path_or_id)
    is_local = Path(source).is_dir()
    # a hub id resolved to its snapshot in the local Hugging Face cache
    cached_id = (
        path_or_id
        if isinstance(path_or_id, str)
        and is_local
        and path_or_id not in TINY_MODEL_NAMES
        and not Path(path_or_id).expanduser().exists()
        else None
    )
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
        model = _from_pretrained(AutoModelForCausalLM, source, dtype, trust_remote_code)
    except OSError as err:
        if cached_id is not None:
            raise FileNotFoundError(
                f"model {cached_id!r} could not be loaded from the local Hugging Face cache "
                f"({source}; {type(err).__name__}: {err})"
            ) from err
        if is_local:
            raise
        raise FileNotFoundError(
            f"model {source!r} is not a local directory and could not be loaded from the "
            f"Hugging Face Hub ({type(err).__name__}: {err})"
        ) from err
    if cached_id is not None:  # named like a download from the Hub
        model.config._name_or_path = model.name_or_path = cached_id
        tokenizer.name_or_path = cached_id
    return model, tokenizer


def load_model_and_tokenizer(
    path_or_id: str | Path | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` for RL: tokenizer left-padded with a pad token.

    ``path_or_id``: ``None`` or ``"tiny"`` for the embedded tiny Qwen3, a local directory saved
    with ``save_pretrained``, or a Hugging Face Hub id (read from the local Hugging Face cache
    when it is there, else downloaded; see :func:`resolve_model_path`). A peft adapter
    directory (``adapter_config.json``, a LoRA run's ``RUN/model``) loads its base model
    (:func:`adapter_base`; itself possibly an adapter) with the adapter merged into the
    weights, and the tokenizer saved beside the adapter (else the base's). The pad token
    falls back to EOS when the tokenizer has none; a tokenizer with neither raises
    ``ValueError``. The model is returned in eval mode on ``device`` with ``dtype`` weights.
    """
    if _is_adapter_dir(path_or_id):
        model, tokenizer = _load_adapter(
            Path(str(path_or_id)).expanduser(), dtype=dtype, trust_remote_code=trust_remote_code
        )
    else:
        model, tokenizer = _load_full(
            path_or_id, dtype=dtype, trust_remote_code=trust_remote_code
        )
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"tokenizer of {str(path_or_id)!r} has neither a pad nor an EOS token")
        tokenizer.pad_token = tokenizer.eos_token
    for cfg in (model.config, getattr(model, "generation_config", None)):
        if cfg is not None and getattr(cfg, "pad_token_id", None) is None:
            cfg.pad_token_id = tokenizer.pad_token_id
    model.to(device)
    model.eval()
    return model, tokenizer
