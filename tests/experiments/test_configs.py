"""Every configuration file under configs/ (and configs/paper/) passes
``gbmpo train --config FILE --dry-run``.

Files for hub models (Qwen3-1.7B / 4B) cannot be dry-run completely here (no network, no cached
weights): they are validated and dry-run with the embedded tiny model substituted for the model
(everything else, task data and templates included, is built), then skipped with that reason.
A file pointing at an ES mirror map that does not exist yet (``gbmpo es`` produces it) is checked
with a stand-in mirror file of the same format.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gbmpo.cli import main
from gbmpo.models import TINY_MODEL_PATH
from gbmpo.train import load_config

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml")) + sorted(
    (REPO / "configs" / "paper").glob("*.yaml")
)
DATA = REPO.parent / "shared" / "data"


def test_paper_configs_exist():
    names = {p.name for p in CONFIGS}
    for needed in (
        "gbmpo-qwen3-1.7b-gsm8k-kl.yaml", "gbmpo-qwen3-1.7b-gsm8k-probl2.yaml",
        "gbmpo-qwen3-1.7b-gsm8k-nm.yaml", "gbmpo-qwen3-1.7b-gsm8k-nm-es.yaml",
        "gbmpo-qwen3-1.7b-mbpp-kl.yaml", "gbmpo-qwen3-1.7b-mbpp-probl2.yaml",
        "gbmpo-qwen3-1.7b-mbpp-nm.yaml", "gbmpo-qwen3-1.7b-mbpp-nm-es.yaml",
        "rpg-qwen3-4b-ufkl.yaml", "rpg-qwen3-4b-urkl.yaml",
        "rpg-qwen3-4b-reinforce-ufkl.yaml", "rpg-qwen3-4b-reinforce-urkl.yaml",
        "atr-grpo-qwen3-1.7b-gsm8k.yaml",
    ):
        assert needed in names


def test_paper_configs_set_what_they_claim():
    def cfg(name):
        return load_config(REPO / "configs" / "paper" / name)

    assert cfg("atr-grpo-qwen3-1.7b-gsm8k.yaml").objective.surrogate.params == {"delta": 0.02}
    nm_es = cfg("gbmpo-qwen3-1.7b-mbpp-nm-es.yaml").objective.regularizer
    assert nm_es.name == "neural_mirror" and nm_es.params["mirror"].endswith("best_mirror.json")
    assert cfg("gbmpo-qwen3-1.7b-gsm8k-nm.yaml").objective.regularizer.params == {}
    for variant in ("ufkl", "urkl"):
        fd = cfg(f"rpg-qwen3-4b-{variant}.yaml").objective
        assert fd.regularizer.name == f"rpg_{variant}" and fd.regularizer.anchor == "old"
        rf = cfg(f"rpg-qwen3-4b-reinforce-{variant}.yaml").objective
        assert rf.surrogate.name == "rpg_reinforce" and rf.surrogate.params["variant"] == variant
    for name in ("kl", "probl2", "nm", "nm-es"):
        c = cfg(f"gbmpo-qwen3-1.7b-gsm8k-{name}.yaml")
        assert c.model.path == "Qwen/Qwen3-1.7B" and c.objective.advantage == "dr_grpo"


def _hub_model_missing(path: str) -> bool:
    if path in ("tiny",) or Path(path).expanduser().exists():
        return False
    from huggingface_hub import try_to_load_from_cache

    return not isinstance(try_to_load_from_cache(path, "config.json"), str)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: str(p.relative_to(REPO)))
def test_config_dry_run(config, tmp_path, capsys):
    if not (TINY_MODEL_PATH / "config.json").is_file():
        pytest.skip("embedded tiny model not built")
    raw = yaml.safe_load(config.read_text()) or {}
    task = (raw.get("task") or {}).get("name", "arithmetic")
    if task in ("gsm8k", "mbpp") and not (DATA / task).is_dir():
        pytest.skip(f"needs the {task} data under {DATA}")
    overrides: list[str] = []
    notes: list[str] = []
    cfg = load_config(config)
    mirror = cfg.objective.regularizer.params.get("mirror")
    if mirror is not None and not Path(mirror).exists():
        from gbmpo.objectives.mirror import NeuralMirrorMap

        stand_in = NeuralMirrorMap.random(scale=0.01, seed=0).save(tmp_path / "mirror.json")
        overrides += ["--objective.regularizer.params.mirror", str(stand_in)]
        notes.append(f"mirror file {mirror} (made by `gbmpo es`) replaced by a stand-in")
    hub = _hub_model_missing(cfg.model.path)
    if hub:
        overrides += ["--model.path", "tiny"]
        notes.append(f"hub model {cfg.model.path} needs the network: built with the tiny model")
    code = main(["train", "--config", str(config), "--dry-run", *overrides])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "dry run OK" in captured.out
    if hub:
        pytest.skip("; ".join(notes))
