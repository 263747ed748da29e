"""The cost of the divergence knob: policy-loss forward + backward against a TRL-style loss.

Times :func:`gbmpo.objectives.compute_policy_loss` (surrogate + ``coef`` * regularizer +
aggregation, with its metrics) forward and backward, for every surrogate x regularizer pair, on
one batch of a realistic shape (64 sequences x 1,024 tokens, ragged lengths, float32, one torch
thread), against a ten-line PPO clip + k3 loss written as TRL 1.16's ``GRPOTrainer._compute_loss``
writes it (``loss_type="grpo"``, ``beta=0.04``). Each pair is timed interleaved with the
baseline (baseline, pair, baseline, pair, ...) so that load from other jobs hits both alike;
the printed ratio is median(pair) / median(baseline) of the **CPU time** of the process (one
thread: the work done, far less sensitive to other jobs on a shared machine than wall time,
which is recorded too). A pair whose first call takes over 5 s (the neural-mirror clip measure
before its interval tables: a 2 x 60-step bisection over the map per token) is timed by that
one call; otherwise the first call is an untimed warm-up (it builds the neural-mirror interval
tables, cached per map and radius). ``neural_mirror_table`` and ``dc:neural_mirror_table`` use
the default map's tabulated evaluation (``NeuralMirrorMap.tabulated()``, the regularizer's
``evaluation: table``, its default since the table met its bound), in ``--before`` too where
that revision has it; ``neural_mirror_exact`` the 126 units per token (``evaluation: exact``).
``--ref-noise`` sets how far the reference log-probs lie from the policy's (the tabulated map's
cost depends on the share of tokens next to p = q).
``dc:neural_mirror*`` is timed with no regularizer only unless named in ``--regularizers``.

``--before REV`` also times the objectives package of git revision ``REV`` in the same run (its
``src/gbmpo/objectives`` is loaded from git under another module name), so that a speed change
is reported before / after from one run on one machine state; a case that revision cannot
build (a name or parameter it lacks) shows "-".

Goals: every sampled-token objective <= 1.5x the TRL-style loss; the neural mirror map (as a
regularizer or a clip measure) <= 3x.

    PYTHONPATH=src python benchmarks/objective_cost.py --before 45b681b --out results.json

``--compile`` times :func:`gbmpo.objectives.compiled_policy_loss` (a fresh compile per pair)
against the TRL-style loss under ``torch.compile`` and against it eager; on a GPU
(``--device cuda``) each timing is the mean of 20 calls between two synchronizes.

    python benchmarks/objective_cost.py --device cuda --compile --surrogates clip
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, finish_result, load_average, median, start_result  # noqa: E402

B, T = 64, 1024
BETA = 0.04

#: name -> surrogate parameters (the ``divergence_clip`` measures one by one)
SURROGATE_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "clip": ("clip", {"eps_low": 0.2, "eps_high": 0.28}),
    "clip+dual": ("clip", {"eps_low": 0.2, "eps_high": 0.28, "dual_clip_c": 3.0}),
    "gspo": ("gspo", {}),
    "atr": ("atr", {"delta": 0.02}),
    "dc:k1": ("divergence_clip", {"measure": "k1", "delta": 0.2}),
    "dc:prob_l2": ("divergence_clip", {"measure": "prob_l2", "delta": 0.02}),
    "dc:neural_mirror": ("divergence_clip", {"measure": "neural_mirror", "delta": 0.01}),
    "dc:neural_mirror_table": (
        "divergence_clip",
        {"measure": "neural_mirror", "delta": 0.01, "mirror": "table"},
    ),
    "dc:dppo_tv": ("divergence_clip", {"measure": "dppo_tv", "delta": 0.15}),
    "dc:dppo_kl": ("divergence_clip", {"measure": "dppo_kl", "delta": 0.05}),
    "rpg_clip": ("rpg_clip", {"variant": "urkl", "beta": 1e-4}),
    "rpg_reinforce": ("rpg_reinforce", {"variant": "urkl"}),
    "cispo": ("cispo", {}),
    "sapo": ("sapo", {}),
    "gmpo": ("gmpo", {}),
    "vespo": ("vespo", {}),
}
REGULARIZER_CASES = ["none", "kl_k1", "kl_k3", "kl_k3_is", "prob_l2", "log_l2", "neural_mirror",
                     "neural_mirror_table", "neural_mirror_exact", "rpg_rkl",
                     "rpg_urkl"]  # fmt: skip
#: cases that need ``NeuralMirrorMap.tabulated`` (a revision without it shows "-")
TABLE_CASES = {"dc:neural_mirror_table", "neural_mirror_table"}


def _tabulated_map(objectives: ModuleType) -> Any:
    """``neural_mirror_table`` / ``"mirror": "table"``: the default map (random(0.01, 42)) with
    its explicit tabulated evaluation (``NeuralMirrorMap.tabulated()``)."""
    return objectives.NeuralMirrorMap.random(scale=0.01, seed=42).tabulated()


def trl_style_loss(logp, old, ref, adv, mask, eps_low=0.2, eps_high=0.28, beta=BETA):  # noqa: ANN001, ANN201
    """PPO clip + beta * k3, grpo aggregation, as TRL 1.16's _compute_loss computes it."""
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)
    per_token_kl = torch.exp(ref - logp) - (ref - logp) - 1
    per_token_loss = per_token_loss + beta * per_token_kl
    return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def make_batch(
    seed: int = 0, b: int = B, t: int = T, ref_noise: float = 0.2
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(t // 4, t + 1, (b,), generator=g)
    lens[0] = t
    mask = (torch.arange(t)[None, :] < lens[:, None]).float()
    # log-probs of sampled tokens: mostly likely tokens, a tail of rare ones
    logp = -torch.distributions.Exponential(2.0).sample((b, t))
    old = logp + 0.1 * torch.randn(b, t, generator=g)
    ref = logp + ref_noise * torch.randn(b, t, generator=g)
    adv = torch.randn(b, 1, generator=g)
    return {"logp": logp, "old": old, "ref": ref, "adv": adv, "mask": mask}


def load_objectives(rev: str) -> ModuleType:
    """``gbmpo.objectives`` of git revision ``rev``, imported as ``_objectives_<rev>``."""
    name = "_objectives_" + rev.replace("-", "_").replace(".", "_")
    tmp = Path(tempfile.mkdtemp(prefix="objectives_before_"))
    pkg = tmp / name
    pkg.mkdir()
    files = subprocess.run(  # -r: the objectives may hold subpackages (surrogates/)
        ["git", "ls-tree", "-r", "--name-only", rev, "src/gbmpo/objectives/"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    for f in files:
        if not f.endswith(".py"):
            continue
        text = subprocess.run(["git", "show", f"{rev}:{f}"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout  # fmt: skip
        dest = pkg / Path(f).relative_to("src/gbmpo/objectives")
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(text.replace("gbmpo.objectives", name))
    sys.path.insert(0, str(tmp))
    return importlib.import_module(name)


def make_step(objectives: ModuleType, surrogate: tuple[str, dict[str, Any]], regularizer: str,
              x: dict[str, torch.Tensor], compile_: bool = False,
              read_metrics: bool = True):  # noqa: ANN201  # fmt: skip
    params = dict(surrogate[1])
    if params.get("mirror") == "table":
        params["mirror"] = _tabulated_map(objectives)
    surr = objectives.get_surrogate(surrogate[0], **params)
    if regularizer == "none":
        reg = None
    elif regularizer == "neural_mirror_table":
        reg = objectives.get_regularizer("neural_mirror", mirror=_tabulated_map(objectives))
    elif regularizer == "neural_mirror_exact":  # the 126 units per token, whatever the default
        mirror = objectives.NeuralMirrorMap.random(scale=0.01, seed=42)
        reg = objectives.get_regularizer("neural_mirror", mirror=mirror, **(
            {"evaluation": "exact"} if hasattr(mirror, "tabulated") else {}))  # fmt: skip
    else:
        reg = objectives.get_regularizer(regularizer)
    coef = 0.0 if reg is None else BETA
    adv = x["adv"][:, 0]
    # the regularizer as a list of terms; a --before revision older than that takes
    # regularizer= / coef= / ref_logp= instead
    if "regularizer" in inspect.signature(objectives.compute_policy_loss).parameters:
        reg_kw: dict[str, Any] = {"regularizer": reg, "coef": coef, "ref_logp": x["ref"]}
    else:
        reg_kw = {"terms": [] if reg is None else
                  [objectives.LossTerm(reg.name, reg, coef, x["ref"])]}  # fmt: skip

    if compile_:  # a fresh compile cache per pair (one objective per run, as in training)
        torch._dynamo.reset()
    policy_loss = (objectives.compiled_policy_loss() if compile_
                   else objectives.compute_policy_loss)  # fmt: skip
    if compile_ and not read_metrics:
        # the compiled graph alone: the metrics stay on the device (the attribution of their
        # one host read; not a public mode)
        core = torch.compile(importlib.import_module(objectives.__name__ + ".loss")._policy_loss)

        def policy_loss(**kw: Any) -> tuple[torch.Tensor, None]:
            kw.setdefault("max_len", None)
            kw.setdefault("num_sequences", None)
            kw.setdefault("num_tokens", None)
            kw.setdefault("token_weights", None)
            return core(**kw)[0], None

    def step() -> None:
        lp = x["logp"].clone().requires_grad_(True)
        loss, _ = policy_loss(
            logp=lp, old_logp=x["old"], advantages=adv, mask=x["mask"], surrogate=surr,
            aggregation="grpo", **reg_kw,
        )  # fmt: skip
        loss.backward()

    return step


def baseline_step(x: dict[str, torch.Tensor], compile_: bool = False):  # noqa: ANN201
    loss_fn = torch.compile(trl_style_loss) if compile_ else trl_style_loss

    def step() -> None:
        lp = x["logp"].clone().requires_grad_(True)
        loss_fn(lp, x["old"], x["ref"], x["adv"], x["mask"]).backward()

    return step


#: set by ``--device``: on a GPU a timing is of ``CUDA_CALLS`` calls between two synchronizes
#: (per call), and the ratio is of wall time (the CPU time of the launching thread says nothing
#: about the kernels)
ON_CUDA = False
CUDA_CALLS = 20


def _time(fn) -> tuple[float, float]:  # noqa: ANN001
    """(CPU seconds, wall seconds) of one call (on a GPU: the mean of ``CUDA_CALLS`` calls)."""
    calls = CUDA_CALLS if ON_CUDA else 1
    if ON_CUDA:
        torch.cuda.synchronize()
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(calls):
        fn()
    if ON_CUDA:
        torch.cuda.synchronize()
    return (time.process_time() - c0) / calls, (time.perf_counter() - t0) / calls


SLOW_S = 5.0


def time_pair(fn, base, reps: int, compiled: bool = False) -> dict[str, float]:  # noqa: ANN001
    """Median CPU and wall seconds of ``fn`` and of ``base``, interleaved, after one warm-up
    call each (a first call of ``fn`` over ``SLOW_S`` is the measurement itself, unless
    ``compiled``: then the first call is the compile, recorded as ``first_s``, and a second
    warm-up call follows)."""
    t0 = time.perf_counter()
    fn()
    if ON_CUDA:
        torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    first = (first_s, first_s)
    if compiled:
        fn()
        first = (0.0, 0.0)
    base()
    runs = [first] if first[1] > SLOW_S else []
    bases = []
    for _ in range(reps):
        bases.append(_time(base))
        if first[1] <= SLOW_S:
            runs.append(_time(fn))
    return {
        "first_s": first_s,
        "cpu": median([r[0] for r in runs]),
        "wall": median([r[1] for r in runs]),
        "base_cpu": median([b[0] for b in bases]),
        "base_wall": median([b[1] for b in bases]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=11, help="timed calls per pair (median)")
    ap.add_argument("--before", default=None, help="git revision to time as 'before' too")
    ap.add_argument("--surrogates", default=None,
                    help="comma-separated subset of: " + ", ".join(SURROGATE_CASES))
    ap.add_argument("--regularizers", default=None,
                    help="comma-separated subset of: " + ", ".join(REGULARIZER_CASES))
    ap.add_argument("--out", default=None, help="result JSON (default benchmarks/results/...)")
    ap.add_argument("--shape", default=f"{B},{T}", help="sequences,tokens (default %(default)s)")
    ap.add_argument("--ref-noise", type=float, default=0.2,
                    help="log ref = log p + this * N(0, 1) (default %(default)s; small values "
                         "put every token next to p = q)")
    ap.add_argument("--device", default="cpu",
                    help="cpu (CPU-time ratios, one thread) or cuda (wall-time ratios, "
                         "synchronized)")
    ap.add_argument("--compile", action="store_true",
                    help="time gbmpo.objectives.compiled_policy_loss against the TRL-style loss "
                         "under torch.compile too (the eager TRL-style loss is timed once at "
                         "the start, for a second ratio); not with --before")
    ap.add_argument("--no-metrics-read", action="store_true",
                    help="with --compile: leave the metrics on the device (no host read per "
                         "call), to attribute that read's cost")
    a = ap.parse_args()
    if a.no_metrics_read and not a.compile:
        ap.error("--no-metrics-read needs --compile")
    if a.compile and a.before:
        ap.error("--compile times this revision's compiled_policy_loss; leave out --before")
    global ON_CUDA
    ON_CUDA = a.device.startswith("cuda")
    try:
        b, t = (int(v) for v in a.shape.split(","))
    except ValueError:
        ap.error(f"--shape must be two integers 'B,T', got {a.shape!r}")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    sur_names = a.surrogates.split(",") if a.surrogates else list(SURROGATE_CASES)
    reg_names = a.regularizers.split(",") if a.regularizers else list(REGULARIZER_CASES)
    for n in sur_names:
        if n not in SURROGATE_CASES:
            ap.error(f"unknown surrogate case {n!r}; valid: {', '.join(SURROGATE_CASES)}")
    for n in reg_names:
        if n not in REGULARIZER_CASES:
            ap.error(f"unknown regularizer {n!r}; valid: {', '.join(REGULARIZER_CASES)}")

    import gbmpo.objectives as after

    versions: dict[str, ModuleType] = {"after": after}
    if a.before:
        versions = {"before": load_objectives(a.before), "after": after}
    x = {k: v.to(a.device) for k, v in make_batch(b=b, t=t, ref_noise=a.ref_noise).items()}
    base = baseline_step(x)
    result = start_result("objective_cost")
    result.update({"shape": [b, t], "tokens": int(x["mask"].sum()), "threads": 1,
                   "ref_noise": a.ref_noise,
                   "device": a.device, "compile": a.compile,
                   "metrics_read": not a.no_metrics_read,
                   "device_name": torch.cuda.get_device_name() if ON_CUDA else None,
                   "torch": torch.__version__,
                   "before": a.before, "rows": []})  # fmt: skip
    base()
    clock = 1 if ON_CUDA else 0  # index into _time's (CPU, wall)
    unit = "wall" if ON_CUDA else "CPU"
    base_t = median([_time(base)[clock] for _ in range(max(3, a.reps))])
    where = torch.cuda.get_device_name() if ON_CUDA else a.device
    print(f"TRL-style clip + k3 loss, fwd+bwd, {b}x{t} ({int(x['mask'].sum())} valid tokens), "
          f"{where}, torch {torch.__version__}, 1 thread: {base_t * 1e3:.3f} ms {unit}; "
          f"load {load_average()}")  # fmt: skip
    result["eager_baseline_ms"] = base_t * 1e3
    if a.compile:
        base = baseline_step(x, compile_=True)
        base()
        base()
        cbase_t = median([_time(base)[clock] for _ in range(max(3, a.reps))])
        result["compiled_baseline_ms"] = cbase_t * 1e3
        print(f"the same loss under torch.compile: {cbase_t * 1e3:.3f} ms {unit}; the pairs "
              "below are compiled_policy_loss; 'x' is against the compiled TRL-style loss, "
              "'x eager' against the eager one")  # fmt: skip
    print(f"ratios: {unit} time of the pair / {unit} time of the TRL-style loss, interleaved")
    cols = list(versions)
    print(f"{'surrogate':18s} {'regularizer':14s} " + " ".join(f"{c + ' ms':>10s} {c + ' x':>8s}"
                                                        for c in cols))  # fmt: skip
    for sn in sur_names:
        for rn in reg_names:
            if sn.startswith("dc:neural_mirror") and rn != "none" and not a.regularizers:
                continue
            row: dict[str, Any] = {"surrogate": sn, "regularizer": rn}
            cells = []
            for c, mod in versions.items():
                no_table = not hasattr(mod.NeuralMirrorMap, "tabulated")
                if c == "before" and no_table and (sn in TABLE_CASES or rn in TABLE_CASES):
                    cells.append(f"{'-':>10s} {'-':>8s}")
                    continue
                try:
                    fn = make_step(mod, SURROGATE_CASES[sn], rn, x, compile_=a.compile,
                                   read_metrics=not a.no_metrics_read)
                except Exception:  # noqa: BLE001 - a name or parameter this revision lacks
                    if c != "before":
                        raise
                    cells.append(f"{'-':>10s} {'-':>8s}")
                    continue
                t = time_pair(fn, base, a.reps, compiled=a.compile)
                ratio = t["wall"] / t["base_wall"] if ON_CUDA else t["cpu"] / t["base_cpu"]
                row[c] = {"cpu_ms": t["cpu"] * 1e3, "wall_ms": t["wall"] * 1e3,
                          "baseline_cpu_ms": t["base_cpu"] * 1e3,
                          "baseline_wall_ms": t["base_wall"] * 1e3, "ratio_cpu": ratio,
                          "ratio_wall": t["wall"] / t["base_wall"],
                          "first_call_s": t["first_s"]}  # fmt: skip
                ms = (t["wall"] if ON_CUDA else t["cpu"]) * 1e3
                cells.append(f"{ms:10.3f} {ratio:8.2f}")
                if a.compile:
                    row[c]["ratio_vs_eager_baseline"] = ms / (base_t * 1e3)
                    cells.append(f"{ms / (base_t * 1e3):8.2f} eager, compile "
                                 f"{t['first_s']:.1f} s")  # fmt: skip
            result["rows"].append(row)
            print(f"{sn:18s} {rn:14s} " + " ".join(cells), flush=True)
    # the summary of the sampled-token pairs (the neural mirror's have a goal of their own), also
    # against the run's median baseline: the baseline's own time moves between pairs (1.4-3.3 ms
    # CPU in one idle run), and so does a pair's ratio to its interleaved baseline
    for c in cols:
        timed = [r for r in result["rows"] if c in r]
        if not timed:
            continue
        key = "wall_ms" if ON_CUDA else "cpu_ms"
        run_base = median([r[c]["baseline_" + key] for r in timed])
        for r in timed:
            r[c]["ratio_run_median"] = r[c][key] / run_base
        result[f"{c}_run_median_baseline_ms"] = run_base
        sampled = [r[c] for r in timed
                   if "neural_mirror" not in r["surrogate"] + r["regularizer"]]  # fmt: skip
        if not sampled:
            continue
        for label, name in (("interleaved", "ratio_cpu"), ("run-median", "ratio_run_median")):
            xs = sorted(v[name] for v in sampled)
            print(f"{c}, {len(xs)} sampled-token pairs, {label} baseline: median "
                  f"{median(xs):.2f}x, worst {xs[-1]:.2f}x, {sum(x <= 1.5 for x in xs)} within "
                  f"1.5x")  # fmt: skip
    path = finish_result(result, a.out)
    print(f"load at end {load_average()}; written {path}")


if __name__ == "__main__":
    main()
