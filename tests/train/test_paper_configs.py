"""Every configs/paper/*.yaml states its engine and passes ``gbmpo train --config FILE --dry-run``
here (engine-independent checks; what needs a GPU, a hub model or an ES result is reported as
skipped); no file under configs/ names a path of a development machine."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from gbmpo.cli import main
from gbmpo.config import load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PAPER = sorted((CONFIGS / "paper").glob("*.yaml"))
#: absolute paths that only exist on some machine (home and work directories, temp dirs)
MACHINE_PATH = re.compile(r"(?<![\w.])(/work/|/home/|/root/|/Users/|/tmp/|/mnt/|[A-Z]:\\\\)")


@pytest.fixture(scope="module", autouse=True)
def _verl_validates_each_config_once(verl_check_memo: dict) -> dict:
    """verl's validation of a composed config runs once per distinct config in this file (the
    ``packed`` and ``hidden`` dry runs of a config compose the same one: tests/conftest.py);
    module-scoped, so this file's tests stay on one xdist worker and share it."""
    return verl_check_memo


def test_paper_configs_exist() -> None:
    assert len(PAPER) >= 10


@pytest.mark.parametrize("path", sorted(CONFIGS.rglob("*.yaml")), ids=lambda p: p.name)
def test_no_machine_paths(path: Path) -> None:
    hits = [line for line in path.read_text().splitlines() if MACHINE_PATH.search(line)]
    assert not hits, hits


@pytest.mark.parametrize("path", PAPER, ids=lambda p: p.name)
def test_paper_config_states_its_engine_and_dry_runs(
    path: Path, data_mode: str, capsys: pytest.CaptureFixture
) -> None:
    """Exit 0 on any machine: with the data where this install has it, and in a user's clone
    without it (the data set is then a warning, like a hub model that is not here)."""
    assert "\nengine: " in "\n" + path.read_text()
    cfg = load_config(path)
    engine = cfg.engine
    # GBMPO's one-node settings on TRL; RPG's / ATR's multi-GPU settings on verl
    assert engine == ("trl" if path.name.startswith("gbmpo-") else "verl")
    assert main(["train", "--config", str(path), "--dry-run"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out.split("dry run OK: ", 1)[1])
    checks = report["checks"]
    assert report["engine"] == engine
    assert checks["config"].startswith("ok")
    from gbmpo.tasks import _common

    if data_mode == "packed" and any((_common.package_data_dir() / cfg.task.name).glob("*.gz")):
        assert checks["task"].startswith("ok")
    else:  # the user's case: a warning naming the data set, everything else still checked
        assert checks["task"].startswith("skipped: ") and "data not available" in checks["task"]
        assert "warning: task:" in captured.err
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


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")
def test_own_engine_dry_run_for_another_machine_warns_about_missing_data(
    data_mode: str, capsys: pytest.CaptureFixture
) -> None:
    """The own engine's dry run of a GPU config: a data set missing here is a warning (like the
    model); on a machine the config is meant for (device present) it stays an error."""
    if data_mode == "packed":
        pytest.skip("the user's case only")
    argv = ["train", "--dry-run", "--task", "gsm8k", "--model.device", "cuda"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "warning: task 'gsm8k'" in err and "checked without its data" in err
    assert main(["train", "--dry-run", "--task", "gsm8k"]) == 2  # cpu: meant for this machine
    assert "gsm8k/train.jsonl" in capsys.readouterr().err
