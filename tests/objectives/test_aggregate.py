import math

import pytest
import torch

from gbmpo.objectives import AGGREGATIONS, aggregate
from gbmpo.registry import UnknownNameError

F64 = torch.float64
MODES = ["grpo", "bnpo", "dr_grpo", "seq_mean_token_sum"]


def ragged(b=8, t=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, generator=g, dtype=F64).requires_grad_()
    lengths = torch.tensor([1, 7, 3, 5, 2, 7, 4, 6])[:b]
    mask = (torch.arange(t)[None, :] < lengths[:, None]).to(F64)
    return x, mask, lengths


def test_formulas_by_hand():
    x, mask, lengths = ragged()
    v = x.detach()
    tok_sum = (v * mask).sum(-1)
    b, t = v.shape
    expected = {
        "grpo": (tok_sum / lengths).mean(),
        "bnpo": tok_sum.sum() / lengths.sum(),
        "dr_grpo": tok_sum.sum() / (b * t),
        "seq_mean_token_sum": tok_sum.mean(),
    }
    for mode in MODES:
        torch.testing.assert_close(aggregate(v, mask, mode), expected[mode].to(F64))
    torch.testing.assert_close(aggregate(v, mask, "dr_grpo", max_len=20), tok_sum.sum() / (b * 20))


def test_dr_grpo_equals_bnpo_when_every_completion_has_max_length():
    x, _, _ = ragged()
    full = torch.ones_like(x)
    torch.testing.assert_close(aggregate(x, full, "dr_grpo"), aggregate(x, full, "bnpo"))
    torch.testing.assert_close(aggregate(x, full, "dr_grpo", max_len=7), aggregate(x, full, "grpo"))
    # and differs once lengths are ragged
    _, mask, _ = ragged()
    assert not torch.allclose(aggregate(x, mask, "dr_grpo"), aggregate(x, mask, "bnpo"))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("k", [1, 2, 4])
def test_micro_batches_sum_to_full_batch_loss_and_gradient(mode, k):
    x, mask, lengths = ragged(seed=k)
    b, t = x.shape
    full = aggregate(x, mask, mode, max_len=t)
    (g_full,) = torch.autograd.grad(full, x)
    totals = {"num_sequences": b, "num_tokens": float(mask.sum())}
    micro = []
    for rows in torch.arange(b).chunk(k):
        # each micro-batch is re-padded to its own longest completion, as a collator would
        width = int(lengths[rows].max())
        micro.append(aggregate(x[rows, :width], mask[rows, :width], mode, max_len=t, **totals))
    total = torch.stack(micro).sum()
    torch.testing.assert_close(total, full)
    (g_micro,) = torch.autograd.grad(total, x)
    torch.testing.assert_close(g_micro, g_full)
    if k > 1 and mode != "bnpo":
        # without the full-batch normalisers the sum is wrong (the test can fail)
        naive = sum(aggregate(x[r], mask[r], mode, max_len=t) for r in torch.arange(b).chunk(k))
        assert not torch.allclose(naive, full)


def test_masked_positions_are_ignored_even_if_not_finite():
    x, mask, _ = ragged()
    garbage = torch.where(mask > 0, x.detach(), torch.full_like(mask, math.nan))
    for mode in MODES:
        out = aggregate(garbage, mask.bool(), mode)
        assert torch.isfinite(out)
        torch.testing.assert_close(out, aggregate(x.detach(), mask, mode))


