"""The documentation site builds with ``mkdocs build --strict`` (a broken link, a missing page or
a docstring mkdocstrings cannot render fails), and the configuration page lists every key."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gbmpo.config import TrainConfig, config_to_dict

REPO = Path(__file__).resolve().parents[1]


def _keys(data: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and not key.endswith("params"):
            out += _keys(value, path + ".")
        else:
            out.append(path)
    return out


def test_every_config_key_is_documented() -> None:
    page = (REPO / "docs" / "cli-and-config.md").read_text()
    keys = _keys(config_to_dict(TrainConfig()))
    assert len(keys) > 40
    missing = [k for k in keys if f"| `{k}` |" not in page]
    assert not missing, f"keys missing from docs/cli-and-config.md: {missing}"


def _cells(row: str) -> int:
    """The cells of a Markdown table row as Python-Markdown splits it: at unescaped pipes
    outside code spans."""
    text = re.sub(r"`[^`]*`", "code", row.strip().replace("\\|", ""))
    return len(text.strip("|").split("|"))


def table_rows_off_their_header(text: str) -> list[str]:
    """Table rows with another number of cells than their header: the extra cells of a row are
    dropped on the site (its text lost), missing ones left empty."""
    bad, header, fenced = [], None, False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if fenced or not line.lstrip().startswith("|"):
            header = None
            continue
        if header is None:
            header = _cells(line)
        elif _cells(line) != header:
            bad.append(f"line {number}: {_cells(line)} cells under a header of {header}")
    return bad


def test_every_table_row_has_its_headers_cells() -> None:
    pages = sorted((REPO / "docs").rglob("*.md")) + [REPO / "README.md"]
    bad = [f"{p.relative_to(REPO)} {b}" for p in pages
           for b in table_rows_off_their_header(p.read_text())]  # fmt: skip
    assert not bad, bad
    assert table_rows_off_their_header("| a | b |\n|---|---|\n| `x` || y |\n") == [
        "line 3: 3 cells under a header of 2"]


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    pytest.importorskip("mkdocstrings_handlers.python")
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for page in ("index.html", "methods/index.html", "cli-and-config/index.html",
                 "api/objectives/index.html", "api/train/index.html", "api/rollout/index.html",
                 "results/arithmetic-150-seed5/report/index.html"):
        assert (site / page).is_file(), page
    # the results page is results.md (docs/results/README.md would be built to the same place)
    results = (site / "results" / "index.html").read_text()
    assert 'id="embedded-default"' in results
    # inline: the accuracy panel, read at the page's width; a click opens every panel
    assert 'src="arithmetic-150-seed5/accuracy_arithmetic.png"' in results
    assert 'href="arithmetic-150-seed5/curves_arithmetic.png"' in results
    # formulas go to MathJax, which the site serves itself
    assert (site / "javascripts" / "mathjax" / "tex-svg.js").is_file()
    assert 'class="arithmatex"' in (site / "api" / "objectives" / "index.html").read_text()
    # docstrings' Sphinx roles and math blocks are rendered, not printed as written
    for api_page in (site / "api").glob("*/index.html"):
        text = api_page.read_text()
        assert ":func:" not in text and ":math:" not in text and ".. math::" not in text, api_page
    assert (site / "results" / "arithmetic-150-seed5" / "curves_arithmetic.png").is_file()
    api = (site / "api" / "objectives" / "index.html").read_text()
    assert "gbmpo.objectives.loss.compute_policy_loss" in api
    assert "gbmpo.objectives.regularizers.kl_k3" in api


def test_docstring_markup_becomes_markdown_with_math() -> None:
    """The API reference's griffe extension: cross-reference roles become code, ``:math:`` roles
    and ``.. math::`` blocks become arithmatex math, shared Google entries are split."""
    import runpy

    mod = runpy.run_path(str(REPO / "scripts" / "griffe_sphinx_roles.py"))
    render = mod["render_sphinx_markup"]
    assert render(r"see :func:`~gbmpo.a.b` with :math:`\varepsilon_{\text{high}}`") == (
        r"see `b` with $\varepsilon_{\text{high}}$")
    block = render("Intro.\n\n.. math::\n\n    a = \\frac{1}{2}\n\nAfter.\n")
    assert "$$\na = \\frac{1}{2}\n$$" in block and ".. math::" not in block
    split = render("Do.\n\nArgs:\n    lo, hi: the bounds\n        (inclusive).\n    x: one\n")
    entry = "the bounds\n        (inclusive).\n"
    assert f"    lo: {entry}    hi: {entry}" in split


def test_links_to_repository_files_work_on_the_site(tmp_path: Path) -> None:
    """A page's relative link to a repository file (``../configs/...``, right in a clone) is
    pointed at the copy the site serves under ``_repo/``; a link to a missing file fails."""
    import runpy

    pytest.importorskip("mkdocs")
    mod = runpy.run_path(str(REPO / "scripts" / "mkdocs_hooks.py"))
    docs = REPO / "docs"
    text = "[RESULTS](../benchmarks/RESULTS.md#x), [a](../configs/tiny-atr.yaml), [p](index.md)"
    out, linked = mod["repo_links"](text, "results.md", docs)
    assert linked == ["benchmarks/RESULTS.md", "configs/tiny-atr.yaml"]
    assert "](_repo/benchmarks/RESULTS.md.txt#x)" in out
    assert "](_repo/configs/tiny-atr.yaml)" in out
    assert "](index.md)" in out
    deep, _ = mod["repo_links"]("[c](../../../configs/tiny-atr.yaml)", "results/a/README.md", docs)
    assert "](../../_repo/configs/tiny-atr.yaml)" in deep
    with pytest.raises(Exception, match="missing repository file"):
        mod["repo_links"]("[m](../configs/none.yaml)", "results.md", docs)


def test_links_to_repository_folders_work_on_the_site() -> None:
    """A relative link to a repository folder (a listing in a clone's browser) is pointed at a
    listing page the site serves, whose links reach the folder's files; files too large to copy
    (model weights) are named, not linked."""
    import runpy

    pytest.importorskip("mkdocs")
    mod = runpy.run_path(str(REPO / "scripts" / "mkdocs_hooks.py"))
    out, linked = mod["repo_links"]("[p](../configs/paper/)", "getting-started.md", REPO / "docs")
    assert linked == ["configs/paper/"] and "](_repo/configs/paper/index.html)" in out
    page, shown = mod["folder_listing"]("configs/paper")
    yaml = sorted(p.name for p in (REPO / "configs" / "paper").glob("*.yaml"))
    assert yaml and shown == [f"configs/paper/{n}" for n in yaml]
    assert all(f'<a href="{n}">' in page for n in yaml)
    weights, shown = mod["folder_listing"]("src/gbmpo/assets/tiny-qwen3")
    assert "model.safetensors (" in weights and '<a href="model.safetensors"' not in weights
    assert "src/gbmpo/assets/tiny-qwen3/config.json" in shown
