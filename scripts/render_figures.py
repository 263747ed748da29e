"""The figures that docs/results.md shows inline, sized to read at the page's width:

* ``accuracy_TASK.png`` next to each comparison's ``curves_TASK.png``: its held-out accuracy
  panel with the figure's legend below it, cut from the learning-curve figure at full
  resolution (the runs' ``metrics.jsonl`` files the curves were drawn from are not in the
  repository, so the panel is cut, not redrawn). The page links the whole figure from it.
* ``frontier_TASK.png`` of the frontier comparisons, redrawn from their ``results.json`` by
  :func:`gbmpo.experiments.plots.plot_frontier` (accuracy in %, every evaluated point marked).

    python scripts/render_figures.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"

#: the comparisons whose curves the results page shows, and the number of panels each figure
#: has (six fixed panels, then one per regularizer of the grid; three panels a row)
CURVES = ["arithmetic-150-seed5", "arithmetic-150-seed3", "arithmetic-150", "arithmetic",
          "clip-measures", "clip-measures-tight", "divergence-knob", "engines", "engines-verl",
          "es-variance"]  # fmt: skip
#: the frontier figures redrawn, with their titles
FRONTIERS = {
    "frontier": "Accuracy against drift from the reference, tiny model (60 steps, 3 seeds)",
    "frontier-50m-gpu": ("Accuracy against drift, 55M-parameter Qwen3 on one H100 "
                         "(60 steps, 2 seeds)"),
}


#: widest inline figure whose smallest text stays >= 9 px at the page's width (see
#: tests/test_docs_figures.py)
MAX_WIDTH = 900


def _spines(gray: object, x0: int, x1: int) -> tuple[int, int]:
    """The rows of the top and bottom spine of the panel between columns ``x0`` and ``x1``
    (``gray``: the figure as a 2-D uint8 array): the first two rows (20 px apart at least) that
    are dark over most of the panel's width."""
    dark = (gray[:, x0:x1] < 100).sum(axis=1)
    found: list[int] = []
    for y in range(len(dark)):
        if dark[y] > 0.5 * (x1 - x0) and (not found or y > found[-1] + 20):
            found.append(y)
            if len(found) == 2:
                return found[0], found[1]
    raise ValueError("no panel frame found")


def _split_legend(legend: object) -> list[object]:
    """A legend strip wider than :data:`MAX_WIDTH` cut at the white gap (18 px or more, between
    two entries) nearest its middle, recursively."""
    from PIL import ImageOps

    if legend.width <= MAX_WIDTH:
        return [legend]
    gray = ImageOps.grayscale(legend)
    px = gray.load()
    white = [all(px[x, y] > 245 for y in range(gray.height)) for x in range(gray.width)]
    gaps, run = [], 0
    for x, w in enumerate(white + [False]):
        if w:
            run += 1
        elif run:
            if run >= 18:
                gaps.append(x - run // 2)
            run = 0
    if not gaps:
        return [legend]
    cut = min(gaps, key=lambda g: abs(g - legend.width / 2))
    left = legend.crop((0, 0, cut, legend.height))
    right = legend.crop((cut, 0, legend.width, legend.height))
    parts = []
    for part in (left, right):
        box = ImageOps.invert(part).getbbox()
        parts += _split_legend(part.crop((max(0, box[0] - 6), 0, min(part.width, box[2] + 6),
                                          part.height)) if box else part)  # fmt: skip
    return parts


def accuracy_panel(curves: Path, out: Path) -> Path:
    """Cut the held-out accuracy panel (the first row's middle one, with its title, ticks and
    axis label) and the legend (below the panels, rewrapped to at most :data:`MAX_WIDTH` px) out
    of a ``plot_curves`` figure and stack them."""
    import numpy as np
    from PIL import Image, ImageOps

    im = Image.open(curves).convert("RGB")
    w, h = im.size
    x0, x1 = w // 3, 2 * w // 3
    top, bottom = _spines(np.asarray(ImageOps.grayscale(im)), x0 + 60, x1 - 20)
    # the title sits ~25 px above the frame, tick labels and "RL step" ~45 px below it
    panel = im.crop((x0, max(0, top - 32), x1, min(h, bottom + 50)))
    legend = im.crop((0, int(0.94 * h), w, h))
    box = ImageOps.invert(legend).getbbox()
    if box:
        legend = legend.crop((max(0, box[0] - 10), max(0, box[1] - 6), min(w, box[2] + 10),
                              min(legend.height, box[3] + 6)))  # fmt: skip
    parts = [panel, *_split_legend(legend)]
    width = max(p.width for p in parts)
    canvas = Image.new("RGB", (width, sum(p.height for p in parts)), "white")
    y = 0
    for p in parts:
        canvas.paste(p, ((width - p.width) // 2, y))
        y += p.height
    canvas.save(out, optimize=True)
    return out


def main() -> int:
    from gbmpo.experiments.plots import plot_frontier

    for name in CURVES:
        src = RESULTS / name / "curves_arithmetic.png"
        accuracy_panel(src, src.with_name("accuracy_arithmetic.png"))
    for name, title in FRONTIERS.items():
        task = json.loads((RESULTS / name / "results.json").read_text())["tasks"][0]
        plot_frontier(task["frontier"], RESULTS / name / f"frontier_{task['task']}.png",
                      title=title)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
