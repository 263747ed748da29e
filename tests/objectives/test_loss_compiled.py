"""The policy loss without host reads: :func:`gbmpo.objectives.compiled_policy_loss` (one
graph under ``torch.compile``) and the sync-free forms the eager loss takes off the CPU
(:func:`gbmpo.objectives.tensors.sync_free`).

* Every registered surrogate (every ``divergence_clip`` measure but the neural mirror's) and
  every regularizer compile into **one** graph (``fullgraph=True`` raises on any graph break),
  with the same loss, gradient and metrics as the eager function up to float rounding.
  ``aot_eager`` traces exactly what inductor compiles, without its code generation; one case
  runs through inductor itself.
* The sync-free forms (``where`` masking, the tangent ``where`` of k3, tensor token counts,
  no finite-loss check) give the same loss, gradient and metrics as the CPU forms, bit for
  bit, and leave one host read per call: the metrics.
* The checks that read values still run before the graph: a bad mask and a too-short
  ``max_len`` are refused with the eager function's errors.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from test_loss_registry import SURROGATE_CASES, _batch, _run  # same folder (pytest's rootdir)

from gbmpo.objectives import compiled_policy_loss, compute_policy_loss, get_surrogate
from gbmpo.objectives.regularizers import REGULARIZERS

#: every surrogate case with a regularizer, walking the regularizer list so that each one
#: appears too (the neural mirror's table evaluation reads its range back: not one graph)
_REGS = [r for r in REGULARIZERS.names() if r not in ("none", "neural_mirror")]
PAIRS = [(case, _REGS[i % len(_REGS)]) for i, case in enumerate(SURROGATE_CASES)]
PAIRS += [("clip", r) for r in _REGS[len(SURROGATE_CASES):]]


def _close(a: torch.Tensor | None, b: torch.Tensor | None, rtol: float) -> bool:
    if a is None or b is None:
        return a is None and b is None
    scale = max(float(b.abs().max()), 1e-30)
    return bool(torch.isfinite(a).all()) and float((a - b).abs().max()) <= rtol * scale


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize(("case", "reg"), PAIRS, ids=[f"{c}-{r}" for c, r in PAIRS])
def test_compiled_loss_is_one_graph_and_the_eager_loss(case, reg):
    name, params = SURROGATE_CASES[case]
    x = _batch(torch.float32)
    regs = [(reg, 0.05)]
    eager = _run(compute_policy_loss, x, get_surrogate(name, **params), regs, "grpo")
    fn = compiled_policy_loss(backend="aot_eager", fullgraph=True)
    comp = _run(fn, x, get_surrogate(name, **params), regs, "grpo")
    assert _close(comp[0], eager[0], 1e-6), (comp[0], eager[0])
    assert _close(comp[1], eager[1], 1e-5)
    assert list(comp[2]) == list(eager[2])
    for k, v in eager[2].items():
        assert abs(comp[2][k] - v) <= 1e-5 * max(abs(v), 1e-6), (k, comp[2][k], v)


@pytest.mark.parametrize("aggregation", ["bnpo", "dr_grpo", "seq_mean_token_sum"])
def test_compiled_loss_with_weights_terms_and_normalisers(aggregation):
    x = _batch(torch.float64)
    regs = [("kl_k3", 0.04), ("prob_l2", 0.0), ("rpg_rkl", 0.1)]
    kw: dict[str, Any] = {"max_len": 40, "num_sequences": 16, "num_tokens": 123.5,
                          "token_weights": torch.rand(12, 40, dtype=torch.float64)}  # fmt: skip
    surr = get_surrogate("cispo")
    eager = _run(compute_policy_loss, x, surr, regs, aggregation, **kw)
    comp = _run(compiled_policy_loss(backend="aot_eager", fullgraph=True), x, surr, regs,
                aggregation, **kw)  # fmt: skip
    assert _close(comp[0], eager[0], 1e-12) and _close(comp[1], eager[1], 1e-12)
    assert list(comp[2]) == list(eager[2])


@pytest.mark.skipif(
    os.environ.get("ATEN_CPU_CAPABILITY") == "default",
    reason="inductor emits at::vec code whose headers ATEN_CPU_CAPABILITY=default leaves out "
    "(a C++ compile error inside torch 2.13, before any gbmpo code runs)",
)
def test_compiled_loss_through_inductor():
    x = _batch(torch.float32)
    surr = get_surrogate("clip", eps_low=0.2, eps_high=0.28)
    eager = _run(compute_policy_loss, x, surr, [("kl_k3", 0.04)], "grpo")
    comp = _run(compiled_policy_loss(), x, surr, [("kl_k3", 0.04)], "grpo")
    assert _close(comp[0], eager[0], 1e-6) and _close(comp[1], eager[1], 1e-5)


def test_compiled_loss_keeps_the_value_checks():
    x = _batch(torch.float32)
    fn = compiled_policy_loss(backend="aot_eager")
    bad = x["mask"].clone()
    bad[0, 0] = 0.5
    with pytest.raises(ValueError, match="mask must contain only 0 and 1"):
        _run(fn, {**x, "mask": bad}, get_surrogate("clip"), [], "grpo")
    with pytest.raises(ValueError, match="max_len=8 is shorter than a completion with 40"):
        _run(fn, x, get_surrogate("clip"), [], "dr_grpo", max_len=8)


def _sync_free_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    for mod in ("tensors", "aggregate"):
        monkeypatch.setattr(sys.modules[f"gbmpo.objectives.{mod}"], "sync_free",
                            lambda x: True)  # fmt: skip


def _host_reads(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Count the tensor-to-python reads (each one a device synchronisation off the CPU)."""
    count: Counter[str] = Counter()
    for attr in ("__float__", "__int__", "__bool__", "item", "tolist"):
        orig = getattr(torch.Tensor, attr)

        def read(self: torch.Tensor, *a: Any, _orig: Any = orig, _attr: str = attr) -> Any:
            count[_attr] += 1
            return _orig(self, *a)

        monkeypatch.setattr(torch.Tensor, attr, read)
    return count


@pytest.mark.parametrize("case", list(SURROGATE_CASES))
def test_sync_free_forms_are_the_cpu_forms(case, monkeypatch):
    name, params = SURROGATE_CASES[case]
    x = _batch(torch.float32)
    regs = [("kl_k3", 0.04), ("prob_l2", 0.02), ("kl_k1", 0.0)]
    cpu = _run(compute_policy_loss, x, get_surrogate(name, **params), regs, "grpo")
    _sync_free_everywhere(monkeypatch)
    surr = get_surrogate(name, **params)
    _run(compute_policy_loss, x, surr, regs, "grpo")  # checks (and remembers) the mask
    reads = _host_reads(monkeypatch)
    free = _run(compute_policy_loss, x, surr, regs, "grpo")
    monkeypatch.undo()
    assert torch.equal(free[0], cpu[0]) and torch.equal(free[1], cpu[1])
    assert free[2] == cpu[2]
    assert reads == Counter(tolist=1), reads  # the metrics, nothing else
