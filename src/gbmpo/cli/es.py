"""``gbmpo es``: meta-learn a neural mirror map with evolution strategies (NM-GRPO-ES).

With no arguments it runs the embedded default (:data:`DEFAULT_ES_CONFIG`): the tiny model on
the built-in arithmetic task, population 4, 4 inner RL steps per member, 4 iterations, members on
a local process pool. Each iteration prints the population's fitness mean/std/min/max and
whether the step was accepted. The output directory holds ``es_state.json`` (iteration,
best_fitness, history, ...; the resolved configuration under ``"run"``), the parameters after
every iteration under ``theta/`` and ``best_mirror.json``, which trains with
``gbmpo train --regularizer neural_mirror --mirror DIR/best_mirror.json``.

A YAML ``--config FILE`` overrides any part of the default (its sections:
:mod:`gbmpo.meta.config`).

``--resume DIR`` continues a killed run with the configuration saved in it (only the execution
options ``--backend``, ``--workers``, ``--address`` and a larger ``--iterations`` may change).
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from gbmpo.cli.args import report_errors
from gbmpo.meta.backends import get_backend
from gbmpo.meta.checkpoint import load_state
from gbmpo.meta.config import load_es_config
from gbmpo.meta.es import ESConfig
from gbmpo.meta.fitness import TrainingFitness
from gbmpo.meta.runner import MIRROR_FILE, export_mirror_map, format_iteration, run_es_loop
from gbmpo.objectives.mirror import NeuralMirrorMap

__all__ = ["add_es_parser", "run_es"]


def add_es_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``es`` subcommand on an ``argparse`` subparsers object."""
    p = subparsers.add_parser(
        "es",
        help="meta-learn a neural mirror map with evolution strategies (NM-GRPO-ES)",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
        allow_abbrev=False,
    )
    _add_arguments(p)
    return p


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="YAML file overriding the embedded default")
    p.add_argument("--backend", choices=["local", "ray", "serial"], help="where members run")
    p.add_argument("--workers", type=int, metavar="W", help="local pool size (default: cores)")
    p.add_argument("--address", metavar="ADDR", help="Ray cluster address (ray backend)")
    p.add_argument("--output-dir", metavar="DIR", help="default: runs/es-<timestamp>")
    p.add_argument("--resume", metavar="DIR", help="continue the ES run saved in DIR")
    p.add_argument("--iterations", type=int, metavar="K", help="meta-iterations (es.iterations)")
    p.add_argument("--population", type=int, metavar="N", help="population size (es.population)")
    p.add_argument("--steps", type=int, metavar="T", help="inner RL steps per member")
    p.add_argument(
        "--print-config", action="store_true", help="print the resolved configuration and exit"
    )


def _make_backend(cfg: dict[str, Any]) -> Any:
    b = cfg["backend"]
    name = b["name"]
    if name == "local":
        return get_backend("local", workers=b.get("workers"), threads_per_worker=b.get("threads"))
    if name == "ray":
        return get_backend(
            "ray", address=b.get("address"), cpus_per_member=b.get("cpus_per_member") or 1
        )
    # one member at a time; 1 torch thread unless told otherwise (fastest for small models on a
    # shared CPU, as the trainer's own default)
    return get_backend(name, threads=b.get("threads") or 1)


def _execute(args: argparse.Namespace) -> int:
    if args.resume:
        if args.config or args.population or args.steps:
            raise ValueError("--resume uses the configuration saved in the run; drop --config, "
                             "--population and --steps")
        if args.output_dir and Path(args.output_dir) != Path(args.resume):
            raise ValueError("--resume DIR writes into DIR; drop --output-dir")
        _, doc = load_state(args.resume)
        cfg = doc["run"]
        out = Path(args.resume)
    else:
        cfg = load_es_config(args.config)
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        out = Path(args.output_dir) if args.output_dir else Path("runs") / f"es-{stamp}"
        if args.population is not None:
            cfg["es"]["population"] = args.population
        if args.steps is not None:
            cfg["fitness"]["steps"] = args.steps
    if args.iterations is not None:
        cfg["es"]["iterations"] = args.iterations
    if args.backend:
        cfg["backend"]["name"] = args.backend
    if args.workers is not None:
        cfg["backend"]["workers"] = args.workers
    if args.address:
        cfg["backend"]["address"] = args.address

    es_cfg = ESConfig.from_dict(cfg["es"])
    fitness = TrainingFitness(train_config=cfg["train"], **cfg["fitness"])
    if args.print_config:
        print(yaml.safe_dump(cfg, sort_keys=False), end="")
        return 0
    theta0 = NeuralMirrorMap.random(**cfg["init"]).to_unconstrained().numpy().astype(np.float64)
    # the execution options are not part of the trajectory: keep the saved ones on resume
    metadata = copy.deepcopy(cfg)

    backend = _make_backend(cfg)
    print(
        f"gbmpo es: N={es_cfg.population} T={fitness.steps} K={es_cfg.iterations} "
        f"estimator={es_cfg.estimator} backend={backend.describe()} -> {out}",
        flush=True,
    )
    try:
        state = run_es_loop(
            fitness,
            backend,
            es_cfg,
            out,
            theta0=None if args.resume else theta0,
            resume=bool(args.resume),
            metadata=metadata,
            export=lambda s, d: export_mirror_map(s, d / MIRROR_FILE),
            on_iteration=lambda s, entry: print(format_iteration(entry), flush=True),
        )
    finally:
        backend.close()
    accepted = sum(1 for h in state.history if h["accepted"])
    print(
        f"done: {state.iteration} iterations, {accepted} accepted, best population mean "
        f"{state.best_fitness:.4f}; state {out / 'es_state.json'}"
    )
    print(
        f"train with it: gbmpo train --regularizer neural_mirror --mirror {out / MIRROR_FILE}"
    )
    return 0


def run_es(args: argparse.Namespace) -> int:
    """Run ``gbmpo es`` from parsed arguments; returns the exit code (2 for bad input)."""
    return report_errors("es", lambda: _execute(args),
                         extra=(ValueError, FileExistsError, ImportError))