def test_empty_rows_count_in_b_and_contribute_zero():
    x = torch.tensor([[2.0, 4.0], [9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    assert float(aggregate(x, mask, "grpo")) == pytest.approx(1.5)
    assert float(aggregate(x, mask, "bnpo")) == pytest.approx(3.0)
    assert float(aggregate(x, torch.zeros_like(mask), "bnpo")) == 0.0


def test_bf16_gives_float32():
    x, mask, _ = ragged()
    for mode in MODES:
        out = aggregate(x.detach().to(torch.bfloat16), mask.to(torch.bfloat16), mode)
        assert out.dtype == torch.float32 and torch.isfinite(out)


def test_errors():
    x, mask, _ = ragged()
    with pytest.raises(UnknownNameError, match="bnpo, dr_grpo, grpo, seq_mean_token_sum"):
        aggregate(x, mask, "token-mean")
    assert set(AGGREGATIONS.names()) == set(MODES)
    with pytest.raises(ValueError, match="needs an explicit max_len"):
        aggregate(x, mask, "dr_grpo", num_sequences=16)
    with pytest.raises(ValueError, match="max_len=5 is shorter"):
        aggregate(x, mask, "dr_grpo", max_len=5)
    with pytest.raises(ValueError, match="num_sequences=4"):
        aggregate(x, mask, "grpo", num_sequences=4)
    with pytest.raises(ValueError, match="mask shape"):
        aggregate(x, mask[:, :3], "bnpo")
    with pytest.raises(ValueError, match="only 0 and 1"):
        aggregate(x, mask * 0.5, "bnpo")
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        aggregate(x[0], mask[0], "bnpo")


# --- num_tokens: a float normaliser Z, possibly below the local token count -------------------


@pytest.mark.parametrize("fraction", [0.25, 0.5, 1.0, 3.0])
def test_num_tokens_is_used_exactly_even_below_the_local_count(fraction):
    """bnpo = sum(m * l) / Z for any finite Z > 0: Z below the local count (data-parallel
    normaliser N_global / P on a process holding more than its share) scales the loss and
    gradient by local / Z exactly."""
    x, mask, _ = ragged()
    local = float(mask.sum())  # 35 tokens
    z = fraction * local
    out = aggregate(x, mask, "bnpo", num_tokens=z)
    torch.testing.assert_close(out, (x.detach() * mask).sum() / z, rtol=1e-15, atol=0)
    torch.testing.assert_close(out, aggregate(x, mask, "bnpo") * (local / z), rtol=1e-14, atol=0)
    (g,) = torch.autograd.grad(out, x)
    torch.testing.assert_close(g, mask / z, rtol=1e-15, atol=0)


def test_num_tokens_below_one_is_not_clamped():
    """An explicit Z is used as given (TRL dapo: max(1, N) / P * G_acc / S_gen can be < 1); the
    >= 1 clamp applies only to the default (this mask's count)."""
    x = torch.tensor([[2.0, 4.0], [9.0, 9.0]], dtype=F64)
    mask = torch.tensor([[1.0, 0.0], [0.0, 0.0]], dtype=F64)
    assert float(aggregate(x, mask, "bnpo", num_tokens=0.25)) == 8.0
    assert float(aggregate(x, mask, "bnpo")) == 2.0
    assert float(aggregate(x, torch.zeros_like(mask), "bnpo", num_tokens=0.25)) == 0.0


@pytest.mark.parametrize("accum", [1, 2])
def test_data_parallel_average_with_global_token_normaliser(accum):
    """P = 2 processes with unequal token counts, each splitting its rows into ``accum``
    micro-batches: with Z = N_global / P, the process-average (DDP) of the summed micro-batch
    losses and gradients equals the global token mean, although Z is below the heavier
    process's local count."""
    x, mask, _ = ragged()  # lengths [1, 7, 3, 5, 2, 7, 4, 6]
    full = aggregate(x, mask, "bnpo")
    (g_full,) = torch.autograd.grad(full, x)
    procs = [torch.tensor([1, 3, 5, 7]), torch.tensor([0, 2, 4, 6])]  # 25 and 10 tokens
    p = len(procs)
    z = float(mask.sum()) / p  # 17.5
    assert float(mask[procs[0]].sum()) > z
    per_proc = []
    for rows in procs:
        per_proc.append(
            sum(aggregate(x[r], mask[r], "bnpo", num_tokens=z) for r in rows.chunk(accum))
        )
    averaged = torch.stack(per_proc).mean()
    torch.testing.assert_close(averaged, full)
    (g_avg,) = torch.autograd.grad(averaged, x)
    torch.testing.assert_close(g_avg, g_full)


def test_modes_without_a_token_denominator_ignore_num_tokens():
    x, mask, _ = ragged()
    for mode in ("grpo", "dr_grpo", "seq_mean_token_sum"):
        torch.testing.assert_close(
            aggregate(x, mask, mode, num_tokens=0.5), aggregate(x, mask, mode)
        )


@pytest.mark.parametrize("bad", [0, 0.0, -1.0, -35, math.nan, math.inf, -math.inf])
def test_invalid_num_tokens_raise_value_error_naming_it(bad):
    x, mask, _ = ragged()
    for mode in ("bnpo", "grpo"):  # validated whatever the mode
        with pytest.raises(ValueError, match=r"num_tokens=.*finite and > 0"):
            aggregate(x, mask, mode, num_tokens=bad)


@pytest.mark.parametrize("bad", [True, "35"])
def test_non_numeric_num_tokens_raise_type_error_naming_it(bad):
    x, mask, _ = ragged()
    with pytest.raises(TypeError, match="num_tokens"):
        aggregate(x, mask, "bnpo", num_tokens=bad)
