"""The run directories of one command (one per seed) as one small result file: each run's seed,
RL steps, RL seconds, held-out accuracy before and after and end-of-run drift, read from its
``summary.json`` (the run directories themselves are not committed).

    python scripts/collect_summaries.py OUT.json "COMMAND" DIR [DIR ...]

``COMMAND`` is recorded as given (the command each run was made with).
"""

from __future__ import annotations

import json
import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path


def run_row(run_dir: Path) -> dict[str, object]:
    """One run's row from its ``summary.json``."""
    s = json.loads((run_dir / "summary.json").read_text())
    drift = s.get("drift") or {}
    return {
        "seed": s["seed"], "steps": s["steps"], "stop_reason": s["stop_reason"],
        "rl_seconds": s["rl_seconds"], "wall_seconds": s["wall_seconds"],
        "before": s["eval_before"]["accuracy"], "after": s["eval_after"]["accuracy"],
        "eval_n": s["eval_after"]["n"], "drift_kl": drift.get("kl"),
    }  # fmt: skip


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__.strip().splitlines()[4].strip(), file=sys.stderr)
        return 2
    out, command, dirs = Path(argv[0]), argv[1], [Path(d) for d in argv[2:]]
    result = {
        "command": command,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores",
        "runs": [run_row(d) for d in dirs],
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
