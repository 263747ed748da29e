"""Docs that match their sources: every value of ``configs/paper/*.yaml`` carries a source tag,
docs/methods.md's provenance table is the one ``scripts/render_provenance.py`` renders from them,
and nothing cites a document the repository does not hold."""

from __future__ import annotations

import re
import runpy
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "render_provenance.py"


@pytest.fixture(scope="module")
def mod() -> dict[str, Any]:
    return runpy.run_path(str(SCRIPT))


def test_methods_page_holds_the_rendered_provenance_table(mod: dict[str, Any]) -> None:
    text = (ROOT / "docs" / "methods.md").read_text()
    assert mod["rendered"](text) == text, "run python scripts/render_provenance.py"


def test_every_paper_config_value_has_a_declared_source(mod: dict[str, Any]) -> None:
    paths = sorted((ROOT / "configs" / "paper").glob("*.yaml"))
    assert len(paths) >= 13
    for path in paths:
        rows = mod["parse_config"](path)
        assert rows, path.name
        for row in rows:
            assert row.source == "gbmpo's choice" or row.source.startswith(
                ("arXiv ", "authors' code: ")), row  # fmt: skip
    table = mod["render_markdown"]()
    # the three papers are cited by arXiv id with a place in the text, code by commit
    assert "arXiv 2505.17508 (RPG, ICLR 2026), App. H" in table
    assert "arXiv 2602.04380 (GBMPO), abstract" in table
    assert "arXiv 2602.05494 (UCF), abstract" in table
    assert re.search(r"\(Lexsi-Labs/aligntune @ [0-9a-f]{7}\)", table)
    assert re.search(r"\(complex-reasoning/RPG @ [0-9a-f]{7}\)", table)


CONFIG = """\
# source paper: arXiv 2505.17508 (RPG)
# source code rpg: complex-reasoning/RPG@6209206 verl/trainer/ppo/core_algos.py
model:
  path: Qwen/Qwen3-4B    # [paper App. H]
objective:
  surrogate:
    params: {eps_low: 0.2}   # [code rpg]
  aggregation: bnpo      # [gbmpo] token mean
"""


def test_a_config_that_drifts_from_its_tags_is_refused(mod: dict[str, Any], tmp_path: Path) -> None:
    error = mod["ProvenanceError"]
    path = tmp_path / "c.yaml"
    path.write_text(CONFIG)
    rows = mod["parse_config"](path)
    assert [(r.key, r.value) for r in rows] == [
        ("model.path", "Qwen/Qwen3-4B"), ("objective.surrogate.params", "{eps_low: 0.2}"),
        ("objective.aggregation", "bnpo")]  # fmt: skip
    assert rows[1].source.startswith("authors' code: `core_algos.py` (complex-reasoning/RPG @")
    for bad, match in [
        (CONFIG.replace("  # [gbmpo] token mean", ""), "'objective.aggregation' has no source"),
        (CONFIG.replace("[code rpg]", "[code verl]"), r"\[code verl\] is not declared"),
        (CONFIG.replace("# source paper: arXiv 2505.17508 (RPG)\n", ""), "without a '# source"),
        (CONFIG + "  extra: [1, 2]\n", "'objective.extra' has no source"),
    ]:
        path.write_text(bad)
        with pytest.raises(error, match=match):
            mod["parse_config"](path)


#: a reference to a document outside the repository (the project's working notes)
OUTSIDE = re.compile(r"METHODS §|METHODS\.md|FEASIBILITY|ANCHORS\.md|VERL_CPU|ARCHITECTURE\.md|"
                     r"shared/spec")  # fmt: skip


def test_nothing_cites_a_document_outside_the_repository() -> None:
    roots = ["configs", "docs", "src", "examples", "scripts", "benchmarks"]
    found = []
    for root in roots:
        for path in (ROOT / root).rglob("*"):
            if path.suffix not in {".py", ".md", ".yaml", ".yml", ".sh", ".toml"}:
                continue
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if OUTSIDE.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    for name in ("README.md", "CHANGELOG.md"):
        text = (ROOT / name).read_text()
        found += [f"{name}: {m.group(0)}" for m in OUTSIDE.finditer(text)]
    assert not found, "\n".join(found)


def test_no_unquoted_appeal_to_the_paper() -> None:
    """'as in the paper' only with the place in the paper; the GBMPO and ATR-GRPO texts were
    not available, so a claim about them names the authors' code or the abstract instead."""
    hits = []
    for root in ("src", "docs", "examples", "configs"):
        for path in (ROOT / root).rglob("*"):
            if path.suffix in {".py", ".md", ".yaml"}:
                for n, line in enumerate(path.read_text().splitlines(), 1):
                    if re.search(r"as in the paper(?!\s*\()", line, re.IGNORECASE):
                        hits.append(f"{path.relative_to(ROOT)}:{n}")
    assert not hits, hits
