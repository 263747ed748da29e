"""MkDocs hooks (``hooks:`` in ``mkdocs.yml``): serve MathJax from the site itself, so that the
formulas of the API reference render offline. The MathJax 3 build comes from the
``django-static-mathjax`` wheel (a plain copy of MathJax's files, no Django needed; in
``requirements.txt`` and the ``docs`` extra); its single-file SVG build, ``es5/tex-svg.js``,
needs no font files beside it.
"""

from __future__ import annotations

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
    return files
