"""Hub ids in :mod:`gbmpo.models`: loaded from the local Hugging Face cache without network
access; with no cache and no reachable Hub, a fast one-line error (exit 2 from the CLI)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import huggingface_hub.constants
import pytest
from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

import gbmpo.models
from gbmpo.cli import main
from gbmpo.models import (
    TINY_MODEL_PATH,
    _looks_like_hub_id,
    load_model_and_tokenizer,
    resolve_model_path,
)

REPO_ID = "gbmpo-test/tiny-qwen3"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face hub cache, used by huggingface_hub for this test."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


@pytest.fixture
def no_probe(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record (and refuse) any request to the Hub; returns the list of requested URLs."""
    calls: list[str] = []

    def refuse(url: str, **kwargs: object) -> None:
        calls.append(url)
        raise AssertionError(f"unexpected Hub request for {url}")

    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", refuse)
    return calls


def _offline(monkeypatch: pytest.MonkeyPatch, value: bool = True) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", value)


def _populate(cache: Path, repo_id: str = REPO_ID, files: tuple[str, ...] = MODEL_FILES) -> Path:
    """Put the embedded tiny model into ``cache`` in the hub cache layout (blobs + symlinked
    snapshot + refs/main), as ``hf download`` would; returns the snapshot directory."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    for name in files:
        data = (TINY_MODEL_PATH / name).read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


# ------------------------------------------------------------------------------ hub id syntax


@pytest.mark.parametrize("name", ["gpt2", "Qwen/Qwen3-1.7B", "org_x/model.v2", "a/b", "_x/y_"])
def test_valid_hub_ids(name: str) -> None:
    assert _looks_like_hub_id(name)


@pytest.mark.parametrize(
    "name",
    [
        "",
        "a/b/c",
        "-x/y",
        "x/y-",
        "x/.y",
        "x/y.",
        "x--y/z",
        "x/y..z",
        "x/y.git",
        "Qwen/Qwën",
        "./model",
        "~/model",
        "x y",
        "C:\\models\\x",
        "a" * 97,
        "ns/" + "b" * 97,
    ],
)
def test_invalid_hub_ids(name: str) -> None:
    assert not _looks_like_hub_id(name)


# ------------------------------------------------------------------------------ local cache


def test_cached_hub_id_loads_offline(
    hub_cache: Path, no_probe: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _offline(monkeypatch)
    snapshot = _populate(hub_cache)
    assert resolve_model_path(REPO_ID) == str(snapshot)
    model, tok = load_model_and_tokenizer(REPO_ID)
    ref, _ = load_model_and_tokenizer("tiny")
    assert model.config._name_or_path == REPO_ID and tok.name_or_path == REPO_ID
    assert tok.padding_side == "left" and tok.pad_token_id is not None
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in ref.parameters())
    assert no_probe == []


def test_cached_hub_id_needs_no_network_when_online(
    hub_cache: Path, no_probe: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _offline(monkeypatch, False)
    snapshot = _populate(hub_cache)
    assert resolve_model_path(REPO_ID) == str(snapshot)
    assert no_probe == []


def test_partly_cached_hub_id_offline_names_the_missing_files(
    hub_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _offline(monkeypatch)
    files = tuple(f for f in MODEL_FILES if f != "model.safetensors")
    snapshot = _populate(hub_cache, files=files)
    with pytest.raises(FileNotFoundError, match="only partly in the local Hugging Face cache") as e:
        resolve_model_path(REPO_ID)
    assert str(snapshot) in str(e.value) and "model weights" in str(e.value)


def test_sharded_checkpoint_needs_every_shard(tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    for name in ("config.json", "tokenizer.json", "model-00001-of-00002.safetensors"):
        (d / name).write_text("{}")
    (d / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "model-00001-of-00002.safetensors",'
        ' "b": "model-00002-of-00002.safetensors"}}'
    )
    assert gbmpo.models._missing_model_files(d) == ["model-00002-of-00002.safetensors"]
    (d / "model-00002-of-00002.safetensors").write_text("{}")
    assert gbmpo.models._missing_model_files(d) == []


# ------------------------------------------------------------------------------ no cache


@pytest.mark.exclusive  # a time limit: alone under pytest-xdist
def test_offline_without_cache_fails_fast_with_a_clear_message(
    hub_cache: Path, no_probe: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _offline(monkeypatch)
    start = time.perf_counter()
    with pytest.raises(FileNotFoundError) as err:
        load_model_and_tokenizer("Qwen/Qwen3-1.7B")
    assert time.perf_counter() - start < 2.0
    msg = str(err.value)
    for needle in (
        "'Qwen/Qwen3-1.7B'",
        "not in the local Hugging Face cache",
        str(hub_cache),
        "cannot be reached",
        "HF_HUB_OFFLINE=1",
        "hf download Qwen/Qwen3-1.7B",
        "save_pretrained",
        "`tiny`",
    ):
        assert needle in msg
    assert "\n" not in msg
    assert no_probe == []  # offline mode: the Hub is not even asked


def test_unreachable_hub_fails_fast(hub_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _offline(monkeypatch, False)

    def fail(url: str, **kwargs: object) -> None:
        assert url.endswith("/gbmpo-test/absent/resolve/main/config.json")
        assert kwargs["timeout"] == gbmpo.models.HUB_PROBE_TIMEOUT
        raise ConnectionError("Name or service not known")

    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", fail)
    with pytest.raises(FileNotFoundError, match="cannot be reached .*Name or service not known"):
        resolve_model_path("gbmpo-test/absent")


@pytest.mark.exclusive  # a time limit: alone under pytest-xdist
def test_hung_hub_probe_is_bounded(hub_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _offline(monkeypatch, False)
    monkeypatch.setattr(gbmpo.models, "HUB_PROBE_TIMEOUT", 0.2)
    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", lambda *a, **k: time.sleep(5))
    start = time.perf_counter()
    with pytest.raises(FileNotFoundError, match="no answer from .* within 0.2 s"):
        resolve_model_path("gbmpo-test/absent")
    assert time.perf_counter() - start < 2.0


def test_reachable_hub_passes_the_id_through(
    hub_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _offline(monkeypatch, False)
    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", lambda *a, **k: None)
    assert resolve_model_path("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"
    assert resolve_model_path("gpt2") == "gpt2"


@pytest.mark.parametrize(
    ("error", "status", "needle"),
    [
        (RepositoryNotFoundError, 404, "does not exist on the Hugging Face Hub"),
        (GatedRepoError, 403, "is gated"),
        (HfHubHTTPError, 403, "refused it"),
        (HfHubHTTPError, 503, "cannot be reached"),
    ],
)
def test_hub_answers_are_reported(
    hub_cache: Path, monkeypatch: pytest.MonkeyPatch, error: type, status: int, needle: str
) -> None:
    _offline(monkeypatch, False)
    response = SimpleNamespace(status_code=status, headers={}, request=None)

    def answer(url: str, **kwargs: object) -> None:
        raise error(f"HTTP {status}", response=response)

    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", answer)
    with pytest.raises(FileNotFoundError, match=needle):
        resolve_model_path("gbmpo-test/absent")


def test_rate_limited_hub_passes_the_id_through(
    hub_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _offline(monkeypatch, False)
    response = SimpleNamespace(status_code=429, headers={}, request=None)

    def answer(url: str, **kwargs: object) -> None:
        raise HfHubHTTPError("HTTP 429", response=response)

    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", answer)
    assert resolve_model_path("gbmpo-test/absent") == "gbmpo-test/absent"


# ------------------------------------------------------------------------------ CLI


@pytest.mark.exclusive  # a time limit: alone under pytest-xdist
@pytest.mark.parametrize("command", ["train", "eval"])
def test_cli_unreachable_hub_exit_2(
    hub_cache: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    command: str,
) -> None:
    _offline(monkeypatch, False)

    def fail(url: str, **kwargs: object) -> None:
        raise ConnectionError("Name or service not known")

    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", fail)
    args = ["train", "--dry-run"] if command == "train" else ["eval", "--task", "arithmetic"]
    start = time.perf_counter()
    assert main([*args, "--model", "Qwen/Qwen3-1.7B"]) == 2
    assert time.perf_counter() - start < 10.0
    err = capsys.readouterr().err
    assert err.startswith(f"gbmpo {command}: error: model 'Qwen/Qwen3-1.7B' is not a local")
    assert "not in the local Hugging Face cache" in err and "cannot be reached" in err


@pytest.mark.exclusive  # a time limit: alone under pytest-xdist
def test_console_script_offline_without_cache_exit_2(tmp_path: Path) -> None:
    """The acceptance case: ``HF_HUB_OFFLINE=1``, empty ``HF_HOME``, ``gbmpo train --dry-run``
    on a hub id -> exit 2 with a one-line message, no traceback, in seconds."""
    script = Path(sys.executable).with_name("gbmpo")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "gbmpo.cli"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), TOKENIZERS_PARALLELISM="false")
    config = tmp_path / "c.yaml"
    config.write_text("model:\n  path: Qwen/Qwen3-1.7B\n")
    start = time.perf_counter()
    proc = subprocess.run(
        [*cmd, "train", "--dry-run", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    elapsed = time.perf_counter() - start
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("gbmpo train: error: model 'Qwen/Qwen3-1.7B'")
    assert "not in the local Hugging Face cache" in proc.stderr
    assert "cannot be reached" in proc.stderr
    assert elapsed < 45  # interpreter + torch/transformers imports; was ~55 s of retries


def test_models_load_with_fused_attention(micro_model_dir: Path) -> None:
    """The training model runs PyTorch's fused attention (SDPA), asked for explicitly; a model
    class that refuses it loads with its default."""
    import torch
    from transformers import AutoModelForCausalLM

    from gbmpo.models import _from_pretrained

    model, _ = load_model_and_tokenizer(str(micro_model_dir))
    assert model.config._attn_implementation == "sdpa"

    class NoSdpa:
        calls: list[dict] = []

        @classmethod
        def from_pretrained(cls, source, **kwargs):
            cls.calls.append(kwargs)
            if "attn_implementation" in kwargs:
                raise ValueError("this model does not support attn_implementation='sdpa'")
            return AutoModelForCausalLM.from_pretrained(source, **kwargs)

    _from_pretrained(NoSdpa, str(micro_model_dir), torch.float32, False)
    assert [("attn_implementation" in c) for c in NoSdpa.calls] == [True, False]
