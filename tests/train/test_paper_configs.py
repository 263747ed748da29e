"""Every configs/paper/*.yaml states its engine and passes ``gbmpo train --config FILE --dry-run``
here (engine-independent checks; what needs a GPU, a hub model or an ES result is reported as
skipped); no file under configs/ names a path of a development machine."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from gbmpo.cli import main
from gbmpo.train.config import load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PAPER = sorted((CONFIGS / "paper").glob("*.yaml"))
#: absolute paths that only exist on some machine (home and work directories, temp dirs)
MACHINE_PATH = re.compile(r"(?<![\w.])(/work/|/home/|/root/|/Users/|/tmp/|/mnt/|[A-Z]:\\\\)")


def test_paper_configs_exist() -> None:
    assert len(PAPER) >= 10


@pytest.mark.parametrize("path", sorted(CONFIGS.rglob("*.yaml")), ids=lambda p: p.name)
def test_no_machine_paths(path: Path) -> None:
    hits = [line for line in path.read_text().splitlines() if MACHINE_PATH.search(line)]
    assert not hits, hits


@pytest.mark.parametrize("path", PAPER, ids=lambda p: p.name)
def test_paper_config_states_its_engine_and_dry_runs(
    path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a hub model not cached here is a skipped check
    assert "\nengine: " in "\n" + path.read_text()
    engine = load_config(path).engine
    # GBMPO's one-node settings on TRL; RPG's / ATR's multi-GPU settings on verl
    assert engine == ("trl" if path.name.startswith("gbmpo-") else "verl")
    assert main(["train", "--config", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    report = json.loads(out.split("dry run OK: ", 1)[1])
    checks = report["checks"]
    assert report["engine"] == engine
    assert checks["config"].startswith("ok") and checks["task"].startswith("ok")
    assert checks["device"].startswith(("ok", "skipped: cuda"))
    if engine == "trl":
        assert checks["GRPOConfig"].startswith("ok")
    else:
        assert checks["overrides"].startswith("ok")
        assert checks["verl config"].startswith(("ok", "skipped: no verl environment"))


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize(
    "name", ["gbmpo-qwen3-1.7b-gsm8k-probl2.yaml", "rpg-qwen3-4b-ufkl.yaml"]
)
def test_paper_config_without_its_device_stops_at_once(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real run of a GPU config on a machine without the GPU: exit 2 naming what is missing
    (the device for TRL, the GPUs for verl), before any model is loaded or anything written."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "run"
    code = main(["train", "--config", str(CONFIGS / "paper" / name), "--output-dir", str(out)])
    err = capsys.readouterr().err
    assert code == 2
    assert "model.device is 'cuda'" in err or "GPU" in err, err
    assert not out.exists()
