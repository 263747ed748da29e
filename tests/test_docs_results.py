"""One source for every number: the measured tables of the README, docs/results.md and the
one-GPU guide are the ones ``scripts/render_results.py`` renders from the committed result
files, a planted mismatch is caught, and no page says "no GPU run" while GPU results are
committed."""

from __future__ import annotations

import json
import re
import runpy
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "render_results.py"


@pytest.fixture(scope="module")
def mod() -> dict[str, Any]:
    return runpy.run_path(str(SCRIPT))


def test_pages_hold_the_tables_rendered_from_their_sources(mod: dict[str, Any]) -> None:
    for page in mod["PAGES"]:
        text = page.read_text()
        assert "<!-- table:" in text, page
        assert mod["rendered"](text) == text, f"{page.name}: run python scripts/render_results.py"


def test_every_marked_table_has_a_renderer_and_every_renderer_is_used(mod: dict[str, Any]) -> None:
    used = set()
    for page in mod["PAGES"]:
        used |= set(re.findall(r"<!-- table:([\w-]+) -->", page.read_text()))
    assert used == set(mod["TABLES"])


def test_a_planted_mismatch_is_caught(mod: dict[str, Any]) -> None:
    text = (ROOT / "docs" / "results.md").read_text()
    # the regularizer comparison's KL row, as its results.json gives it
    row = "| kl_k3 | 0.04 | 78.5 ± 1.8 | – |"
    assert row in text
    planted = text.replace(row, "| kl_k3 | 0.04 | 79.5 ± 1.8 | – |")
    assert mod["rendered"](planted) != planted
    assert mod["rendered"](planted) == text
    # the estimator table's k3 bias on the trained pair, as estimator_table.json gives it
    cell = "| k3 | −0.00367 ± 0.0015 (0.282) |"
    assert cell in text
    planted = text.replace(cell, "| k3 | −0.00267 ± 0.0015 (0.282) |")
    assert mod["rendered"](planted) == text
    readme = (ROOT / "README.md").read_text()
    planted = readme.replace("25 of 25 `--engine trl` kills", "30 of 30 `--engine trl` kills")
    assert planted != readme and mod["rendered"](planted) == readme
    # the end-to-end engines, parity, fuzzing and GSM8K tables, as their result files give them
    for cell, other in (("| 17.4 s; 50.0% → 55.0% |", "| 17.4 s; 50.0% → 45.0% |"),
                        ("loss ≤ 1.5e-8, gradient ≤ 1.9e-9 (float32)",
                         "loss ≤ 1.5e-8, gradient ≤ 1.5e-9 (float32)"),
                        ("| 22 (12 crashes, 10 messages not one line) |",
                         "| 21 (12 crashes, 9 messages not one line) |"),
                        ("| base, ≤ 64 new tokens | 2.0% |", "| base, ≤ 64 new tokens | 0% |"),
                        ("| 79.0 / 80.0 / 78.5 (204–206) | **+30.2** |",
                         "| 79.5 / 84.0 / 81.0 (161–170) | **+32.5** |")):
        assert cell in text, cell
        planted = text.replace(cell, other)
        assert planted != text and mod["rendered"](planted) == text, cell


def test_a_changed_source_changes_the_page(mod: dict[str, Any], tmp_path: Path) -> None:
    """The numbers come from the file: the table rendered from an edited copy of
    ``sandbox.json`` shows the edited figure."""
    data = json.loads((ROOT / "benchmarks" / "results" / "sandbox.json").read_text())
    data["settings"]["one_stream"]["ratio"] = 1.23
    (tmp_path / "sandbox.json").write_text(json.dumps(data))
    namespace = mod["sandbox"].__globals__  # the script's module namespace
    mod["bench"].cache_clear()
    namespace["BENCH"] = tmp_path
    try:
        assert "**1.23×**" in mod["sandbox"]()
    finally:
        namespace["BENCH"] = ROOT / "benchmarks" / "results"
        mod["bench"].cache_clear()


def test_every_listed_fuzz_find_is_kept_by_its_test(mod: dict[str, Any], tmp_path: Path) -> None:
    """found.json's problems each name a test of tests/fuzz and the ``@example`` decorators that
    keep them; a listed example or test that is gone fails the rendering."""
    found = mod["fuzz_finds"]()
    assert found and {p["kind"] for p in found} == {"crash", "message not one line"}
    data = json.loads((ROOT / "docs" / "results" / "fuzzing" / "found.json").read_text())
    namespace = mod["fuzz_finds"].__globals__
    gone = "tests/fuzz/test_fuzz_cli.py::test_gone"
    for broken in ({"examples": ['"--top-p=0.5"']}, {"test": gone}):
        planted = {**data, "problems": [{**data["problems"][0], **broken}]}
        (tmp_path / "fuzzing").mkdir(exist_ok=True)
        (tmp_path / "fuzzing" / "found.json").write_text(json.dumps(planted))
        namespace["RESULTS"] = tmp_path
        try:
            with pytest.raises(KeyError, match="test_gone|--top-p=0.5"):
                mod["fuzz_finds"]()
        finally:
            namespace["RESULTS"] = ROOT / "docs" / "results"


def test_fuzz_example_counts_are_the_long_profiles(mod: dict[str, Any]) -> None:
    """The counts come from the tests' settings: the eval target takes the long profile's own
    count through ``@sized(4)``, the reward functions the ``long=20_000`` of theirs."""
    count = mod["long_profile_examples"]
    assert count("test_fuzz_cli.py::test_eval_flags") == 2000
    assert count("test_fuzz_rewards.py::test_reward_functions_lose_nothing") == 20_000


#: claims that results committed on a GPU contradict
NO_GPU = re.compile(r"no GPU run|all on (?:a )?CPU|are all on CPU|never (?:been )?run on a GPU",
                    re.IGNORECASE)  # fmt: skip


def _gpu_results() -> list[str]:
    found = [p.name for p in (ROOT / "benchmarks" / "results").glob("*.json")
             if json.loads(p.read_text()).get("device") in ("cuda", "NVIDIA H200")]
    found += [p.name for p in (ROOT / "docs" / "results").glob("*gpu*")]
    return found


def test_no_page_denies_the_committed_gpu_runs() -> None:
    assert _gpu_results(), "the GPU results this test guards are committed"
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    hits = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in pages
            for n, line in enumerate(p.read_text().splitlines(), 1) if NO_GPU.search(line)]
    assert not hits, "\n".join(hits)


def test_the_no_gpu_check_can_fail() -> None:
    assert NO_GPU.search("The engines end to end. No GPU run has been made.")
    assert NO_GPU.search("The measurements in Results are all on CPU.")
