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
    with pytest.raises(ValueError, match="num_tokens=3"):
        aggregate(x, mask, "bnpo", num_tokens=3)
    with pytest.raises(ValueError, match="mask shape"):
        aggregate(x, mask[:, :3], "bnpo")
    with pytest.raises(ValueError, match="only 0 and 1"):
        aggregate(x, mask * 0.5, "bnpo")
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        aggregate(x[0], mask[0], "bnpo")
