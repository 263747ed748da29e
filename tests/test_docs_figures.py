"""Figures shown inline in the docs read at the page's width: none is so wide that the browser
shrinks its smallest text below 9 px."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
#: the width of Material's content column on a wide screen (measured in headless Chromium at a
#: 1400 px window: about 690 px), which shrinks any wider image to it
PAGE_PX = 690
#: the smallest text in gbmpo's figures: 8 pt (the frontier's point labels) at 110 dpi, 12.2 px
SMALLEST_TEXT_PX = 8 * 110 / 72
#: a figure at most this wide keeps that text at 9 px or more on the page (690 * 12.2 / 9 = 937)
MAX_PX = int(PAGE_PX * SMALLEST_TEXT_PX / 9)
INLINE = re.compile(r"!\[[^\]]*\]\(([^)\s]+\.png)\)")


def inline_figures(text: str) -> list[str]:
    """The images a page shows inline (``![alt](path.png)``, also inside a link; not in an
    HTML comment)."""
    return INLINE.findall(re.sub(r"<!--.*?-->", "", text, flags=re.S))


def too_wide(width: int) -> bool:
    return width * 9 > PAGE_PX * SMALLEST_TEXT_PX


def test_every_inline_figure_reads_at_the_page_width() -> None:
    pytest.importorskip("PIL")
    from PIL import Image

    checked, wide = 0, []
    for page in sorted(DOCS.glob("*.md")):
        for rel in inline_figures(page.read_text()):
            path = (page.parent / rel).resolve()
            assert path.is_file(), f"{page.name}: {rel}"
            width = Image.open(path).width
            checked += 1
            if too_wide(width):
                wide.append(f"{page.name}: {rel} is {width} px (at most {MAX_PX})")
    assert checked >= 12, checked
    assert not wide, "\n".join(wide)


def test_the_width_check_can_fail() -> None:
    # the whole learning-curve figure (three panels a row) is what the pages showed before
    assert too_wide(1716) and not too_wide(825) and MAX_PX >= 900
    shown = "[![a](results/x/accuracy_arithmetic.png)](results/x/curves_arithmetic.png)"
    assert inline_figures(shown) == ["results/x/accuracy_arithmetic.png"]
