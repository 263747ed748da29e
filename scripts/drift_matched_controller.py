"""The controlled coefficients of a ``gbmpo compare --match-drift`` run, per step: extracted from
each run's ``metrics.jsonl`` into one small JSON (the runs' directories are not committed) and
drawn as two one-panel figures sized for the results page.

    python scripts/drift_matched_controller.py COMPARE_DIR docs/results/drift-matched

writes ``controller.json`` (per arm and seed: the coefficient and the measure of every step, the
target, and the measure's mean over the second half of the steps), ``controller_coef.png``
(the coefficient against the step, log scale, one line per run) and
``controller_measure.png`` (the measure's running mean over 10 steps against the step, with
the target).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

#: the running mean drawn in controller_measure.png (the measure is heavy-tailed step to step)
WINDOW = 10
#: the width of each figure in pixels at its dpi (the page's column is ~690 px)
WIDTH_IN, HEIGHT_IN, DPI = 7.0, 3.6, 110


def _series(metrics: Path) -> tuple[str, list[float], list[float]]:
    """The controlled term's name, its coefficient and its measure per RL step."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if any(k.startswith("drift_coef/") for k in r)]
    (key,) = [k for k in rows[0] if k.startswith("drift_coef/")]
    term = key.removeprefix("drift_coef/")
    return term, [r[key] for r in rows], [r[f"drift_measure/{term}"] for r in rows]


def extract(compare_dir: Path) -> dict[str, dict[str, dict[str, object]]]:
    """``{arm: {seed: {term, target, coef, measure, second_half_mean}}}`` of every run."""
    out: dict[str, dict[str, dict[str, object]]] = {}
    for metrics in sorted(compare_dir.glob("runs/*/*/seed*/metrics.jsonl")):
        run = metrics.parent
        config = yaml.safe_load((run / "config.yaml").read_text())
        target = float(config["objective"]["regularizer"]["control"]["target"])
        term, coef, measure = _series(metrics)
        half = measure[len(measure) // 2:]
        out.setdefault(run.parent.name, {})[run.name.removeprefix("seed")] = {
            "term": term, "target": target, "coef": coef, "measure": measure,
            "second_half_mean": sum(half) / len(half),
        }  # fmt: skip
    return out


def _running_mean(ys: list[float], j: int) -> float:
    window = ys[max(0, j - WINDOW + 1):j + 1]
    return sum(window) / len(window)


def plot(data: dict[str, dict[str, dict[str, object]]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    panels = (("coef", "coefficient", True),
              ("measure", f"rollout k3, mean of {WINDOW} steps", False))  # fmt: skip
    for name, ylabel, log in panels:
        fig, ax = plt.subplots(figsize=(WIDTH_IN, HEIGHT_IN), dpi=DPI)
        target = None
        for color, (arm, seeds) in zip(colors, sorted(data.items()), strict=False):
            for i, (_, run) in enumerate(sorted(seeds.items())):
                ys = list(run[name])  # type: ignore[call-overload]
                if name == "measure":
                    ys = [_running_mean(ys, j) for j in range(len(ys))]
                    target = run["target"]
                ax.plot(range(1, len(ys) + 1), ys, color=color, lw=1.2,
                        label=arm if i == 0 else None)  # fmt: skip
        if target is not None:
            ax.axhline(float(target), color="black", ls="--", lw=1, label="target")  # type: ignore[arg-type]
        if log:
            ax.set_yscale("log")
        ax.set_xlabel("RL step")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8, ncol=3)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / f"controller_{name}.png")
        plt.close(fig)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[3].strip(), file=sys.stderr)
        return 2
    compare_dir, out = Path(argv[0]), Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    data = extract(compare_dir)
    (out / "controller.json").write_text(json.dumps(data, indent=1) + "\n")
    plot(data, out)
    for arm, seeds in sorted(data.items()):
        means = ", ".join(f"{float(r['second_half_mean']):.4f}" for _, r in sorted(seeds.items()))  # type: ignore[arg-type]
        print(f"{arm}: second-half mean of the measure per seed {means}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
