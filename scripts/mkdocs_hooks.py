"""MkDocs hooks (``hooks:`` in ``mkdocs.yml``): serve MathJax from the site itself, so that the
formulas of the API reference render offline; and serve the repository files and folders that
pages link to relatively (``[x](../configs/a.yaml)``, ``[y](../configs/paper/)``: links that work
in a clone), so that the same link works on the site (a folder as a page listing its files).
The MathJax 3 build comes from the ``django-static-mathjax`` wheel (a plain copy of MathJax's
files, no Django needed; in ``requirements.txt`` and the ``docs`` extra); its single-file SVG
build, ``es5/tex-svg.js``, needs no font files beside it.
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
    listed: set[str] = set()
    for rel in sorted(w for w in wanted if w.endswith("/")):
        content, shown = folder_listing(rel.rstrip("/"))
        files.append(File.generated(config, f"{SERVED}/{rel}index.html", content=content))
        listed.update(shown)
    for rel in sorted({w for w in wanted if not w.endswith("/")} | listed):
        files.append(File.generated(config, _served_name(rel), abs_src_path=str(REPO / rel)))
    return files


# ------------------------------------------------------------------ links to repository files

#: the repository root (docs_dir's parent) and where the site serves the files its pages link to
REPO = Path(__file__).resolve().parents[1]
SERVED = "_repo"
_LINK = re.compile(r"\]\((\.\./[^)\s#]+)(#[^)\s]*)?\)")
#: a linked folder's files larger than this are listed, not copied onto the site (model weights)
LISTED_BYTES = 1 << 20


def _served_name(rel: str) -> str:
    """A repository file's path on the site: a Markdown file is served as text (``.md.txt``)
    so that the site does not build it as a page."""
    return f"{SERVED}/{rel}.txt" if rel.endswith(".md") else f"{SERVED}/{rel}"


def folder_listing(rel: str) -> tuple[str, list[str]]:
    """The site's page for a linked repository folder (what a clone's browser shows for it): its
    files, each linked to the site's copy, and its sub-folders by name; and the files it links
    (those under :data:`LISTED_BYTES`; hidden files and caches left out)."""
    from html import escape

    folder = REPO / rel
    items, shown = [], []
    for entry in sorted(folder.iterdir()):
        if entry.name.startswith(".") or entry.name == "__pycache__" or entry.suffix == ".pyc":
            continue
        name = escape(entry.name)
        if entry.is_dir():
            items.append(f"<li>{name}/</li>")
        elif entry.stat().st_size > LISTED_BYTES:
            mib = entry.stat().st_size / 2**20
            items.append(f"<li>{name} ({mib:.1f} MiB, not on the site)</li>")
        else:
            shown.append(f"{rel}/{entry.name}")
            href = escape(Path(_served_name(shown[-1])).name)
            items.append(f'<li><a href="{href}">{name}</a></li>')
    title = escape(f"{rel}/")
    content = (f'<!doctype html>\n<meta charset="utf-8">\n<title>{title}</title>\n'
               f"<h1>{title}</h1>\n<p>A folder of the gbmpo repository.</p>\n"
               f"<ul>\n{chr(10).join(items)}\n</ul>\n")  # fmt: skip
    return content, shown


def repo_links(markdown: str, page_src: str, docs_dir: Path) -> tuple[str, list[str]]:
    """``markdown`` with each relative link that leaves ``docs/`` for a file or folder of the
    repository (``[x](../configs/a.yaml)``, ``[y](../configs/paper/)``, which work in a clone)
    pointed at the site's copy of that file or listing of that folder, and the repository paths
    so linked (a folder's with a trailing ``/``)."""
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
        if target.is_dir():
            linked.append(f"{rel}/")
            served = docs_dir / SERVED / rel / "index.html"
        elif target.is_file():
            linked.append(rel)
            served = docs_dir / _served_name(rel)
        else:
            raise PluginError(f"{page_src}: link to a missing repository file {m.group(1)}")
        return f"]({os.path.relpath(served, page_dir)}{m.group(2) or ''})"

    return _LINK.sub(one, markdown), linked


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files, **kwargs: Any) -> str:
    text, _ = repo_links(markdown, page.file.src_uri, Path(config["docs_dir"]))
    return text
