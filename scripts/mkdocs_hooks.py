"""MkDocs hooks (``hooks:`` in ``mkdocs.yml``): serve MathJax from the site itself, so that the
formulas of the API reference render offline; and serve the repository files that pages link
to relatively (``[x](../configs/a.yaml)``, a link that works in a clone), so that the same link
works on the site. The MathJax 3 build comes from the
``django-static-mathjax`` wheel (a plain copy of MathJax's files, no Django needed; in
``requirements.txt`` and the ``docs`` extra); its single-file SVG build, ``es5/tex-svg.js``,
needs no font files beside it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

#: where the page templates load it from (``extra_javascript`` in ``mkdocs.yml``)
SITE_PATH = "javascripts/mathjax/tex-svg.js"


def mathjax_file() -> Path:
    """The installed MathJax single-file SVG build; a clear error when it is not installed."""
    try:
        import mathjax  # the django-static-mathjax wheel's package
    except ImportError as err:
        raise PluginError(
            "MathJax for the docs is missing: pip install django-static-mathjax==3.2.2.1"
        ) from err
    path = Path(mathjax.__file__).parent / "static" / "mathjax" / "es5" / "tex-svg.js"
    if not path.is_file():
        raise PluginError(f"MathJax build not found at {path}")
    return path


def on_files(files: Files, config: Any, **kwargs: Any) -> Files:
    files.append(File.generated(config, SITE_PATH, abs_src_path=str(mathjax_file())))
    # the repository files the pages link to (``../configs/...``), served under _repo/
    docs_dir = Path(config["docs_dir"])
    wanted: set[str] = set()
    for f in list(files):
        if f.src_uri.endswith(".md") and f.abs_src_path:
            wanted.update(repo_links(Path(f.abs_src_path).read_text(), f.src_uri, docs_dir)[1])
    for rel in sorted(wanted):
        files.append(File.generated(config, _served_name(rel), abs_src_path=str(REPO / rel)))
    return files


# ------------------------------------------------------------------ links to repository files

#: the repository root (docs_dir's parent) and where the site serves the files its pages link to
REPO = Path(__file__).resolve().parents[1]
SERVED = "_repo"
_LINK = re.compile(r"\]\((\.\./[^)\s#]+)(#[^)\s]*)?\)")


def _served_name(rel: str) -> str:
    """A repository file's path on the site: a Markdown file is served as text (``.md.txt``)
    so that the site does not build it as a page."""
    return f"{SERVED}/{rel}.txt" if rel.endswith(".md") else f"{SERVED}/{rel}"


def repo_links(markdown: str, page_src: str, docs_dir: Path) -> tuple[str, list[str]]:
    """``markdown`` with each relative link that leaves ``docs/`` for a file of the repository
    (``[x](../configs/a.yaml)``, which works in a clone) pointed at the site's copy of that file,
    and the repository paths so linked."""
    page_dir = (docs_dir / page_src).parent
    linked: list[str] = []

    def one(m: re.Match[str]) -> str:
        target = (page_dir / m.group(1)).resolve()
        try:
            target.relative_to(docs_dir.resolve())
            return m.group(0)  # inside docs/: mkdocs' own link
        except ValueError:
            pass
        try:
            rel = target.relative_to(REPO).as_posix()
        except ValueError:
            return m.group(0)
        if not target.is_file():
            raise PluginError(f"{page_src}: link to a missing repository file {m.group(1)}")
        linked.append(rel)
        served = docs_dir / _served_name(rel)
        return f"]({os.path.relpath(served, page_dir)}{m.group(2) or ''})"

    return _LINK.sub(one, markdown), linked


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files, **kwargs: Any) -> str:
    text, _ = repo_links(markdown, page.file.src_uri, Path(config["docs_dir"]))
    return text
